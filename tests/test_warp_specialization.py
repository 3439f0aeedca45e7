"""The warp-specialised kernels (launch.warp_specialize) against the plain ones and the reference.

On a Hopper GPU with a checked Triton, the forward and dQ kernels of dense non-causal calls whose
key tiles are all full run warp-specialised (the dQ kernel from 4k keys), reading tiles through
descriptors over the whole tensor (tiles.tensor_tile_descriptors). FLASH_ATTENTION_WS=1 forces that path wherever it can work, the
CPU interpreter included (same code, no warp specialisation), "0" turns it off. The cases cross
the places where whole-tensor descriptors differ from per-slice ones: query tiles running past
their slice into the next head's or batch's rows, heads side by side in a row or one under
another, packed qkv, GQA. Under the interpreter both paths use the same tiles and must agree
bit for bit; on the GPU their tiles differ, so both meet the float64 bar.
"""

import math

import pytest
import torch
import triton

from conftest import ON_GPU
from inputs import bshd, cu_seqlens, random_qkv
from reference import BWD_FACTOR, FWD_FACTOR, assert_within_bar, run_ref
from sizes import BF16

HEAD_DIM = 128  # a width with warp-specialised entries for the forward and dQ kernels


@pytest.fixture(autouse=True)
def _tl_kernels(monkeypatch):
    """The tl kernels' warp-specialised loops are under test: on Hopper the Gluon kernels
    (hopper_forward, hopper_dkdv, hopper_dq) would take these calls."""
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", "0")


def _descriptors_possible():
    """Whether the warp-specialised loop can run here: a Hopper GPU (only its config class has
    warp-specialised entries, configs.TABLES) or the interpreter."""
    return not ON_GPU or torch.cuda.get_device_capability()[0] == 9


def _specialized(fa, q, k, v, causal=False, layout=None, kernel="fwd", **options):
    """Whether ``kernel`` runs warp-specialised on these inputs (launch.tl_launch, as the
    launchers call it); ``options``: AttentionOptions' keywords."""
    launch = fa.flash_attention_kernel.launch
    layout = layout or launch.SequenceLayout.of(q, k)
    options = fa.flash_attention_kernel.AttentionOptions(q.shape[-1] ** -0.5, causal, **options)
    return launch.tl_launch(kernel, q.shape[-1], q.dtype, options, layout, not ON_GPU, q, k, v).specialized


def test_taken_only_where_it_can_work(fa, monkeypatch):
    """The decision; without it the comparisons below could compare the plain path with itself."""
    q, k, v = random_qkv((2, 64, 4, HEAD_DIM), (2, 256, 2, HEAD_DIM), BF16)
    monkeypatch.setenv("FLASH_ATTENTION_WS", "1")
    long_k = k.repeat(1, 16, 1, 1)  # 4096 keys: the dQ kernel's entry starts there on the GPU
    assert _specialized(fa, q, k, v) == _descriptors_possible()
    assert _specialized(fa, q, long_k, long_k, kernel="bwd_dq") == _descriptors_possible()
    assert _specialized(fa, q, k, v, kernel="bwd_dq") == (not ON_GPU)
    assert not _specialized(fa, q, long_k, long_k, kernel="bwd_dkdv")  # no entry
    for kernel in ("fwd", "bwd_dq"):
        assert not _specialized(fa, q, long_k, long_k, causal=True, kernel=kernel)
    assert not _specialized(fa, q, k[:, :200], v[:, :200])  # the last key tile is partial
    assert not _specialized(fa, q[..., :120], k[..., :120], v[..., :120])  # head dim padded to 128
    assert not _specialized(fa, *(x[..., :64].contiguous() for x in (q, k, v)))  # no entry at 64
    assert not _specialized(fa, q.float(), k.float(), v.float())
    assert _specialized(fa, q, k, v, softcap=20.0, sinks=torch.zeros(4)) == _descriptors_possible()
    assert not _specialized(fa, q, k, v, window_left=64)
    assert not _specialized(fa, q, k, v, dropout_p=0.1)
    rows = 64 * 4 * HEAD_DIM  # batch stride not a whole number of rows
    q_odd = torch.randn(2, rows + 8, device=q.device, dtype=q.dtype)[:, :rows].view(2, 64, 4, HEAD_DIM)
    assert not _specialized(fa, q_odd, k, v)
    lens = [64, 64]
    packed_q, packed_k = q.flatten(0, 1), k[:, :64].flatten(0, 1)
    varlen = fa.flash_attention_kernel.launch.SequenceLayout.of(packed_q, packed_k, cu_seqlens(lens), cu_seqlens(lens),
                                                                64, 64)
    assert not _specialized(fa, packed_q, packed_k, packed_k, layout=varlen)
    monkeypatch.setenv("FLASH_ATTENTION_TMA", "0")
    assert not _specialized(fa, q, k, v)
    monkeypatch.delenv("FLASH_ATTENTION_TMA")
    monkeypatch.setenv("FLASH_ATTENTION_WS", "0")
    assert not _specialized(fa, q, k, v)
    monkeypatch.delenv("FLASH_ATTENTION_WS")
    checked = triton.__version__.startswith(fa.flash_attention_kernel.launch.WARP_SPECIALIZATION_CHECKED)
    assert _specialized(fa, q, k, v) == (ON_GPU and torch.cuda.get_device_capability()[0] == 9 and checked)


def _bhsd_view(batch, seqlen, heads, dtype):
    return bshd(batch, heads, seqlen, dtype).transpose(1, 2)


# (name, q, k, v builders): key lengths are multiples of 128 (every key tile full, on CPU and GPU)
CASES = [
    ("bshd-gqa", lambda dt: (bshd(2, 256, 4, dt), bshd(2, 256, 2, dt), bshd(2, 256, 2, dt))),
    ("bshd-ragged-q", lambda dt: (bshd(2, 113, 2, dt), bshd(2, 128, 2, dt), bshd(2, 128, 2, dt))),
    ("bhsd-view", lambda dt: (_bhsd_view(2, 203, 3, dt), _bhsd_view(2, 128, 3, dt), _bhsd_view(2, 128, 3, dt))),
    ("qkv-packed", lambda dt: bshd(2, 128, 3 * 2, dt).unflatten(2, (3, 2)).unbind(2)),
    ("long-keys", lambda dt: (bshd(1, 64, 2, dt), bshd(1, 4096, 1, dt), bshd(1, 4096, 1, dt))),
    ("d192-two-chunks", lambda dt: (bshd(2, 113, 2, dt, 192), bshd(2, 128, 2, dt, 192), bshd(2, 128, 2, dt, 192))),
    ("d256-gqa", lambda dt: (bshd(1, 64, 4, dt, 256), bshd(1, 128, 2, dt, 256), bshd(1, 128, 2, dt, 256))),
]


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name, make", CASES, ids=[c[0] for c in CASES])
def test_matches_plain_path_and_reference(fa, monkeypatch, name, make, dtype):
    if not _descriptors_possible():
        pytest.skip("the warp-specialised loop needs a Hopper GPU")
    q, k, v = make(dtype)
    dout = torch.randn_like(q)
    monkeypatch.setenv("FLASH_ATTENTION_WS", "1")
    assert _specialized(fa, q, k, v)
    results = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("FLASH_ATTENTION_WS", setting)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out, lse, _ = fa.flash_attn_func(*leaves, return_attn_probs=True)
        results[setting] = (out, lse, *torch.autograd.grad(out, leaves, dout))
    if not ON_GPU:
        for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), results["1"], results["0"]):
            assert torch.equal(a, b), f"{label} differs between the warp-specialised and plain kernels"

    scale = 1.0 / math.sqrt(q.shape[-1])
    truth_out, truth_grads = run_ref(q, k, v, dout, False, scale, torch.float64)
    pt_out, pt_grads = run_ref(q, k, v, dout, False, scale, dtype)
    out, lse, *grads = results["1"]
    assert_within_bar("out", out, pt_out, truth_out, FWD_FACTOR)
    for label, ours, pt, truth in zip(("dq", "dk", "dv"), grads, pt_grads, truth_grads):
        assert_within_bar(label, ours, pt, truth, BWD_FACTOR)


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
def test_options_in_the_warp_specialised_loop(fa, monkeypatch, dtype):
    """softcap, ALiBi and sinks keep the warp-specialised loop (launch.WARP_SPECIALIZABLE): its
    results meet the float64 bar with all three on, and equal the plain loop's bit for bit under
    the interpreter."""
    if not _descriptors_possible():
        pytest.skip("the warp-specialised loop needs a Hopper GPU")
    device = "cuda" if ON_GPU else "cpu"
    seqlen_k = 4096 if ON_GPU else 256  # (4096: the dQ kernel's warp-specialised entry starts there)
    q, k, v = bshd(2, 113, 4, dtype), bshd(2, seqlen_k, 2, dtype), bshd(2, seqlen_k, 2, dtype)
    sinks = torch.randn(4, device=device)
    slopes = torch.rand(4, device=device) * 0.2
    options = dict(softcap=5.0, alibi_slopes=slopes)
    monkeypatch.setenv("FLASH_ATTENTION_WS", "1")
    assert _specialized(fa, q, k, v, sinks=sinks, **options)
    assert _specialized(fa, q, k, v, kernel="bwd_dq", sinks=sinks, **options)
    dout = torch.randn_like(q)
    results = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("FLASH_ATTENTION_WS", setting)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)] + [sinks.clone().requires_grad_()]
        out, lse, _ = fa.flash_attn_func(*leaves[:3], s_aux=leaves[3], return_attn_probs=True, **options)
        results[setting] = (out, lse, *torch.autograd.grad(out, leaves, dout))
    if not ON_GPU:
        for label, a, b in zip(("out", "lse", "dq", "dk", "dv", "ds_aux"), results["1"], results["0"]):
            assert torch.equal(a, b), f"{label} differs between the warp-specialised and plain kernels"

    scale = 1.0 / math.sqrt(q.shape[-1])
    reference = dict(softcap=5.0, alibi_slopes=slopes, sinks=sinks)
    truth_out, truth_grads = run_ref(q, k, v, dout, False, scale, torch.float64, **reference)
    pt_out, pt_grads = run_ref(q, k, v, dout, False, scale, dtype, **reference)
    out, lse, *grads = results["1"]
    assert_within_bar("out", out, pt_out, truth_out, FWD_FACTOR)
    for label, ours, pt, truth in zip(("dq", "dk", "dv"), grads, pt_grads, truth_grads):
        assert_within_bar(label, ours, pt, truth, BWD_FACTOR)
