"""Scores and masks: the one place where the kernels turn Q K^T into logits and decide which
(query, key) pairs exist. The forward and both backward kernels call these functions.

Which options a kernel is compiled for is one constexpr bit set, VARIANT (host side:
``options.AttentionOptions.variant``); every option costs nothing when its bit is clear.

* MASK_LEFT / MASK_RIGHT: a window bound on that side. Query row i sees key j iff
  i + diag - left <= j <= i + diag + right, with diag = seqlen_k - seqlen_q (flash-attn's
  bottom-right alignment); causal masking is MASK_RIGHT with right = 0. Keys past seqlen_k are
  never visible.
* SOFTCAP: logits softcap * tanh(scaled / softcap), before the bias and the mask.
* ALIBI: a bias -slope * |i + diag - j| added to the (capped) scaled scores.
* SINKS: a per-head logit in every row's softmax denominator (the kernels start each row's
  running max and sum from it).
* DROPOUT: a keep mask drawn from Philox, keyed by a seed, an offset and the pair's (batch, head,
  query, key) index, so that every kernel regenerates the same mask whatever its tiling.
* TANH_APPROX: the softcap's tanh through the GPU's approximate instruction (2-byte inputs).
* WIDE_PRODUCTS: Philox's 32 x 32-bit products through mul.wide.u32, one instruction for both
  halves where mul.hi and mul.lo take two (the compiled forward with dropout; elsewhere, and on
  the interpreter, tl.philox draws the same bits).
* FP32_EXACT: fp32 inputs, whose error must stay at that of PyTorch's fp32 attention (the 2-byte
  paths round P to 16 bits anyway and keep the cheaper forms). Logits, row maxima, sinks, ALiBi
  slopes, the softcap and the logsumexp stay in natural units (options.kernel_args passes the
  scale and the softcap unscaled), and only a difference of logits is turned into base 2, by
  ``exp_logits``: the product by log2(e), and its fp32 rounding, then scale |s - max| instead of
  |s| and |max| separately (the rounded constants fl(scale * log2 e) and fl(softcap * log2 e)
  would also shift every logit of a call the same way, which PyTorch's exact scales do not). The
  backward reads the stored natural lse as it is, with no conversion to base 2. Also: the
  softcap's tanh without cancellation near 0 and its derivative from exp(-2|x|) instead of
  1 - tanh^2 (``_tanh_exact``), and IEEE divisions (div.rn) where the compiled default is
  div.full.f32 (2 ulp). FIXED_PIVOT is off (its headroom is counted in base 2). The head-dim
  products q . k and dO . v are summed in 32-term parts (tiles.mma_over_head, keyed on the
  "ieee" PRECISION that only fp32 inputs take).
* FIXED_PIVOT: a softcap bounds every logit to [-softcap, softcap], so the forward subtracts a
  constant (``row_start``) instead of the running row max: no max, no rescaling of the
  accumulator. The launcher sets it where the bound keeps every exp2 in fp32's and bf16's normal
  range (no ALiBi or sinks, which are unbounded; no fp16 P).

Logits are held in base 2 (scaled by log2(e)), as the kernels use exp2 (natural units under
FP32_EXACT), and in units of ``logit_unit`` (the softcap's scale where the tanh is returned
unscaled, else 1).

Tile ranges. A program that owns a block of rows streams tiles of the other side in three ranges:
[lo, full_lo) tiles crossing the lower band edge (masked), [full_lo, full_hi) tiles every row of
the block sees in full (no mask), [full_hi, hi) tiles crossing the upper band edge or the
sequence end (masked). Tiles outside the band are never visited, so the work of a window grows
with the window, not with the sequence.
"""

import triton
import triton.language as tl

from . import options as host  # (the values' one home)
from . import rules
from .rules import PHILOX_ROUNDS

MASK_LEFT = tl.constexpr(host.MASK_LEFT)
MASK_RIGHT = tl.constexpr(host.MASK_RIGHT)
SOFTCAP = tl.constexpr(host.SOFTCAP)
ALIBI = tl.constexpr(host.ALIBI)
SINKS = tl.constexpr(host.SINKS)
DROPOUT = tl.constexpr(host.DROPOUT)
TANH_APPROX = tl.constexpr(host.TANH_APPROX)  # the softcap's tanh through the GPU's tanh.approx.f32 (launch.kernel_variant)
FIXED_PIVOT = tl.constexpr(host.FIXED_PIVOT)  # (and its headroom) launch.kernel_variant
WIDE_PRODUCTS = tl.constexpr(host.WIDE_PRODUCTS)  # Philox's products by mul.wide.u32 (launch.kernel_variant)
PIVOT_HEADROOM = tl.constexpr(32.0)  # FIXED_PIVOT: p = exp2(logit - pivot) <= 2^32
FP32_EXACT = tl.constexpr(host.FP32_EXACT)  # fp32 inputs (launch.kernel_variant)

LOG2E = tl.constexpr(host.LOG2E)
LN2 = tl.constexpr(host.LN2)
# tanh x = x (1 + x^2 (c1 + x^2 (c2 + ...))) on |x| < TANH_SERIES_BOUND: Taylor coefficients, the first
# term left out below 2^-32 relative at the bound (FP32_EXACT, ``_tanh_exact``)
TANH_SERIES_BOUND = tl.constexpr(0.25)
TANH_C1, TANH_C2, TANH_C3 = tl.constexpr(-1.0 / 3.0), tl.constexpr(2.0 / 15.0), tl.constexpr(-17.0 / 315.0)
TANH_C4, TANH_C5 = tl.constexpr(62.0 / 2835.0), tl.constexpr(-1382.0 / 155925.0)

# the rules the Gluon kernels share (rules.py), compiled for tl
_SHARED = rules.instantiate(tl, triton.jit)
band_tiles, tanh_approx, philox_rounds = _SHARED.band_tiles, _SHARED.tanh_approx, _SHARED.philox_rounds


@triton.jit
def key_tile_ranges(start_m, seqlen_q, seqlen_k, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    VARIANT: tl.constexpr):
    """Key-tile ranges (lo, full_lo, full_hi, hi) for query rows [start_m, start_m + BLOCK_M)
    (forward and dQ kernels). ``window`` is (left, right), read only where its bit is set."""
    last_m = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
    return rows_key_tile_ranges(start_m, last_m, seqlen_q, seqlen_k, window, BLOCK_N, VARIANT)


@triton.jit
def rows_key_tile_ranges(first_m, last_m, seqlen_q, seqlen_k, window, BLOCK_N: tl.constexpr, VARIANT: tl.constexpr):
    """``key_tile_ranges`` for the query rows first_m .. last_m (the decode kernel's blocks hold
    several heads of each row)."""
    left, right = window
    diag = seqlen_k - seqlen_q
    return band_tiles(first_m, last_m, diag - left, diag + right, seqlen_k, BLOCK_N,
                      MASK_LEFT & VARIANT, MASK_RIGHT & VARIANT, True)


@triton.jit
def query_tile_ranges(start_n, seqlen_q, seqlen_k, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      VARIANT: tl.constexpr):
    """Query-tile ranges (lo, full_lo, full_hi, hi) for keys [start_n, start_n + BLOCK_N) (dK/dV
    kernel): key j is seen by rows j - diag - right .. j - diag + left. Rows past seqlen_q sit in
    the last, masked range."""
    left, right = window
    diag = seqlen_k - seqlen_q
    last_n = tl.minimum(start_n + BLOCK_N, seqlen_k) - 1
    return band_tiles(start_n, last_n, -diag - right, -diag + left, seqlen_q, BLOCK_M,
                      MASK_RIGHT & VARIANT, MASK_LEFT & VARIANT, True)


@triton.jit
def query_tile_start(BLOCK_M: tl.constexpr, VARIANT: tl.constexpr):
    """First query row of this program's tile (grid axis 0). With an upper band edge (causal) the
    tiles run in reverse, longest rows first, so that the short ones fill the last wave."""
    if MASK_RIGHT & VARIANT:
        return (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    else:
        return tl.program_id(0) * BLOCK_M


@triton.jit
def visible(q_idx, k_idx, seqlen_k, diag, window, VARIANT: tl.constexpr):
    """Mask of the (query, key) pairs that exist, broadcast from query and key indices."""
    left, right = window
    mask = k_idx < seqlen_k
    if MASK_RIGHT & VARIANT:
        mask = mask & (k_idx <= q_idx + diag + right)
    if MASK_LEFT & VARIANT:
        mask = mask & (k_idx >= q_idx + diag - left)
    return mask


@triton.jit
def _tanh(x, VARIANT: tl.constexpr):
    """tanh of 2-byte inputs (fp32 ones take ``_tanh_exact``): with TANH_APPROX the GPU's
    tanh.approx.f32 (one special-function op, relative error 2^-11, flash-attn's choice for
    2-byte inputs); else from exp2 (the interpreter has neither libdevice nor PTX):
    (1 - e) / (1 + e) with e = exp(-2|x|), which neither overflows nor loses the sign, accurate to
    a few fp32 ulps."""
    if TANH_APPROX & VARIANT:
        return tanh_approx(x)
    else:
        e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
        t = tl.fdiv(1.0 - e, 1.0 + e)
        return tl.where(x < 0, -t, t)


@triton.jit
def _tanh_exact(x):
    """(tanh x, tanh' x = 1 - tanh^2 x) to a few fp32 ulps each (FP32_EXACT).

    ``_tanh``'s (1 - e) / (1 + e) loses the relative precision of e = exp(-2|x|) in 1 - e when
    |x| is small: an absolute error of about 2^-23 there, which softcap * tanh turns into a logit
    error of softcap * 2^-23 (PyTorch's is |logit| * 2^-24). Below TANH_SERIES_BOUND the odd
    Taylor series is used instead; above it 1 - e >= 0.39 keeps e's relative error. The
    derivative 4 e / (1 + e)^2 has e's relative error everywhere, where 1 - t^2 from a rounded t
    cancels as the tanh saturates (|x| of a few units: most scores of a softcapped model)."""
    a = tl.abs(x)
    e = tl.exp2(a * (-2.0 * LOG2E))
    x2 = x * x
    series = a + a * x2 * (TANH_C1 + x2 * (TANH_C2 + x2 * (TANH_C3 + x2 * (TANH_C4 + x2 * TANH_C5))))
    one_plus_e = 1.0 + e
    t = tl.where(a < TANH_SERIES_BOUND, series, tl.math.div_rn(1.0 - e, one_plus_e))
    return tl.where(x < 0, -t, t), tl.math.div_rn(4.0 * e, one_plus_e * one_plus_e)


@triton.jit
def logit_units(x, VARIANT: tl.constexpr):
    """A natural-log quantity (an ALiBi slope, a sink, the stored logsumexp) in the kernels' logit
    units: times log2(e), or as it is under FP32_EXACT."""
    if FP32_EXACT & VARIANT:
        return x
    else:
        return x * LOG2E


@triton.jit
def exp_logits(x, VARIANT: tl.constexpr):
    """exp of a difference of logits in the kernels' units (a probability, a rescaling factor):
    exp2(x), or exp2(x * log2(e)) under FP32_EXACT, where x is natural."""
    if FP32_EXACT & VARIANT:
        return tl.exp2(x * LOG2E)
    else:
        return tl.exp2(x)


@triton.jit
def logit_unit(score, VARIANT: tl.constexpr):
    """What one unit of ``logits``' result is worth in base-2 logits: softcap * log2(e) where a
    softcap without ALiBi leaves the tanh unscaled, else 1. Callers form exp2(s * unit - pivot),
    one fused multiply-add per score, and a row's max as max(s) * unit (unit > 0)."""
    if (SOFTCAP & VARIANT) and not (ALIBI & VARIANT):
        return score[1]
    else:
        return 1.0


@triton.jit
def logits(qk, q_idx, k_idx, seqlen_k, diag, window, score, MASKED: tl.constexpr, VARIANT: tl.constexpr):
    """Logits of a tile of q.k products, in units of ``logit_unit`` (base 2), masked to -inf where
    MASKED and invisible, and the tanh of the softcap (for ``logits_grad``; unused without
    SOFTCAP).

    ``score`` = (scale, softcap_log2, alibi_slope_log2) (natural units under FP32_EXACT: no
    log2(e) in any of them): without SOFTCAP, scale is
    softmax_scale * log2(e); with it, softmax_scale / softcap, and the capped logit is
    softcap_log2 * tanh(qk * scale), returned as the tanh alone unless ALiBi's bias must be added
    to it. ALiBi's distance is formed in fp32 from the fp32 row and column indices, exact below
    2^24, so each element costs a subtraction and a multiply-add. Under FP32_EXACT the second
    result is tanh' itself (``_tanh_exact``)."""
    scale, softcap_log2, alibi_slope_log2 = score
    if (SOFTCAP & VARIANT) and (FP32_EXACT & VARIANT):
        s, capped = _tanh_exact(qk * scale)
    elif SOFTCAP & VARIANT:
        capped = _tanh(qk * scale, VARIANT)
        s = capped
    else:
        capped = qk
        s = qk * scale
    if ALIBI & VARIANT:
        if SOFTCAP & VARIANT:
            s = softcap_log2 * s
        distance = (q_idx + diag).to(tl.float32) - k_idx.to(tl.float32)
        s = s - alibi_slope_log2 * tl.abs(distance)
    if MASKED:
        s = tl.where(visible(q_idx, k_idx, seqlen_k, diag, window, VARIANT), s, float("-inf"))
    return s, capped


@triton.jit
def logits_grad(x, capped, VARIANT: tl.constexpr):
    """``x`` times the derivative of the logits with respect to q.k * softmax_scale: the softcap's
    tanh' = 1 - tanh^2, else 1. The gradient of the scores is P * tanh' * (dP - delta); the dQ
    kernel applies this to P as soon as it exists, so that the tanh does not stay in registers
    while dP is computed (the scale is applied by the caller). Under FP32_EXACT ``capped`` is
    tanh' already."""
    if (SOFTCAP & VARIANT) and (FP32_EXACT & VARIANT):
        return x * capped
    elif SOFTCAP & VARIANT:
        return x * (1.0 - capped * capped)
    else:
        return x


@triton.jit
def score_grads(p_grad, dp, delta, q_idx, k_idx, seqlen_k, diag, window, MASKED: tl.constexpr,
                VARIANT: tl.constexpr):
    """dS = p_grad * (dP - delta) of a tile (``p_grad`` = ``logits_grad`` of P; ``delta``, like
    the indices, shaped to broadcast), exactly 0 where MASKED and invisible: masked_fill's
    gradient, as in PyTorch. P = 0 there, but a row whose output is NaN has delta = NaN (and lse
    NaN: P = NaN), and 0 * NaN would carry it into dK of keys the row never sees, or a NaN value
    row into dQ of rows that never see it. The mask, not P == 0, decides: a visible pair whose P
    underflows to 0 keeps PyTorch's 0 * NaN. Full tiles, where every pair is visible, need no
    select."""
    ds = p_grad * (dp - delta)
    if MASKED:
        ds = tl.where(visible(q_idx, k_idx, seqlen_k, diag, window, VARIANT), ds, 0.0)
    return ds


@triton.jit
def row_start(sink_log2, score, BLOCK_M: tl.constexpr, VARIANT: tl.constexpr):
    """Initial (running max, running sum) of a block of rows in base 2: (-inf, 0), or with SINKS
    the sink logit itself, (sink, 1). With FIXED_PIVOT the "max" is a constant pivot that the
    forward never updates: max(u - 32, 0) for logits in [-u, u] (u = softcap * log2(e) <= 76,
    launch.kernel_variant), so every p = exp2(logit - pivot) lies in [2^-120, 2^32]."""
    if FIXED_PIVOT & VARIANT:
        pivot = tl.maximum(score[1] - PIVOT_HEADROOM, 0.0)
        return tl.full([BLOCK_M], 0.0, tl.float32) + pivot, tl.zeros([BLOCK_M], dtype=tl.float32)
    elif SINKS & VARIANT:
        return tl.full([BLOCK_M], 0.0, tl.float32) + sink_log2, tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        return tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32)


@triton.jit
def _bytes_reach(word, limit):
    """Whether each of the four bytes of uint32 ``word`` reaches ``limit`` = threshold << 24, as
    [..., 2, 2] booleans indexed [bit 0, bit 1] of the byte's position: each byte is compared in
    the top position of the word, where its lower neighbours add less than one of its units."""
    return tl.join(tl.join((word << 24) >= limit, (word << 16) >= limit),
                   tl.join((word << 8) >= limit, word >= limit))


@triton.jit
def _pick_word(index, r0, r1, r2, r3):
    """Word ``index`` (0-3, broadcast against the words) of a Philox call's four outputs."""
    return tl.where(index == 0, r0, tl.where(index == 1, r1, tl.where(index == 2, r2, r3)))


@triton.jit
def _keep_by_rows(r0, r1, r2, r3, start_n, limit, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  SPAN: tl.constexpr):
    """[BLOCK_M, BLOCK_N] keep mask from the words [A, r, T, c] of the tile's calls: each call's
    bytes are split into registers by joins (every join adds a dimension held by one thread)."""
    if SPAN == 32:  # word 2 h + j // 2: [A, r, T, c, e, j % 2, j // 2, h]
        keep = tl.join(tl.join(_bytes_reach(r0, limit), _bytes_reach(r1, limit)),
                       tl.join(_bytes_reach(r2, limit), _bytes_reach(r3, limit)))
        keep = tl.permute(keep, (0, 7, 1, 2, 6, 5, 3, 4))
    else:  # 16 keys: j // 2 is the tile's half of the 32-key block: [A, r, T, c, e, j % 2, h]
        upper = (start_n // 16) % 2 == 1
        keep = tl.join(_bytes_reach(tl.where(upper, r1, r0), limit), _bytes_reach(tl.where(upper, r3, r2), limit))
        keep = tl.permute(keep, (0, 6, 1, 2, 5, 3, 4))
    return tl.reshape(keep, [BLOCK_M, BLOCK_N])


@triton.jit
def _spread(word, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPAN: tl.constexpr):
    """[BLOCK_N, BLOCK_M]: word [T, c, A, r] of call (4 t + c, 16 a + r) on each of its pairs,
    key n = 32 t + 8 j + 2 c + e (rows), query m = 16 a + 8 h + r (columns)."""
    shape: tl.constexpr = [BLOCK_N // SPAN, SPAN // 8, 4, 2, BLOCK_M // 16, 2, 8]
    return tl.reshape(tl.broadcast_to(word[:, None, :, None, :, None, :], shape), [BLOCK_N, BLOCK_M])


@triton.jit
def _keep_by_columns(r0, r1, r2, r3, start_n, limit, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     SPAN: tl.constexpr):
    """[BLOCK_N, BLOCK_M] keep mask (rows = keys) from the words [T, c, A, r] of the tile's calls:
    each pair picks its word and byte from its call's words, broadcast to the pairs (joins would
    put the bytes of one call into different threads, through shared memory)."""
    keys = start_n + tl.arange(0, BLOCK_N)
    j = (keys % 32) // 8
    h = (tl.arange(0, BLOCK_M) // 8) % 2
    index = 2 * h[None, :] + (j // 2)[:, None]
    word = _pick_word(index, _spread(r0, BLOCK_M, BLOCK_N, SPAN), _spread(r1, BLOCK_M, BLOCK_N, SPAN),
                      _spread(r2, BLOCK_M, BLOCK_N, SPAN), _spread(r3, BLOCK_M, BLOCK_N, SPAN))
    shift = (24 - 8 * (2 * (j % 2) + keys % 2)).to(tl.uint32)
    return (word << shift[:, None]) >= limit


@triton.jit
def _philox(seed, c0, c1, c2, c3, VARIANT: tl.constexpr):
    """tl.philox(seed, c0, c1, c2, c3, PHILOX_ROUNDS) (32-bit counters): with WIDE_PRODUCTS the same rounds
    (rules.philox_rounds, which the Gluon kernels share), each product's two halves from one
    mul.wide.u32."""
    if WIDE_PRODUCTS & VARIANT:
        seed = seed.to(tl.uint64)
        k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        c0 = c0.to(tl.uint32, bitcast=True)
        c1 = c1.to(tl.uint32, bitcast=True)
        c2 = c2.to(tl.uint32, bitcast=True)
        c3 = c3.to(tl.uint32, bitcast=True)
        return philox_rounds(c0, c1, c2, c3, k0, k1, True)
    else:
        return tl.philox(seed, c0, c1, c2, c3, PHILOX_ROUNDS)


@triton.jit
def dropout_keep(offs_m, start_n, dropout, BLOCK_N: tl.constexpr, KEYS_FIRST: tl.constexpr, VARIANT: tl.constexpr):
    """Dropout's keep mask of query rows ``offs_m`` (a tile starting at a multiple of 16) x keys
    [start_n, start_n + BLOCK_N) of one (batch, head): [BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M]
    with KEYS_FIRST (the dK/dV kernel's transposed tiles).

    ``dropout`` = (seed, stream, offset, threshold). One Philox-4x32 call (7 rounds, which pass
    BigCrush) keyed by the 64-bit seed at counter (key group, query group, stream, offset), stream
    numbering the (batch, head), gives 128 bits: sixteen 8-bit draws for 16 (query, key) pairs, and
    a pair is kept iff its draw reaches ``threshold`` = round(p * 256), as in flash-attn's CUDA
    kernels (p is quantised to 1/256; the output is still scaled by 1 / (1 - p)).

    Which 16 pairs share a call follows the tensor cores' accumulator layout, where a thread holds
    rows r and r + 8 of each 16-row block and columns 2 c + e + 8 j: query m = 16 a + 8 h + r
    (h < 2, r < 8) and key n = 32 t + 8 j + 2 c + e (j < 4, c < 4, e < 2) draw byte 8 h + 2 j + e of
    the call at key group 4 t + c, query group 16 a + r. A thread of the forward and dQ kernels
    (queries on rows) holds all 16 pairs of each call it draws; a thread of the dK/dV kernel (keys
    on rows: keys r, r + 8, queries 2 c + e + 8 j) holds 4 of them, so it draws each call it needs
    itself and no draw crosses threads through shared memory. The draw of a pair depends only on
    its indices, never on the tiling; 16-key tiles use the words of their half of the block."""
    tl.static_assert(BLOCK_N >= 16, "dropout tiles hold at least 16 keys")
    seed, stream, offset, threshold = dropout
    BLOCK_M: tl.constexpr = offs_m.shape[0]
    tl.static_assert(BLOCK_M >= 16, "dropout tiles hold at least 16 query rows")
    SPAN: tl.constexpr = BLOCK_N if BLOCK_N < 32 else 32  # (not min(): Triton 3.4 folds no builtin min of constexprs)
    key_groups = (start_n // 32 + tl.arange(0, BLOCK_N // SPAN))[:, None] * 4 + tl.arange(0, 4)[None, :]  # [T, c]
    query_groups = tl.split(tl.permute(tl.reshape(offs_m, [BLOCK_M // 16, 2, 8]), (0, 2, 1)))[0]  # [A, r]: h = 0
    limit = threshold.to(tl.uint32) << 24
    if KEYS_FIRST:
        r0, r1, r2, r3 = _philox(seed, key_groups[:, :, None, None], query_groups[None, None, :, :], stream, offset,
                                 VARIANT)
        keep = _keep_by_columns(r0, r1, r2, r3, start_n, limit, BLOCK_M, BLOCK_N, SPAN)
    else:
        r0, r1, r2, r3 = _philox(seed, key_groups[None, None, :, :], query_groups[:, :, None, None], stream, offset,
                                 VARIANT)
        keep = _keep_by_rows(r0, r1, r2, r3, start_n, limit, BLOCK_M, BLOCK_N, SPAN)
    return keep


@triton.jit
def head_options(AlibiSlopes, stride_alibi_b, Sinks, RngState, score_scale, softcap_log2, dropout_threshold, batch,
                 head, num_heads, VARIANT: tl.constexpr):
    """The per-(batch, head) options of a program: (score, dropout, sink_log2) for ``logits``,
    ``dropout_keep`` and ``row_start``, loading only what VARIANT uses."""
    score_scale = tl.cast(score_scale, tl.float32)  # torch.compile passes Python floats as fp64
    slope_log2 = 0.0
    sink_log2 = 0.0
    seed = 0
    offset = 0
    if ALIBI & VARIANT:
        slope_log2 = logit_units(tl.load(AlibiSlopes + batch.to(tl.int64) * stride_alibi_b + head), VARIANT)
    if SINKS & VARIANT:
        sink_log2 = logit_units(tl.load(Sinks + head).to(tl.float32), VARIANT)
    if DROPOUT & VARIANT:
        seed = tl.load(RngState)
        offset = (tl.load(RngState + 1) & 0xFFFFFFFF).to(tl.uint32)
    score = (score_scale, tl.cast(softcap_log2, tl.float32), slope_log2)
    return score, (seed, batch * num_heads + head, offset, dropout_threshold), sink_log2
