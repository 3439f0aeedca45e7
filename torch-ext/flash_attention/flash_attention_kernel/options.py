"""The attention options as one object, from the public functions to the kernels.

``AttentionOptions`` carries everything beyond the inputs and their sequence layout: the softmax
scale, causal masking, the window, softcap, ALiBi slopes, attention sinks and dropout (with its
RNG state). Along the way it

* flattens itself into the op schema and back (``flatten`` / ``unflatten``, ``SCHEMA``): tensor
  options first (``tensors``: what the autograd context saves for the backward), then scalars;
* tells the config table which kind of masking a call has (``mask_kind``);
* gives the launchers their constexpr (``variant``, the bit set of ``scores.py``) and their
  kernel arguments (``kernel_args``), in the order every kernel declares them.

Semantics are flash-attn 2.8's; ``scores.py`` documents how the kernels apply them.

Dropout's randomness: ``rng_state`` is an int64 pair (seed, offset) drawn from PyTorch's
generator of the inputs' device (``draw_rng_state``), as a tensor on that device. Drawing it is
an ordinary random op, so torch.manual_seed reproduces a call, CUDA graph capture records it
(each replay draws afresh, like PyTorch's own fused kernels), and torch.compile traces it. The
kernels read the pair from memory; the backward gets the same tensor and regenerates the same
mask. Pair (i, j) of query head h in batch entry b (sequence b for varlen) draws Philox keyed by
the seed at counter (4 (j // 32) + (j % 8) // 2, 16 (i // 16) + i % 8, b * heads + h,
offset mod 2^32): each call gives 8-bit draws to 16 pairs, queries i and i + 8 by 8 keys
(scores.dropout_keep).
"""

import functools
import inspect
import math
from dataclasses import dataclass, fields, replace
from typing import Optional

import torch

# The one home of the kernels' constants and VARIANT bits: the tl kernels take them as constexprs
# through scores.py, the Gluon kernels through hopper_gluon.py, each wrapping these values.
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

# A window bound past any sequence length means the same as this one, which keeps the kernels'
# int32 index arithmetic (index + diag +- bound) from overflowing.
MAX_WINDOW = 2 ** 30

# VARIANT bits
MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, SINKS, DROPOUT, TANH_APPROX, FIXED_PIVOT = 1, 2, 4, 8, 16, 32, 64, 128
WIDE_PRODUCTS = 256
SCORES_AHEAD = 512  # the Gluon forward's schedule for dropout (hopper_forward)
FP32_EXACT = 1024  # fp32 inputs: the exact forms of scores.py (launch.kernel_variant)


@dataclass(frozen=True)
class AttentionOptions:
    softmax_scale: float
    causal: bool = False
    window_left: int = -1  # -1: unbounded
    window_right: int = -1
    softcap: float = 0.0  # 0: off
    dropout_p: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = None  # fp32 (heads,) or (batch, heads)
    sinks: Optional[torch.Tensor] = None  # (heads,)
    rng_state: Optional[torch.Tensor] = None  # int64 (2,): seed, offset; with dropout only
    # flash-attn's ``deterministic``: True keeps the backward off kernels that sum by atomics (the
    # fused backward on the A100 class, ampere_route), so that its gradients are bitwise repeatable
    deterministic: bool = False

    TENSORS = ("alibi_slopes", "sinks", "rng_state")  # (``tensors`` spells them out in this order)
    SCALARS = ("softmax_scale", "causal", "window_left", "window_right", "softcap", "dropout_p", "deterministic")

    # ---- the op schema -------------------------------------------------------------------
    @staticmethod
    def schema() -> list:
        """The trailing op parameters, as inspect.Parameters with the types torch.library reads."""
        types = {f.name: f.type for f in fields(AttentionOptions)}
        return [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=types[name])
                for name in AttentionOptions.TENSORS + AttentionOptions.SCALARS]

    def flatten(self) -> tuple:
        return tuple(getattr(self, name) for name in self.TENSORS + self.SCALARS)

    @staticmethod
    def unflatten(values) -> "AttentionOptions":
        values = tuple(values)
        if values[0] is None and values[1] is None and values[2] is None:  # no tensor option: one object per scalars
            try:
                return _scalar_options(values[3:])
            except TypeError:  # (a symbolic scalar under tracing has no hash)
                pass
        names = AttentionOptions.TENSORS + AttentionOptions.SCALARS
        return AttentionOptions(**dict(zip(names, values, strict=True)))

    @functools.cached_property
    def scalar_values(self) -> tuple:
        """The scalar options, in schema order (hashable: a prepared call's key, replay.py)."""
        return tuple(getattr(self, name) for name in self.SCALARS)

    def tensors(self) -> tuple:
        """The tensor options (None where unset), in schema order: what a backward must keep."""
        return self.alibi_slopes, self.sinks, self.rng_state  # (TENSORS; one tuple, no loop: asked per call)

    def with_tensors(self, tensors) -> "AttentionOptions":
        return replace(self, **dict(zip(self.TENSORS, tensors, strict=True)))

    # ---- what the kernels see ------------------------------------------------------------
    # (derived values are cached on the instance: the public functions reuse one options object
    # per distinct set of scalar options, checks.scalar_options)
    @functools.cached_property
    def window(self) -> tuple[int, int]:
        """(left, right) as the kernels apply them: causal bounds the right side at 0."""
        right = 0 if self.causal else self.window_right
        return self.window_left, right

    @functools.cached_property
    def mask_kind(self) -> str:
        """Config-table key: "none", "causal" (an upper band edge only) or "window" (a lower one)."""
        left, right = self.window
        if left >= 0:
            return "window"
        return "causal" if right >= 0 else "none"

    @functools.cached_property
    def variant(self) -> int:
        """The VARIANT constexpr: one bit per option in use (scores.py)."""
        left, right = self.window
        return ((MASK_LEFT if left >= 0 else 0) | (MASK_RIGHT if right >= 0 else 0)
                | (SOFTCAP if self.softcap > 0 else 0) | (ALIBI if self.alibi_slopes is not None else 0)
                | (SINKS if self.sinks is not None else 0) | (DROPOUT if self.dropout_p > 0 else 0))

    def kernel_args(self, stand_in: torch.Tensor) -> tuple:
        """(AlibiSlopes, stride_alibi_b, Sinks, RngState, score_scale, softcap_log2, window_left,
        window_right, dropout_threshold, dropout_scale), as every kernel takes them; ``stand_in``
        (q) fills unused pointers (never read). For fp32 q the scale and the softcap are natural,
        without the factor log2(e) (scores.FP32_EXACT)."""
        slopes = self.alibi_slopes
        stride_alibi_b = slopes.stride(0) if slopes is not None and slopes.dim() == 2 else 0
        return (
            stand_in if slopes is None else slopes, stride_alibi_b,
            stand_in if self.sinks is None else self.sinks,
            stand_in if self.rng_state is None else self.rng_state,
            *(self._natural_scalar_args if stand_in.dtype == torch.float32 else self._scalar_args),
        )

    @functools.cached_property
    def _scalar_args(self) -> tuple:
        """kernel_args' scalars for 2-byte inputs, computed once per options object (an eager
        call without tensor options reuses one: ``unflatten``)."""
        return self._scalars(LOG2E)

    @functools.cached_property
    def _natural_scalar_args(self) -> tuple:
        """kernel_args' scalars for fp32 inputs: natural units."""
        return self._scalars(1.0)

    def _scalars(self, log2e: float) -> tuple:
        """(score_scale, softcap_log2, window_left, window_right, dropout_threshold, dropout_scale)."""
        left, right = (min(bound, MAX_WINDOW) for bound in self.window)  # (int32 arithmetic in the kernels)
        if self.softcap > 0:
            score_scale, softcap_log2 = self.softmax_scale / self.softcap, self.softcap * log2e
        else:
            score_scale, softcap_log2 = self.softmax_scale * log2e, 0.0
        threshold = min(int(round(self.dropout_p * 256)), 255)  # (scores.dropout_keep)
        return score_scale, softcap_log2, left, right, threshold, 1.0 / (1.0 - self.dropout_p)


@functools.lru_cache(maxsize=1024)
def _scalar_options(scalars: tuple) -> AttentionOptions:
    """The options of these SCALARS and no tensor option, made once (their derived values, cached
    on the instance, with them): unflatten's common case."""
    return AttentionOptions(**dict(zip(AttentionOptions.SCALARS, scalars, strict=True)))


def draw_rng_state(device: torch.device) -> torch.Tensor:
    """Dropout's (seed, offset), drawn from PyTorch's generator of ``device`` (see the module
    docstring)."""
    return torch.randint(0, 2 ** 62, (2,), dtype=torch.int64, device=device)
