"""Random test inputs: q, k, v (dense or varlen layout alike) and cu_seqlens."""

import pytest
import torch

from sizes import BF16_SUPPORTED, DEVICE


def random_qkv(q_shape, kv_shape, dtype=torch.float16, requires_grad=False):
    """q of ``q_shape`` and k, v of ``kv_shape``, standard normal, on the test device."""
    return tuple(torch.randn(*shape, device=DEVICE, dtype=dtype).requires_grad_(requires_grad)
                 for shape in (q_shape, kv_shape, kv_shape))


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

