"""The logits rule, in every form the kernels hold it, against one host statement of it.

The rule: a (query, key) pair's logit is the scaled q.k product, capped by softcap * tanh, minus
ALiBi's slope * |q + diag - k|, in base 2 (natural under FP32_EXACT); -inf outside the band
(the causal and window edges, and for the tl kernels keys past seqlen_k); its gradient factor is
the softcap's tanh' (else 1), and dS is exactly 0 outside the band. ``reference.logits_rule``
states it in float64 on the same integers and maps the kernels' arguments onto it.

Unlike rules.py's rules (tests/test_shared_rules.py) it has no one source: the tl kernels take it
from scores.py (``logits``, ``logit_unit``, ``visible``, ``logits_grad``, ``score_grads``), the
Hopper Gluon kernels hold their own forms, shaped for their schedules (hopper_gluon.py:
``tile_logits``, the backward's, minus the row's lse, ALiBi split into a row and a key term
without ALIBI_ABS; ``forward_logits``, t * unit - row_offset in the three ALIBI_SIDE forms;
``band_mask``; ``tile_logits_grad``). So each form is checked against the reference here:

* Probe kernels call the forms on tiles of 16 query rows by 32 keys, one program per tile and
  each tile its own case, with the arguments as the launchers make them: per case
  ``AttentionOptions.kernel_args`` (tl) or ``hopper_gluon.option_arguments`` (Gluon), VARIANT
  from ``launch.kernel_variant`` / option_arguments, the tl slope read by
  ``scores.head_options``.
* The grid: the causal / window edges each alone, both, none (tl: the sequence end alone) and
  full tiles (MASKED off); softcap on and off; ALiBi on and off, slopes of both signs and 0;
  base 2 and FP32_EXACT (tl); the tl and dK/dV (keys-first) orientations; Gluon's ALIBI_ABS
  forms and ALIBI_SIDE forms, each fed only tiles where its precondition holds (every compared
  pair on or below the diagonal for ALIBI_ABS off and ALIBI_BELOW, on or above it for
  ALIBI_ABOVE). Cases: diag = seqlen_k - seqlen_q of 0, +-1, +-37, +-1000, +-1e6; windows of
  0, 1, 7, 40 and 2^31 - 1 (clamped to MAX_WINDOW by kernel_args) on each side; causal;
  tiles crossing each band edge, the diagonal, the sequence end, or away from all; rows from 0
  to about 8e6 (< 2^24: the fp32 distances must stay exact), rows that see no key; q.k
  products of 0, -0, tiny, huge (a saturated tanh) and random ones at three magnitudes.
* Checks: the -inf pattern equals the reference's exactly; the logits agree within fp32
  rounding of each term (2^-20 of the scaled logit, of slope * (|d| + 64), of the lse) plus
  the tanh's error (tanh.approx.f32's 2^-11 relative, as test_shared_rules checks it; the
  exp2 form's and FP32_EXACT's few ulps); dS is exactly 0 outside the band also on rows whose
  delta is NaN (every odd row), where visible pairs must stay NaN (the mask decides, not P),
  and the gradient factor agrees elsewhere. The Gluon backward form also gets rows with lse =
  +inf (rows that saw no key: P = 0, never NaN).

The tl probes run on the CPU interpreter and on a GPU (there the bf16 softcap takes
tanh.approx.f32, TANH_APPROX); the Gluon probes on a GPU only (Gluon has no interpreter:
``gluon_probes`` skips elsewhere, as in test_shared_rules), but every Gluon probe launch is
compiled for sm_90 on CPU too, so that CI sees a probe the installed Gluon no longer builds.
"""

import itertools
import math
import os
import random
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE, ON_GPU, PACKAGE_SOURCE
from reference import logits_rule

sys.path.insert(0, str(PACKAGE_SOURCE))
from flash_attention_kernel import launch, scores  # noqa: E402  (the source the built package copies)
from flash_attention_kernel.options import (  # noqa: E402
    ALIBI, FP32_EXACT, MASK_LEFT, MASK_RIGHT, SOFTCAP, TANH_APPROX, AttentionOptions,
)

# the Gluon forms: hopper_gluon's, imported by test_shared_rules only where Gluon builds (as the kernels' route does)
from test_shared_rules import gluon, require_gluon_on_gpu  # noqa: E402

if gluon is not None:
    from test_shared_rules import gl, hopper_gluon  # noqa: E402

ROWS, KEYS = 16, 32  # a probe tile: query rows by keys
CASES = 16  # tiles (programs) per probe launch
# the VARIANT bits the logits read (launch.kernel_variant may add others, e.g. FIXED_PIVOT)
LOGIT_BITS = MASK_LEFT | MASK_RIGHT | SOFTCAP | ALIBI | TANH_APPROX | FP32_EXACT
ROUNDING = 2.0 ** -20  # (relative, per term: a few fp32 roundings of each with room)

# the cases' values
BOUNDS = (0, 1, 7, 40, 2 ** 31 - 1)  # window bounds; 2^31 - 1: past any sequence (kernel_args clamps it)
ROW_STARTS = (0, 3, 100, 1_000_000, 8_000_000)  # (the large ones plus up to 5000)
DIAGS = (0, 1, -1, 37, -37, 1000, -1000, 1_000_003, -999_983)
SCALES = (0.125, 128 ** -0.5, 1.0, 0.01)
SOFTCAPS = (5.0, 30.0, 50.0)
SLOPES = (0.0, 0.3, -0.2, 1e-3, 8.0, -3.5)  # (any fp32 is taken; flash-attn's own are U(0, 0.3))
MAGNITUDES = (1.0, 30.0, 300.0)

# mask -> (MASK_LEFT, MASK_RIGHT, MASKED): "unmasked" is a full tile under both edges' bits
MASKS = {"none": (False, False, True), "left": (True, False, True), "right": (False, True, True),
         "both": (True, True, True), "unmasked": (True, True, False)}


@dataclass(frozen=True)
class Spec:
    """One probe launch: its mask, options, and which side of the diagonal the compared pairs
    must lie on ("any", "below": d = q + diag - k >= 0, "above": d <= 0)."""
    mask: str
    softcap: bool
    alibi: bool
    side: str = "any"

    @property
    def masked(self):
        return MASKS[self.mask][2]


@dataclass
class Case:
    options: AttentionOptions
    rows: torch.Tensor  # int64 (ROWS,)
    keys: torch.Tensor  # int64 (KEYS,)
    diag: int
    seqlen_k: int
    qk: torch.Tensor  # fp32 (ROWS, KEYS)


def _window_options(spec, rng):
    """(causal, window_left, window_right) of one case."""
    has_left, has_right, _ = MASKS[spec.mask]
    left = rng.choice(BOUNDS) if has_left else -1
    right = rng.choice(BOUNDS) if has_right else -1
    if spec.side == "below" and spec.masked:  # (every visible pair on or below the diagonal)
        right = 0
    if right == 0 and rng.random() < 0.5:
        return True, left, -1  # causal: the same right bound
    return False, left, right


def _key_offset(spec, window, rng):
    """The tile's first key minus (first row + diag): near the diagonal or an edge of the band,
    so that the tile crosses it, or away from both; for the one-sided forms' full tiles, wholly
    on their side."""
    far = rng.choice([0, rng.randrange(0, 3 * KEYS), 5000])
    if spec.side == "below" and not spec.masked:
        return -(KEYS - 1) - far
    if spec.side == "above" and not spec.masked:
        return ROWS - 1 + far
    left, right = window
    anchors = [0, 3 * KEYS + far, -3 * KEYS - far]
    anchors += [-bound for bound in [left] if 0 <= bound < 1000] + [bound for bound in [right] if 0 <= bound < 1000]
    return rng.choice(anchors) + rng.randrange(-KEYS - 2, ROWS + 3)


def _side_holds(spec, case, gluon_form):
    if spec.side == "any":
        return True
    distance = case.rows[:, None] + case.diag - case.keys[None, :]
    if spec.masked:
        visible = torch.isfinite(_reference(spec, case, gluon_form)[0])
        distance = distance[visible]
    return bool((distance >= 0).all() if spec.side == "below" else (distance <= 0).all())


def _cases(spec, seed, gluon_form=False, count=CASES):
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    cases = []
    while len(cases) < count:
        causal, left, right = _window_options(spec, rng)
        softcap = rng.choice(SOFTCAPS) if spec.softcap else 0.0
        slopes = torch.tensor([rng.choice(SLOPES)], dtype=torch.float32) if spec.alibi else None
        options = AttentionOptions(rng.choice(SCALES), causal, left, right, softcap, alibi_slopes=slopes)
        diag = rng.choice(DIAGS)
        row0 = rng.choice(ROW_STARTS)
        row0 += rng.randrange(0, 5000) if row0 >= 1_000_000 else 0
        key0 = row0 + diag + _key_offset(spec, options.window, rng)
        if key0 < 0:  # (rows before the diagonal's first key: under causal they see none)
            key0 = rng.randrange(0, KEYS)
        if max(key0 + KEYS, row0 + ROWS + abs(diag)) >= 2 ** 24:
            continue
        seqlen_k = key0 + rng.randrange(0, KEYS + 1) if rng.random() < 0.3 else key0 + KEYS + rng.randrange(0, 1000)
        qk = torch.randn(ROWS, KEYS, generator=generator) * rng.choice(MAGNITUDES)
        qk[0, :5] = torch.tensor([0.0, -0.0, 1e-30, 1e4, -1e4])
        case = Case(options, row0 + torch.arange(ROWS), key0 + torch.arange(KEYS), diag, seqlen_k, qk.float())
        if _side_holds(spec, case, gluon_form):
            cases.append(case)
    return cases


def _reference(spec, case, gluon_form, natural=False):
    """logits_rule of a case: with its band where the tile is MASKED (the Gluon forms have no
    sequence end: their tiles are full), else the plain values (a full tile's pairs all visible)."""
    options = case.options
    window, seqlen_k = (options.window, None if gluon_form else case.seqlen_k) if spec.masked else ((-1, -1), None)
    slope = None if options.alibi_slopes is None else float(options.alibi_slopes[0])
    return logits_rule(case.qk, case.rows[:, None], case.keys[None, :], case.diag, window, options.softmax_scale,
                       options.softcap, slope, seqlen_k, natural)


def _tanh_error(t, form):
    """Bound on |computed - exact| of a tanh t: "approx" tanh.approx.f32 (2^-11 relative, as
    test_shared_rules' _check_tanh), "exp2" scores._tanh's (1 - e) / (1 + e) (absolute error
    near 0), "exact" scores._tanh_exact (a few ulps)."""
    if form == "approx":
        return 2 ** -10.5 * t.abs() + 2 ** -20
    if form == "exp2":
        return ROUNDING * t.abs() + 2 ** -21
    return ROUNDING * t.abs()


def _tolerances(spec, case, tanh_form, natural=False, lse=None):
    """(logits, gradient factor) tolerances of a case, elementwise: each term's fp32 rounding
    (the scaled logit, ALiBi's slope * |d| with the tile's width for the split forms, the lse)
    plus the tanh's error."""
    options, unit = case.options, 1.0 if natural else math.log2(math.e)
    scaled = case.qk.double() * options.softmax_scale
    if options.softcap > 0:
        x = scaled / options.softcap
        t = torch.tanh(x)
        tol = options.softcap * unit * (ROUNDING * t.abs() + _tanh_error(t, tanh_form))
        if tanh_form == "exact":  # tanh' from exp(-2|x|): its argument's rounding grows with |x|
            grad_tol = torch.cosh(x) ** -2.0 * 2 ** -21 * (2 + x.abs()) + 2 ** -100  # (fp32 underflows to 0)
        else:  # 1 - tanh^2 of the computed tanh
            grad_tol = 2 * t.abs() * _tanh_error(t, tanh_form) + 2 ** -22
    else:
        tol, grad_tol = ROUNDING * unit * scaled.abs(), torch.zeros_like(scaled)
    if options.alibi_slopes is not None:
        distance = (case.rows[:, None] + case.diag - case.keys[None, :]).abs().double()
        tol = tol + ROUNDING * unit * abs(float(options.alibi_slopes[0])) * (distance + 2 * KEYS)
    if lse is not None:
        tol = tol + ROUNDING * lse.double().abs().nan_to_num(posinf=0.0)[:, None]
    return tol, grad_tol


def _where(cases, index):
    """Where a check failed: the case's options and the pair."""
    c, i, j = (int(x) for x in index)
    case, options = cases[c], cases[c].options
    return (f"case {c} (scale {options.softmax_scale}, softcap {options.softcap}, window {options.window}, "
            f"slopes {options.alibi_slopes}, diag {case.diag}, seqlen_k {case.seqlen_k}): row {int(case.rows[i])}, "
            f"key {int(case.keys[j])}, q.k {float(case.qk[i, j])!r}")


def _assert_logits(got, expected, tol, cases, what):
    """-inf exactly where ``expected`` is; elsewhere finite and within ``tol``."""
    got = got.double().cpu()
    pattern = torch.isneginf(got) != torch.isneginf(expected)
    assert not pattern.any(), (f"{what}: -inf pattern differs at {_where(cases, pattern.nonzero()[0])}: got "
                               f"{float(got[tuple(pattern.nonzero()[0])])}")
    finite = torch.isfinite(expected)
    error = (got - expected).abs().where(finite, 0.0).nan_to_num(nan=float("inf"))
    bad = error > tol
    if bad.any():
        index = tuple(bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} logits beyond their tolerance, first {_where(cases, index)}: "
                             f"got {float(got[index])!r}, expected {float(expected[index])!r}, tolerance "
                             f"{float(tol[index]):.3g}")


def _assert_grads(got, visible, expected, tol, cases, what):
    """dS of dP - delta = 1 - delta (delta NaN on odd rows, else 0): exactly 0 outside the band,
    NaN on visible pairs of NaN rows, the gradient factor within ``tol`` elsewhere."""
    got = got.double().cpu()
    nan_rows = (torch.arange(ROWS) % 2 == 1)[None, :, None]
    not_zero = ~visible & (got != 0)
    assert not not_zero.any(), f"{what}: dS not 0 outside the band at {_where(cases, not_zero.nonzero()[0])}"
    lost = visible & nan_rows & ~torch.isnan(got)
    assert not lost.any(), f"{what}: a visible pair of a row with NaN delta lost its NaN at " \
                           f"{_where(cases, lost.nonzero()[0])}"
    bad = visible & ~nan_rows & ~((got - expected).abs() <= tol)
    if bad.any():
        index = tuple(bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} gradient factors beyond their tolerance, first "
                             f"{_where(cases, index)}: got {float(got[index])!r}, expected "
                             f"{float(expected[index])!r}, tolerance {float(tol[index]):.3g}")


def _delta():
    """Each tile's delta per row: NaN on odd rows (a row whose output is NaN), else 0."""
    return torch.where(torch.arange(ROWS) % 2 == 1, float("nan"), 0.0).float().repeat(CASES, 1)


def _indices(cases):
    rows = torch.stack([case.rows for case in cases]).to(torch.int32).to(DEVICE)
    keys = torch.stack([case.keys for case in cases]).to(torch.int32).to(DEVICE)
    return rows, keys, torch.stack([case.qk for case in cases]).to(DEVICE)


def _argument_tensors(cases, ints, floats):
    """The probes' (Ints, Floats, Slopes): per case its integers, its floats and its ALiBi slope."""
    slopes = [0.0 if case.options.alibi_slopes is None else float(case.options.alibi_slopes[0]) for case in cases]
    return tuple(torch.tensor(values, dtype=dtype, device=DEVICE)
                 for values, dtype in ((ints, torch.int32), (floats, torch.float32), (slopes, torch.float32)))


# -- scores.py's tl forms -----------------------------------------------------------------------------------

@triton.jit
def _tl_logits_kernel(QK, Rows, Keys, Ints, Floats, Slopes, Delta, S, Unit, Grad, M: tl.constexpr,
                      N: tl.constexpr, MASKED: tl.constexpr, VARIANT: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """Case c = program c: logits (S, in units of Unit per row) and score_grads of logits_grad
    (Grad, with dP = 1 and the rows' Delta) of its [M, N] tile of q.k products (held as [N, M]
    with KEYS_FIRST, the dK/dV kernel's orientation). Ints: (diag, seqlen_k, left, right),
    Floats: (score_scale, softcap_log2), Slopes: the ALiBi slope, read by head_options."""
    c = tl.program_id(0)
    r = tl.arange(0, M)
    k = tl.arange(0, N)
    rows = tl.load(Rows + c * M + r)
    keys = tl.load(Keys + c * N + k)
    delta = tl.load(Delta + c * M + r)
    diag, seqlen_k = tl.load(Ints + c * 4), tl.load(Ints + c * 4 + 1)
    window = (tl.load(Ints + c * 4 + 2), tl.load(Ints + c * 4 + 3))
    score, _, _ = scores.head_options(Slopes, 1, Slopes, Slopes, tl.load(Floats + c * 2), tl.load(Floats + c * 2 + 1),
                                      0, c, 0, 1, VARIANT)
    if KEYS_FIRST:
        tile = c * M * N + r[None, :] * N + k[:, None]
        queries, keys_2d, delta_2d = rows[None, :], keys[:, None], delta[None, :]
    else:
        tile = c * M * N + r[:, None] * N + k[None, :]
        queries, keys_2d, delta_2d = rows[:, None], keys[None, :], delta[:, None]
    qk = tl.load(QK + tile)
    s, capped = scores.logits(qk, queries, keys_2d, seqlen_k, diag, window, score, MASKED, VARIANT)
    tl.store(S + tile, s)
    tl.store(Unit + c * M + r, tl.zeros([M], tl.float32) + scores.logit_unit(score, VARIANT))
    p_grad = scores.logits_grad(qk * 0.0 + 1.0, capped, VARIANT)
    tl.store(Grad + tile, scores.score_grads(p_grad, 1.0, delta_2d, queries, keys_2d, seqlen_k, diag, window,
                                             MASKED, VARIANT))


def _tl_arguments(cases, dtype):
    """(Ints, Floats, Slopes, VARIANT) of the cases as the tl launchers make them, for inputs of
    ``dtype``: kernel_args' values and kernel_variant's bits (one VARIANT for all cases)."""
    stand_in = torch.empty(1, dtype=dtype)
    ints, floats, variants = [], [], set()
    for case in cases:
        *_, score_scale, softcap_log2, left, right, _, _ = case.options.kernel_args(stand_in)
        ints.append([case.diag, case.seqlen_k, left, right])
        floats.append([score_scale, softcap_log2])
        variants.add(launch.kernel_variant(case.options, dtype, not ON_GPU) & LOGIT_BITS)
    assert len(variants) == 1, variants
    return (*_argument_tensors(cases, ints, floats), variants.pop())


def _run_tl(spec, dtype, keys_first, seed):
    cases = _cases(spec, seed)
    ints, floats, slopes, variant = _tl_arguments(cases, dtype)
    has_left, has_right, masked = MASKS[spec.mask]
    assert variant & (MASK_LEFT | MASK_RIGHT) == has_left * MASK_LEFT | has_right * MASK_RIGHT
    rows, keys, qk = _indices(cases)
    s, grad = torch.full_like(qk, 7.0), torch.full_like(qk, 7.0)  # (poisoned)
    unit = torch.full((CASES, ROWS), 7.0, device=DEVICE)
    _tl_logits_kernel[(CASES,)](qk, rows, keys, ints, floats, slopes, _delta().to(DEVICE), s, unit, grad, ROWS, KEYS,
                                masked, variant, keys_first)
    natural = bool(variant & FP32_EXACT)
    form = "exact" if natural else "approx" if variant & TANH_APPROX else "exp2"
    references = [_reference(spec, case, False, natural) for case in cases]
    tolerances = [_tolerances(spec, case, form, natural) for case in cases]
    expected = torch.stack([logits for logits, _ in references])
    logits = s.double().cpu() * unit.double().cpu()[:, :, None]
    what = f"scores.logits, VARIANT {variant:#x}, MASKED {masked}, keys first {keys_first}"
    _assert_logits(logits, expected, torch.stack([tol for tol, _ in tolerances]), cases, what)
    _assert_grads(grad, torch.isfinite(expected), torch.stack([g for _, g in references]),
                  torch.stack([tol for _, tol in tolerances]), cases, what.replace("logits", "score_grads"))


UNITS = {"base2": torch.bfloat16, "fp32_exact": torch.float32}  # (the inputs' dtype sets the units)


@pytest.mark.parametrize("units", UNITS)
@pytest.mark.parametrize("softcap", [False, True], ids=["nocap", "softcap"])
@pytest.mark.parametrize("alibi", [False, True], ids=["noalibi", "alibi"])
@pytest.mark.parametrize("mask", MASKS)
def test_tl_logits_match_the_reference(mask, alibi, softcap, units):
    seed = list(MASKS).index(mask) * 8 + alibi * 4 + softcap * 2 + (units == "fp32_exact")
    _run_tl(Spec(mask, softcap, alibi), UNITS[units], False, seed)


@pytest.mark.parametrize("units", UNITS)
@pytest.mark.parametrize("mask", ["right", "both", "unmasked"])
def test_tl_logits_keys_first_match_the_reference(mask, units):
    """The dK/dV kernel's orientation (keys on the tile's rows), every option on."""
    _run_tl(Spec(mask, True, True), UNITS[units], True, 100 + list(MASKS).index(mask) * 2 + (units == "fp32_exact"))


# -- hopper_gluon.py's Gluon forms ---------------------------------------------------------------------------

if gluon is not None:
    _TILE_LAYOUT = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])  # (launched with num_warps=4)
    _DIM0 = gl.constexpr(gl.SliceLayout(1, _TILE_LAYOUT))  # index vectors along the tile's rows
    _DIM1 = gl.constexpr(gl.SliceLayout(0, _TILE_LAYOUT))  # along its columns
    _ALIBI = hopper_gluon.ALIBI_
    _LOG2E = hopper_gluon.LOG2E_

    @gluon.jit
    def _gluon_slope_log2(Slopes, c, VARIANT: gl.constexpr):
        """The case's slope in base 2, as the Gluon kernels load it."""
        slope_log2 = 0.0
        if _ALIBI & VARIANT:
            slope_log2 = gl.load(Slopes + c) * _LOG2E
        return slope_log2

    @gluon.jit
    def _gluon_tile_logits_kernel(QK, Rows, Keys, Ints, Floats, Slopes, Lse, Delta, X, Grad, M: gl.constexpr,
                                  N: gl.constexpr, MASKED: gl.constexpr, VARIANT: gl.constexpr,
                                  ALIBI_ABS: gl.constexpr, KEYS_FIRST: gl.constexpr):
        """Case c = program c: tile_logits (X, minus the rows' Lse in base 2) and tile_logits_grad
        (Grad, of 1 - Delta) of its [M, N] tile (held [N, M] with KEYS_FIRST: the dK/dV kernel's
        S^T). Ints: (diag, -, left, right), Floats: (score_scale, softcap_log2)."""
        c = gl.program_id(0)
        band = (gl.load(Ints + c * 4), gl.load(Ints + c * 4 + 2), gl.load(Ints + c * 4 + 3))
        score = (gl.load(Floats + c * 2), gl.load(Floats + c * 2 + 1))
        slope_log2 = _gluon_slope_log2(Slopes, c, VARIANT)
        key_base = gl.load(Keys + c * N)
        if KEYS_FIRST:
            r = gl.arange(0, M, _DIM1)
            k = gl.arange(0, N, _DIM0)
            tile = c * M * N + r[None, :] * N + k[:, None]
            queries = gl.load(Rows + c * M + r)[None, :]
            keys = gl.load(Keys + c * N + k)[:, None]
            lse_log2 = gl.load(Lse + c * M + r)[None, :]
            delta = gl.load(Delta + c * M + r)[None, :]
        else:
            r = gl.arange(0, M, _DIM0)
            k = gl.arange(0, N, _DIM1)
            tile = c * M * N + r[:, None] * N + k[None, :]
            queries = gl.load(Rows + c * M + r)[:, None]
            keys = gl.load(Keys + c * N + k)[None, :]
            lse_log2 = gl.load(Lse + c * M + r)[:, None]
            delta = gl.load(Delta + c * M + r)[:, None]
        s = gl.load(QK + tile)
        x, capped = hopper_gluon.tile_logits(s, lse_log2, queries, keys, key_base, band, score, slope_log2, MASKED,
                                             VARIANT, ALIBI_ABS)
        gl.store(X + tile, x)
        ds = hopper_gluon.tile_logits_grad(s * 0.0 + (1.0 - delta), capped, queries, keys, band, MASKED, VARIANT)
        gl.store(Grad + tile, ds)

    @gluon.jit
    def _gluon_forward_logits_kernel(QK, Rows, Keys, Ints, Floats, Slopes, T, Unit, RowOffset, M: gl.constexpr,
                                     N: gl.constexpr, MASKED: gl.constexpr, VARIANT: gl.constexpr,
                                     ALIBI_SIDE: gl.constexpr):
        """Case c = program c: forward_logits (T, Unit and RowOffset per row: logits
        T * Unit - RowOffset) of its [M, N] tile."""
        c = gl.program_id(0)
        band = (gl.load(Ints + c * 4), gl.load(Ints + c * 4 + 2), gl.load(Ints + c * 4 + 3))
        score = (gl.load(Floats + c * 2), gl.load(Floats + c * 2 + 1))
        slope_log2 = _gluon_slope_log2(Slopes, c, VARIANT)
        r = gl.arange(0, M, _DIM0)
        k = gl.arange(0, N, _DIM1)
        rows = gl.load(Rows + c * M + r)
        keys = gl.load(Keys + c * N + k)
        tile = c * M * N + r[:, None] * N + k[None, :]
        s = gl.load(QK + tile)
        t, unit, row_offset = hopper_gluon.forward_logits(s, rows, keys, gl.load(Keys + c * N), band, score,
                                                          slope_log2, MASKED, VARIANT, ALIBI_SIDE)
        gl.store(T + tile, t)
        zero = r.to(gl.float32) * 0.0
        gl.store(Unit + c * M + r, zero + unit)
        gl.store(RowOffset + c * M + r, zero + row_offset)


@pytest.fixture
def gluon_probes():
    """The Gluon probe kernels (``test_shared_rules.require_gluon_on_gpu``)."""
    require_gluon_on_gpu("the Gluon forms run")
    return types.SimpleNamespace(tile_logits=_gluon_tile_logits_kernel, forward_logits=_gluon_forward_logits_kernel)


def _gluon_arguments(cases):
    """(Ints, Floats, Slopes, VARIANT) of the cases as option_arguments makes them for the Gluon
    kernels (2-byte inputs: base 2)."""
    stand_in = torch.empty(1, dtype=torch.bfloat16)
    ints, floats, variants = [], [], set()
    for case in cases:
        arguments, constexprs = hopper_gluon.option_arguments(case.options, stand_in)
        score_scale, softcap_log2, _, left, right = arguments[:5]
        ints.append([case.diag, 0, left, right])
        floats.append([score_scale, softcap_log2])
        variants.add(constexprs["VARIANT"])
    assert len(variants) == 1, variants
    return (*_argument_tensors(cases, ints, floats), variants.pop())


def _gluon_variant(mask, softcap, alibi):
    """The VARIANT option_arguments gives a form's cases (checked in each launch)."""
    has_left, has_right, _ = MASKS[mask]
    return has_left * MASK_LEFT | has_right * MASK_RIGHT | softcap * SOFTCAP | alibi * ALIBI


def _lse(seed):
    """Each tile's lse_log2 per row: random, +inf on the last row of every fourth tile (a row
    that saw no key: the forward stores +inf)."""
    lse = (torch.rand(CASES, ROWS, generator=torch.Generator().manual_seed(seed)) - 0.5) * 120.0
    lse[::4, -1] = float("inf")
    return lse


# (mask, alibi, ALIBI_ABS): ALIBI_ABS off only where every visible pair lies on or below the
# diagonal: right = 0 (masked), or full tiles below it
TILE_FORMS = [(mask, alibi, alibi_abs) for mask in ("left", "right", "both", "unmasked")
              for alibi, alibi_abs in ((False, False), (True, True), (True, False))
              if not (alibi and not alibi_abs and mask == "left")]


@pytest.mark.parametrize("keys_first", [False, True], ids=["rows_first", "keys_first"])
@pytest.mark.parametrize("softcap", [False, True], ids=["nocap", "softcap"])
@pytest.mark.parametrize("mask, alibi, alibi_abs", TILE_FORMS,
                         ids=[f"{mask}-{'alibi_abs' if abs_ else 'alibi_split' if alibi else 'noalibi'}"
                              for mask, alibi, abs_ in TILE_FORMS])
def test_gluon_tile_logits_match_the_reference(gluon_probes, mask, alibi, alibi_abs, softcap, keys_first):
    spec = Spec(mask, softcap, alibi, "any" if alibi_abs or not alibi else "below")
    seed = 200 + TILE_FORMS.index((mask, alibi, alibi_abs)) * 4 + softcap * 2 + keys_first
    cases = _cases(spec, seed, gluon_form=True)
    ints, floats, slopes, variant = _gluon_arguments(cases)
    assert variant == _gluon_variant(mask, softcap, alibi)
    rows, keys, qk = _indices(cases)
    lse = _lse(seed)
    x, grad = torch.full_like(qk, 7.0), torch.full_like(qk, 7.0)  # (poisoned)
    gluon_probes.tile_logits[(CASES,)](qk, rows, keys, ints, floats, slopes, lse.to(DEVICE), _delta().to(DEVICE), x,
                                       grad, ROWS, KEYS, spec.masked, variant, alibi_abs, keys_first, num_warps=4)
    references = [_reference(spec, case, True) for case in cases]
    tolerances = [_tolerances(spec, case, "approx", lse=lse[c]) for c, case in enumerate(cases)]
    logits = torch.stack([logits for logits, _ in references])
    what = f"hopper_gluon.tile_logits, VARIANT {variant:#x}, MASKED {spec.masked}, ALIBI_ABS {alibi_abs}"
    _assert_logits(x, logits - lse.double()[:, :, None], torch.stack([tol for tol, _ in tolerances]), cases, what)
    _assert_grads(grad, torch.isfinite(logits), torch.stack([g for _, g in references]),
                  torch.stack([tol for _, tol in tolerances]), cases, what.replace("tile_logits", "tile_logits_grad"))


SIDES = {"below": hopper_gluon.ALIBI_BELOW.value, "above": hopper_gluon.ALIBI_ABOVE.value,
         "across": hopper_gluon.ALIBI_ACROSS.value} if gluon is not None else {}
# (mask, alibi, ALIBI_SIDE): ALIBI_BELOW where every compared pair lies on or below the diagonal
# (right = 0, as the kernels' masked tiles without ALIBI_ABS; full tiles below it), ALIBI_ABOVE
# on full tiles above it (the kernels' last full tiles with ALIBI_ABS); without ALiBi the side
# is unread
FORWARD_FORMS = [(mask, False, "below") for mask in ("left", "right", "both", "unmasked")] + \
                [(mask, True, "across") for mask in ("left", "right", "both", "unmasked")] + \
                [(mask, True, "below") for mask in ("right", "both", "unmasked")] + [("unmasked", True, "above")]


@pytest.mark.parametrize("softcap", [False, True], ids=["nocap", "softcap"])
@pytest.mark.parametrize("mask, alibi, side", FORWARD_FORMS,
                         ids=[f"{mask}-{side}" if alibi else f"{mask}-noalibi" for mask, alibi, side in FORWARD_FORMS])
def test_gluon_forward_logits_match_the_reference(gluon_probes, mask, alibi, side, softcap):
    spec = Spec(mask, softcap, alibi, side if alibi and side != "across" else "any")
    seed = 300 + FORWARD_FORMS.index((mask, alibi, side)) * 2 + softcap
    cases = _cases(spec, seed, gluon_form=True)
    ints, floats, slopes, variant = _gluon_arguments(cases)
    assert variant == _gluon_variant(mask, softcap, alibi)
    rows, keys, qk = _indices(cases)
    t = torch.full_like(qk, 7.0)  # (poisoned)
    unit, row_offset = torch.full((CASES, ROWS), 7.0, device=DEVICE), torch.full((CASES, ROWS), 7.0, device=DEVICE)
    gluon_probes.forward_logits[(CASES,)](qk, rows, keys, ints, floats, slopes, t, unit, row_offset, ROWS, KEYS,
                                          spec.masked, variant, SIDES[side], num_warps=4)
    assert (unit > 0).all() and torch.isfinite(row_offset).all(), (unit, row_offset)
    logits = t.double().cpu() * unit.double().cpu()[:, :, None] - row_offset.double().cpu()[:, :, None]
    expected = torch.stack([_reference(spec, case, True)[0] for case in cases])
    tolerance = torch.stack([_tolerances(spec, case, "approx")[0] for case in cases])
    _assert_logits(logits, expected, tolerance, cases,
                   f"hopper_gluon.forward_logits, VARIANT {variant:#x}, MASKED {spec.masked}, ALIBI_SIDE {side}")


# -- the Gluon probes compile on CPU too ----------------------------------------------------------------------

_PROBE_TYPES = dict(QK="*fp32", Rows="*i32", Keys="*i32", Ints="*i32", Floats="*fp32", Slopes="*fp32", Lse="*fp32",
                    Delta="*fp32", X="*fp32", Grad="*fp32", T="*fp32", Unit="*fp32", RowOffset="*fp32")


def _gluon_probe_launches():
    """(probe kernel, constexprs) of every Gluon probe launch of the tests above."""
    for (mask, alibi, alibi_abs), softcap, keys_first in itertools.product(TILE_FORMS, (False, True), (False, True)):
        yield _gluon_tile_logits_kernel, dict(M=ROWS, N=KEYS, MASKED=MASKS[mask][2],
                                              VARIANT=_gluon_variant(mask, softcap, alibi), ALIBI_ABS=alibi_abs,
                                              KEYS_FIRST=keys_first)
    for (mask, alibi, side), softcap in itertools.product(FORWARD_FORMS, (False, True)):
        yield _gluon_forward_logits_kernel, dict(M=ROWS, N=KEYS, MASKED=MASKS[mask][2],
                                                 VARIANT=_gluon_variant(mask, softcap, alibi), ALIBI_SIDE=SIDES[side])


def compile_gluon_probes():
    """Compile every Gluon probe launch for sm_90 under the installed Triton (no GPU needed);
    test_gluon_probes_compile_for_hopper runs this in a fresh process."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    for kernel, constants in _gluon_probe_launches():
        signature = {name: "constexpr" if name in constants else _PROBE_TYPES[name] for name in kernel.arg_names}
        compiled = triton.compile(GluonASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=4))
        assert compiled.asm["cubin"], (kernel.__name__, constants)


@pytest.mark.skipif(gluon is None, reason="a Triton whose Gluon cannot build the Hopper kernels' module")
def test_gluon_probes_compile_for_hopper():
    """Every Gluon probe launch above builds an sm_90 cubin, also where no GPU runs them (CPU CI:
    a probe that Gluon's API no longer builds shows here), in a fresh process, as
    tests/gluon_compile.py compiles the Gluon kernels (interpreter state stays out of it)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import conftest, test_logits_rule; "
            "test_logits_rule.compile_gluon_probes()")
    result = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parent)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
