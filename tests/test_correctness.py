"""Output, logsumexp and gradients against a float64 reference, with flash-attn's error bar."""

import math

import pytest
import torch

from conftest import DEVICE
from inputs import gradients, random_qkv
from reference import BWD_FACTOR, FWD_FACTOR, assert_within_bar, attention_ref, run_ref
from sizes import BF16, DTYPES, HEAD_DIMS, HEADS, LONG_SEQLENS, ON_GPU, SEQLENS


def check_against_reference(fa, q, k, v, causal, softmax_scale=None):
    """Runs flash_attn_func forward + backward and checks out, lse, dq, dk, dv."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse, _ = fa.flash_attn_func(*leaves, causal=causal, softmax_scale=softmax_scale, return_attn_probs=True)
    dout = torch.randn_like(out)
    grads = gradients(out, leaves, dout)

    truth_out, truth_grads = run_ref(q, k, v, dout, causal, scale, torch.float64)
    pt_out, pt_grads = run_ref(q, k, v, dout, causal, scale, q.dtype)
    assert_within_bar("out", out, pt_out, truth_out, FWD_FACTOR)
    for name, ours, pt, truth in zip(("dq", "dk", "dv"), grads or (), pt_grads, truth_grads):
        assert ours.shape == truth.shape and ours.dtype == q.dtype
        assert_within_bar(name, ours, pt, truth, BWD_FACTOR)

    _, truth_lse = attention_ref(q, k, v, causal, scale, torch.float64)
    visible = torch.isfinite(truth_lse)
    assert torch.equal(torch.isinf(lse) & (lse > 0), ~visible), "lse must be +inf exactly on rows with no key"
    assert (lse[visible].double() - truth_lse[visible]).abs().max().item() <= 1e-4 * max(1.0, scale)


CASES = [
    (dtype, causal, seqlens, HEAD_DIMS[i % len(HEAD_DIMS)], HEADS[i % len(HEADS)])
    for i, (dtype, causal, seqlens) in enumerate(
        (dtype, causal, seqlens) for dtype in DTYPES for causal in (False, True) for seqlens in SEQLENS
    )
]


@pytest.mark.parametrize(
    "dtype, causal, seqlens, head_dim, heads",
    CASES,
    ids=[f"{str(c[0])[6:]}-{'causal' if c[1] else 'full'}-q{c[2][0]}k{c[2][1]}-d{c[3]}-h{c[4][1]}:{c[4][2]}" for c in CASES],
)
def test_flash_attn_func(fa, dtype, causal, seqlens, head_dim, heads):
    batch, heads_q, heads_kv = heads
    seqlen_q, seqlen_k = seqlens
    q, k, v = random_qkv((batch, seqlen_q, heads_q, head_dim), (batch, seqlen_k, heads_kv, head_dim), dtype)
    check_against_reference(fa, q, k, v, causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_head_dims(fa, head_dim, dtype):
    seqlen_q, seqlen_k = LONG_SEQLENS
    q, k, v = random_qkv((1, seqlen_q, 2, head_dim), (1, seqlen_k, 1, head_dim), dtype)
    check_against_reference(fa, q, k, v, causal=True)


@pytest.mark.skipif(not ON_GPU, reason="the short-sequence entries serve compiled kernels (the interpreter has its own)")
def test_short_sequence_entries(fa):
    """Each entry of this GPU's short-sequence buckets (configs.SEQLEN_BUCKETS: the tiles calls of
    at most 1024 or 2048 rows take), at the bucket's longest keys and one query row fewer (a
    ragged tile), with its head dim and mask: the suite's other lengths miss the 2048 bucket."""
    kernels = fa.flash_attention_kernel
    gpu = kernels.launch.device_gpu_class(torch.device(DEVICE)).name
    for bucket, entries in kernels.configs.TABLES[gpu].short.items():
        for head_dim, mask in sorted({(head_dim, mask) for _, head_dim, mask in entries}):
            q, k, v = random_qkv((1, bucket - 1, 2, head_dim), (1, bucket, 1, head_dim), BF16)
            check_against_reference(fa, q, k, v, causal=mask == "causal")


@pytest.mark.parametrize("softmax_scale", [0.05, 1.0, 3.0])
def test_softmax_scale(fa, softmax_scale):
    q, k, v = random_qkv((1, 113, 2, 64), (1, 203, 2, 64))
    check_against_reference(fa, q, k, v, causal=True, softmax_scale=softmax_scale)


def test_large_scores(fa):
    """Scaled-up inputs (flash-attn's overflow test): large logits must not overflow or lose mass."""
    q, k, v = random_qkv((1, 113, 2, 64), (1, 203, 1, 64), BF16)
    check_against_reference(fa, q * 5, k * 3, v * 3, causal=True)


@pytest.mark.parametrize("layout", ["bhsd_transposed", "packed_qkv", "non_contiguous_last_dim"])
def test_strided_inputs(fa, layout):
    batch, seqlen, heads, head_dim = 2, 113, 2, 40
    if layout == "bhsd_transposed":  # (B, H, S, D) storage seen as (B, S, H, D)
        q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device=DEVICE, dtype=torch.float16).transpose(1, 2)
                   for _ in range(3))
    elif layout == "packed_qkv":  # slices of one (B, S, 3, H, D) projection output
        qkv = torch.randn(batch, seqlen, 3, heads, head_dim, device=DEVICE, dtype=torch.float16)
        q, k, v = qkv.unbind(dim=2)
    else:  # last dim strided: copied by the wrapper
        q, k, v = (torch.randn(batch, seqlen, heads, 2 * head_dim, device=DEVICE, dtype=torch.float16)[..., ::2]
                   for _ in range(3))
    check_against_reference(fa, q, k, v, causal=True)


def test_flash_attention_forward_layout(fa):
    """kernels-community API: (batch, heads, seqlen, dim) in and out, differentiable."""
    q = torch.randn(2, 4, 113, 64, device=DEVICE, dtype=torch.float16, requires_grad=True)
    k = torch.randn(2, 2, 203, 64, device=DEVICE, dtype=torch.float16, requires_grad=True)
    v = torch.randn(2, 2, 203, 64, device=DEVICE, dtype=torch.float16, requires_grad=True)
    out = fa.flash_attention_forward(q, k, v, causal=True)
    assert out.shape == q.shape
    expected = fa.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    assert torch.equal(out, expected.transpose(1, 2))
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and not torch.isnan(k.grad).any()
