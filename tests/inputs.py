"""Random test inputs: q, k, v (dense or varlen layout alike) and cu_seqlens."""

import torch

from sizes import DEVICE


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
