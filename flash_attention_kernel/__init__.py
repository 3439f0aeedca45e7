"""Pure-Triton FlashAttention kernels and their launchers.

Plain torch tensors in, tensors out; no torch.library here (the Hub package in
torch-ext/flash_attention registers these launchers as torch ops). Layouts: dense
(batch, seqlen, heads, head_dim) or varlen (total_tokens, heads, head_dim) with cu_seqlens, any
strides whose last dim is contiguous.

* forward.py: FlashAttention-2 forward (online softmax), returns out and the natural-log logsumexp.
* backward.py: dQ + dK/dV kernels (delta from the dQ kernel or a preprocess kernel), no atomics,
  GQA reduced inside the dK/dV kernel.
* tiles.py: tile loads/stores with 64-bit offsets, sequence spans (dense or varlen), the
  causal/sequence-end masks and tile ranges, and the mma/rounding helpers.
* launch.py: host-side helpers (sequence layout, strides, precision mode).
* configs.py: the fixed table of tile sizes per head dim and dtype.
"""

from .backward import attention_backward
from .forward import _attn_fwd_kernel, attention_forward
from .launch import is_interpreted


def interpreter_active() -> bool:
    """True when the kernels run through Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_attn_fwd_kernel)


__all__ = ["attention_forward", "attention_backward", "interpreter_active"]
