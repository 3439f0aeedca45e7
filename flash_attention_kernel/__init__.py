"""Pure-Triton FlashAttention kernels and their launchers.

Plain torch tensors in, tensors out; no torch.library here (the Hub package in
torch-ext/flash_attention registers these launchers as torch ops). Layout everywhere is
(batch, seqlen, heads, head_dim) with any strides whose last dim is contiguous.

* forward.py: FlashAttention-2 forward (online softmax), returns out and the natural-log logsumexp.
* backward.py: preprocess + dK/dV + dQ kernels, no atomics, GQA reduced inside the dK/dV kernel.
* tiles.py: tile loads/stores with 64-bit offsets, and the causal/sequence-end masks.
* configs.py: the fixed table of tile sizes per head dim and dtype.
"""

from .backward import attention_backward
from .configs import padded_head_dim
from .forward import attention_forward
from .launch import is_interpreted


def interpreter_active() -> bool:
    """True when the kernels run through Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    from .forward import _attn_fwd_kernel

    return is_interpreted(_attn_fwd_kernel)


__all__ = ["attention_forward", "attention_backward", "interpreter_active", "padded_head_dim"]
