"""fp32 within flash-attn's error bar with every option (issue 39, item 3).

fp32 inputs run the kernels' FP32_EXACT forms (scores.py): logits, maxima and the logsumexp in
natural units, only differences of logits scaled by log2(e); the softcap's tanh and its derivative
without cancellation; IEEE divisions. ``test_exact_tanh_forms`` checks the tanh forms alone.
Each case holds every fp32 result to the bar of reference.py against the float64 truth: out and
softmax_lse within 2x PyTorch's own fp32 error, dq, dk, dv and the sinks' gradient within 3x
(the sinks' bar also counting the floor of reading back the fp32 output, as test_variants.py).

Cases: the issue's worst ones (softcap at head dim 256 with MQA 8:1; softcap on a ragged varlen
batch; ALiBi + sinks at head dim 256; flash_attn_with_kvcache with rotary, cache_batch_idx and MQA,
split and not), then every option alone (causal, window, softcap, ALiBi, sinks, dropout) and none,
over head dims 64, 128, 256 and 59 and GQA ratios 1 and 8. Small on CPU (Triton's interpreter),
the issue's sizes on a GPU. The GPU-wide survey with ratios per tensor is
scripts/fp32_error_report.py.
"""

import math
import sys

import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE, ON_GPU
from inputs import cu_seqlens, random_qkv
from reference import (
    BWD_FACTOR, FWD_FACTOR, assert_within_bar, max_err, run_ref, run_varlen_ref, sink_grad_rounded_out,
)
from test_kvcache import _tables, cache_ref, rotate
from test_variants import add_sinks, call_options, keep_mask, scale_for_softcap

DTYPE = torch.float32
SEQLENS = [(1023, 1024), (2049, 2049), (513, 1023)] if ON_GPU else [(65, 97), (97, 65), (40, 40)]
VARLEN = ([1023, 2049, 1, 511, 700], [1024, 2049, 5, 300, 700]) if ON_GPU else ([17, 64, 1, 40], [33, 64, 5, 40])


def _close_lse(name, lse, pt_lse, truth_lse):
    """softmax_lse: +inf exactly where the truth is -inf (no key), elsewhere within FWD_FACTOR x
    PyTorch's fp32 logsumexp error (plus the bar's slack)."""
    empty = torch.isneginf(truth_lse)
    assert torch.equal(torch.isposinf(lse), empty), f"{name}: +inf exactly on rows that see no key"
    finite = ~empty
    assert_within_bar(name, lse[finite], pt_lse[finite], truth_lse[finite], FWD_FACTOR)


def _check_grads(grads, pt_grads, truth_grads, inputs, truth_out, truth_lse, dout):
    for name, ours, pt, truth, x in zip(("dq", "dk", "dv", "ds_aux"), grads, pt_grads, truth_grads, inputs):
        assert ours.dtype == x.dtype and ours.shape == x.shape, f"{name}: {ours.dtype} {tuple(ours.shape)}"
        floor = None
        if name == "ds_aux":
            floor = sink_grad_rounded_out(truth_out, truth_lse, x, dout, DTYPE).to(x.dtype)
        assert_within_bar(name, ours, pt, truth, BWD_FACTOR, floor=floor)


def check_dense(fa, q, k, v, **kwargs):
    """flash_attn_func in fp32, forward and backward, every result within the bar."""
    causal = kwargs.pop("causal", False)
    s_aux = kwargs.pop("s_aux", None)
    scale = 1.0 / math.sqrt(q.shape[-1])
    inputs = [t.detach().requires_grad_() for t in (q, k, v)] + ([s_aux.detach().requires_grad_()] if s_aux is not None
                                                                  else [])
    out, lse, S_dmask = fa.flash_attn_func(*inputs[:3], causal=causal, return_attn_probs=True,
                                           s_aux=inputs[3] if s_aux is not None else None, **kwargs)
    assert out.dtype == DTYPE and lse.dtype == torch.float32
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dout)
    batch, seqlen_q, heads = q.shape[:3]
    keep = keep_mask(S_dmask, (batch, heads, seqlen_q, k.shape[1]), kwargs.get("dropout_p", 0.0))
    ref = dict(window=tuple(kwargs.get("window_size", (-1, -1))), softcap=kwargs.get("softcap", 0.0),
               alibi_slopes=kwargs.get("alibi_slopes"), keep=keep, dropout_p=kwargs.get("dropout_p", 0.0))
    truth_out, truth_grads, truth_lse = run_ref(q, k, v, dout, causal, scale, torch.float64, sinks=s_aux,
                                                return_lse=True, **ref)
    pt_out, pt_grads, pt_lse = run_ref(q, k, v, dout, causal, scale, DTYPE, sinks=s_aux, return_lse=True, **ref)
    assert_within_bar("out", out, pt_out, truth_out, FWD_FACTOR)
    _close_lse("lse", lse, pt_lse, truth_lse)
    _check_grads(grads, pt_grads, truth_grads, inputs, truth_out, truth_lse, dout)


def dense_inputs(options, seqlens, head_dim, heads):
    """q, k, v (fp32, standard normal; q scaled by the softcap as test_variants does) and the
    call's keywords for an options dict of test_variants' form."""
    batch, heads_q, heads_kv = heads
    q, k, v = random_qkv((batch, seqlens[0], heads_q, head_dim), (batch, seqlens[1], heads_kv, head_dim), DTYPE)
    q = scale_for_softcap(q, options)
    kwargs = call_options(options, batch, heads_q)
    add_sinks(kwargs, options, q, k, v)
    return q, k, v, kwargs


# ---------------------------------------------------------------------------------------------
# The issue's cases

ISSUE_CASES = {
    "softcap-d256-mqa8": (dict(softcap=30.0), SEQLENS[0], 256, (1, 8, 1)),
    "softcap-d256-mqa8-causal": (dict(softcap=50.0, causal=True), SEQLENS[2], 256, (1, 8, 1)),
    "alibi+sinks-d256": (dict(alibi="h", sinks=torch.float32), SEQLENS[1], 256, (2, 4, 2) if ON_GPU else (1, 2, 2)),
    "alibi+sinks-d256-causal": (dict(alibi="bh", sinks=torch.float32, causal=True), SEQLENS[0], 256, (1, 8, 1)),
}


@pytest.mark.parametrize("name", list(ISSUE_CASES))
def test_issue_dense_cases(fa, name):
    options, seqlens, head_dim, heads = ISSUE_CASES[name]
    q, k, v, kwargs = dense_inputs(options, seqlens, head_dim, heads)
    check_dense(fa, q, k, v, **kwargs)


@pytest.mark.parametrize("options", [dict(softcap=30.0), dict(softcap=50.0, causal=True),
                                     dict(softcap=30.0, alibi="bh", sinks=torch.float32)],
                         ids=["softcap30", "softcap50-causal", "softcap-alibi-sinks"])
def test_issue_softcap_ragged_varlen(fa, options):
    """flash_attn_varlen_func in fp32 with a softcap on ragged sequences (lengths 1 up), MQA 4:1."""
    lens_q, lens_k = VARLEN
    heads_q, heads_kv, head_dim = 4, 1, 128 if ON_GPU else 64
    q, k, v = random_qkv((sum(lens_q), heads_q, head_dim), (sum(lens_k), heads_kv, head_dim), DTYPE)
    q = scale_for_softcap(q, options)
    kwargs = call_options(options, len(lens_q), heads_q)
    add_sinks(kwargs, options, q, k, v, lens=(lens_q, lens_k))
    causal = kwargs.pop("causal")
    s_aux = kwargs.pop("s_aux", None)
    kwargs.pop("dropout_p")
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    inputs = [t.detach().requires_grad_() for t in (q, k, v)] + ([s_aux.detach().requires_grad_()] if s_aux is not None
                                                                  else [])
    out, lse, _ = fa.flash_attn_varlen_func(*inputs[:3], cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                            return_attn_probs=True, s_aux=inputs[3] if s_aux is not None else None,
                                            **kwargs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dout)
    scale = 1.0 / math.sqrt(head_dim)
    ref = dict(window=tuple(kwargs["window_size"]), softcap=kwargs["softcap"], alibi_slopes=kwargs.get("alibi_slopes"))
    truth_out, truth_grads, truth_lse = run_varlen_ref(q, k, v, dout, cu_q, cu_k, causal, scale, torch.float64,
                                                       sinks=s_aux, **ref)
    pt_out, pt_grads, pt_lse = run_varlen_ref(q, k, v, dout, cu_q, cu_k, causal, scale, DTYPE, sinks=s_aux, **ref)
    assert_within_bar("out", out, pt_out, truth_out, FWD_FACTOR)
    _close_lse("lse", lse, pt_lse, truth_lse)
    _check_grads(grads, pt_grads, truth_grads, inputs, truth_out, truth_lse, dout)


def test_saturated_softcap_tiny_sequences(fa):
    """Varlen fp32, head dim 256, MQA 8:1, q scaled by the softcap (logits ~ N(0, 30^2) against a
    softcap of 30) on sequences of 1 query and 5 keys: the fp32 error report's varlen_softcap
    case, whose 1 x 5 sequence held dQ at 11.8x PyTorch's error on an H100. With one key holding
    nearly all of each row's P, the logits' error is what every result inherits, and PyTorch's
    fp32 q . k of such small shapes is more accurate than one 256-term FMA chain
    (tiles.mma_over_head sums 32-term parts). The bar's slack (1e-5 of the lse, ~30) would hide
    this regime, so out and lse are held to FWD_FACTOR x PyTorch's error without it (before the
    parts: 5.7x for out on CPU); the gradients keep the usual bar."""
    heads_q, head_dim, sequences = 8, 256, 16
    lens_q, lens_k = [1] * sequences, [5] * sequences
    q, k, v = random_qkv((sequences, heads_q, head_dim), (5 * sequences, 1, head_dim), DTYPE)
    q = q * 30.0
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse, _ = fa.flash_attn_varlen_func(*inputs, cu_q, cu_k, 1, 5, softcap=30.0, return_attn_probs=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dout)
    scale = 1.0 / math.sqrt(head_dim)
    truth_out, truth_grads, truth_lse = run_varlen_ref(q, k, v, dout, cu_q, cu_k, False, scale, torch.float64,
                                                       softcap=30.0)
    pt_out, pt_grads, pt_lse = run_varlen_ref(q, k, v, dout, cu_q, cu_k, False, scale, DTYPE, softcap=30.0)
    for name, ours, pt, truth in (("out", out, pt_out, truth_out), ("lse", lse, pt_lse, truth_lse)):
        err, bar = max_err(ours, truth), FWD_FACTOR * max_err(pt, truth)
        assert err <= bar, f"{name}: max error {err:.3g} > {FWD_FACTOR} x PyTorch's ({bar:.3g})"
    _check_grads(grads, pt_grads, truth_grads, inputs, truth_out, truth_lse, dout)


KV = dict(batch_cache=5, capacity=2100, seqlens=[1500, 2040, 3], batch_idx=[3, 0, 4]) if ON_GPU else \
    dict(batch_cache=4, capacity=100, seqlens=[60, 90, 3], batch_idx=[3, 0, 2])


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_issue_kvcache_rotary_batch_idx_mqa(fa, seqlen_q, num_splits):
    """flash_attn_with_kvcache in fp32: new keys rotated into a permuted cache (cache_batch_idx),
    q rotated, MQA 8:1, causal; out and lse against attention on the float64 rotations, the bar
    from the fp32 rotations and fp32 attention (as test_kvcache.test_rotary)."""
    heads, heads_k, head_dim, rotary_dim = 8, 1, 128, 64
    seqlens, batch_idx = KV["seqlens"], KV["batch_idx"]
    batch = len(seqlens)
    cos, sin = _tables(KV["capacity"], rotary_dim // 2, DTYPE)
    k_cache = torch.randn(KV["batch_cache"], KV["capacity"], heads_k, head_dim, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    q, k, v = random_qkv((batch, seqlen_q, heads, head_dim), (batch, seqlen_q, heads_k, head_dim), DTYPE)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                          cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=DEVICE),
                                          cache_batch_idx=torch.tensor(batch_idx, dtype=torch.int32, device=DEVICE),
                                          rotary_interleaved=False, causal=True, num_splits=num_splits,
                                          return_softmax_lse=True)
    positions = (torch.tensor(seqlens)[:, None] + torch.arange(seqlen_q)[None, :]).to(DEVICE)

    def cache_with(new_k, dtype):
        k_all, v_all = k_before.to(dtype).clone(), v_before.to(dtype).clone()
        for b, row in enumerate(batch_idx):
            k_all[row, seqlens[b]:seqlens[b] + seqlen_q] = new_k[b]
            v_all[row, seqlens[b]:seqlens[b] + seqlen_q] = v[b].to(dtype)
        return k_all, v_all

    seqlens_k = [n + seqlen_q for n in seqlens]
    truth, truth_lse = cache_ref(rotate(q, cos, sin, positions, False),
                                 *cache_with(rotate(k, cos, sin, positions, False), torch.float64), seqlens_k,
                                 torch.float64, batch_idx=batch_idx, causal=True)
    same, same_lse = cache_ref(rotate(q, cos, sin, positions, False, DTYPE),
                               *cache_with(rotate(k, cos, sin, positions, False, DTYPE), DTYPE), seqlens_k, DTYPE,
                               batch_idx=batch_idx, causal=True)
    assert_within_bar("out", out, same, truth, FWD_FACTOR)
    _close_lse("lse", lse, same_lse, truth_lse)


# ---------------------------------------------------------------------------------------------
# Every option alone, in fp32, over head dims and GQA ratios

OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(300, 100) if ON_GPU else (24, 8)),
    "softcap": dict(softcap=30.0),
    "alibi": dict(alibi="h"),
    "sinks": dict(sinks=torch.float32),
    "dropout": dict(dropout=0.17),
}
HEAD_DIMS = [64, 128, 256, 59]
HEADS = [(2, 4, 4), (1, 8, 1)]  # GQA ratios 1 and 8
SWEEP = [(option, HEAD_DIMS[i % len(HEAD_DIMS)], HEADS[i % len(HEADS)], SEQLENS[i % len(SEQLENS)])
         for i, option in enumerate(OPTIONS)]
if ON_GPU:  # every option at every head dim and ratio
    SWEEP = [(option, d, h, SEQLENS[(i + j) % len(SEQLENS)]) for i, option in enumerate(OPTIONS)
             for j, (d, h) in enumerate((d, h) for d in HEAD_DIMS for h in HEADS)]


@pytest.mark.parametrize("option,head_dim,heads,seqlens", SWEEP,
                         ids=[f"{o}-d{d}-h{h[1]}:{h[2]}-q{s[0]}k{s[1]}" for o, d, h, s in SWEEP])
def test_each_option_fp32(fa, option, head_dim, heads, seqlens):
    q, k, v, kwargs = dense_inputs(OPTIONS[option], seqlens, head_dim, heads)
    check_dense(fa, q, k, v, **kwargs)


_scores = None  # the built package's scores module (test_exact_tanh_forms)


@triton.jit
def _tanh_exact_kernel(X, T, D, N: tl.constexpr):
    offs = tl.arange(0, N)
    t, d = _scores._tanh_exact(tl.load(X + offs))
    tl.store(T + offs, t)
    tl.store(D + offs, d)


def test_exact_tanh_forms(fa):
    """The FP32_EXACT tanh and tanh' (scores._tanh_exact) to a few fp32 ulps over the softcap's
    range, near 0 and around the series bound included, where 1 - tanh^2 of a rounded tanh and
    (1 - e) / (1 + e) lose most of their bits."""
    global _scores
    _scores = sys.modules[fa.flash_attention_kernel.__name__ + ".scores"]
    x = torch.cat([torch.linspace(-12, 12, 4001), torch.logspace(-8, 0, 96), -torch.logspace(-8, 0, 96),
                   torch.linspace(0.2499, 0.2501, 15)]).to(DEVICE, DTYPE)
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.full((n - x.numel(),), 0.5, device=DEVICE, dtype=DTYPE)])
    t, d = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    _tanh_exact_kernel[(1,)](x, t, d, N=n)
    x64 = x.double()
    want_t, want_d = torch.tanh(x64), 1.0 / torch.cosh(x64) ** 2
    eps = torch.finfo(DTYPE).eps
    t_err = ((t.double() - want_t).abs() / want_t.abs().clamp_min(1e-30)).max().item()
    # tanh' = 4 e / (1 + e)^2 carries the rounding of exp's argument -2|x|: |2x| ulps (1 - tanh^2 of a
    # rounded tanh has all of its bits wrong from |x| = 9 on)
    d_err = ((d.double() - want_d).abs() / (want_d.clamp_min(1e-30) * (4.0 + 2.0 * x64.abs()))).max().item()
    assert t_err <= 4 * eps, f"tanh: relative error {t_err / eps:.2f} ulp"
    assert d_err <= eps, f"tanh': relative error {d_err / eps:.2f} x (4 + 2|x|) ulp"
