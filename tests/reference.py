"""Reference attention and the flash-attn error bar.

``attention_ref`` is plain PyTorch attention on (batch, seqlen, heads, dim) tensors with GQA and
bottom-right causal masking, computed in a chosen dtype, with flash-attn 2.8's options: sliding
window, softcap, ALiBi, attention sinks (``s_aux``) and dropout with a given keep mask. Run in
float64 it is the truth; run in the inputs' dtype it is "PyTorch math attention in the same
dtype", whose error against float64 sets the bar (flash-attn's rule): our error may be at most 2x
that for the output and 3x for the gradients, plus a small slack, 1e-5 relative to the largest
reference value, for cases where PyTorch happens to be exact (e.g. the gradient of a one-key
softmax is exactly 0) or nearly so (fp32 reductions over thousands of keys). The slack is far
below TF32 error (~1e-3 relative), so fp32 inputs silently computed in TF32 still fail. For the
sinks' gradient the bar's error is the larger of PyTorch's and that of the float64 closed form fed
the output rounded to the inputs' dtype (sink_grad_rounded_out), which every backward that reads
its stored output back makes.

The order of operations is flash-attn's: scores = q k^T * scale, then softcap * tanh(scores /
softcap), then the ALiBi bias -slope * |i + seqlen_k - seqlen_q - j|, then the mask (-inf), then
the softmax, whose denominator also holds exp(sink) when there are sinks, then dropout.

``logits_rule`` is the same rule for single (query, key) pairs in the kernels' own terms, base-2
logits of given q.k products and indices (its docstring maps the kernels' arguments onto it):
tests/test_logits_rule.py checks scores.py's tl functions and hopper_gluon.py's Gluon forms
against it.
"""

import math

import torch

FWD_FACTOR = 2.0
BWD_FACTOR = 3.0
SLACK = 1e-5
LOG2E = math.log2(math.e)


def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool = False, window=(-1, -1), device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool: key j is visible to query i. Aligned to the bottom-right corner:
    with off = seqlen_k - seqlen_q, i + off - left <= j <= i + off + right, -1 = unbounded on that
    side; causal sets right = 0."""
    left, right = (int(w) for w in window)
    if causal:
        right = 0
    rows = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= cols <= rows + right
    if left >= 0:
        visible &= cols >= rows - left
    return visible


def logits_rule(qk, q_idx, k_idx, diag: int, window=(-1, -1), softmax_scale: float = 1.0, softcap: float = 0.0,
                alibi_slope=None, seqlen_k=None, natural: bool = False):
    """(logits, grad) in float64 of the (query, key) pairs of q.k products ``qk``, query indices
    ``q_idx`` and key indices ``k_idx`` (all three broadcast against each other, e.g. [M, N],
    [M, 1], [1, N]), the one statement of the rule the kernels' tl and Gluon forms compute:

    * logit = softcap * tanh(qk * softmax_scale / softcap) (qk * softmax_scale without a softcap,
      softcap <= 0), minus alibi_slope * |q + diag - k| with ALiBi (any sign of slope), times
      log2(e) (base 2), or natural with ``natural`` (FP32_EXACT);
    * -inf where key k is not visible to query q: unless q + diag - left <= k <= q + diag + right
      (window (left, right), a negative bound = none, as flash-attn's window_size; causal is
      right = 0), or k >= seqlen_k (None: no end, the Gluon kernels' full-length tiles);
    * grad = d logit / d(qk * softmax_scale) (dimensionless): the softcap's tanh' =
      1 - tanh^2 = sech^2, else 1; exactly 0 where the pair is not visible (masked_fill's
      gradient: the kernels' dS = 0 there).

    How the kernels' arguments map onto it (``options.AttentionOptions.kernel_args(q)``, which
    ``hopper_gluon.option_arguments`` passes on; L = log2(e), or 1 for fp32 q, FP32_EXACT):

    * without a softcap score_scale = softmax_scale * L and the logit is qk * score_scale; with
      one, score_scale = softmax_scale / softcap, softcap_log2 = softcap * L and the capped logit
      is softcap_log2 * tanh(qk * score_scale);
    * the slope's logit units: slope_log2 = slope * L (scores.head_options via
      ``logit_units``; the Gluon kernels load the slope times LOG2E), bias -slope_log2 * |d|;
    * (left, right) = options.window clamped to MAX_WINDOW, diag = seqlen_k - seqlen_q; VARIANT
      has MASK_LEFT / MASK_RIGHT where a bound is >= 0 (``launch.kernel_variant``);
    * what the forms return: ``scores.logits`` s in units of ``scores.logit_unit`` (logit =
      s * unit: the tanh alone, unit softcap_log2, under a softcap without ALiBi) and, for
      ``logits_grad``, the tanh (grad = 1 - tanh^2) or, under FP32_EXACT, grad itself;
      ``hopper_gluon.tile_logits`` logit - lse_log2; ``hopper_gluon.forward_logits`` (t, unit,
      row_offset) with logit = t * unit - row_offset; ``scores.score_grads`` and
      ``hopper_gluon.tile_logits_grad`` x * grad, exactly 0 where masked."""
    qk = torch.as_tensor(qk, dtype=torch.float64)
    q_idx, k_idx = torch.as_tensor(q_idx, dtype=torch.int64), torch.as_tensor(k_idx, dtype=torch.int64)
    scaled = qk * softmax_scale
    if softcap > 0:
        x = scaled / softcap
        logits, grad = softcap * torch.tanh(x), torch.cosh(x) ** -2.0  # (sech^2: no cancellation near |tanh| = 1)
    else:
        logits, grad = scaled, torch.ones_like(scaled)
    distance = q_idx + diag - k_idx  # (int64: exact)
    if alibi_slope is not None:
        logits = logits - alibi_slope * distance.abs().to(torch.float64)
    left, right = (int(bound) for bound in window)
    visible = torch.ones_like(distance, dtype=torch.bool)
    if seqlen_k is not None:
        visible = visible & (k_idx < seqlen_k)
    if right >= 0:
        visible = visible & (distance >= -right)
    if left >= 0:
        visible = visible & (distance <= left)
    logits = torch.where(visible, logits * (1.0 if natural else LOG2E), float("-inf"))
    return logits, torch.where(visible, grad, 0.0)


def alibi_bias(alibi_slopes: torch.Tensor, batch: int, nheads: int, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """(batch, nheads, seqlen_q, seqlen_k) float64 bias -slope[b, h] * |i + seqlen_k - seqlen_q - j|;
    slopes (nheads,) or (batch, nheads)."""
    slopes = alibi_slopes.double().expand(batch, nheads) if alibi_slopes.dim() == 1 else alibi_slopes.double()
    rows = torch.arange(seqlen_q, device=slopes.device, dtype=torch.float64)[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=slopes.device, dtype=torch.float64)[None, :]
    return -slopes[:, :, None, None] * (rows - cols).abs()


def attention_ref(q, k, v, causal: bool = False, softmax_scale=None, dtype: torch.dtype = torch.float64, *,
                  window=(-1, -1), softcap: float = 0.0, alibi_slopes=None, sinks=None, keep=None,
                  dropout_p: float = 0.0, return_probs: bool = False):
    """Returns (out, lse) computed in ``dtype`` (with ``return_probs``, (out, lse, probs)).

    q (batch, seqlen_q, nheads, d), k and v (batch, seqlen_k, nheads_k, d); softmax_scale None =
    1/sqrt(d). window (left, right) as flash-attn's window_size; softcap > 0 caps the scaled scores;
    alibi_slopes (nheads,) or (batch, nheads); sinks (nheads,): one extra logit per head in every
    row's softmax denominator, with no value vector (autograd reaches it when it requires grad);
    keep: bool (batch, nheads, seqlen_q, seqlen_k), the entries dropout keeps, with the kept
    probabilities scaled by 1 / (1 - dropout_p). The bias and sinks are cast to ``dtype``.

    lse (batch, nheads, seqlen_q) is float32 (float64 when ``dtype`` is), natural log, and holds
    the sink: log(sum over visible keys of exp(score) + exp(sink)). Rows that see no key give out
    0 and lse -inf (lse = sink with sinks). probs are the softmax probabilities before dropout
    (batch, nheads, seqlen_q, seqlen_k), 0 where masked.
    """
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if (keep is None) != (dropout_p == 0.0):
        raise ValueError("attention_ref: pass keep together with dropout_p > 0, or neither")
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    batch, seqlen_q, nheads = q.shape[:3]
    seqlen_k = k.shape[1]
    group = nheads // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k * softmax_scale)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, batch, nheads, seqlen_q, seqlen_k).to(device=q.device, dtype=dtype)
    if causal or tuple(int(w) for w in window) != (-1, -1):
        visible = visible_mask(seqlen_q, seqlen_k, causal, window, device=q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_column = sinks.to(dtype)[None, :, None, None].expand(batch, nheads, seqlen_q, 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    lse = torch.logsumexp(scores.float() if dtype != torch.float64 else scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    else:  # rows that see no key: softmax gives NaN there
        probs = probs.masked_fill(torch.isneginf(scores).all(dim=-1, keepdim=True), 0.0)
    dropped = probs
    if keep is not None:
        dropped = probs.masked_fill(~keep.to(probs.device), 0.0)
        v = v * (1.0 / (1.0 - dropout_p))
    out = torch.einsum("bhqk,bkhd->bqhd", dropped, v)
    return (out, lse, probs) if return_probs else (out, lse)


def _sink_leaf(sinks, dtype):
    """The sinks as a leaf for autograd: float64 for the truth; otherwise in their own dtype (cast to
    ``dtype`` inside attention_ref), so that the same-dtype gradient is rounded to that dtype, as
    any implementation's must be."""
    if sinks is None:
        return None
    return sinks.detach().to(torch.float64 if dtype == torch.float64 else sinks.dtype).requires_grad_()


def run_ref(q, k, v, dout, causal, softmax_scale, dtype, *, sinks=None, return_lse=False, **options):
    """Output and gradients of attention_ref in ``dtype``: (out, (dq, dk, dv)), with sinks
    (out, (dq, dk, dv, dsinks)); with ``return_lse`` the lse comes third. ``options`` are
    attention_ref's keywords (window, softcap, alibi_slopes, keep, dropout_p). dq, dk, dv come in
    ``dtype``; dsinks in float64 for the truth, else in the sinks' own dtype."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    sink_leaf = _sink_leaf(sinks, dtype)
    out, lse = attention_ref(*leaves, causal, softmax_scale, dtype, sinks=sink_leaf, **options)
    inputs = leaves if sink_leaf is None else [*leaves, sink_leaf]
    grads = torch.autograd.grad(out, inputs, dout.to(dtype), allow_unused=True, materialize_grads=True)
    return (out, grads, lse) if return_lse else (out, grads)


def run_varlen_ref(q, k, v, dout, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, dtype, *, sinks=None,
                   alibi_slopes=None, keep=None, **options):
    """Varlen attention as per-sequence attention_ref calls in ``dtype``: returns (out, grads, lse)
    with out (total_q, nheads, d), grads (dq, dk, dv[, dsinks]) and lse (nheads, total_q).

    alibi_slopes (nheads,) or (batch, nheads) (row b for sequence b); keep (batch, nheads,
    max_seqlen_q, max_seqlen_k) bool, sliced to [b, :, :len_q, :len_k] for sequence b."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    sink_leaf = _sink_leaf(sinks, dtype)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b]
        seq_keep = None if keep is None else keep[b:b + 1, :, :cu_q[b + 1] - cu_q[b], :cu_k[b + 1] - cu_k[b]]
        out, lse = attention_ref(leaves[0][rows_q][None], leaves[1][rows_k][None], leaves[2][rows_k][None], causal,
                                 softmax_scale, dtype, sinks=sink_leaf, alibi_slopes=slopes, keep=seq_keep, **options)
        outs.append(out[0])
        lses.append(lse[0])
    out = torch.cat(outs)
    inputs = leaves if sink_leaf is None else [*leaves, sink_leaf]
    grads = torch.autograd.grad(out, inputs, dout.to(dtype), allow_unused=True, materialize_grads=True)
    return out, grads, torch.cat(lses, dim=-1)


def sink_grad_rounded_out(out, lse, sinks, dout, dtype):
    """d sinks in float64 by its closed form, -sum over rows of exp(sink - lse) * (dout . out),
    with the float64 ``out`` rounded to ``dtype`` first: the error floor of any backward that reads
    back its output stored in the inputs' dtype (FlashAttention's delta = rowsum(dout * out)). The
    same-dtype PyTorch gradient does not read the output back, so its error can fall below that
    floor (e.g. with few rows). out, dout (..., nheads, d) and lse (..., nheads, rows) as the
    public functions lay them out, dense (batch, seqlen_q, ...) or varlen (total_q, ...)."""
    delta = (dout.double() * out.detach().to(dtype).double()).sum(dim=-1).transpose(-1, -2)
    terms = torch.exp(sinks.detach().double()[:, None] - lse.detach().double()) * delta
    return -terms.movedim(-2, 0).reshape(sinks.shape[0], -1).sum(dim=1)


def max_err(x, ref) -> float:
    return (x.double() - ref.double()).abs().max().item() if x.numel() else 0.0


def assert_within_bar(name, ours, pytorch_same_dtype, truth, factor, floor=None):
    """max|ours - truth| <= factor * max|pytorch - truth| + slack, and no NaN. ``floor``: another
    same-dtype estimate (sink_grad_rounded_out); the bar takes the larger of the two errors."""
    assert not torch.isnan(ours).any(), f"{name} has NaN"
    err, bar_err = max_err(ours, truth), max_err(pytorch_same_dtype, truth)
    if floor is not None:
        bar_err = max(bar_err, max_err(floor, truth))
    scale = max(1.0, truth.abs().max().item()) if truth.numel() else 1.0
    bound = factor * bar_err + SLACK * scale
    assert err <= bound, f"{name}: max error {err:.3g} > {factor} x PyTorch's {bar_err:.3g} + {SLACK} x {scale:.3g}"


def bar_bound(pytorch_same_dtype, truth, factor) -> float:
    """The bound assert_within_bar applies: factor * max|pytorch - truth| + slack."""
    scale = max(1.0, truth.abs().max().item()) if truth.numel() else 1.0
    return factor * max_err(pytorch_same_dtype, truth) + SLACK * scale
