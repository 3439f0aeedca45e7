"""The forward kernel for Hopper (sm_90), written in Gluon with explicit warp roles: the backward's
dQ kernel (``hopper_dq``) with an online softmax in place of the gradient.

The tl forward (``forward._attn_fwd_kernel``) issues Q K^T, waits for it, turns the scores into
probabilities and only then issues P V, so every score's work (the scale, exp2, a softcap's
tanh, ALiBi's bias, dropout's draws) runs while the warpgroup's tensor-core products do not.
Here, FlashAttention-3's schedule:

* one program per 128 query rows of one query head (dense batches), Q in shared memory;
* a producer warp streams the (K, V) tiles of KEYS keys of the head's KV head through a ring of
  STAGES shared-memory buffers by TMA ("ready" and "empty" mbarriers per buffer);
* two consumer warpgroups, each owning 64 of the query rows, read the ring independently (nothing
  holds them in step, so one's softmax runs while the other's products do), and each overlaps its
  own work across tiles: for key tile t it issues S_t = Q K_t^T and O += P_{t-1} V_{t-1} together,
  waits for S_t only, forms P_t (and the rescaling factor) while the P V product still runs, then
  waits for it and rescales O. The first tile's S is formed before the loop (a prologue that
  treats it as masked, whichever range it lies in) and the last tile's P V after it. ptxas moves
  the wait for P V up to the last product issued before it, so P_t is in fact formed after P V
  has finished (docs/design.md#gluon-forward). With dropout, whose draws make P's formation longest, the kernel takes
  a second schedule (SCORES_AHEAD): step t issues S_{t+1}, forms P_t while it runs, then rescales
  O and issues O += P_t V_t; the prologue forms the first S, the epilogue the last P and P V.

Online softmax in base 2, as in ``forward``: m' = max(m, rowmax(S)), P = exp2(S - m'),
alpha = exp2(m - m'), l = l alpha + rowsum(P), O = O alpha + P V; at the end O / l and
lse = (m + log2 l) ln 2. A softcap bounded as ``scores.FIXED_PIVOT`` allows skips the running
max (a constant pivot, alpha = 1). Sinks start the row at (sink, 1); dropout zeroes P after it
enters l (``hopper_dropout.dropout_rows``, drawn while the products run) and scales O by
1 / (1 - p) at the end. Rows that see no key end with O = 0 and lse = +inf (or the sink).

Causal and window bounds come from ``hopper_gluon.band_tiles``: each warpgroup visits masked
tiles at the band's lower edge, full tiles, masked tiles at its upper edge, and releases unread
the tiles only the other warpgroup sees. ``hopper_route.chosen`` decides where it runs (full
tiles of 128 query rows and KEYS keys); everything else, and ``return_attn_probs``' tile of
probabilities, takes the tl kernels.

At head dims 80 and 96 every tile and accumulator over the head dim is two chunks (64 + 16, 64 +
32) and each such product one wgmma per chunk (``hopper_gluon``'s module docstring).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma_wait

from .hopper_dropout import dropout_rows, keep_pairs, row_calls
from .hopper_gluon import (
    ALIBI_, ALIBI_ABOVE, ALIBI_ACROSS, ALIBI_BELOW, CONSUMER_REGISTERS, DROPOUT_, LOG2E_, MASK_LEFT_, MASK_RIGHT_,
    accumulator_layout, chunk_buffers, chunk_bytes, chunks_at, forward_logits, issue_into_chunks, issue_over_chunks,
    key_tiles, load_chunks, make_ring, operand_layout, option_arguments, query_program, release_unread, round_pairs,
    scale_rows, store_chunks, stream_key_tiles, tile_arguments, wait_chunks, zero_chunks,
)
from .configs import GLUON_TILES, GluonConfig
from .direct_launch import launcher
from .launch import SequenceLayout, kernel_variant
from .options import FIXED_PIVOT, LN2, SCORES_AHEAD, SINKS, AttentionOptions
from .scores import PIVOT_HEADROOM

# query rows per consumer warpgroup (the wgmma M of S and O), keys per ring buffer (the wgmma N of
# S, K of P V); the ring depth is the launch's (configs.GLUON_STAGES)
QUERY_ROWS, KEY_ROWS = GLUON_TILES["fwd"][0] // 2, GLUON_TILES["fwd"][1]


def forward_bits(options: AttentionOptions, dtype: torch.dtype) -> int:
    """The VARIANT bits the kernel reads beyond ``option_arguments``' (which serve the backward
    too): SINKS, FIXED_PIVOT where ``launch.kernel_variant`` allows it, and SCORES_AHEAD (the
    schedule that forms a tile's P while the next tile's S runs) with dropout, whose draws it
    hides: +5-12% there, while the softcap and plain rows lost 2-10% with it (docs/design.md#gluon-forward)."""
    bits = kernel_variant(options, dtype, False, forward=True) & (SINKS | FIXED_PIVOT)
    return bits | (SCORES_AHEAD if options.dropout_p > 0 else 0)


def attention_forward(q, k, v, out, lse, options: AttentionOptions, layout: SequenceLayout,
                      config: GluonConfig) -> None:
    """Write out and lse ((batch, heads, seqlen_q) fp32, ``SequenceLayout.new_row_stats``) of a
    call the planner gave this kernel, with its ``config`` (planner.plan_forward). Launched
    directly, not through torch.library.wrap_triton: the route keeps traced calls on the tl kernels."""
    batch, seqlen_q, num_heads, _ = q.shape
    arguments, constexprs = option_arguments(options, q)
    constexprs["VARIANT"] |= forward_bits(options, q.dtype)
    sinks = lse if options.sinks is None else options.sinks
    rows, keys = config.query_tile // 2, config.key_tile  # (per consumer warpgroup)
    launcher(_forward_kernel)[(seqlen_q // config.query_tile, num_heads, batch)](
        *tile_arguments((q, k, v), layout, (rows, keys, keys)),
        out, *layout.strides(out), lse, *layout.stat_strides(lse), sinks,
        layout.seqlen_k, layout.seqlen_k - layout.seqlen_q, *arguments,
        KEYS=keys, GROUP_SIZE=num_heads // k.shape[2], STAGES=config.stages, CALLS_LAYOUT=CALLS, **constexprs,
        num_warps=4,
    )


CALLS = row_calls(KEY_ROWS)  # the layout of dropout's Philox calls (the kernel's CALLS_LAYOUT)
ROWS = gl.constexpr(QUERY_ROWS)
FIRST, SECOND = gl.constexpr(0), gl.constexpr(1)  # the consumer warpgroups
REGISTERS = gl.constexpr(CONSUMER_REGISTERS)
SINKS_, FIXED_PIVOT_, SCORES_AHEAD_ = gl.constexpr(SINKS), gl.constexpr(FIXED_PIVOT), gl.constexpr(SCORES_AHEAD)
LN2_ = gl.constexpr(LN2)

@gluon.jit
def _producer(q_descs, k_descs, v_descs, q_row, q_col, k_row, k_col, v_row, v_col, q_smem, k_bufs, v_bufs, q_bar,
              ring, keys_lo, keys_hi):
    """One warp: the program's Q once, then the (K, V) tiles of keys [keys_lo, keys_hi) through the ring."""
    mbarrier.expect(q_bar, 2 * chunk_bytes(*q_descs))
    for w in gl.static_range(2):
        load_chunks(q_descs, q_row + w * ROWS, q_col, q_bar, q_smem, w)
    stream_key_tiles(k_descs, v_descs, k_row, k_col, v_row, v_col, k_bufs, v_bufs, ring, keys_lo, keys_hi)

@gluon.jit
def _issue_scores(q, k_bufs, ring, i, S_LAYOUT: gl.constexpr):
    """Issue S = Q K^T of the key tile in ring buffer ``i`` once it has arrived (Q and K in
    head-dim chunks); returns the product in flight."""
    KEYS: gl.constexpr = k_bufs[0].shape[1]
    ring.wait_ready(i)
    zero_s = gl.zeros([ROWS, KEYS], gl.float32, S_LAYOUT)
    return issue_over_chunks(q, chunks_at(k_bufs, ring.index(i)), zero_s, False)

@gluon.jit
def _probabilities(s, row_max, row_sum, n, first_row, rows, band, score, slope_log2, pivot_constant, dropout,
                   DTYPE: gl.constexpr, S_LAYOUT: gl.constexpr, OPERAND_LAYOUT: gl.constexpr,
                   CALLS_LAYOUT: gl.constexpr, PENDING: gl.constexpr, MASKED: gl.constexpr,
                   VARIANT: gl.constexpr, ALIBI_SIDE: gl.constexpr):
    """(P, alpha, row_max, row_sum) of key tile [n, n + KEYS) from its S product ``s`` in
    flight (PENDING younger wgmmas may stay in flight): dropout's draws while it runs, then
    the online softmax step (module docstring); P is dropout's kept probabilities, in DTYPE
    and OPERAND_LAYOUT for the P V product."""
    draws = 0
    if DROPOUT_ & VARIANT:  # (drawn while the products run)
        draws = dropout_rows(dropout, first_row, n, S_LAYOUT, CALLS_LAYOUT)
    s = warpgroup_mma_wait(PENDING, deps=(s,))
    KEYS: gl.constexpr = s.shape[1]
    keys = n + gl.arange(0, KEYS, gl.SliceLayout(0, S_LAYOUT))
    t, unit, row_offset = forward_logits(s, rows, keys, n, band, score, slope_log2, MASKED, VARIANT, ALIBI_SIDE)
    if FIXED_PIVOT_ & VARIANT:  # bounded logits: the pivot is a constant, nothing to rescale
        p = gl.exp2(t * unit - pivot_constant)
        alpha = 1.0
        row_sum = row_sum + gl.sum(p, 1)
    else:
        new_max = gl.maximum(row_max, gl.max(t, 1) * unit - row_offset)
        pivot = new_max
        if MASKED:  # (a row with no visible key yet keeps -inf: pivot 0, no NaN)
            pivot = gl.where(new_max == float("-inf"), 0.0, new_max)
        if ALIBI_ & VARIANT:  # (logits t * unit - row_offset)
            p = gl.exp2(t * unit - (pivot + row_offset)[:, None])
        else:
            p = gl.exp2(t * unit - pivot[:, None])
        alpha = gl.exp2(row_max - pivot)
        row_sum = row_sum * alpha + gl.sum(p, 1)
        row_max = new_max
    p = round_pairs(p, DTYPE)
    if DROPOUT_ & VARIANT:
        p = keep_pairs(dropout, draws, p)
    return gl.convert_layout(p, OPERAND_LAYOUT), alpha, row_max, row_sum

@gluon.jit
def _rescale(o, alpha, VARIANT: gl.constexpr):
    """O (its head-dim chunks) times each row's alpha = exp2(m - m') (``_probabilities``); nothing
    with a fixed pivot."""
    if not (FIXED_PIVOT_ & VARIANT):
        o = scale_rows(o, alpha)
    return o

@gluon.jit
def _key_tile(o, carried, row_max, row_sum, q, k_bufs, v_bufs, ring, i, n, first_row, rows, band, score,
              slope_log2, pivot_constant, dropout, S_LAYOUT: gl.constexpr, OPERAND_LAYOUT: gl.constexpr,
              CALLS_LAYOUT: gl.constexpr, MASKED: gl.constexpr, VARIANT: gl.constexpr, ALIBI_SIDE: gl.constexpr):
    """One step of the overlapped loop for key tile [n, n + KEYS), MASKED if it crosses a band
    edge; returns (o, carried, row_max, row_sum). Two schedules (module docstring):

    * P V behind S (``carried`` is the previous tile's P in OPERAND_LAYOUT, this tile's K in
      ring buffer ``i``): issue S of this tile and O += P V of the previous one (buffer i - 1)
      together, form this tile's P, wait for both, rescale O;
    * SCORES_AHEAD (``carried`` is this tile's finished S product, its K and V in buffer
      ``i``): issue S of the next tile (buffer i + 1), form this tile's P while it runs, then
      rescale O and issue O += P V; here every wait follows a product issued behind the work it
      is meant to overlap, which ptxas cannot move the wait above (docs/design.md#gluon-forward)."""
    CHUNKS: gl.constexpr = len(v_bufs)  # (wgmmas per product into O)
    if SCORES_AHEAD_ & VARIANT:
        idx = ring.index(i)
        s_next = _issue_scores(q, k_bufs, ring, i + 1, S_LAYOUT)
        p, alpha, row_max, row_sum = _probabilities(carried, row_max, row_sum, n, first_row, rows, band, score,
                                                    slope_log2, pivot_constant, dropout, k_bufs[0].dtype, S_LAYOUT,
                                                    OPERAND_LAYOUT, CALLS_LAYOUT, CHUNKS, MASKED, VARIANT,
                                                    ALIBI_SIDE)
        o = issue_into_chunks(p, chunks_at(v_bufs, idx), _rescale(o, alpha, VARIANT))
        carried = warpgroup_mma_wait(CHUNKS, deps=(s_next,))
        o = wait_chunks(0, o)
        ring.release(i)
    else:
        prev = ring.index(i + ring.STAGES - 1)  # (the previous tile's buffer)
        s = _issue_scores(q, k_bufs, ring, i, S_LAYOUT)
        o = issue_into_chunks(carried, chunks_at(v_bufs, prev), o)
        carried, alpha, row_max, row_sum = _probabilities(s, row_max, row_sum, n, first_row, rows, band, score,
                                                          slope_log2, pivot_constant, dropout, k_bufs[0].dtype,
                                                          S_LAYOUT, OPERAND_LAYOUT, CALLS_LAYOUT, CHUNKS, MASKED,
                                                          VARIANT, ALIBI_SIDE)
        o = wait_chunks(0, o)
        ring.release(i + ring.STAGES - 1)
        o = _rescale(o, alpha, VARIANT)
    return o, carried, row_max, row_sum

@gluon.jit
def _key_range(o, carried, row_max, row_sum, i, start, end, q, k_bufs, v_bufs, ring, first_row, rows,
               band, score, slope_log2, pivot_constant, dropout, S_LAYOUT: gl.constexpr,
               OPERAND_LAYOUT: gl.constexpr, CALLS_LAYOUT: gl.constexpr, MASKED: gl.constexpr,
               VARIANT: gl.constexpr, ALIBI_SIDE: gl.constexpr):
    """``_key_tile`` over the key tiles [start, end), ring buffers i, i + 1, ...; returns (o,
    carried, row_max, row_sum, the next buffer's count)."""
    KEYS: gl.constexpr = k_bufs[0].shape[1]
    for n in range(start, end, KEYS):
        o, carried, row_max, row_sum = _key_tile(o, carried, row_max, row_sum, q, k_bufs, v_bufs, ring, i, n,
                                                 first_row, rows, band, score, slope_log2, pivot_constant, dropout,
                                                 S_LAYOUT, OPERAND_LAYOUT, CALLS_LAYOUT, MASKED, VARIANT, ALIBI_SIDE)
        i += 1
    return o, carried, row_max, row_sum, i

@gluon.jit
def _consumer(q_smem, k_bufs, v_bufs, q_bar, ring, Out, out_base, stride_om, Lse, lse_base, sink,
              start_m, keys_lo, keys_hi, seqlen_k, band, score, slope, RngState, stream, dropout_threshold,
              dropout_scale, WG: gl.constexpr, CALLS_LAYOUT: gl.constexpr, VARIANT: gl.constexpr,
              ALIBI_ABS: gl.constexpr):
    """One warpgroup: O and lse of query rows [start_m + WG * 64, + 64) over the key tiles
    [keys_lo, keys_hi) the producer streams."""
    KEYS: gl.constexpr = k_bufs[0].shape[1]
    s_layout: gl.constexpr = accumulator_layout(KEYS)
    p_layout: gl.constexpr = operand_layout(v_bufs[0].shape[2])  # (P's, for O's first chunk)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    first_row = start_m + WG * ROWS
    rows = first_row + gl.arange(0, ROWS, row_layout)
    dropout = (RngState, stream, dropout_threshold)
    slope_log2 = 0.0
    if ALIBI_ & VARIANT:
        slope_log2 = gl.load(slope) * LOG2E_
    pivot_constant = 0.0
    if FIXED_PIVOT_ & VARIANT:  # (scores.row_start: every exp2 within [2^-120, 2^32])
        pivot_constant = gl.maximum(score[1] - PIVOT_HEADROOM, 0.0)
        row_max = gl.full([ROWS], 0.0, gl.float32, row_layout) + pivot_constant
        row_sum = gl.zeros([ROWS], gl.float32, row_layout)
    elif SINKS_ & VARIANT:
        row_max = gl.full([ROWS], 0.0, gl.float32, row_layout) + gl.load(sink).to(gl.float32) * LOG2E_
        row_sum = gl.full([ROWS], 1.0, gl.float32, row_layout)
    else:
        row_max = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
        row_sum = gl.zeros([ROWS], gl.float32, row_layout)
    q = chunks_at(q_smem, WG)
    o = zero_chunks(ROWS, v_bufs)
    # this warpgroup's key tiles: [lo, full_lo) and [full_hi, hi) cross a band edge, the ones
    # before lo and from hi_end on it does not see (streamed for the other warpgroup)
    lo, full_lo, full_hi, hi = key_tiles(first_row, first_row + ROWS - 1, seqlen_k, band, KEYS, VARIANT)
    hi_end = gl.maximum(gl.cdiv(hi, KEYS) * KEYS, lo)
    # ALiBi's form on tiles that may hold pairs on both sides of the diagonal (ALIBI_ABS: keys
    # right of it are visible), and on the full tiles that come last: above the diagonal then
    EDGE_SIDE: gl.constexpr = ALIBI_ACROSS if ALIBI_ABS else ALIBI_BELOW
    FULL_SIDE: gl.constexpr = ALIBI_ABOVE if ALIBI_ABS else ALIBI_BELOW
    mbarrier.wait(q_bar, 0)
    i = 0
    if MASK_LEFT_ & VARIANT:
        i = release_unread(ring, i, keys_lo, lo, KEYS)
    if lo < hi:
        # prologue: the first tile's S, and with P V behind S its P too (masked whichever range
        # it lies in); the steps then run from ``first_step`` to ``step_end``, the last tile's
        # P (SCORES_AHEAD) or P V after them
        s = _issue_scores(q, k_bufs, ring, i, s_layout)
        if SCORES_AHEAD_ & VARIANT:
            carried = warpgroup_mma_wait(0, deps=(s,))
            first_step = lo
            step_end = lo + (hi - 1 - lo) // KEYS * KEYS  # (the last tile, whose P the epilogue forms)
        else:
            carried, _, row_max, row_sum = _probabilities(s, row_max, row_sum, lo, first_row, rows, band, score,
                                                          slope_log2, pivot_constant, dropout, k_bufs[0].dtype,
                                                          s_layout, p_layout, CALLS_LAYOUT, 0, True,
                                                          VARIANT, EDGE_SIDE)
            i += 1
            first_step = lo + KEYS
            step_end = hi
        tiles = (q, k_bufs, v_bufs, ring, first_row, rows, band, score, slope_log2, pivot_constant, dropout)
        if MASK_LEFT_ & VARIANT:
            o, carried, row_max, row_sum, i = _key_range(o, carried, row_max, row_sum, i, first_step,
                                                         gl.minimum(full_lo, step_end), *tiles, s_layout,
                                                         p_layout, CALLS_LAYOUT, True, VARIANT,
                                                         EDGE_SIDE)
        below_end = gl.maximum(full_lo, first_step)
        above_start = below_end
        if ALIBI_ABS:  # the full tiles below the diagonal, across it, above it (``forward_logits``)
            diag = band[0]
            below_end = gl.minimum(gl.maximum(gl.maximum(first_row + diag + 1, 0) // KEYS * KEYS, below_end),
                                   full_hi)
            above_start = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(first_row + ROWS + diag, 0), KEYS) * KEYS,
                                                below_end), full_hi)
            o, carried, row_max, row_sum, i = _key_range(o, carried, row_max, row_sum, i,
                                                         gl.maximum(full_lo, first_step),
                                                         gl.minimum(below_end, step_end), *tiles, s_layout,
                                                         p_layout, CALLS_LAYOUT, False, VARIANT,
                                                         ALIBI_BELOW)
            o, carried, row_max, row_sum, i = _key_range(o, carried, row_max, row_sum, i, below_end,
                                                         gl.minimum(above_start, step_end), *tiles, s_layout,
                                                         p_layout, CALLS_LAYOUT, False, VARIANT,
                                                         ALIBI_ACROSS)
        # (all full tiles without ALIBI_ABS)
        o, carried, row_max, row_sum, i = _key_range(o, carried, row_max, row_sum, i, above_start,
                                                     gl.minimum(full_hi, step_end), *tiles, s_layout,
                                                     p_layout, CALLS_LAYOUT, False, VARIANT,
                                                     FULL_SIDE)
        if MASK_RIGHT_ & VARIANT:
            o, carried, row_max, row_sum, i = _key_range(o, carried, row_max, row_sum, i,
                                                         gl.maximum(full_hi, first_step), step_end, *tiles,
                                                         s_layout, p_layout, CALLS_LAYOUT, True,
                                                         VARIANT, EDGE_SIDE)
        # epilogue: the last tile's P V (SCORES_AHEAD: its P first)
        if SCORES_AHEAD_ & VARIANT:
            carried, alpha, row_max, row_sum = _probabilities(carried, row_max, row_sum, step_end, first_row, rows,
                                                              band, score, slope_log2, pivot_constant, dropout,
                                                              k_bufs[0].dtype, s_layout, p_layout,
                                                              CALLS_LAYOUT, 0, True, VARIANT, EDGE_SIDE)
            o = _rescale(o, alpha, VARIANT)
            i += 1
        o = wait_chunks(0, issue_into_chunks(carried, chunks_at(v_bufs, ring.index(i + ring.STAGES - 1)), o))
        ring.release(i + ring.STAGES - 1)  # (the last tile's buffer)
    if MASK_RIGHT_ & VARIANT:
        release_unread(ring, i, hi_end, keys_hi, KEYS)

    empty_row = row_sum == 0.0
    inv_sum = 1.0 / gl.where(empty_row, 1.0, row_sum)
    if DROPOUT_ & VARIANT:
        inv_sum = inv_sum * dropout_scale
    lse = gl.where(empty_row, float("inf"), (row_max + gl.log2(gl.where(empty_row, 1.0, row_sum))) * LN2_)
    gl.store(Lse + lse_base + rows, lse)
    # (through this warpgroup's Q buffers: its last S product has finished)
    store_chunks(Out + out_base, first_row, stride_om, scale_rows(o, inv_sum), 1.0, q)

@gluon.jit
def _forward_kernel(q_desc, k_desc, v_desc, q_desc_b, k_desc_b, v_desc_b,
                    q_batch_rows, q_head_rows, q_head_cols, k_batch_rows, k_head_rows, k_head_cols,
                    v_batch_rows, v_head_rows, v_head_cols,
                    Out, stride_ob, stride_oh, stride_om, Lse, stride_lse_b, stride_lse_h, Sinks, seqlen_k, diag,
                    score_scale, softcap_log2, softmax_scale, window_left, window_right,
                    AlibiSlopes, stride_alibi_b, RngState, dropout_threshold, dropout_scale,
                    KEYS: gl.constexpr, GROUP_SIZE: gl.constexpr, STAGES: gl.constexpr,
                    CALLS_LAYOUT: gl.constexpr, VARIANT: gl.constexpr, ALIBI_ABS: gl.constexpr):
    """The descriptors and the geometry are ``hopper_gluon.tile_arguments``' (the ``_b`` ones of
    the second head-dim chunk, or None); the arguments after seqlen_k and diag are
    ``hopper_gluon.option_arguments``', VARIANT and ALIBI_ABS its constexprs (VARIANT plus SINKS
    and FIXED_PIVOT); CALLS_LAYOUT: ``hopper_dropout.row_calls(KEYS)``, the layout of dropout's
    Philox calls."""
    band = (diag, window_left, window_right)
    score = (score_scale, softcap_log2)
    start_m, head, batch, kv_head, keys_lo, keys_hi, stream, slope = query_program(
        seqlen_k, band, AlibiSlopes, stride_alibi_b, 2 * ROWS, KEYS, GROUP_SIZE, VARIANT)

    q_descs, k_descs, v_descs = (q_desc, q_desc_b), (k_desc, k_desc_b), (v_desc, v_desc_b)
    q_smem = chunk_buffers(q_descs, 2)
    k_bufs = chunk_buffers(k_descs, STAGES)
    v_bufs = chunk_buffers(v_descs, STAGES)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    ring = make_ring(STAGES)

    lse_base = batch.to(gl.int64) * stride_lse_b + head.to(gl.int64) * stride_lse_h
    out_base = batch.to(gl.int64) * stride_ob + head.to(gl.int64) * stride_oh
    sink = Sinks + head
    # (each partition's arguments spelled out: adding tuples would turn the constexprs into ints)
    gl.warp_specialize([
        (_consumer, (q_smem, k_bufs, v_bufs, q_bar, ring, Out, out_base, stride_om, Lse, lse_base, sink,
                     start_m, keys_lo, keys_hi, seqlen_k, band, score, slope, RngState, stream,
                     dropout_threshold, dropout_scale, FIRST, CALLS_LAYOUT, VARIANT,
                     ALIBI_ABS)),
        (_consumer, (q_smem, k_bufs, v_bufs, q_bar, ring, Out, out_base, stride_om, Lse, lse_base, sink,
                     start_m, keys_lo, keys_hi, seqlen_k, band, score, slope, RngState, stream,
                     dropout_threshold, dropout_scale, SECOND, CALLS_LAYOUT, VARIANT,
                     ALIBI_ABS)),
        (_producer, (q_descs, k_descs, v_descs,
                     batch * q_batch_rows + head * q_head_rows + start_m, head * q_head_cols,
                     batch * k_batch_rows + kv_head * k_head_rows, kv_head * k_head_cols,
                     batch * v_batch_rows + kv_head * v_head_rows, kv_head * v_head_cols,
                     q_smem, k_bufs, v_bufs, q_bar, ring, keys_lo, keys_hi)),
    ], [4, 1], [REGISTERS, 24])
