"""Which kernel runs each pass of an attention call, with which config: the one place that decides.

A forward call is one pass (``fwd``); a backward call is three decisions: where delta comes from,
which kernel computes dQ (``bwd_dq``) and which dK/dV (``bwd_dkdv``). Each pass runs either a tl
kernel (forward.py, backward.py: every GPU and the CPU interpreter) or, on Hopper, a Gluon kernel
(hopper_forward, hopper_dq, hopper_dkdv):

* Gluon where ``hopper_route.chosen`` says so (sm_90, a checked Triton, a dense bf16/fp16 call in
  full tiles at head dim 64, 80, 96 or 128, long enough to repay the kernel, FLASH_ATTENTION_GLUON), with
  ``configs.gluon_config`` (the kernel's fixed program tiles and its ring depth per head dim and
  mask).
* tl otherwise, with ``launch.tl_launch`` (the config table's entry, warp-specialised or plain,
  through tensor descriptors or not). A pass the Gluon kernel runs gets no tl launch.
* on the A100 class, the backward of a dense bf16/fp16 call at head dim 64 or 128, causal or not, in
  full tiles, that does not ask for determinism: one Gluon kernel for both passes, dQ by atomics
  (``ampere_route.chosen``, ``ampere_backward``; ``BackwardPlan.fused``). On Hopper the Gluon
  dK/dV kernel can add dQ itself by TMA reductions (``hopper_route.fused_chosen``,
  ``hopper_dkdv.attention_dkdv_dq``), planned the same way.
* delta (rowsum(dO * O) - dlse, which both backward kernels read): fp32 inputs make it in the tl
  dQ kernel's first pass (``DELTA_FP32_PASS``, PyTorch's form from P and dP); a plain dense tl dQ
  kernel and the Gluon dQ kernel make it in their prologue and run first (``DELTA_IN_DQ``), saving
  the preprocess launch and its pass over O and dO; the tl warp-specialised and varlen dQ kernels
  lose more than that behind the extra prologue (docs/design.md#backward), so there the
  preprocess kernel makes it (``DELTA_PREPROCESS``).

A plan depends only on facts a call's signature holds (``plan_key``: the options' scalars and
which tensor options are set, the sequence layout's lengths, each tensor's type, shape, strides,
dtype, device and 16-byte alignment, ``launch_environment``: the environment switches and torch's
determinism flag), so eager calls find it in a cache keyed by them (``_PLANS``, bounded by
``launch.remembered``) instead of deciding again: the decisions cost more host time than a short
call's kernels (issue 41). Setting an override empties the cache; a config
``launch.launch_fitting`` stepped down is applied to a cached plan as it is to a new one
(``launch.refitted``). Calls on other tensor types (fake tensors under torch.compile) are decided
afresh each time.

One hook overrides these decisions: ``configs.set_override(pass, config, warp_specialized,
implementation)`` forces, for every launch of a pass (fwd, bwd_dq, bwd_dkdv, decode), the tl or
the Gluon kernel and its config (docs/design.md#config-rules); ``override`` below sets it for a
``with`` block. The launchers (forward.attention_forward, backward.attention_backward) launch what
``plan_forward`` / ``plan_backward`` return; the tuner (benchmarks/tune_configs.py) and the
benchmarks choose kernels and configs through the hook.
"""

import contextlib
import os
import types
from dataclasses import dataclass, replace
from typing import Callable, Optional, Union

import torch

from . import ampere_route, configs, hopper_route
from .configs import FusedBackwardConfig, GluonConfig
from .launch import (
    PLAIN_TENSORS, SequenceLayout, TlLaunch, any_refitted, kernel_variant, refitted, remembered, tl_launch,
)
from .options import FP32_EXACT, AttentionOptions

# Where the backward's delta comes from (BackwardPlan.delta_source)
DELTA_IN_DQ = "dq prologue"
DELTA_PREPROCESS = "preprocess kernel"
DELTA_FP32_PASS = "dq first pass"


@dataclass(frozen=True)
class PassPlan:
    """The kernel of one pass: the tl kernel with ``tl`` (its TlLaunch), or, where ``gluon`` is
    set (the Gluon kernel's launch function, hopper_route.launcher or ampere_route.launcher), the
    Gluon kernel with ``gluon_config`` (a GluonConfig, or the fused backward's FusedBackwardConfig)."""

    tl: Optional[TlLaunch] = None
    gluon: Optional[Callable] = None
    gluon_config: Optional[Union[GluonConfig, FusedBackwardConfig]] = None

    @property
    def implementation(self) -> str:
        """"gluon" or "tl"."""
        return "gluon" if self.gluon is not None else "tl"


@dataclass(frozen=True)
class BackwardPlan:
    """The backward's decisions: ``delta_source`` (DELTA_IN_DQ, DELTA_PREPROCESS or
    DELTA_FP32_PASS) and the dQ and dK/dV passes. ``fused``: one kernel makes both passes (dQ added
    to an fp32 accumulator: ``ampere_backward``, ``hopper_dkdv.attention_dkdv_dq``), whose launch
    function both passes' ``gluon`` hold."""

    delta_source: str
    dq: PassPlan
    dkdv: PassPlan
    fused: bool = False


def plan_forward(options: AttentionOptions, layout: SequenceLayout, interpreted: bool, q, k, v) -> PassPlan:
    """The forward's kernel and config for this call."""
    tensors = (q, k, v)
    plan = _cached("fwd", options, layout, interpreted, tensors, lambda: _pass_plan(
        "fwd", options, layout, interpreted, tensors))
    return _refitted_pass(plan)


def plan_backward(options: AttentionOptions, layout: SequenceLayout, interpreted: bool, q, k, v,
                  dout) -> BackwardPlan:
    """The backward's delta source and its dQ and dK/dV kernels and configs for this call."""
    tensors = (q, k, v, dout)
    plan = _cached("bwd", options, layout, interpreted, tensors, lambda: _backward_plan(
        options, layout, interpreted, tensors))
    if not any_refitted():
        return plan
    dq, dkdv = _refitted_pass(plan.dq), _refitted_pass(plan.dkdv)
    return plan if dq is plan.dq and dkdv is plan.dkdv else replace(plan, dq=dq, dkdv=dkdv)


def _backward_plan(options: AttentionOptions, layout: SequenceLayout, interpreted: bool, tensors) -> BackwardPlan:
    q = tensors[0]
    fused = ampere_route.launcher() if ampere_route.chosen(options, layout, interpreted, tensors) else None
    if fused is not None:
        both = PassPlan(gluon=fused, gluon_config=ampere_route.config(q.device, q.shape[-1]))
        return BackwardPlan(DELTA_PREPROCESS, both, both, fused=True)
    fused = hopper_route.fused_launcher() if hopper_route.fused_chosen(options, layout, interpreted, tensors) else None
    if fused is not None:  # (Hopper's: the Gluon dK/dV kernel adds dQ)
        both = PassPlan(gluon=fused, gluon_config=GluonConfig(
            *configs.GLUON_TILES["bwd_dkdv"], configs.GLUON_FUSED_STAGES[q.shape[-1]]))
        return BackwardPlan(DELTA_PREPROCESS, both, both, fused=True)
    dq = _pass_plan("bwd_dq", options, layout, interpreted, tensors)
    # (no warp-specialised dK/dV loop nor table entry: Triton 3.6 fails on it, docs/design.md#warp-specialised-tl-loops)
    dkdv = _pass_plan("bwd_dkdv", options, layout, interpreted, tensors)
    if kernel_variant(options, q.dtype, interpreted) & FP32_EXACT:
        delta_source = DELTA_FP32_PASS
    elif dq.gluon is not None or not (dq.tl.specialized or layout.is_varlen):
        delta_source = DELTA_IN_DQ
    else:
        delta_source = DELTA_PREPROCESS
    return BackwardPlan(delta_source, dq, dkdv)


# plan_key -> PassPlan or BackwardPlan, for eager calls (module docstring; launch.remembered bounds it)
_PLANS: dict = {}
configs.cleared_by_overrides(types.SimpleNamespace(cache_clear=_PLANS.clear))
# The environment switches that change what a call launches (docs/production.md#environment-variables),
# in the order ``switches`` gives their values; replay.py keys its prepared calls by them too
SWITCHES = ("FLASH_ATTENTION_GLUON", "FLASH_ATTENTION_TMA", "FLASH_ATTENTION_WS", "FLASH_ATTENTION_DIRECT_LAUNCH",
            "FLASH_ATTENTION_REPLAY", "FLASH_ATTENTION_FUSED_DQ")


def _cached(kind: str, options: AttentionOptions, layout: SequenceLayout, interpreted: bool, tensors, make):
    """The plan ``make()`` makes, from _PLANS where a call of the same plan_key made it before."""
    key = plan_key(kind, options, layout, interpreted, tensors)
    return make() if key is None else remembered(_PLANS, key, make)


def plan_key(kind: str, options: AttentionOptions, layout: SequenceLayout, interpreted: bool, tensors):
    """What a plan of ``kind`` ("fwd", "bwd") for these arguments depends on, hashable; None for
    tensors of other types than plain tensors and parameters (fake tensors have no address)."""
    if not all(type(x) in PLAIN_TENSORS for x in tensors):
        return None
    return (kind, interpreted, options.variant, options.causal, options.window, options.softcap, options.dropout_p > 0,
            options.deterministic, layout.is_varlen, layout.seqlen_q, layout.seqlen_k, layout.page_size,
            *launch_environment(),
            *[(x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16) for x in tensors])


# The switches' values as os.environ holds them (os.environ.get encodes each name and decodes each
# value: 1-2 us a switch, more than the rest of the key)
_ENVIRON_DATA = getattr(os.environ, "_data", None)
_SWITCH_KEYS = [os.environ.encodekey(name) for name in SWITCHES] if hasattr(os.environ, "encodekey") else None


def switches() -> tuple:
    if _ENVIRON_DATA is None or _SWITCH_KEYS is None:  # (a Python whose os.environ differs: the public way)
        return tuple(os.environ.get(name) for name in SWITCHES)
    return tuple(map(_ENVIRON_DATA.get, _SWITCH_KEYS))


def launch_environment() -> tuple:
    """What outside a call's arguments changes what it launches: the switches' values (in SWITCHES'
    order, so replay.py can index them) and torch.are_deterministic_algorithms_enabled(), which
    keeps the backward off the fused kernel (ampere_route). The plan cache and replay.py's prepared
    calls key by it."""
    return (*switches(), torch.are_deterministic_algorithms_enabled())


def _refitted_pass(plan: PassPlan) -> PassPlan:
    if plan.tl is None or not any_refitted():
        return plan
    tl = refitted(plan.tl)
    return plan if tl is plan.tl else replace(plan, tl=tl)


def _pass_plan(kernel: str, options: AttentionOptions, layout: SequenceLayout, interpreted: bool,
               tensors) -> PassPlan:
    """Pass ``kernel``'s plan: its Gluon kernel where the override forces it (a ValueError where
    it cannot run the call) or, without one, where hopper_route chooses it and it builds; else
    the tl kernel."""
    forced = configs.overridden_implementation(kernel)
    if forced == "gluon":
        if not hopper_route.fits(kernel, options, layout, interpreted, tensors):
            raise ValueError(f"flash_attention: the {kernel} override forces the Gluon kernel, which cannot run this "
                             f"call (hopper_route.fits: sm_90, dense bf16/fp16, head dim 64/80/96/128, full tiles)")
        gluon = hopper_route.launcher(kernel)
        if gluon is None:
            raise ValueError(f"flash_attention: the {kernel} override forces the Gluon kernel, which does not build "
                             f"under this Triton")
    elif forced is None and hopper_route.chosen(kernel, options, layout, interpreted, tensors):
        gluon = hopper_route.launcher(kernel)
    else:
        gluon = None
    q = tensors[0]
    head_dim = q.shape[-1]
    if gluon is not None:
        return PassPlan(gluon=gluon, gluon_config=configs.gluon_config(kernel, head_dim, options.mask_kind))
    return PassPlan(tl=tl_launch(kernel, head_dim, q.dtype, options, layout, interpreted, *tensors))


@contextlib.contextmanager
def override(kernel: str, config=None, warp_specialized: bool = False, implementation: Optional[str] = None):
    """``configs.set_override(kernel, config, warp_specialized, implementation)`` for the ``with``
    block, then the override that was there before (or none)."""
    previous = configs.OVERRIDES.get(kernel)
    configs.set_override(kernel, config, warp_specialized, implementation)
    try:
        yield
    finally:
        if previous is None:
            configs.set_override(kernel, None)
        else:
            configs.set_override(kernel, previous.config, previous.warp_specialized, previous.implementation)
