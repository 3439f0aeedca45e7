"""Pure-Triton FlashAttention kernels and their launchers.

Plain torch tensors in, tensors out; no torch.library here (the Hub package in
torch-ext/flash_attention registers these launchers as torch ops). Layouts: dense
(batch, seqlen, heads, head_dim) or varlen (total_tokens, heads, head_dim) with cu_seqlens, any
strides whose last dim is contiguous.

* options.py: AttentionOptions, every option beyond the inputs (scale, causal, window, softcap,
  ALiBi, sinks, dropout) as one object, and what the launchers derive from it.
* scores.py: the one place where scores become logits: softcap, ALiBi, window/causal masks,
  dropout's keep mask, and which tiles a program visits.
* forward.py: FlashAttention-2 forward (online softmax), returns out and the natural-log logsumexp.
* decode.py: attention over a KV cache (flash_attn_with_kvcache): appending new keys and values,
  split-KV decoding with the query heads of a KV head packed into one program, and the merge.
* backward.py: dQ + dK/dV kernels (delta from the dQ kernel or a preprocess kernel), no atomics,
  GQA reduced inside the dK/dV kernel; the sinks' gradient.
* hopper_dkdv.py: the dK/dV kernel again, in Gluon for Hopper (a producer warp, two consumer
  warpgroups out of step), for the dense calls it covers.
* probabilities.py: the attention probabilities with the dropout mask (return_attn_probs).
* rotary.py: rotary position embeddings (RoPE), in place or not, dense or varlen, with offsets.
* tiles.py: tile loads/stores with 64-bit offsets, sequence spans (dense or varlen) and the
  mma/rounding helpers.
* launch.py: host-side helpers (sequence layout, strides, precision mode, launch plan).
* configs.py: the fixed table of tile sizes per head dim, mask kind and dtype.
"""

from .backward import attention_backward
from .decode import attention_with_kvcache
from .forward import _attn_fwd_kernel, attention_forward
from .launch import is_interpreted
from .options import AttentionOptions, draw_rng_state
from .probabilities import attention_probabilities
from .rotary import apply_rotary


def interpreter_active() -> bool:
    """True when the kernels run through Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_attn_fwd_kernel)


__all__ = ["AttentionOptions", "apply_rotary", "attention_backward", "attention_forward", "attention_probabilities",
           "attention_with_kvcache", "draw_rng_state", "interpreter_active"]
