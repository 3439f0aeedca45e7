"""Long context over two GPUs: the ring engines on this kernel against one GPU (issue 43).

A causal bf16 problem of head dim 128 with GQA (32 query / 8 key-value heads, batch 1) of
--tokens tokens (default 64k and 128k), forward + backward, timed three ways in one command:

  1 GPU, whole   flash_attn_func on all the tokens on rank 0 alone (where it fits in memory);
  1 GPU, half    the same on half the tokens (the sequence one rank holds);
  2 GPUs         each engine over both ranks, this package standing in for flash-attn
                 (install_as_flash_attn): ring-flash-attn's zigzag ring (zigzag_ring_flash_attn_func,
                 balanced causal work) and yunchang's Ulysses (UlyssesAttention: all-to-all to 16 / 4
                 heads per GPU, the whole sequence each); the slower rank's time.

"speedup" is 1 GPU whole over 2 GPUs (issue 43's goal: at least 1.8 at 128k tokens). For the ring,
"overlap" is the share of the communication hidden behind compute: with C the compute alone (1
GPU whole / 2) and X the ring's transfers alone (the same send/recv of k, v forward and of k, v,
dk, dv backward, timed without attention), overlap = (C + X - T) / X for the ring's time T,
clamped to [0, 1].

Times are medians of --reps runs after one warm-up, each synchronised on every rank and
bracketed by barriers. The script starts its two ranks itself (NCCL, one GPU each). --smoke runs
the same code on two CPU processes over gloo through Triton's interpreter at 64 tokens and 4 / 2
heads of 32: a check that it runs, not a measurement.

Usage: python benchmarks/bench_context_parallel.py [--tokens 65536 131072] [--reps 3]
           [--out benchmarks/results/context_parallel.md]   (after scripts/build_variants.py, on 2 GPUs)
       python benchmarks/bench_context_parallel.py --smoke
"""

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

if "--smoke" in sys.argv:  # must precede the first import of triton (kernels imports it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))  # (run_with_flash_attn: ring-flash-attn under transformers 5)
WORLD = 2


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[65536, 131072])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "context_parallel.md")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.reps = [64], 1
    elif torch.cuda.device_count() < WORLD:
        raise SystemExit(f"bench_context_parallel: needs {WORLD} GPUs (or --smoke), found {torch.cuda.device_count()}")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(port, args), nprocs=WORLD)


def _rank(rank, port, args):
    import torch.distributed as dist

    import kernels

    smoke = args.smoke
    device = torch.device("cpu") if smoke else torch.device(f"cuda:{rank}")
    if not smoke:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if smoke else "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    fa = kernels.get_local_kernel(REPO_ROOT / "build")
    fa.install_as_flash_attn()
    heads, heads_kv, head_dim = (4, 2, 32) if smoke else (32, 8, 128)
    engines = _engines(rank)
    lines = []
    for tokens in args.tokens:
        def inputs(length, heads_q=heads, heads_k=heads_kv):
            generator = torch.Generator().manual_seed(tokens)
            return [torch.randn(1, length, h, head_dim, generator=generator).to(device, torch.bfloat16)
                    .requires_grad_(grad) for h, grad in ((heads_q, True), (heads_k, True), (heads_k, True),
                                                           (heads_q, False))]

        def step(run, tensors):
            q, k, v, dout = tensors
            torch.autograd.grad(run(q, k, v), (q, k, v), dout)

        single = lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True)  # noqa: E731
        whole = half = None
        if rank == 0:  # one GPU alone, on all the tokens and on the half a rank holds
            whole, half = (_single_gpu_ms(lambda: inputs(length), single, step, args.reps, device)
                           for length in (tokens, tokens // WORLD))
        dist.barrier()
        results = {}
        for name, (shard, run) in engines.items():
            local = [shard(x).detach().clone().requires_grad_(x.requires_grad) for x in inputs(tokens)]
            results[name] = _slowest(_timed(lambda: step(run, local), args.reps, device, barrier=True))
            local = None
            _free(device)
        transfers = _slowest(_ring_transfers(tokens // WORLD, heads_kv, head_dim, device, args.reps))
        if rank == 0:
            lines += _rows(tokens, whole, half, results, transfers)
    if rank == 0:
        header = (f"# Context parallelism over {WORLD} {'CPU processes (smoke)' if smoke else 'GPUs'}\n\n"
                  f"{_device_line(device)}; causal bf16, batch 1, {heads} / {heads_kv} heads of {head_dim}, "
                  f"forward + backward, ms (median of {args.reps})\n\n"
                  "| tokens | 1 GPU whole | 1 GPU half | engine | 2 GPUs | speedup | overlap |\n"
                  "|---|---|---|---|---|---|---|\n")
        text = header + "\n".join(lines) + "\n"
        print(text)
        if not smoke:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
    dist.destroy_process_group()


def _engines(rank):
    """name -> (shard of the whole problem this rank holds, attention on the shards)."""
    import torch.distributed as dist
    from run_with_flash_attn import transformers_name_for_ring_flash_attn
    from yunchang import UlyssesAttention
    from yunchang.kernels import AttnType

    def zigzag_shard(x):
        chunks = x.chunk(2 * WORLD, dim=1)
        return torch.cat([chunks[rank], chunks[2 * WORLD - 1 - rank]], dim=1)

    transformers_name_for_ring_flash_attn()
    from ring_flash_attn import zigzag_ring_flash_attn_func

    ulysses = UlyssesAttention(dist.group.WORLD, attn_type=AttnType.FA)
    return {
        "zigzag ring": (zigzag_shard, lambda q, k, v: zigzag_ring_flash_attn_func(q, k, v, causal=True)),
        "Ulysses": (lambda x: x.chunk(WORLD, dim=1)[rank], lambda q, k, v: ulysses(q, k, v, causal=True)),
    }


def _ring_transfers(local_tokens, heads_kv, head_dim, device, reps):
    """ms of the ring's transfers alone: k, v forward and k, v, dk, dv backward, to the next rank
    and from the previous one, WORLD - 1 steps each, as ring-flash-attn's RingComm sends them."""
    import torch.distributed as dist

    rank = dist.get_rank()
    block = torch.empty(1, local_tokens, heads_kv, head_dim, device=device, dtype=torch.bfloat16)

    def transfers():
        for count in (2, 4):
            for _ in range(WORLD - 1):
                ops = []
                for _ in range(count):
                    ops.append(dist.P2POp(dist.isend, block, (rank + 1) % WORLD))
                    ops.append(dist.P2POp(dist.irecv, torch.empty_like(block), (rank - 1) % WORLD))
                for request in dist.batch_isend_irecv(ops):
                    request.wait()

    return _timed(transfers, reps, device, barrier=True)


def _timed(fn, reps, device, barrier=False):
    import torch.distributed as dist

    times = []
    for rep in range(reps + 1):  # (the first is the warm-up)
        if barrier:
            dist.barrier()
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        if rep:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _slowest(ms):
    import torch.distributed as dist

    value = torch.tensor([ms], dtype=torch.float64)
    gathered = [torch.zeros_like(value) for _ in range(WORLD)]
    dist.all_gather_object(gathered, value)
    return max(x.item() for x in gathered)


def _single_gpu_ms(make_inputs, run, step, reps, device):
    """ms of ``step(run, inputs)`` on this GPU alone, or None where the problem does not fit."""
    try:
        tensors = make_inputs()
        return _timed(lambda: step(run, tensors), reps, device)
    except torch.OutOfMemoryError:
        return None
    finally:
        tensors = None
        _free(device)


def _free(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_line(device):
    if device.type != "cuda":
        return "CPU, Triton interpreter"
    import triton

    return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, Triton {triton.__version__}"


def _rows(tokens, whole, half, results, transfers):
    text = lambda ms: "n/a" if ms is None else f"{ms:.1f}"  # noqa: E731
    rows = []
    for name, ms in results.items():
        speedup = "n/a" if whole is None else f"{whole / ms:.2f}"
        overlap = "n/a"
        if name == "zigzag ring" and whole is not None and transfers > 0:
            overlap = f"{min(1.0, max(0.0, (whole / WORLD + transfers - ms) / transfers)):.2f}"
        rows.append(f"| {tokens} | {text(whole)} | {text(half)} | {name} | {ms:.1f} | {speedup} | {overlap} |")
    rows.append(f"| {tokens} | | | ring transfers alone | {transfers:.1f} | | |")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
