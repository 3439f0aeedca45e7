"""Pure-Triton FlashAttention kernels and their launchers.

Plain torch tensors in, tensors out; no torch.library here (the Hub package in
torch-ext/flash_attention registers these launchers as torch ops). Layouts: dense
(batch, seqlen, heads, head_dim) or varlen (total_tokens, heads, head_dim) with cu_seqlens, any
strides whose last dim is contiguous. A call flows options -> launcher -> planner -> kernel.

The options and the launch:
* options.py: AttentionOptions, every option beyond the inputs (scale, causal, window, softcap,
  ALiBi, sinks, dropout) as one object, and what the launchers derive from it.
* configs.py: the fixed table of tile sizes, warps and stages per GPU class, head dim, mask kind,
  sequence-length bucket and dtype (no autotuning), the Gluon kernels' tiles and ring depths, and
  the one override hook (set_override: a pass's kernel and config).
* planner.py: which kernel (tl or Gluon) runs each pass of a call with which config, and where the
  backward's delta comes from; the launchers launch what it says.
* launch.py: host-side helpers (sequence layout, strides, precision mode, a tl kernel's launch:
  TlLaunch, its TMA and warp-specialization choices, stepping down a config that does not fit).
* direct_launch.py: DirectKernel, relaunching a compiled kernel without JITFunction.run's per-call
  host work (decoding's host time).
* replay.py: prepared calls: an eager forward, backward or decode step whose signature came twice
  replays the recorded launches, with the tensors' addresses as the only per-call work.

The tl kernels (every supported GPU, configs.MIN_CAPABILITY up, and the CPU interpreter):
* tiles.py: tile loads/stores with 64-bit offsets, sequence spans (dense or varlen) and the
  mma/rounding helpers.
* scores.py: the one place where scores become logits: softcap, ALiBi, window/causal masks,
  dropout's keep mask, and which tiles a program visits.
* forward.py: FlashAttention-2 forward (online softmax), returns out and the natural-log logsumexp.
* backward.py: dQ + dK/dV kernels (delta from the dQ kernel or a preprocess kernel), no atomics,
  GQA reduced inside the dK/dV kernel; the sinks' gradient.
* ampere_backward.py, ampere_route.py: the backward in one Gluon kernel for the A100 class (dQ by
  atomics), for calls that do not ask for determinism.
* decode.py: attention over a KV cache (flash_attn_with_kvcache): appending new keys and values,
  split-KV decoding with the query heads of a KV head packed into one program, and the merge.
* probabilities.py: the attention probabilities with the dropout mask (return_attn_probs).
* rotary.py: rotary position embeddings (RoPE), in place or not, dense or varlen, with offsets.

The Gluon kernels for Hopper (sm_90, dense bf16/fp16 calls in full tiles; imported on first use):
* hopper_route.py: which calls the Gluon kernels take, decided without importing Gluon, and
  their loading (a Triton whose Gluon fails to import falls back to the tl kernels).
* hopper_gluon.py: what the Gluon kernels share: arguments, TMA rings, score math, and the Gluon
  names that moved between Triton releases.
* hopper_dropout.py: dropout's keep mask in Gluon (Philox from scores.py's constants), laid out
  for the Gluon kernels' score tiles.
* hopper_forward.py: the forward, FlashAttention-3's schedule (a TMA producer warp, two consumer
  warpgroups out of step).
* hopper_dq.py: the backward's dQ kernel, keys streamed past resident queries.
* hopper_dkdv.py: the backward's dK/dV kernel, queries streamed past resident keys and values.
"""

from .backward import attention_backward
from .decode import attention_with_kvcache
from .forward import _attn_fwd_kernel, attention_forward
from .launch import is_interpreted
from .options import AttentionOptions, draw_rng_state
from .probabilities import attention_probabilities
from .rotary import apply_rotary

# The package's version: build.toml's general.version, the major version (Hub branch v<version>)
# that kernels.get_kernel(..., version=...) loads; tests/test_package.py checks that they agree.
__version__ = "1"


def interpreter_active() -> bool:
    """True when the kernels run through Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_attn_fwd_kernel)


__all__ = ["AttentionOptions", "apply_rotary", "attention_backward", "attention_forward", "attention_probabilities",
           "attention_with_kvcache", "draw_rng_state", "interpreter_active"]
