"""Variable-length batches, packed inputs and the padding helpers, against per-sequence references."""

import math

import pytest
import torch

from conftest import DEVICE, ON_GPU
from inputs import cu_seqlens, random_qkv
from reference import BWD_FACTOR, FWD_FACTOR, assert_within_bar, attention_ref
from sizes import BF16, DTYPES

# Per-sequence (q lengths, k lengths); k None = same as q.
BATCHES_CPU = {
    "many_short": ([5, 1, 17, 9, 33, 2, 12, 7, 40, 3], None),
    "one_long_many_short": ([203, 3, 1, 17, 5, 9], None),
    "empty_sequences": ([0, 17, 0, 5, 1], [3, 0, 0, 9, 1]),
    "q_ne_k": ([17, 113, 1, 40], [113, 17, 40, 1]),
}
BATCHES_GPU = {
    **BATCHES_CPU,
    "one_long_many_short": ([4096, 3, 1, 17, 500, 129, 1023, 64], None),
    "mixed_long": ([1024, 2000, 128, 3000, 777], [900, 2100, 128, 3000, 1]),
}
BATCHES = BATCHES_GPU if ON_GPU else BATCHES_CPU


def _varlen_inputs(lens_q, lens_k, heads_q, heads_kv, head_dim, dtype, requires_grad=False):
    return random_qkv((sum(lens_q), heads_q, head_dim), (sum(lens_k), heads_kv, head_dim), dtype, requires_grad)


def varlen_ref(q, k, v, dout, cu_q, cu_k, causal, scale, dtype):
    """Concatenated per-sequence attention_ref outputs, gradients and lse (heads, total_q)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    outs, lses = [], []
    for b in range(cu_q.numel() - 1):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        out, lse = attention_ref(leaves[0][rows_q][None], leaves[1][rows_k][None], leaves[2][rows_k][None],
                                 causal, scale, dtype)
        outs.append(out[0])
        lses.append(lse[0])
    out = torch.cat(outs)
    grads = torch.autograd.grad(out, leaves, dout.to(dtype), allow_unused=True, materialize_grads=True)
    return out, grads, torch.cat(lses, dim=-1)


def check_varlen(fa, q, k, v, lens_q, lens_k, causal):
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    scale = 1.0 / math.sqrt(q.shape[-1])
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse, _ = fa.flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                            return_attn_probs=True)
    assert lse.shape == (q.shape[1], q.shape[0])
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)

    truth_out, truth_grads, truth_lse = varlen_ref(q, k, v, dout, cu_q, cu_k, causal, scale, torch.float64)
    pt_out, pt_grads, _ = varlen_ref(q, k, v, dout, cu_q, cu_k, causal, scale, q.dtype)
    assert_within_bar("out", out, pt_out, truth_out, FWD_FACTOR)
    for name, ours, pt, truth in zip(("dq", "dk", "dv"), grads, pt_grads, truth_grads):
        assert_within_bar(name, ours, pt, truth, BWD_FACTOR)
    visible = torch.isfinite(truth_lse)
    assert torch.equal(torch.isposinf(lse), ~visible)
    if visible.any():
        assert (lse[visible].double() - truth_lse[visible]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_varlen(fa, batch, causal, dtype):
    lens_q, lens_k = BATCHES[batch]
    lens_k = lens_k or lens_q
    head_dim = {torch.float16: 59, torch.bfloat16: 128, torch.float32: 40}[dtype]
    q, k, v = _varlen_inputs(lens_q, lens_k, 4, 2 if dtype != torch.float32 else 1, head_dim, dtype)
    check_varlen(fa, q, k, v, lens_q, lens_k, causal)


@pytest.mark.parametrize("head_dim", [16, 80, 111, 192, 256])
def test_varlen_head_dims(fa, head_dim):
    lens = BATCHES["one_long_many_short"][0]
    q, k, v = _varlen_inputs(lens, lens, 2, 2, head_dim, BF16)
    check_varlen(fa, q, k, v, lens, lens, causal=True)


def test_varlen_matches_dense(fa):
    """A batch of equal lengths gives the dense kernel's result, bit for bit."""
    batch, seqlen, heads, head_dim = 3, 113, 4, 64
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device=DEVICE, dtype=torch.float16) for _ in range(3))
    cu = cu_seqlens([seqlen] * batch)
    dense, dense_lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    varlen, varlen_lse, _ = fa.flash_attn_varlen_func(*(t.flatten(0, 1) for t in (q, k, v)), cu, cu, seqlen, seqlen,
                                                      causal=True, return_attn_probs=True)
    assert torch.equal(varlen, dense.flatten(0, 1))
    assert torch.equal(varlen_lse, dense_lse.transpose(0, 1).flatten(1))


def _grads_of(fn, inputs, dout):
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, dout)), out.grad_fn


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_packed_variants(fa, varlen):
    """qkv- and kv-packed functions equal the unpacked ones bit for bit, and their gradient is
    written straight into the packed gradient (no unbind/stack node in the autograd graph)."""
    heads, head_dim, causal = 4, 64, True
    if varlen:
        lens = [17, 1, 40, 0, 9]
        cu, longest = cu_seqlens(lens), max(lens)
        qkv = torch.randn(sum(lens), 3, heads, head_dim, device=DEVICE, dtype=BF16)
        unpacked = lambda q, k, v: fa.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)  # noqa: E731
        qkv_fn = lambda qkv: fa.flash_attn_varlen_qkvpacked_func(qkv, cu, longest, causal=causal)  # noqa: E731
        kv_fn = lambda q, kv: fa.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, longest, longest, causal=causal)  # noqa: E731
    else:
        qkv = torch.randn(2, 113, 3, heads, head_dim, device=DEVICE, dtype=BF16)
        unpacked = lambda q, k, v: fa.flash_attn_func(q, k, v, causal=causal)  # noqa: E731
        qkv_fn = lambda qkv: fa.flash_attn_qkvpacked_func(qkv, causal=causal)  # noqa: E731
        kv_fn = lambda q, kv: fa.flash_attn_kvpacked_func(q, kv, causal=causal)  # noqa: E731
    pack_dim = qkv.dim() - 3
    q, k, v = qkv.unbind(dim=pack_dim)
    dout = torch.randn_like(q)
    (out, dq, dk, dv), _ = _grads_of(unpacked, (q, k, v), dout)

    (out_qkv, dqkv), grad_fn = _grads_of(qkv_fn, (qkv,), dout)
    assert torch.equal(out_qkv, out) and torch.equal(dqkv, torch.stack((dq, dk, dv), dim=pack_dim))
    assert [type(f).__name__ for f, _ in grad_fn.next_functions if f is not None] == ["AccumulateGrad"]

    (out_kv, dq_kv, dkv), grad_fn = _grads_of(kv_fn, (q, torch.stack((k, v), dim=pack_dim)), dout)
    assert torch.equal(out_kv, out) and torch.equal(dq_kv, dq) and torch.equal(dkv, torch.stack((dk, dv), dim=pack_dim))
    assert all(type(f).__name__ == "AccumulateGrad" for f, _ in grad_fn.next_functions if f is not None)


def test_unpad_pad_roundtrip(fa):
    """unpad_input / pad_input: flash-attn's outputs, inverse of each other, differentiable."""
    from_padding = fa.bert_padding
    batch, seqlen, hidden = 3, 11, 8
    mask = torch.zeros(batch, seqlen, dtype=torch.bool, device=DEVICE)
    for b, length in enumerate([11, 0, 4]):
        mask[b, :length] = True
    unused = torch.zeros_like(mask)
    unused[2, 4:6] = True
    x = torch.randn(batch, seqlen, hidden, device=DEVICE, requires_grad=True)

    packed, indices, cu, max_seqlen, seqused = from_padding.unpad_input(x, mask, unused)
    assert cu.tolist() == [0, 11, 11, 17] and cu.dtype == torch.int32
    assert max_seqlen == 11 and isinstance(max_seqlen, int) and seqused.tolist() == [11, 0, 4]
    assert torch.equal(packed, x.reshape(-1, hidden)[(mask | unused).flatten()])
    padded = from_padding.pad_input(packed, indices, batch, seqlen)
    assert torch.equal(padded, x * (mask | unused)[..., None])
    (padded * padded).sum().backward()
    assert torch.equal(x.grad, 2 * x.detach() * (mask | unused)[..., None])


def test_varlen_through_padding_helpers(fa):
    """The transformers path: unpad a padded batch, attend per sequence, pad back."""
    batch, seqlen, heads, head_dim = 3, 40, 2, 32
    mask = torch.arange(seqlen, device=DEVICE)[None, :] < torch.tensor([40, 7, 23], device=DEVICE)[:, None]
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device=DEVICE, dtype=torch.float16) for _ in range(3))
    unpad = fa.bert_padding.unpad_input
    (q_u, indices, cu, longest, _), (k_u, *_), (v_u, *_) = unpad(q, mask), unpad(k, mask), unpad(v, mask)
    out = fa.bert_padding.pad_input(fa.flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, longest, longest, causal=True),
                                    indices, batch, seqlen)
    for b, length in enumerate([40, 7, 23]):
        expected = fa.flash_attn_func(q[b:b + 1, :length], k[b:b + 1, :length], v[b:b + 1, :length], causal=True)
        assert torch.equal(out[b:b + 1, :length], expected)
        assert torch.equal(out[b, length:], torch.zeros_like(out[b, length:]))


def test_varlen_reference_batch_is_bitwise_repeatable(fa):
    lens = BATCHES["one_long_many_short"][0]
    q, k, v = _varlen_inputs(lens, lens, 4, 2, 64, BF16, requires_grad=True)
    cu = cu_seqlens(lens)
    dout = torch.randn_like(q)
    runs = []
    for _ in range(2):
        out = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    for got, first in zip(*runs):
        assert torch.equal(got, first)
