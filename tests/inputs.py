"""Random test inputs: q, k, v (dense or varlen layout alike), cu_seqlens, paged caches."""

import pytest
import torch

from sizes import BF16_SUPPORTED, DEVICE


def random_qkv(q_shape, kv_shape, dtype=torch.float16, requires_grad=False):
    """q of ``q_shape`` and k, v of ``kv_shape``, standard normal, on the test device."""
    return tuple(torch.randn(*shape, device=DEVICE, dtype=dtype).requires_grad_(requires_grad)
                 for shape in (q_shape, kv_shape, kv_shape))


def bshd(batch, seqlen, heads, dtype=torch.bfloat16, head_dim=128):
    """A standard normal (batch, seqlen, heads, head_dim) tensor on the test device (q, k, v or dout
    in flash-attn's dense layout)."""
    return torch.randn(batch, seqlen, heads, head_dim, dtype=dtype, device=DEVICE)


def cu_seqlens(lengths):
    """int32 (len(lengths) + 1,) offsets of sequences packed back to back."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def op_options(fa, causal, softmax_scale=0.125, **options):
    """The ops' trailing option arguments (AttentionOptions.flatten) for a direct op call."""
    return fa.flash_attention_kernel.AttentionOptions(softmax_scale, causal, **options).flatten()


def gradients(out, inputs, dout):
    """torch.autograd.grad(out, inputs, dout), or None where this GPU cannot run the backward:
    fp32 beyond head dim 128 on a Turing GPU (64 KB of shared memory per block), after checking
    that the call says so with a ValueError."""
    if not BF16_SUPPORTED and out.dtype == torch.float32 and out.shape[-1] > 128:
        with pytest.raises(ValueError, match="need more shared memory"):
            torch.autograd.grad(out, inputs, dout)
        return None
    return torch.autograd.grad(out, inputs, dout)


def paged_caches(k, v, lengths, page_size, spare_pages=3):
    """The packed rows of ``k`` and ``v`` (total_k, heads_k, d) scattered over the same shuffled
    pages of two caches (num_blocks, page_size, heads_k, d) whose other rows hold NaN, and the
    block table (padding entries point at a NaN page)."""
    pages_per_seq = [max(1, -(-n // page_size)) for n in lengths]
    num_blocks = sum(pages_per_seq) + spare_pages
    order = torch.randperm(num_blocks).tolist()
    caches = [torch.full((num_blocks, page_size, *x.shape[1:]), float("nan"), dtype=x.dtype, device=x.device)
              for x in (k, v)]
    table = torch.full((len(lengths), max(pages_per_seq)), order[0], dtype=torch.int32)  # order[0]: never used
    start = 0
    for b, n in enumerate(lengths):
        for p in range(pages_per_seq[b]):
            page = order.pop()
            table[b, p] = page
            rows = slice(start + p * page_size, start + min(n, (p + 1) * page_size))
            for cache, x in zip(caches, (k, v)):
                cache[page, :rows.stop - rows.start] = x[rows]
        start += n
    return caches[0], caches[1], table.to(k.device)
