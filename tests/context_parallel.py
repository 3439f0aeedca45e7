"""Context-parallel engines on this package standing in for flash-attn: one worker per rank.

``run_ranks(case, build_dir, world_size)`` starts ``world_size`` processes (spawned; each inherits
the test process's environment, so TRITON_INTERPRET too), joins them in a torch.distributed group
(NCCL over one GPU per rank where there are enough GPUs, else gloo on the CPU through Triton's
interpreter: a machine with fewer GPUs than ranks spawns them with no GPU visible and the
interpreter on, so that they run exactly as on a machine without one, ``_cpu_ranks``), and
runs ``case`` in each: the engine on the rank's shard of one random problem, against the whole
problem on this rank alone. Each rank checks its shard of the output and of
every gradient against the float64 truth within the project's error bars (2x PyTorch's error in
the same dtype forward, 3x backward) and against single-process ``flash_attn_func``; it reports
"ok" or its traceback in a file, which the test reads.

Cases (CASES): ring-flash-attn's ``ring_flash_attn_func`` (full and causal),
``zigzag_ring_flash_attn_func`` and ``llama3_flash_attn_varlen_func`` (packed sequences, the
all-gather scheme), yunchang's ``UlyssesAttention`` and ``LongContextAttention`` with its ring
(ring degree 2), and PyTorch's own ``context_parallel`` through the experimental
``kernels_in_torch_context_parallel`` (SDPA's call, GQA by repeated k and v), each with GQA
(4 query heads, 2 key/value heads) in bf16; ``llama3_varlen_window_causal``: the llama3 scheme with
a sliding window (WINDOW), which it carries (each query block gathers its keys, bottom-right
aligned); and what a ring cannot carry, which must be refused with a ValueError naming the option
(REFUSED): ``ring_dropout`` (its backward has no rng_state per step) and ``ring_window_causal`` (a
window in a ring's block calls, which see block-local positions).
"""

import contextlib
import functools
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path
from unittest import mock

import torch

SEQLEN, HEADS, HEADS_KV, HEAD_DIM = 64, 4, 2, 32  # per sequence, whole problem (every rank holds SEQLEN / world)
VARLEN_LENGTHS = [20, 30, 14]  # packed sequences of the varlen case, 64 tokens in all
CASES = ["ring", "ring_causal", "zigzag_causal", "llama3_varlen_causal", "ulysses_causal", "usp_ring_causal",
         "torch_cp_causal", "llama3_varlen_window_causal", "ring_dropout", "ring_window_causal"]
WINDOW = (8, 0)  # (left, right) of the window cases
# case -> the ValueError its engine must raise
REFUSED = {"ring_dropout": "rng_state: a backward with dropout_p > 0 needs the rng_state",
           "ring_window_causal": r"window_size \(8, 0\): ring_flash_attn.ring_flash_attn runs"}


def run_ranks(case: str, build_dir: Path, world_size: int = 2, timeout_s: float = 900) -> dict:
    """{rank: "ok" or the rank's traceback} of ``case`` on ``world_size`` spawned ranks."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as results, socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        with _cpu_ranks(world_size):
            context = mp.start_processes(_rank_main, args=(world_size, port, str(build_dir), case, results),
                                         nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{case}: the ranks did not finish in {timeout_s} s")
        return {rank: (Path(results) / f"{rank}.txt").read_text() for rank in range(world_size)}


def ranks_on_gpus(world_size: int) -> bool:
    """Whether the ranks run one per GPU (NCCL): this machine has a GPU per rank and the test does
    not run the interpreter. Else they are CPU ranks (``_cpu_ranks``)."""
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1" \
        and torch.cuda.device_count() >= world_size


def _cpu_ranks(world_size: int):
    """A context within which, where the ranks cannot run one per GPU, the environment they are
    spawned with hides every GPU (CUDA_VISIBLE_DEVICES empty) and turns the interpreter on; the
    test process's own environment comes back after it."""
    cpu = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    return mock.patch.dict(os.environ, {} if ranks_on_gpus(world_size) else cpu)


def _rank_main(rank: int, world_size: int, port: int, build_dir: str, case: str, results: str) -> None:
    try:
        report = "ok"
        _run_case(rank, world_size, port, build_dir, case)
    except BaseException:  # (reported to the test; the rank exits normally so the others are not torn down)
        report = traceback.format_exc()
    Path(results, f"{rank}.txt").write_text(report)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _run_case(rank: int, world_size: int, port: int, build_dir: str, case: str) -> None:
    import torch.distributed as dist

    on_gpus = torch.cuda.is_available()  # (_cpu_ranks hid the GPUs unless there is one per rank)
    device = torch.device(f"cuda:{rank}") if on_gpus else torch.device("cpu")
    if on_gpus:
        torch.cuda.set_device(device)
    import kernels
    dist.init_process_group("nccl" if on_gpus else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    fa = kernels.get_local_kernel(Path(build_dir))
    fa.install_as_flash_attn()
    dtype = torch.bfloat16
    generator = torch.Generator().manual_seed(0)  # (every rank draws the same whole problem)
    tokens = sum(VARLEN_LENGTHS) if case.startswith("llama3") else SEQLEN
    q, k, v, dout = (torch.randn(1, tokens, heads, HEAD_DIM, generator=generator).to(device, dtype)
                     for heads in (HEADS, HEADS_KV, HEADS_KV, HEADS))
    causal = "causal" in case
    scale = HEAD_DIM ** -0.5
    window = WINDOW if "window" in case else (-1, -1)  # (what the window cases' engines pass: _ENGINES)
    shard, run = _ENGINES[case.rsplit("_causal", 1)[0]](fa, rank, world_size, causal, scale)
    local = [shard(x).detach().clone().requires_grad_(x is not dout) for x in (q, k, v, dout)]
    if case in REFUSED:  # what a ring cannot carry
        import re

        try:
            torch.autograd.grad(run(*local[:3]), local[:3], local[3])
        except ValueError as error:
            if re.search(REFUSED[case], str(error)):
                return
            raise
        raise AssertionError(f"{case}: the engine's call was not refused ({REFUSED[case]})")
    with getattr(run, "context", contextlib.nullcontext)():  # (what the backward must run in as well)
        out = run(*local[:3])
        grads = torch.autograd.grad(out, local[:3], local[3])
    _check(fa, case, shard, (q, k, v, dout), out, grads, causal, scale, window)


def _check(fa, case, shard, inputs, out, grads, causal, scale, window) -> None:
    """The rank's shard of out and of each gradient against the whole problem: within the error
    bars of the float64 truth, and as close to single-process flash_attn_func as that allows."""
    from reference import assert_within_bar, run_ref, run_varlen_ref

    q, k, v, dout = inputs
    if case.startswith("llama3"):
        cu = torch.tensor([0, *torch.tensor(VARLEN_LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
        flat = [x[0] for x in inputs]
        truth, truth_grads, _ = run_varlen_ref(*flat[:3], flat[3], cu, cu, causal, scale, torch.float64, window=window)
        same, same_grads, _ = run_varlen_ref(*flat[:3], flat[3], cu, cu, causal, scale, q.dtype, window=window)
        truth, same = truth[None], same[None]
        truth_grads, same_grads = [g[None] for g in truth_grads], [g[None] for g in same_grads]
        leaves = [x[0].detach().requires_grad_() for x in (q, k, v)]
        single = fa.flash_attn_varlen_func(*leaves, cu, cu, max(VARLEN_LENGTHS), max(VARLEN_LENGTHS),
                                           softmax_scale=scale, causal=causal, window_size=window)
        single_grads = [g[None] for g in torch.autograd.grad(single, leaves, flat[3])]
        single = single[None]
    else:
        truth, truth_grads = run_ref(q, k, v, dout, causal, scale, torch.float64, window=window)
        same, same_grads = run_ref(q, k, v, dout, causal, scale, q.dtype, window=window)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        single = fa.flash_attn_func(*leaves, softmax_scale=scale, causal=causal, window_size=window)
        single_grads = torch.autograd.grad(single, leaves, dout)
    assert_within_bar(f"{case} out", out, shard(same), shard(truth), 2)
    assert_within_bar(f"{case} out against flash_attn_func", out, shard(same), shard(single), 2)
    for name, ours, pytorch, exact, one_gpu in zip(("dq", "dk", "dv"), grads, same_grads, truth_grads, single_grads):
        assert_within_bar(f"{case} {name}", ours, shard(pytorch), shard(exact), 3)
        assert_within_bar(f"{case} {name} against flash_attn_func", ours, shard(pytorch), shard(one_gpu), 3)


def import_ring_flash_attn():
    """ring_flash_attn, importable under transformers 5 (scripts/run_with_flash_attn.py puts back
    the name its transformers adapter imports; the engine's own code runs unchanged)."""
    from run_with_flash_attn import transformers_name_for_ring_flash_attn

    transformers_name_for_ring_flash_attn()
    import ring_flash_attn

    return ring_flash_attn


def _ring(fa, rank, world_size, causal, scale, **options):
    """ring_flash_attn_func on contiguous shards, with ``options`` (its dropout_p, window_size...)."""
    ring_flash_attn_func = import_ring_flash_attn().ring_flash_attn_func

    return (lambda x: x.chunk(world_size, dim=1)[rank],
            lambda q, k, v: ring_flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, **options))


def _zigzag(fa, rank, world_size, causal, scale):
    zigzag_ring_flash_attn_func = import_ring_flash_attn().zigzag_ring_flash_attn_func

    return (_head_tail_shard(rank, world_size),
            lambda q, k, v: zigzag_ring_flash_attn_func(q, k, v, softmax_scale=scale, causal=causal))


def _head_tail_shard(rank, world_size):
    """The rank's chunks rank and 2 world - 1 - rank of 2 world along the sequence, which balance
    the causal work (zigzag's order, and torch's head-tail load balancer's)."""
    def shard(x):
        chunks = x.chunk(2 * world_size, dim=1)
        return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=1)

    return shard


def _llama3_varlen(fa, rank, world_size, causal, scale, **options):
    engine = import_ring_flash_attn()
    llama3_flash_attn_prepare_cu_seqlens = engine.llama3_flash_attn_prepare_cu_seqlens
    llama3_flash_attn_varlen_func = engine.llama3_flash_attn_varlen_func

    tokens = sum(VARLEN_LENGTHS)
    cu = torch.tensor([0, *torch.tensor(VARLEN_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    device = torch.device(f"cuda:{rank}") if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl" \
        else torch.device("cpu")
    cu_q, cu_k, max_q, max_k, local_k_slice = llama3_flash_attn_prepare_cu_seqlens(cu.to(device), causal, rank,
                                                                                   world_size)
    per_rank = tokens // world_size

    def run(q, k, v):
        return llama3_flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, max_q, max_k, heads_k_stride=1,
                                             local_k_slice=local_k_slice, softmax_scale=scale, causal=causal,
                                             **options)[None]

    return lambda x: x[:, rank * per_rank:(rank + 1) * per_rank], run


def _ulysses(fa, rank, world_size, causal, scale):
    """yunchang's UlyssesAttention: all-to-all from sequence shards to head shards, flash_attn_func
    on the whole sequence of this rank's heads, and back."""
    import torch.distributed as dist
    from yunchang import UlyssesAttention, basic_extract_local
    from yunchang.kernels import AttnType

    attention = UlyssesAttention(dist.group.WORLD, attn_type=AttnType.FA)
    return (lambda x: basic_extract_local(x, rank, world_size),
            lambda q, k, v: attention(q, k, v, softmax_scale=scale, causal=causal))


def _usp_ring(fa, rank, world_size, causal, scale):
    """yunchang's LongContextAttention (USP) with ring degree = world size: its own ring over the
    private entry points. (Ulysses degree 1: a ring of one rank would send to itself, which gloo
    cannot; NCCL can, and yunchang's own scripts run that hybrid on GPUs.)"""
    from yunchang import LongContextAttention, basic_extract_local, set_seq_parallel_pg
    from yunchang.kernels import AttnType

    set_seq_parallel_pg(1, world_size, rank, world_size)
    attention = LongContextAttention(ring_impl_type="basic", attn_type=AttnType.FA)
    return (lambda x: basic_extract_local(x, rank, world_size),
            lambda q, k, v: attention(q, k, v, softmax_scale=scale, causal=causal))


def _torch_cp(fa, rank, world_size, causal, scale):
    """PyTorch's context_parallel with this package's kernel at each ring step
    (kernels_in_torch_context_parallel, experimental): SDPA on the rank's shards in torch's
    head-tail load-balanced order (chunks rank and 2 world - 1 - rank), GQA by repeating k and v."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device_type = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (world_size,))
    shard = _head_tail_shard(rank, world_size)

    # the sequence's positions as context_parallel's buffer: it shards them as it would the model's
    # inputs, which shows that the shards are in its order
    positions = torch.arange(SEQLEN, device=device_type)[None]

    @contextlib.contextmanager
    def context():  # (the backward runs inside it too, as torch's context_parallel requires)
        with fa.kernels_in_torch_context_parallel(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]), \
                context_parallel(mesh, buffers=[positions], buffer_seq_dims=[1]):
            assert torch.equal(positions, shard(torch.arange(SEQLEN, device=device_type)[None]))
            yield

    def run(q, k, v):
        group = q.shape[2] // k.shape[2]
        q, k, v = q.transpose(1, 2), *(x.repeat_interleave(group, dim=2).transpose(1, 2) for x in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale).transpose(1, 2)

    run.context = context
    return shard, run


_ENGINES = {"ring": _ring, "zigzag": _zigzag, "llama3_varlen": _llama3_varlen, "ulysses": _ulysses,
            "usp_ring": _usp_ring, "torch_cp": _torch_cp,
            "ring_dropout": functools.partial(_ring, dropout_p=0.1),
            "ring_window": functools.partial(_ring, window_size=WINDOW),
            "llama3_varlen_window": functools.partial(_llama3_varlen, window_size=WINDOW)}
