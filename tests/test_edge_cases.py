"""Rows with no visible key, empty tensors, and offsets past 2**31."""

import pytest
import torch

from conftest import DEVICE, ON_GPU
from inputs import random_qkv
from reference import attention_ref, run_ref
from sizes import BF16, DTYPES
from test_correctness import check_against_reference


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_rows_without_keys(fa, dtype):
    """Bottom-right causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key.
    They output 0 with lse = +inf, and every gradient stays finite (their dq rows are 0)."""
    seqlen_q, seqlen_k = 113, 40
    q, k, v = random_qkv((1, seqlen_q, 2, 64), (1, seqlen_k, 1, 64), dtype, requires_grad=True)
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    empty = seqlen_q - seqlen_k
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isposinf(lse[..., :empty]).all() and torch.isfinite(lse[..., empty:]).all()
    (out.float().sum() + lse[..., empty:].sum()).backward()
    for grad in (q.grad, k.grad, v.grad):
        assert torch.isfinite(grad).all()
    assert torch.equal(q.grad[:, :empty], torch.zeros_like(q.grad[:, :empty]))
    check_against_reference(fa, q, k, v, causal=True)


def test_no_keys(fa):
    """seqlen_k == 0: every row is empty."""
    q, k, v = random_qkv((2, 17, 2, 32), (2, 0, 2, 32), requires_grad=True)
    out, lse, _ = fa.flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))
    assert k.grad.shape == k.shape


@pytest.mark.parametrize("shape_q, shape_kv", [((0, 17, 2, 32), (0, 17, 2, 32)), ((2, 0, 2, 32), (2, 17, 2, 32))])
def test_empty_inputs(fa, shape_q, shape_kv):
    q, k, v = random_qkv(shape_q, shape_kv, requires_grad=True)
    out = fa.flash_attn_func(q, k, v, causal=True)
    assert out.shape == q.shape
    out.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(v.grad, torch.zeros_like(v))


def test_lse_gradient(fa):
    """A loss that uses softmax_lse gets its gradient too (ring attention merges outputs by lse)."""
    leaves = random_qkv((1, 113, 2, 64), (1, 203, 2, 64), torch.float32, requires_grad=True)
    out, lse, _ = fa.flash_attn_func(*leaves, causal=True, return_attn_probs=True)
    grads = torch.autograd.grad(out.sum() + (lse * lse).sum(), leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_out, ref_lse = attention_ref(*ref_leaves, True, 64 ** -0.5, torch.float64)
    ref_grads = torch.autograd.grad(ref_out.sum() + (ref_lse * ref_lse).sum(), ref_leaves)
    for ours, ref in zip(grads, ref_grads):
        assert (ours.double() - ref).abs().max().item() < 1e-4


@pytest.mark.usefixtures("large_gpu_memory")
def test_offsets_past_int32(fa):
    """Inputs whose batch stride puts element offsets past 2**31 (the kernels offset in int64).

    q, k, v are views into one buffer of 2**31 + 2**20 fp16 elements (4 GiB); batch 1 of each
    starts past element 2**31. Only the viewed elements are filled."""
    seqlen, heads, head_dim = 64, 2, 32
    per_batch = seqlen * heads * head_dim
    batch_stride = 2**31
    buffer = torch.empty(batch_stride + 3 * per_batch, device=DEVICE, dtype=torch.float16)
    views = []
    for i in range(3):
        for b in range(2):
            start = b * batch_stride + i * per_batch
            buffer[start:start + per_batch].normal_()
        views.append(buffer.as_strided((2, seqlen, heads, head_dim), (batch_stride, heads * head_dim, head_dim, 1),
                                       storage_offset=i * per_batch))
    q, k, v = views
    dout = torch.randn(2, seqlen, heads, head_dim, device=DEVICE, dtype=torch.float16)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = fa.flash_attn_func(*leaves, causal=True)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_out, ref_grads = run_ref(*(t.detach().contiguous() for t in (q, k, v)), dout, True, head_dim ** -0.5, torch.float64)
    assert (out.double() - ref_out).abs().max().item() < 1e-2
    for ours, ref in zip(grads, ref_grads):
        assert (ours.double() - ref).abs().max().item() < 5e-2


@pytest.mark.skipif(not ON_GPU, reason="needs ~30 GB and a 33k-batch grid; hours under the CPU interpreter")
@pytest.mark.usefixtures("large_gpu_memory")
def test_dense_tensors_past_int32(fa):
    """Contiguous q, k, v, out and grads of more than 2**31 elements; checks the last batches."""
    batch, seqlen, heads, head_dim = 33000, 256, 2, 128  # 2.16e9 elements per tensor
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device=DEVICE, dtype=BF16).requires_grad_()
               for _ in range(3))
    out = fa.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    tail = slice(batch - 4, batch)
    ref_out, ref_grads = run_ref(q[tail], k[tail], v[tail], dout[tail], True, head_dim ** -0.5, torch.float64)
    assert (out[tail].double() - ref_out).abs().max().item() < 2e-2
    for ours, ref in zip((dq, dk, dv), ref_grads):
        assert (ours[tail].double() - ref).abs().max().item() < 1e-1
