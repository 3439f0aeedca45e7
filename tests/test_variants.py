"""Attention options with flash-attn 2.8 semantics, against the float64 reference.

Sliding windows (window_size), softcap, ALiBi (alibi_slopes), attention sinks (s_aux), dropout and
causal masking: each alone, every pair, all six together; dense, varlen and packed; rows that see
no key; dropout's mask and RNG; determinism, torch.compile and CUDA graphs.

Every reference check runs forward + backward and holds out, dq, dk, dv and d s_aux to
flash-attn's bar (reference.py), softmax_lse to 1e-4 relative; with dropout it rebuilds the
reference from the keep mask the call returns in S_dmask (sign bit set = dropped) and checks
S_dmask's magnitudes against the reference probabilities. Option values are chosen so that each
option changes the result by well more than the bar (checked, so an implementation that ignored
an option would fail). Cases rotate dtypes, head dims, GQA ratios and seqlen_q != seqlen_k both
ways instead of multiplying them, as test_correctness.py does.
"""

import math
from itertools import combinations
from typing import NamedTuple, Optional

import pytest
import torch

from conftest import DEVICE, ON_GPU
from inputs import cu_seqlens, gradients, random_qkv
from reference import (
    BWD_FACTOR, FWD_FACTOR, assert_within_bar, attention_ref, bar_bound, max_err, run_ref, run_varlen_ref,
    sink_grad_rounded_out, visible_mask,
)
from sizes import BF16, DTYPES

DROPOUT_P = 0.17

# Rotated across cases: 7 seqlen pairs, 6 head dims, 5 head layouts, 3 dtypes (coprime lengths, so
# the combinations keep changing). (batch, heads_q, heads_kv).
if ON_GPU:
    SEQLENS = [(1023, 1024), (4093, 3001), (3001, 4093), (1024, 1024), (127, 513), (513, 127), (1, 799)]
    HEAD_DIMS = [128, 40, 59, 80, 111, 192]
    HEADS = [(2, 4, 2), (1, 8, 8), (2, 6, 2), (1, 4, 1), (2, 4, 4)]
    WINDOWS = [(0, 0), (256, -1), (-1, 1000), (700, 300), (3, 5), (0, -1)]
    PAIR_WINDOWS = [(256, 128), (3, 5), (100, 300), (1000, -1), (0, 0)]
    ALL_WINDOWS = [(100, 128), (16, -1), (30, 3)]
else:
    SEQLENS = [(113, 203), (203, 113), (17, 40), (113, 113), (40, 17), (1, 33), (203, 203)]
    HEAD_DIMS = [59, 40, 80, 111, 192, 64]
    HEADS = [(2, 4, 2), (1, 2, 2), (2, 3, 1), (1, 4, 1), (2, 2, 2)]
    WINDOWS = [(0, 0), (-1, 16), (24, -1), (3, 5), (50, 20), (0, -1)]
    PAIR_WINDOWS = [(24, 8), (3, 5), (40, -1), (-1, 16), (0, 0)]
    ALL_WINDOWS = [(24, 8), (40, -1), (30, 3)]


class Case(NamedTuple):
    name: str
    options: dict  # causal, window, softcap, alibi ("h" | "bh"), sinks (a dtype | "q"), dropout, scale
    dtype: torch.dtype
    seqlens: tuple
    head_dim: int
    heads: tuple


def _rotate(i: int, name: str, options: dict) -> Case:
    seqlens = SEQLENS[i % len(SEQLENS)]
    if options.get("causal") and seqlens[0] == 1:  # one query row sees every key: causal would not matter
        seqlens = SEQLENS[(i + 1) % len(SEQLENS)]
    return Case(name, options, DTYPES[i % len(DTYPES)], seqlens, HEAD_DIMS[i % len(HEAD_DIMS)], HEADS[i % len(HEADS)])


def _case_id(case: Case) -> str:
    (sq, sk), (_, hq, hk) = case.seqlens, case.heads
    return f"{case.name}-{str(case.dtype)[6:]}-q{sq}k{sk}-d{case.head_dim}-h{hq}:{hk}"


def _w(window) -> str:
    return f"window{window[0]}_{window[1]}"


# ---------------------------------------------------------------------------------------------
# Building the call and checking it against the reference
# ---------------------------------------------------------------------------------------------

def make_inputs(case: Case):
    """q, k, v for a case (q scaled by softcap with softcap, so that tanh bends, as flash-attn's
    tests do) and the call's option keywords (alibi slopes and s_aux made here)."""
    batch, heads_q, heads_kv = case.heads
    seqlen_q, seqlen_k = case.seqlens
    q, k, v = random_qkv((batch, seqlen_q, heads_q, case.head_dim), (batch, seqlen_k, heads_kv, case.head_dim),
                         case.dtype)
    q = scale_for_softcap(q, case.options)
    kwargs = call_options(case.options, batch, heads_q)
    add_sinks(kwargs, case.options, q, k, v)
    return (q, k, v), kwargs


def scale_for_softcap(q, options):
    """q * softcap with softcap (scores of standard deviation softcap, most of them bent or
    saturated by the tanh, as in flash-attn 2's tests), else q."""
    softcap = options.get("softcap", 0.0)
    return q * softcap if softcap else q


def add_sinks(kwargs, options, q, k, v, lens=None):
    """s_aux (nheads,) in the dtype options["sinks"] asks for ("q": q's), when it asks: each head's
    mean softmax_lse without sinks (float64) plus N(0, 1), so that the sink takes a real share of
    every row whatever the other options do to the scores. ``lens``: (lens_q, lens_k) of varlen q, k."""
    sinks = options.get("sinks")
    if sinks is None:
        return
    ref_kwargs = dict(_ref_options(kwargs, None), causal=kwargs.get("causal", False),
                      softmax_scale=kwargs.get("softmax_scale"))
    slopes = ref_kwargs.pop("alibi_slopes")
    if lens is None:
        lse = attention_ref(q, k, v, alibi_slopes=slopes, **ref_kwargs)[1].transpose(0, 1).flatten(1)
    else:
        lses, starts_q, starts_k = [], cu_seqlens(lens[0]).tolist(), cu_seqlens(lens[1]).tolist()
        for b in range(len(lens[0])):
            rows_q, rows_k = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
            seq_slopes = slopes if slopes is None or slopes.dim() == 1 else slopes[b]
            lses.append(attention_ref(q[rows_q][None], k[rows_k][None], v[rows_k][None], alibi_slopes=seq_slopes,
                                      **ref_kwargs)[1][0])
        lse = torch.cat(lses, dim=-1)
    lse = lse.masked_fill(torch.isinf(lse), float("nan")).nanmean(dim=-1).nan_to_num(0.0)
    sink_dtype = q.dtype if sinks == "q" else sinks
    kwargs["s_aux"] = (lse + torch.randn_like(lse)).to(sink_dtype)


def call_options(options: dict, batch: int, heads_q: int) -> dict:
    """flash_attn_func keywords for an options dict, s_aux aside (add_sinks makes it)."""
    kwargs = dict(causal=options.get("causal", False), window_size=options.get("window", (-1, -1)),
                  softcap=options.get("softcap", 0.0), dropout_p=options.get("dropout", 0.0))
    if options.get("scale") is not None:
        kwargs["softmax_scale"] = options["scale"]
    alibi = options.get("alibi")
    if alibi is not None:  # flash-attn's test slopes: U(0, 0.3), fp32
        shape = (heads_q,) if alibi == "h" else (batch, heads_q)
        kwargs["alibi_slopes"] = torch.rand(*shape, device=DEVICE, dtype=torch.float32) * 0.3
    return kwargs


def _ref_options(kwargs: dict, keep) -> dict:
    """attention_ref keywords (besides causal, scale and sinks) for a call's keywords."""
    window = kwargs.get("window_size", (-1, -1))
    return dict(window=tuple(int(w) for w in window), softcap=kwargs.get("softcap", 0.0),
                alibi_slopes=kwargs.get("alibi_slopes"), keep=keep,
                dropout_p=kwargs.get("dropout_p", 0.0) if keep is not None else 0.0)


def _without(option: str, ref_kwargs: dict) -> dict:
    """The reference keywords with one option switched off."""
    off = dict(ref_kwargs)
    if option == "window":
        off["window"] = (-1, -1)
    elif option == "softcap":
        off["softcap"] = 0.0
    elif option == "alibi":
        off["alibi_slopes"] = None
    elif option == "sinks":
        off["sinks"] = None
    elif option == "dropout":
        off["keep"], off["dropout_p"] = None, 0.0
    elif option == "causal":
        off["causal"] = False
    return off


def keep_mask(S_dmask, shape, dropout_p):
    """The keep mask returned in S_dmask (None without dropout), after checking its shape."""
    if dropout_p == 0.0:
        assert S_dmask is None, "S_dmask must be None when dropout_p == 0"
        return None
    assert S_dmask is not None and tuple(S_dmask.shape) == tuple(shape), \
        f"S_dmask shape {None if S_dmask is None else tuple(S_dmask.shape)}, expected {tuple(shape)}"
    assert not torch.isnan(S_dmask).any()
    return ~torch.signbit(S_dmask)


def check_probs(S_dmask, probs, visible):
    """|S_dmask| equals the reference probabilities before dropout (rtol of S_dmask's dtype), and
    is exactly 0 where the mask hides the key."""
    eps = torch.finfo(S_dmask.dtype).eps
    magnitude = S_dmask.abs().double()
    torch.testing.assert_close(magnitude, probs.double(), rtol=4 * eps + 2e-4, atol=1e-6)
    assert (magnitude[..., ~visible] == 0).all(), "S_dmask must be 0 on keys the mask hides"


def check_lse(lse, truth_lse, has_sinks):
    """+inf exactly on rows that see no key (none with sinks), elsewhere within 1e-4 relative."""
    no_key = torch.isneginf(truth_lse)
    assert not (has_sinks and no_key.any())
    assert torch.equal(torch.isposinf(lse), no_key), "lse must be +inf exactly on rows with no key"
    finite = ~no_key
    if finite.any():
        truth = truth_lse[finite]
        err = (lse[finite].double() - truth).abs().max().item()
        assert err <= 1e-4 * max(1.0, truth.abs().max().item()), f"lse error {err:.3g}"


def check_grads(grads, pt_grads, truth_grads, inputs, truth_out, truth_lse, dout):
    """dq, dk, dv (and ds_aux) finite, shaped and typed as their inputs, within the bar; the bar of
    ds_aux also counts the error of reading back the output in q's dtype (sink_grad_rounded_out)."""
    for name, ours, pt, truth, x in zip(("dq", "dk", "dv", "ds_aux"), grads, pt_grads, truth_grads, inputs):
        assert ours.shape == x.shape and ours.dtype == x.dtype, f"{name}: {ours.shape} {ours.dtype}"
        assert torch.isfinite(ours).all(), f"{name} is not finite"
        floor = None
        if name == "ds_aux":
            floor = sink_grad_rounded_out(truth_out, truth_lse, x, dout, inputs[0].dtype).to(x.dtype)
        assert_within_bar(name, ours, pt, truth, BWD_FACTOR, floor=floor)


def _check_matters(options_tested, run_truth, ref_kwargs, truth_out, bound):
    """Each tested option moves the float64 output by more than twice the bar: ignoring it fails."""
    for option in options_tested:
        other = run_truth(**_without(option, ref_kwargs))
        assert max_err(other, truth_out) > 2 * bound, f"{option} barely changes this case; pick other values"


class Result(NamedTuple):
    out: torch.Tensor
    lse: torch.Tensor
    S_dmask: Optional[torch.Tensor]
    grads: tuple  # dq, dk, dv[, ds_aux]


def check_dense(fa, q, k, v, matters=(), seed=0, **kwargs) -> Result:
    """flash_attn_func(q, k, v, **kwargs) forward + backward (s_aux's gradient too) against the
    reference, with the bar; checks lse and, with dropout, S_dmask. ``matters``: options that must
    change the truth by more than the bar. Returns what the call gave."""
    kwargs = dict(kwargs)
    causal = kwargs.pop("causal", False)
    s_aux = kwargs.pop("s_aux", None)
    softmax_scale = kwargs.get("softmax_scale")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k = k.shape[1]
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    if s_aux is not None:
        inputs.append(s_aux.detach().requires_grad_())
    torch.manual_seed(seed)
    out, lse, S_dmask = fa.flash_attn_func(*inputs[:3], causal=causal, return_attn_probs=True,
                                           s_aux=inputs[3] if s_aux is not None else None, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (batch, heads_q, seqlen_q) and lse.dtype == torch.float32
    dout = torch.randn_like(out)
    grads = gradients(out, inputs, dout)
    keep = keep_mask(S_dmask, (batch, heads_q, seqlen_q, seqlen_k), kwargs.get("dropout_p", 0.0))

    ref_kwargs = _ref_options(kwargs, keep)
    truth_out, truth_grads, truth_lse = run_ref(q, k, v, dout, causal, scale, torch.float64, sinks=s_aux,
                                                return_lse=True, **ref_kwargs)
    pt_out, pt_grads = run_ref(q, k, v, dout, causal, scale, q.dtype, sinks=s_aux, **ref_kwargs)
    assert_within_bar("out", out, pt_out, truth_out, FWD_FACTOR)
    if grads is not None:
        check_grads(grads, pt_grads, truth_grads, inputs, truth_out, truth_lse, dout)
    check_lse(lse, truth_lse, s_aux is not None)
    if keep is not None:
        _, _, probs = attention_ref(q, k, v, causal, scale, torch.float64, sinks=s_aux, return_probs=True,
                                    **_ref_options(kwargs, None))
        check_probs(S_dmask, probs, visible_mask(seqlen_q, seqlen_k, causal, ref_kwargs["window"], device=q.device))
    if matters:
        def run_truth(causal, sinks, **options):
            return attention_ref(q, k, v, causal, scale, torch.float64, sinks=sinks, **options)[0]
        _check_matters(matters, run_truth, dict(ref_kwargs, causal=causal, sinks=s_aux), truth_out,
                       bar_bound(pt_out, truth_out, FWD_FACTOR))
    return Result(out, lse, S_dmask, grads)


def check_varlen(fa, q, k, v, lens_q, lens_k, seed=0, **kwargs) -> Result:
    """flash_attn_varlen_func forward + backward against per-sequence references (keep masks from
    S_dmask[b, :, :len_q, :len_k]); S_dmask is 0 past each sequence's lengths."""
    kwargs = dict(kwargs)
    causal = kwargs.pop("causal", False)
    s_aux = kwargs.pop("s_aux", None)
    scale = 1.0 / math.sqrt(q.shape[-1])
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    batch, heads_q, max_q, max_k = len(lens_q), q.shape[1], max(lens_q), max(lens_k)
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    if s_aux is not None:
        inputs.append(s_aux.detach().requires_grad_())
    torch.manual_seed(seed)
    out, lse, S_dmask = fa.flash_attn_varlen_func(*inputs[:3], cu_q, cu_k, max_q, max_k, causal=causal,
                                                  return_attn_probs=True,
                                                  s_aux=inputs[3] if s_aux is not None else None, **kwargs)
    assert out.shape == q.shape and lse.shape == (heads_q, q.shape[0]) and lse.dtype == torch.float32
    dout = torch.randn_like(out)
    grads = gradients(out, inputs, dout)
    keep = keep_mask(S_dmask, (batch, heads_q, max_q, max_k), kwargs.get("dropout_p", 0.0))
    if keep is not None:
        for b, (len_q, len_k) in enumerate(zip(lens_q, lens_k)):
            assert (S_dmask[b, :, len_q:] == 0).all() and (S_dmask[b, :, :, len_k:] == 0).all(), \
                f"S_dmask must be 0 past sequence {b}'s lengths"

    ref_kwargs = _ref_options(kwargs, keep)
    truth_out, truth_grads, truth_lse = run_varlen_ref(q, k, v, dout, cu_q, cu_k, causal, scale, torch.float64,
                                                       sinks=s_aux, **ref_kwargs)
    pt_out, pt_grads, _ = run_varlen_ref(q, k, v, dout, cu_q, cu_k, causal, scale, q.dtype, sinks=s_aux,
                                         **ref_kwargs)
    assert_within_bar("out", out, pt_out, truth_out, FWD_FACTOR)
    if grads is not None:
        check_grads(grads, pt_grads, truth_grads, inputs, truth_out, truth_lse, dout)
    check_lse(lse, truth_lse, s_aux is not None)
    if keep is not None:
        slopes = kwargs.get("alibi_slopes")
        starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
        for b, (len_q, len_k) in enumerate(zip(lens_q, lens_k)):
            rows_q, rows_k = slice(starts_q[b], starts_q[b] + len_q), slice(starts_k[b], starts_k[b] + len_k)
            options = dict(_ref_options(kwargs, None),
                           alibi_slopes=slopes if slopes is None or slopes.dim() == 1 else slopes[b])
            _, _, probs = attention_ref(q[rows_q][None], k[rows_k][None], v[rows_k][None], causal, scale,
                                        torch.float64, sinks=s_aux, return_probs=True, **options)
            check_probs(S_dmask[b:b + 1, :, :len_q, :len_k], probs,
                        visible_mask(len_q, len_k, causal, options["window"], device=q.device))
    return Result(out, lse, S_dmask, grads)


# ---------------------------------------------------------------------------------------------
# Each option alone, every pair, all six
# ---------------------------------------------------------------------------------------------

_singles = (
    [(_w(w), dict(window=w), ("window",)) for w in WINDOWS]
    + [("softcap30", dict(softcap=30.0), ("softcap",)),
       ("softcap50", dict(softcap=50.0), ("softcap",)),
       ("softcap30-scale0.3", dict(softcap=30.0, scale=0.3), ("softcap",))]
    + [("alibi_h", dict(alibi="h"), ("alibi",)),
       ("alibi_bh", dict(alibi="bh"), ("alibi",)),
       ("alibi_bh", dict(alibi="bh"), ("alibi",))]
    + [("sinks_fp32", dict(sinks=torch.float32), ("sinks",)),
       ("sinks_qdtype", dict(sinks="q"), ("sinks",)),
       ("sinks_fp16", dict(sinks=torch.float16), ("sinks",))]
    + [("dropout", dict(dropout=DROPOUT_P), ("dropout",))] * 3
)
SINGLE_CASES = [(_rotate(i, name, options), matters) for i, (name, options, matters) in enumerate(_singles)]


@pytest.mark.parametrize("case, matters", SINGLE_CASES, ids=[_case_id(c) for c, _ in SINGLE_CASES])
def test_option_alone(fa, case, matters):
    """One option at a time (window shapes incl. (0, 0), one-sided and narrower than a tile;
    softcap with inputs scaled up so tanh saturates; ALiBi slopes (nheads,) and (batch, nheads);
    sinks in several dtypes with their gradient; dropout): out, lse, dq, dk, dv, ds_aux within the bar."""
    (q, k, v), kwargs = make_inputs(case)
    check_dense(fa, q, k, v, matters=matters, **kwargs)


@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("softcap", [52.0, 60.0], ids=["fixed_pivot", "running_max"])
def test_softcap_saturated_rows(fa, dtype, softcap):
    """Rows whose every logit sits at +softcap or at -softcap (q = +-u, every key near u, products
    far past the tanh's bend), causal and not. Up to softcap 52.7 (bf16, fp32) the forward
    subtracts a fixed pivot instead of the running max (launch.FIXED_PIVOT_MAX_LOG2), and a row
    at -softcap is where its exp2 comes closest to underflow; above it the running max serves."""
    torch.manual_seed(0)
    seqlen, heads, head_dim = 37, 2, 64
    u = torch.randn(head_dim, device=DEVICE)
    signs = torch.where(torch.arange(seqlen, device=DEVICE) % 3 == 0, 1.0, -1.0)
    q = (signs[None, :, None, None] * u * 8.0).expand(1, seqlen, heads, head_dim)
    q = (q + 0.3 * torch.randn_like(q)).to(dtype)
    k = (u * 8.0 + 0.3 * torch.randn(1, seqlen, heads, head_dim, device=DEVICE)).to(dtype)
    v = torch.randn(1, seqlen, heads, head_dim, device=DEVICE, dtype=dtype)
    for causal in (False, True):
        check_dense(fa, q, k, v, softcap=softcap, causal=causal)


_OPTION_NAMES = ("window", "softcap", "alibi", "sinks", "dropout", "causal")


def _option(name: str, i: int) -> dict:
    """Option values for the i-th combination case (rotated so pairs differ)."""
    return {
        "window": dict(window=PAIR_WINDOWS[i % len(PAIR_WINDOWS)]),
        "softcap": dict(softcap=(30.0, 50.0)[i % 2]),
        "alibi": dict(alibi=("bh", "h")[i % 2]),
        "sinks": dict(sinks=(torch.float32, "q")[i % 2]),
        "dropout": dict(dropout=DROPOUT_P),
        "causal": dict(causal=True),
    }[name]


def _combination_cases():
    cases, first = [], len(_singles)
    for i, pair in enumerate(combinations(_OPTION_NAMES, 2)):
        options = {key: value for name in pair for key, value in _option(name, i).items()}
        if pair == ("window", "causal"):  # causal sets right = 0: the window needs a left bound to matter
            options["window"] = PAIR_WINDOWS[0]
        cases.append((_rotate(first + i, "+".join(pair), options), pair))
    first += len(cases)
    for i, window in enumerate(ALL_WINDOWS):  # all six, once per dtype
        options = {key: value for name in _OPTION_NAMES for key, value in _option(name, i).items()}
        options["window"] = window
        cases.append((_rotate(first + i, "all", options), _OPTION_NAMES))
    return cases


COMBINATION_CASES = _combination_cases()


@pytest.mark.parametrize("case, matters", COMBINATION_CASES, ids=[_case_id(c) for c, _ in COMBINATION_CASES])
def test_option_combinations(fa, case, matters):
    """Every pair of {window, softcap, alibi, sinks, dropout, causal} and all six at once, each option
    shown to matter in the float64 truth: out, lse, grads and ds_aux within the bar."""
    (q, k, v), kwargs = make_inputs(case)
    check_dense(fa, q, k, v, matters=matters, **kwargs)


# ---------------------------------------------------------------------------------------------
# Varlen
# ---------------------------------------------------------------------------------------------

# Per-sequence (q lengths, k lengths): an empty query sequence, a sequence with no keys (its rows
# see none), length-1 sequences, seqlen_q > seqlen_k and < seqlen_k.
if ON_GPU:
    VARLEN_LENS = ([1023, 0, 1, 3001, 77, 1, 400], [1024, 5, 1, 2500, 0, 333, 400])
    VARLEN_WINDOW = (300, 100)
else:
    VARLEN_LENS = ([17, 0, 1, 40, 9, 1, 30], [23, 3, 1, 17, 0, 5, 30])
    VARLEN_WINDOW = (5, 3)

VARLEN_OPTIONS = {
    "window": dict(window=VARLEN_WINDOW),
    "softcap": dict(softcap=30.0),
    "alibi_h": dict(alibi="h"),
    "alibi_bh": dict(alibi="bh"),
    "sinks": dict(sinks=torch.float32),
    "dropout": dict(dropout=DROPOUT_P),
    "all": dict(window=(VARLEN_WINDOW[0], -1), softcap=50.0, alibi="bh", sinks="q", dropout=DROPOUT_P, causal=True),
}


# name, dtype, head dim, heads_kv (of 4 query heads)
VARLEN_CASES = [(name, DTYPES[i % len(DTYPES)], HEAD_DIMS[i % len(HEAD_DIMS)], (2, 1, 4, 2)[i % 4])
                for i, name in enumerate(VARLEN_OPTIONS)]


@pytest.mark.parametrize("name, dtype, head_dim, heads_kv", VARLEN_CASES,
                         ids=[f"{c[0]}-{str(c[1])[6:]}-d{c[2]}-h4:{c[3]}" for c in VARLEN_CASES])
def test_varlen_options(fa, name, dtype, head_dim, heads_kv):
    """flash_attn_varlen_func with each option (and all at once) on a batch with empty and
    length-1 sequences, against per-sequence float64 references."""
    options = VARLEN_OPTIONS[name]
    lens_q, lens_k = VARLEN_LENS
    heads_q = 4
    q, k, v = random_qkv((sum(lens_q), heads_q, head_dim), (sum(lens_k), heads_kv, head_dim), dtype)
    q = scale_for_softcap(q, options)
    kwargs = call_options(options, len(lens_q), heads_q)
    add_sinks(kwargs, options, q, k, v, lens=(lens_q, lens_k))
    check_varlen(fa, q, k, v, lens_q, lens_k, **kwargs)


# ---------------------------------------------------------------------------------------------
# Packed variants, window_size forms
# ---------------------------------------------------------------------------------------------

ALL_OPTIONS = dict(window=PAIR_WINDOWS[0], softcap=30.0, alibi="bh", dropout=DROPOUT_P, causal=True)


def _all_options(batch, heads):
    """Keywords with every option on, and an fp32 s_aux (nheads,) of the size of the rows' lse
    (q is to be scaled by scale_for_softcap(q, ALL_OPTIONS))."""
    return call_options(ALL_OPTIONS, batch, heads), torch.randn(heads, device=DEVICE) + 12.0


def _run(fn, inputs, dout, seed=0):
    """(out, lse, S_dmask, *grads of inputs) of fn(*inputs) with the RNG seeded first."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    torch.manual_seed(seed)
    out, lse, S_dmask = fn(*leaves)
    return (out, lse, S_dmask, *torch.autograd.grad(out, leaves, dout))


def _assert_equal(got, want, names):
    """Bitwise equality, item by item (None matches None)."""
    for name, a, b in zip(names, got, want):
        assert (a is None and b is None) or torch.equal(a, b), f"{name} differs"


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_packed_variants_with_options(fa, varlen):
    """qkv- and kv-packed functions with every option on (dropout seeded alike) equal the unpacked
    function bit for bit: out, lse, S_dmask, the packed gradients and ds_aux."""
    heads, head_dim, dtype = 4, 64, BF16
    if varlen:
        lens = [17, 1, 0, 40, 9] if not ON_GPU else [1023, 1, 0, 2048, 77]
        cu, longest = cu_seqlens(lens), max(lens)
        batch, shape, pack_dim = len(lens), (sum(lens), 3, heads, head_dim), 1
    else:
        batch, seqlen = 2, (113 if not ON_GPU else 1023)
        cu, longest, shape, pack_dim = None, seqlen, (batch, seqlen, 3, heads, head_dim), 2
    qkv = torch.randn(*shape, device=DEVICE, dtype=dtype)
    qkv.select(pack_dim, 0).copy_(scale_for_softcap(qkv.select(pack_dim, 0), ALL_OPTIONS))
    options, s_aux = _all_options(batch, heads)
    q, k, v = qkv.unbind(dim=pack_dim)
    dout = torch.randn_like(q)
    kw = dict(options, return_attn_probs=True)
    lengths = (cu, cu, longest, longest) if varlen else ()

    def plain(q, k, v, s):
        fn = fa.flash_attn_varlen_func if varlen else fa.flash_attn_func
        return fn(q, k, v, *lengths, s_aux=s, **kw)

    def qkv_fn(qkv, s):
        if varlen:
            return fa.flash_attn_varlen_qkvpacked_func(qkv, cu, longest, s_aux=s, **kw)
        return fa.flash_attn_qkvpacked_func(qkv, s_aux=s, **kw)

    def kv_fn(q, kv, s):
        fn = fa.flash_attn_varlen_kvpacked_func if varlen else fa.flash_attn_kvpacked_func
        return fn(q, kv, *lengths, s_aux=s, **kw)

    out, lse, S, dq, dk, dv, ds = _run(plain, (q, k, v, s_aux), dout)
    assert S is not None

    got = _run(qkv_fn, (qkv, s_aux), dout)
    _assert_equal(got, (out, lse, S, torch.stack((dq, dk, dv), dim=pack_dim), ds),
                  ("out", "lse", "S_dmask", "dqkv", "ds_aux"))
    got = _run(kv_fn, (q, torch.stack((k, v), dim=pack_dim), s_aux), dout)
    _assert_equal(got, (out, lse, S, dq, torch.stack((dk, dv), dim=pack_dim), ds),
                  ("out", "lse", "S_dmask", "dq", "dkv", "ds_aux"))


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_window_size_forms(fa, varlen):
    """window_size as a list, an int64 tensor (what flash-attn's tests pass: torch.randint(0,
    seqlen, (2,))) and an int32 tensor gives the same bits as the tuple, forward and backward."""
    window = (24, 7) if not ON_GPU else (300, 70)
    if varlen:
        lens = [40, 0, 113, 1] if not ON_GPU else [1023, 0, 2048, 1]
        cu, longest = cu_seqlens(lens), max(lens)
        q, k, v = random_qkv((sum(lens), 4, 64), (sum(lens), 2, 64), torch.float16)
        fn = lambda w: lambda q, k, v: fa.flash_attn_varlen_func(  # noqa: E731
            q, k, v, cu, cu, longest, longest, window_size=w, return_attn_probs=True)
    else:
        q, k, v = random_qkv((2, 113, 4, 64), (2, 203, 2, 64), torch.float16) if not ON_GPU else \
            random_qkv((2, 1023, 4, 128), (2, 1024, 2, 128), torch.float16)
        fn = lambda w: lambda q, k, v: fa.flash_attn_func(q, k, v, window_size=w, return_attn_probs=True)  # noqa: E731
    dout = torch.randn_like(q)
    want = _run(fn(window), (q, k, v), dout)
    for form in (list(window), torch.tensor(window), torch.tensor(window, dtype=torch.int32)):
        _assert_equal(_run(fn(form), (q, k, v), dout), want, ("out", "lse", "S_dmask", "dq", "dk", "dv"))


def test_window_beyond_any_sequence(fa):
    """A bound larger than int32 index arithmetic can hold (flash-attn users pass e.g. (2**40, 0))
    means the same as an unbounded side: same bits as (-1, 0), i.e. causal."""
    q, k, v = random_qkv((1, 113, 2, 64), (1, 203, 2, 64), torch.float16, requires_grad=True)
    dout = torch.randn_like(q)
    huge = fa.flash_attn_func(q, k, v, window_size=(2 ** 40, 0))
    causal = fa.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(huge, causal)
    for a, b in zip(torch.autograd.grad(huge, (q, k, v), dout), torch.autograd.grad(causal, (q, k, v), dout)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# Rows that see no key
# ---------------------------------------------------------------------------------------------

# (window, causal, sinks, dtype): with seqlen_q > seqlen_k and a bounded right side, the first
# seqlen_q - seqlen_k - right rows see no key.
EMPTY_ROW_CASES = [
    ((2, 3), False, False, torch.float16),
    ((0, 0), False, True, BF16),
    ((-1, 4), False, True, torch.float32),
    ((5, -1), True, False, torch.float16),
    ((3, 5), True, True, BF16),
]
EMPTY_ROW_SEQLENS = (113, 40) if not ON_GPU else (4093, 1024)


@pytest.mark.parametrize("window, causal, sinks, dtype", EMPTY_ROW_CASES,
                         ids=[f"{_w(c[0])}-{'causal' if c[1] else 'full'}-{'sinks' if c[2] else 'nosinks'}-"
                              f"{str(c[3])[6:]}" for c in EMPTY_ROW_CASES])
def test_rows_without_keys(fa, window, causal, sinks, dtype):
    """A window that leaves some query rows no key: those rows output 0 with lse = +inf (lse =
    s_aux[h] with sinks), their dq rows are 0 and every gradient is finite; the rest within the bar."""
    seqlen_q, seqlen_k = EMPTY_ROW_SEQLENS
    heads_q = 4
    q, k, v = random_qkv((1, seqlen_q, heads_q, 64), (1, seqlen_k, 2, 64), dtype)
    kwargs = dict(window_size=window, causal=causal)
    if sinks:
        kwargs["s_aux"] = torch.randn(heads_q, device=DEVICE) + 2.0
    empty = ~visible_mask(seqlen_q, seqlen_k, causal, window, device=DEVICE).any(dim=-1)
    assert empty.any() and not empty.all()
    result = check_dense(fa, q, k, v, **kwargs)
    assert torch.equal(result.out[:, empty], torch.zeros_like(result.out[:, empty]))
    if sinks:
        expected = kwargs["s_aux"].float()[None, :, None].expand(1, heads_q, int(empty.sum()))
        torch.testing.assert_close(result.lse[:, :, empty], expected, rtol=1e-6, atol=1e-6)
    else:
        assert torch.isposinf(result.lse[:, :, empty]).all()
    dq = result.grads[0]
    assert torch.equal(dq[:, empty], torch.zeros_like(dq[:, empty]))


# ---------------------------------------------------------------------------------------------
# Dropout: mask statistics and RNG
# ---------------------------------------------------------------------------------------------

DROPOUT_SHAPE = ((2, 113, 2, 64), (2, 203, 2, 64)) if not ON_GPU else ((2, 1023, 4, 128), (2, 1024, 4, 128))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_fraction(fa, causal):
    """The share of visible entries that S_dmask marks dropped is within 0.01 of dropout_p, and the
    masks of different heads and batch entries differ (each has its own random stream)."""
    q, k, v = random_qkv(*DROPOUT_SHAPE, torch.float16)
    _, _, S_dmask = fa.flash_attn_func(q, k, v, dropout_p=DROPOUT_P, causal=causal, return_attn_probs=True)
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    assert S_dmask.shape == (q.shape[0], q.shape[2], seqlen_q, seqlen_k)
    visible = visible_mask(seqlen_q, seqlen_k, causal, device=DEVICE)
    dropped = torch.signbit(S_dmask)
    fraction = dropped[..., visible].float().mean().item()
    assert abs(fraction - DROPOUT_P) < 0.01, f"dropped {fraction:.4f} of the entries, expected {DROPOUT_P}"
    assert not torch.equal(dropped[0, 0], dropped[0, 1]) and not torch.equal(dropped[0, 0], dropped[1, 0])


def test_dropout_rng(fa):
    """torch.manual_seed before a call reproduces out, lse, S_dmask and gradients bit for bit; a
    different seed changes the mask and the output; without re-seeding the next call draws a new mask."""
    q, k, v = random_qkv((1, 113, 4, 64), (1, 203, 2, 64), BF16)
    dout = torch.randn_like(q)
    call = lambda q, k, v: fa.flash_attn_func(q, k, v, dropout_p=DROPOUT_P, return_attn_probs=True)  # noqa: E731
    first = _run(call, (q, k, v), dout, seed=1)
    _assert_equal(_run(call, (q, k, v), dout, seed=1), first, ("out", "lse", "S_dmask", "dq", "dk", "dv"))
    other = _run(call, (q, k, v), dout, seed=2)
    assert torch.equal(other[1], first[1]), "lse does not depend on dropout"
    assert not torch.equal(torch.signbit(other[2]), torch.signbit(first[2]))
    assert not torch.equal(other[0], first[0])
    torch.manual_seed(3)
    out_a, _, S_a = call(q, k, v)
    out_b, _, S_b = call(q, k, v)
    assert not torch.equal(torch.signbit(S_a), torch.signbit(S_b)) and not torch.equal(out_a, out_b)


# ---------------------------------------------------------------------------------------------
# Determinism, torch.compile, CUDA graphs
# ---------------------------------------------------------------------------------------------

def test_deterministic_all_options(fa):
    """deterministic=True with every option on: forward + backward three times, re-seeded before
    each, give identical out, lse, S_dmask, dq, dk, dv and ds_aux."""
    shape_q, shape_kv = ((2, 113, 6, 80), (2, 203, 2, 80)) if not ON_GPU else ((2, 1023, 8, 128), (2, 3001, 2, 128))
    q, k, v = random_qkv(shape_q, shape_kv, BF16)
    q = scale_for_softcap(q, ALL_OPTIONS)
    options, s_aux = _all_options(shape_q[0], shape_q[2])
    dout = torch.randn_like(q)
    call = lambda q, k, v, s: fa.flash_attn_func(q, k, v, s_aux=s, deterministic=True,  # noqa: E731
                                                 return_attn_probs=True, **options)
    runs = [_run(call, (q, k, v, s_aux), dout, seed=5) for _ in range(3)]
    for run in runs[1:]:
        _assert_equal(run, runs[0], ("out", "lse", "S_dmask", "dq", "dk", "dv", "ds_aux"))


def test_torch_compile_with_options(fa):
    """torch.compile(fullgraph=True) of flash_attn_func with window, softcap, ALiBi and sinks gives
    the eager bits, forward and gradients (s_aux's included)."""
    q, k, v = random_qkv((1, 113, 4, 64), (1, 203, 2, 64), torch.float16)
    q = q * 30.0  # scale_for_softcap
    slopes = torch.rand(4, device=DEVICE) * 0.3
    s_aux = torch.randn(4, device=DEVICE) + 12.0
    dout = torch.randn_like(q)

    def fn(q, k, v, s):
        out, lse, _ = fa.flash_attn_func(q, k, v, window_size=(24, 8), softcap=30.0, alibi_slopes=slopes,
                                         s_aux=s, return_attn_probs=True)
        return out, lse, None

    eager = _run(fn, (q, k, v, s_aux), dout)
    compiled = _run(torch.compile(fn, fullgraph=True), (q, k, v, s_aux), dout)
    _assert_equal(compiled, eager, ("out", "lse", "S_dmask", "dq", "dk", "dv", "ds_aux"))


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA graphs (a CUDA GPU)")
def test_dropout_in_cuda_graph(fa):
    """A dropout forward captured in a torch.cuda.CUDAGraph draws fresh randomness on each replay:
    two replays give finite outputs that differ."""
    q, k, v = random_qkv((2, 1024, 4, 128), (2, 1024, 2, 128), BF16)
    call = lambda: fa.flash_attn_func(q, k, v, dropout_p=DROPOUT_P, causal=True)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles the kernels) outside the capture
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    first = out.clone()
    graph.replay()
    second = out.clone()
    torch.cuda.synchronize()
    assert torch.isfinite(first).all() and torch.isfinite(second).all()
    assert not torch.equal(first, second), "two replays gave the same dropout mask"
