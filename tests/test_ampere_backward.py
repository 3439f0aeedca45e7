"""The fused backward for mma.sync GPUs (flash_attention_kernel/ampere_backward.py, ampere_route.py).

On the A100 class, a dense bf16/fp16 backward at head dim 64 or 128 (causal or not, sinks) in full tiles
that does not ask for determinism runs one Gluon kernel that adds dQ by atomics, FlashAttention-2's
backward. Here on the CPU: the route's decisions (the GPU class made sm80), the planner's fused
plan and the launcher's steps around the kernel (the preprocess kernel zeroing the accumulator, the
conversion after it) with a reference stand-in for the kernel, ``deterministic`` reaching the
options, and the kernel's sm_80 compile under the installed Triton. On a GPU of the A100 class (an
A100, or an H100/H200 emulating one: ``EMULATE_GPU=sm_80``, docs/gpus.md) the kernel against
float64 and the tl kernels.
"""

import math

import pytest
import torch

from conftest import DEVICE, ON_GPU
from gluon_compile import assert_compiles_for_ampere
from inputs import bshd
from reference import BWD_FACTOR, assert_within_bar, run_ref
from sizes import BF16

FP16 = torch.float16
ON_A100_CLASS = ON_GPU and torch.cuda.get_device_capability() in ((8, 0), (8, 7)) and \
    torch.cuda.get_device_properties(0).shared_memory_per_block_optin >= 166912


@pytest.fixture
def kernels(fa):
    kernels = fa.flash_attention_kernel
    kernels.planner._PLANS.clear()
    yield kernels
    kernels.planner._PLANS.clear()


def _fits(kernels, q, k, v, causal=False, interpreted=False, **options):
    layout = kernels.launch.SequenceLayout.of(q, k)
    attention = kernels.AttentionOptions(q.shape[-1] ** -0.5, causal, **options)
    return kernels.ampere_route.fits(attention, layout, interpreted, (q, k, v, torch.empty_like(q)))


def _chosen(kernels, q, k, v, causal=False, **options):
    layout = kernels.launch.SequenceLayout.of(q, k)
    attention = kernels.AttentionOptions(q.shape[-1] ** -0.5, causal, **options)
    return kernels.ampere_route.chosen(attention, layout, False, (q, k, v, torch.empty_like(q)))


def test_route_takes_what_the_kernel_computes(kernels, monkeypatch):
    """With the GPU class made sm80: dense bf16/fp16 head dim 64 or 128, causal or not, GQA, sinks,
    full tiles (of each head dim's config), rows cp.async can copy; nothing else."""
    route = kernels.ampere_route
    monkeypatch.setattr(route, "gpu_class_name", lambda device: "sm80")
    q, k, v = bshd(2, 256, 4), bshd(2, 384, 2), bshd(2, 384, 2)
    assert _fits(kernels, q, k, v) and _fits(kernels, q, k, v, causal=True)
    assert _fits(kernels, q.half(), k.half(), v.half(), causal=True)
    assert _fits(kernels, q, k, v, causal=True, sinks=torch.zeros(4, device=DEVICE))
    assert _fits(kernels, q, k, v, window_right=0)  # (causal's band)
    assert not _fits(kernels, q, k, v, interpreted=True)
    slopes = torch.zeros(4, device=DEVICE)
    for options in (dict(softcap=30.0), dict(window_left=64), dict(window_right=8), dict(alibi_slopes=slopes),
                    dict(dropout_p=0.1), dict(causal=True, window_left=64)):
        assert not _fits(kernels, q, k, v, **options), options
    assert not _fits(kernels, q.float(), k.float(), v.float())
    assert _fits(kernels, *(x[..., :64].contiguous() for x in (q, k, v)), causal=True)
    for head_dim in (32, 80, 96):  # (no tiles for these: the tl kernels)
        assert not _fits(kernels, *(x[..., :head_dim].contiguous() for x in (q, k, v))), head_dim
    assert not _fits(kernels, *(x[:, :192, :, :64].contiguous() for x in (q, k, v)))  # (d64's 128-row tiles)
    assert not _fits(kernels, q[:, :224], k, v)  # a partial query tile
    assert not _fits(kernels, q, k[:, :320], v[:, :320])  # a partial key tile
    assert _fits(kernels, *(x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)))  # (bhsd views)
    padded = torch.randn(2, 256, 4, 136, dtype=BF16, device=DEVICE)[..., :128]  # rows of 136: strides of 8 x 17
    assert not _fits(kernels, padded, k, v)
    monkeypatch.setattr(route, "gpu_class_name", lambda device: "sm86")  # (160 KB of shared memory: 99 there)
    assert not _fits(kernels, q, k, v)


def test_route_declines_what_asks_for_determinism(kernels, monkeypatch):
    """``chosen``: deterministic=True, torch.use_deterministic_algorithms, FLASH_ATTENTION_GLUON=0,
    an override of a backward pass and short calls keep the tl kernels."""
    route = kernels.ampere_route
    monkeypatch.setattr(route, "gpu_class_name", lambda device: "sm80")
    monkeypatch.setattr(kernels.hopper_route.triton, "__version__", "3.6.0")  # (gluon_setting reads it)
    q, k, v = bshd(1, 256, 2), bshd(1, 256, 2), bshd(1, 256, 2)
    assert _chosen(kernels, q, k, v, causal=True)
    assert not _chosen(kernels, q, k, v, causal=True, deterministic=True)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert not _chosen(kernels, q, k, v, causal=True)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert not _chosen(kernels, q[:, :128], k[:, :128], v[:, :128])  # (below BACKWARD_MIN_SEQLEN_K)
    monkeypatch.setattr(kernels.hopper_route.triton, "__version__", "3.5.1")  # (not a checked release)
    assert not _chosen(kernels, q, k, v)
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", "1")
    assert _chosen(kernels, q, k, v) and _chosen(kernels, q[:, :128], k[:, :128], v[:, :128])
    with kernels.planner.override("bwd_dq", implementation="tl"):
        assert not _chosen(kernels, q, k, v)
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", "0")
    assert not _chosen(kernels, q, k, v)


def test_deterministic_reaches_the_backward(fa, kernels, monkeypatch):
    """flash-attn's ``deterministic`` travels in the options to the backward's route (through the
    op and autograd, and through the private entry point ring engines call)."""
    seen = []
    monkeypatch.setattr(kernels.ampere_route, "chosen", lambda options, *args: seen.append(options.deterministic))
    q, k, v = (x.requires_grad_() for x in (bshd(1, 64, 2, head_dim=32), bshd(1, 64, 2, head_dim=32),
                                            bshd(1, 64, 2, head_dim=32)))
    for deterministic in (False, True):
        fa.flash_attn_func(q, k, v, causal=True, deterministic=deterministic).sum().backward()
    out, lse, _ = fa.flash_attn_func(q, k, v, return_attn_probs=True)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    with torch.no_grad():
        fa.flash_attn_interface._flash_attn_backward(torch.ones_like(out), q, k, v, out, lse, *grads, 0.0, 0.125,
                                                     False, -1, -1, 0.0, None, True)
    assert seen == [False, True, True]


def test_launcher_zeroes_and_converts_the_accumulator(fa, kernels, monkeypatch):
    """A fused plan: delta and a zeroed fp32 accumulator from the preprocess kernel, the kernel
    (here a float64 stand-in that checks both) adds softmax_scale * dQ, and the conversion kernel
    writes dq from it; the stand-in's dK, dV come back as they were written."""
    calls = []

    def stand_in(dout, q, k, v, lse, delta, dq_accumulator, dk, dv, options, layout, config):
        assert dq_accumulator.dtype == torch.float32 and dq_accumulator.shape == q.shape
        assert torch.equal(dq_accumulator, torch.zeros_like(dq_accumulator))
        expected_delta = (dout.double() * out.double()).sum(-1).transpose(1, 2)
        torch.testing.assert_close(delta.double(), expected_delta, atol=1e-3, rtol=1e-3)
        dq_accumulator += reference[0].float()
        dk.copy_(reference[1].float())
        dv.copy_(reference[2].float())
        calls.append(options.causal)

    monkeypatch.setattr(kernels.ampere_route, "chosen", lambda *args: True)
    monkeypatch.setattr(kernels.ampere_route, "launcher", lambda: stand_in)
    monkeypatch.setattr(kernels.ampere_route, "config", lambda device, head_dim: None)  # (head dim 32: no tiles)
    monkeypatch.setattr(kernels.ampere_route, "gpu_class_name", lambda device: "sm80")
    q, k, v = bshd(2, 64, 4, head_dim=32), bshd(2, 128, 2, head_dim=32), bshd(2, 128, 2, head_dim=32)
    dout = torch.randn_like(q)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fa.flash_attn_func(*leaves, causal=True)
    _, reference = run_ref(q, k, v, dout, True, q.shape[-1] ** -0.5, torch.float64)
    grads = torch.autograd.grad(out, leaves, dout)
    assert calls == [True]
    for label, ours, exact in zip(("dq", "dk", "dv"), grads, reference):
        torch.testing.assert_close(ours, exact.float().to(ours.dtype), atol=0, rtol=0, msg=label)


# (tests/gluon_compile.py: args head dim, group, causal, dtype, GPU class)
_KERNEL_SIGNATURE = """
head_dim, group, causal, dtype, gpu_class = int(args[0]), int(args[1]), args[2] == "True", args[3], args[4]
module = importlib.import_module(name + ".flash_attention_kernel.ampere_backward")
configs = importlib.import_module(name + ".flash_attention_kernel.configs")
function = module._backward_kernel
config = configs.FUSED_BACKWARD[gpu_class][head_dim]
constants = dict(GROUP_SIZE=group, HEAD_DIM=head_dim, CAUSAL=causal, ROWS=config.query_tile, KEYS=config.key_tile,
                 S_GRID=config.warp_grids[0], KV_GRID=config.warp_grids[1], DQ_GRID=config.warp_grids[2])
signature, attrs = {}, {}
for index, n in enumerate(function.arg_names):
    if n in constants:
        signature[n] = "constexpr"
    elif n in ("LSE", "DELTA", "DQ_ACC"):
        signature[n] = "*fp32"
    elif n.isupper():
        signature[n] = "*" + dtype
    else:
        signature[n] = "fp32" if n in ("qk_scale_log2", "softmax_scale") else "i32"
    if signature[n].startswith("*") or n.startswith("stride") or n.startswith("seqlen"):
        attrs[(index,)] = [["tt.divisibility", 16]]  # (what a routed launch specialises: ampere_route.fits)
num_warps = config.num_warps
limit = next(c.shared_memory for c in configs.GPU_CLASSES if c.name == gpu_class)
"""


@pytest.mark.parametrize("head_dim, group, causal, dtype", [
    (128, 1, False, "bf16"), (128, 1, True, "bf16"), (128, 4, True, "fp16"), (128, 2, False, "fp16"),
    (64, 1, False, "bf16"), (64, 2, True, "fp16"),
])
@pytest.mark.parametrize("gpu_class", ["sm80"])
def test_compiles_for_each_class(fa, head_dim, group, causal, dtype, gpu_class):
    """The kernel compiles to an sm_80 cubin (mma.sync, cp.async) with each GPU class's tiles at
    each head dim (configs.FUSED_BACKWARD) within that class's shared memory under the installed
    Triton, no GPU needed."""
    assert head_dim in fa.flash_attention_kernel.configs.FUSED_BACKWARD[gpu_class]
    assert_compiles_for_ampere(fa, _KERNEL_SIGNATURE, head_dim, group, causal, dtype, gpu_class)


def _gradients(fa, q, k, v, dout, causal, deterministic, **options):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fa.flash_attn_func(*leaves, causal=causal, deterministic=deterministic, **options)
    return torch.autograd.grad(out, leaves, dout)


# (name, q, k, v builders, causal)
CASES = [
    ("gqa-causal", lambda dt: (bshd(2, 256, 4, dt), bshd(2, 256, 2, dt), bshd(2, 256, 2, dt)), True),
    ("gqa4-full", lambda dt: (bshd(1, 384, 8, dt), bshd(1, 384, 2, dt), bshd(1, 384, 2, dt)), False),
    ("fewer-queries-causal", lambda dt: (bshd(2, 128, 2, dt), bshd(2, 384, 2, dt), bshd(2, 384, 2, dt)), True),
    ("more-queries-causal", lambda dt: (bshd(2, 448, 2, dt), bshd(2, 256, 2, dt), bshd(2, 256, 2, dt)), True),
    ("bhsd-views", lambda dt: tuple(bshd(2, 256, 3, dt).transpose(1, 2).contiguous().transpose(1, 2)
                                    for _ in range(3)), True),
    ("qkv-packed", lambda dt: bshd(2, 256, 3 * 2, dt).unflatten(2, (3, 2)).unbind(2), False),
    ("long-causal", lambda dt: (bshd(1, 1024, 2, dt), bshd(1, 1024, 1, dt), bshd(1, 1024, 1, dt)), True),
    # head dim 64: query tiles of 128 rows
    ("d64-gqa-causal", lambda dt: (bshd(2, 256, 4, dt, 64), bshd(2, 384, 2, dt, 64), bshd(2, 384, 2, dt, 64)), True),
    ("d64-full", lambda dt: (bshd(1, 512, 4, dt, 64), bshd(1, 256, 4, dt, 64), bshd(1, 256, 4, dt, 64)), False),
    ("d64-more-queries-causal", lambda dt: (bshd(2, 640, 2, dt, 64), bshd(2, 256, 2, dt, 64),
                                            bshd(2, 256, 2, dt, 64)), True),
]


@pytest.mark.skipif(not ON_A100_CLASS, reason="the fused backward runs on the A100 class (or its emulation)")
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name, make, causal", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_and_tl_kernels(fa, kernels, name, make, causal, dtype):
    q, k, v = make(dtype)
    dout = torch.randn_like(q)
    assert _chosen(kernels, q, k, v, causal) and not _chosen(kernels, q, k, v, causal, deterministic=True)
    ours = _gradients(fa, q, k, v, dout, causal, deterministic=False)
    tl_kernels = _gradients(fa, q, k, v, dout, causal, deterministic=True)
    scale = 1.0 / math.sqrt(q.shape[-1])
    _, truth = run_ref(q, k, v, dout, causal, scale, torch.float64)
    _, same_dtype = run_ref(q, k, v, dout, causal, scale, dtype)
    for label, mine, other, pt, exact in zip(("dq", "dk", "dv"), ours, tl_kernels, same_dtype, truth):
        assert_within_bar(label, mine, pt, exact, BWD_FACTOR)
        assert_within_bar(f"{label} (tl kernels)", other, pt, exact, BWD_FACTOR)
    assert all(torch.equal(a, b) for a, b in zip(ours[1:], _gradients(fa, q, k, v, dout, causal, False)[1:]))


@pytest.mark.skipif(not ON_A100_CLASS, reason="the fused backward runs on the A100 class (or its emulation)")
def test_sinks_and_lse_gradient(fa, kernels):
    """Sinks reach the kernel through the lse (dsinks from delta), and a loss on the lse through
    delta (the preprocess kernel's dlse term)."""
    q, k, v = bshd(2, 256, 4), bshd(2, 256, 2), bshd(2, 256, 2)
    sinks = torch.randn(4, device=DEVICE)
    dout = torch.randn_like(q)
    assert _chosen(kernels, q, k, v, True, sinks=sinks)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, sinks)]
    out = fa.flash_attn_func(*leaves[:3], causal=True, s_aux=leaves[3])
    ours = torch.autograd.grad(out, leaves, dout)
    scale = 1.0 / math.sqrt(q.shape[-1])
    _, truth = run_ref(q, k, v, dout, True, scale, torch.float64, sinks=sinks)
    _, same_dtype = run_ref(q, k, v, dout, True, scale, BF16, sinks=sinks)
    for label, mine, pt, exact in zip(("dq", "dk", "dv"), ours, same_dtype, truth):
        assert_within_bar(label, mine, pt, exact, BWD_FACTOR)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, sinks)]
    out = fa.flash_attn_func(*leaves[:3], causal=True, s_aux=leaves[3], deterministic=True)
    torch.testing.assert_close(ours[3], torch.autograd.grad(out, leaves, dout)[3], atol=1e-3, rtol=1e-3)  # (dsinks)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse, _ = fa.flash_attn_func(*leaves, causal=True, return_attn_probs=True)
    fused = torch.autograd.grad((out * dout).sum() + lse.sum(), leaves)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse, _ = fa.flash_attn_func(*leaves, causal=True, return_attn_probs=True, deterministic=True)
    split = torch.autograd.grad((out * dout).sum() + lse.sum(), leaves)
    for label, a, b in zip(("dq", "dk", "dv"), fused, split):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2, msg=label)
