"""The backward's dQ kernel for Hopper (sm_90), written in Gluon with explicit warp roles: the
dK/dV kernel's structure (``hopper_dkdv``) turned around, keys streamed past resident queries.

The tl dQ kernel (``backward._attn_bwd_dq_kernel``) runs its warps in lockstep through S -> P ->
dP -> dS -> dQ for each key tile, so the per-score work between the products (exp2, the softcap's
tanh and its gradient, the mask) leaves the tensor cores idle; under a softcap that made it 27%
slower (docs/design.md#hopper-gluon-kernels). Here:

* one program per 128 query rows of one query head (dense batches); their Q and dO stay in
  shared memory, their lse and delta in registers;
* a producer warp streams the (K, V) tiles of 64 keys of the head's KV head through a ring of
  STAGES shared-memory buffers by TMA, with a "ready" and an "empty" mbarrier per buffer;
* two consumer warpgroups, each owning 64 of the query rows, read the ring independently. Per
  tile: S = Q K^T and dP = dO V^T (wgmma from shared memory, both in flight at once), P =
  exp2(S - lse) and dS = P (dP - delta) (times tanh' under a softcap) in registers, then dQ += dS K
  with dS as the register operand. Nothing holds the two warpgroups in step, so one's per-score
  work runs while the other's products do. Within a warpgroup the loop is software-pipelined: a
  step issues its tile's S and dP, then the previous tile's dQ product, and forms its dS while dP
  and that product run (a prologue forms the first dS, an epilogue issues the last product).
* causal and window bounds: each warpgroup splits the key tiles the producer streams into those
  its rows all see, those that cross a band edge (masked, loops of their own) and those outside
  its band (released unread: the other warpgroup may need them), ``hopper_gluon.band_tiles``.
  With an upper band edge (causal) programs run longest rows first. The logits (softcap, ALiBi,
  mask) are ``hopper_gluon.tile_logits``'.
* delta = rowsum(dO * O) - dlse: each consumer makes its rows' delta itself while its first
  tile's S and dP products run, from O read from global memory while the producer's TMA brings dO,
  and writes it out for the dK/dV kernel, which runs after this one (planner.DELTA_IN_DQ: no
  preprocess kernel, whose pass over O and dO cost about 50 us per backward at 16k tokens,
  docs/design.md#gluon-dq).
* dropout: each consumer redraws its pairs' keep bits while its S and dP products run
  (``hopper_dropout.dropout_rows``, bit for bit ``scores.dropout_keep``); dS takes the kept dP,
  with the 1 / (1 - p) of dP moved into delta and applied to dQ once at the end.

Math and conventions are the tl kernel's (the lse includes a sink's term, rows with lse = +inf get
P = 0, dQ is scaled by softmax_scale at the end).
``hopper_route.chosen`` decides where it runs (full tiles here are 128 query rows and 64 keys;
dropout only with causal masking); everything else takes the tl kernel.

At head dims 80 and 96 every tile and accumulator over the head dim is two chunks (64 + 16, 64 +
32) and each such product one wgmma per chunk (``hopper_gluon``'s module docstring).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma_wait

from .hopper_dropout import dropout_rows, keep_pairs, row_calls
from .hopper_gluon import (
    ALIBI_, CONSUMER_REGISTERS, DROPOUT_, LOG2E_, MASK_LEFT_, MASK_RIGHT_, accumulator_layout, chunk_buffers,
    chunk_bytes, chunks_at, issue_into_chunks, issue_over_chunks, key_tiles, load_chunks, load_rows, make_ring,
    operand_layout, option_arguments, query_program, release_unread, round_pairs, store_chunks, stream_key_tiles,
    tile_arguments, tile_logits, tile_logits_grad, wait_chunks, zero_chunks,
)
from .configs import GLUON_TILES, GluonConfig
from .direct_launch import launcher
from .launch import SequenceLayout
from .options import AttentionOptions

# query rows per consumer warpgroup: the wgmma M of S and dQ; keys per ring buffer: the wgmma N
# of S, K of dQ (the kernel and hopper_dropout.dropout_rows take 128 too: with half the ring it
# measured within 2% of 64 either way and spills, docs/design.md#gluon-dq)
# The ring depth is the launch's (configs.GLUON_STAGES)
QUERY_ROWS, KEY_ROWS = GLUON_TILES["bwd_dq"][0] // 2, GLUON_TILES["bwd_dq"][1]


def attention_dq(dout, q, k, v, out, lse, dlse, delta, dq, options: AttentionOptions, layout: SequenceLayout,
                 config: GluonConfig) -> None:
    """Write dQ (softmax_scale applied) of a call the planner gave this kernel, with its ``config``
    (planner.plan_backward), and delta = rowsum(dout * out) - dlse into ``delta`` (dlse None:
    no lse gradient); lse, dlse and delta are contiguous (batch, heads, seqlen_q) fp32
    (``SequenceLayout.new_row_stats``). The kernel launches directly, not through
    torch.library.wrap_triton: the route keeps traced calls on the tl kernels."""
    batch, seqlen_q, num_heads, _ = q.shape
    arguments, constexprs = option_arguments(options, q)
    rows, keys = config.query_tile // 2, config.key_tile  # (per consumer warpgroup)
    launcher(_dq_kernel)[(seqlen_q // config.query_tile, num_heads, batch)](
        *tile_arguments((q, k, v, dout), layout, (rows, keys, keys, rows)),
        out, *layout.strides(out), lse, delta if dlse is None else dlse, delta, *layout.stat_strides(delta),
        dq, *layout.strides(dq),
        layout.seqlen_k, layout.seqlen_k - layout.seqlen_q, *arguments,
        KEYS=keys, GROUP_SIZE=num_heads // k.shape[2], STAGES=config.stages, CALLS_LAYOUT=CALLS,
        HAS_DLSE=dlse is not None, **constexprs, num_warps=4,
    )


CALLS = row_calls(KEY_ROWS)  # the layout of dropout's Philox calls (the kernel's CALLS_LAYOUT)
ROWS = gl.constexpr(QUERY_ROWS)
FIRST, SECOND = gl.constexpr(0), gl.constexpr(1)  # the consumer warpgroups
REGISTERS = gl.constexpr(CONSUMER_REGISTERS)

@gluon.jit
def _producer(q_descs, k_descs, v_descs, do_descs, q_row, q_col, do_row, do_col, k_row, k_col, v_row, v_col,
              q_smem, do_smem, k_bufs, v_bufs, qdo_bar, ring, keys_lo, keys_hi):
    """One warp: the program's Q and dO once, then the (K, V) tiles of keys [keys_lo, keys_hi) through the ring."""
    mbarrier.expect(qdo_bar, 2 * chunk_bytes(*q_descs, *do_descs))
    for w in gl.static_range(2):
        load_chunks(q_descs, q_row + w * ROWS, q_col, qdo_bar, q_smem, w)
        load_chunks(do_descs, do_row + w * ROWS, do_col, qdo_bar, do_smem, w)
    stream_key_tiles(k_descs, v_descs, k_row, k_col, v_row, v_col, k_bufs, v_bufs, ring, keys_lo, keys_hi)

@gluon.jit
def _row_products(out, do):
    """rowsum(dO * O) in fp32 of O's blocks ``out`` (``load_rows``) and dO's shared blocks ``do``."""
    sums = gl.sum(out[0].to(gl.float32) * do[0].load(out[0].type.layout).to(gl.float32), axis=1)
    if len(do) > 1:
        second = gl.sum(out[1].to(gl.float32) * do[1].load(out[1].type.layout).to(gl.float32), axis=1)
        sums = sums + gl.convert_layout(second, sums.type.layout)
    return sums

@gluon.jit
def _make_delta(out, do, Delta, DLse, stat_base, first_row, HAS_DLSE: gl.constexpr):
    """delta = rowsum(dO * O) - dlse of the warpgroup's rows first_row.. from O's blocks ``out``
    and dO's shared blocks ``do``, stored to Delta (the dK/dV kernel, which runs after this one,
    and the sinks' gradient read it) and returned in the layout of the row sums."""
    delta = _row_products(out, do)
    rows = first_row + gl.arange(0, delta.shape[0], delta.type.layout)
    if HAS_DLSE:
        delta = delta - gl.load(DLse + stat_base + rows)
    gl.store(Delta + stat_base + rows, delta)
    return delta

@gluon.jit
def _issue_products(q, do, k_bufs, v_bufs, ring, i, S_LAYOUT: gl.constexpr):
    """Issue S = Q K^T and dP = dO V^T of the key tile in ring buffer ``i`` once it has
    arrived (each over the head-dim chunks); returns both products in flight."""
    KEYS: gl.constexpr = k_bufs[0].shape[1]
    idx = ring.index(i)
    ring.wait_ready(i)
    zero_s = gl.zeros([ROWS, KEYS], gl.float32, S_LAYOUT)
    s = issue_over_chunks(q, chunks_at(k_bufs, idx), zero_s, False)
    dp = issue_over_chunks(do, chunks_at(v_bufs, idx), zero_s, False)
    return s, dp

@gluon.jit
def _score_grads(s, dp, n, first_row, rows, lse_log2, delta, band, score, slope_log2, dropout,
                 DTYPE: gl.constexpr, S_LAYOUT: gl.constexpr, OPERAND_LAYOUT: gl.constexpr,
                 CALLS_LAYOUT: gl.constexpr, CHUNKS: gl.constexpr, PENDING: gl.constexpr, MASKED: gl.constexpr,
                 VARIANT: gl.constexpr, ALIBI_ABS: gl.constexpr):
    """dS of key tile [n, n + KEYS) from its S and dP products in flight (CHUNKS wgmmas each,
    the head-dim chunks; PENDING wgmmas issued after them may stay in flight), in DTYPE and
    OPERAND_LAYOUT for the dQ product. MASKED: the tile crosses a band edge."""
    if DROPOUT_ & VARIANT:  # (drawn while the products run)
        words = dropout_rows(dropout, first_row, n, S_LAYOUT, CALLS_LAYOUT)
    s = warpgroup_mma_wait(PENDING + CHUNKS, deps=(s,))
    KEYS: gl.constexpr = s.shape[1]
    keys = n + gl.arange(0, KEYS, gl.SliceLayout(0, S_LAYOUT))
    x, capped = tile_logits(s, lse_log2[:, None], rows[:, None], keys[None, :], n, band, score, slope_log2,
                            MASKED, VARIANT, ALIBI_ABS)
    p = gl.exp2(x)
    dp = warpgroup_mma_wait(PENDING, deps=(dp,))
    if DROPOUT_ & VARIANT:  # (dP's 1 / (1 - p) is in delta and in the final scale)
        dp = keep_pairs(dropout, words, dp)
    ds = tile_logits_grad(p * (dp - delta[:, None]), capped, rows[:, None], keys[None, :], band, MASKED, VARIANT)
    return gl.convert_layout(round_pairs(ds, DTYPE), OPERAND_LAYOUT)

@gluon.jit
def _key_range(dq, ds, i, start, end, q, do, k_bufs, v_bufs, ring, first_row, rows, lse_log2, delta,
               band, score, slope_log2, dropout, S_LAYOUT: gl.constexpr, OPERAND_LAYOUT: gl.constexpr,
               CALLS_LAYOUT: gl.constexpr, MASKED: gl.constexpr, VARIANT: gl.constexpr, ALIBI_ABS: gl.constexpr):
    """The overlapped loop over key tiles [start, end), ring buffers i, i + 1, ...: each step
    issues this tile's S and dP and the previous tile's dQ += dS K (its dS ``ds``, buffer i -
    1) together and forms this tile's dS while dP and dQ run. Returns (dq, ds, the next
    buffer's count). MASKED: the tiles cross a band edge."""
    KEYS: gl.constexpr = k_bufs[0].shape[1]
    CHUNKS: gl.constexpr = len(k_bufs)
    for n in range(start, end, KEYS):
        prev = ring.index(i + ring.STAGES - 1)  # (the previous tile's buffer)
        s, dp = _issue_products(q, do, k_bufs, v_bufs, ring, i, S_LAYOUT)
        dq = issue_into_chunks(ds, chunks_at(k_bufs, prev), dq)
        ds = _score_grads(s, dp, n, first_row, rows, lse_log2, delta, band, score, slope_log2, dropout,
                          k_bufs[0].dtype, S_LAYOUT, OPERAND_LAYOUT, CALLS_LAYOUT, CHUNKS, CHUNKS, MASKED, VARIANT,
                          ALIBI_ABS)
        dq = wait_chunks(0, dq)
        ring.release(i + ring.STAGES - 1)
        i += 1
    return dq, ds, i

@gluon.jit
def _consumer(q_smem, do_smem, k_bufs, v_bufs, qdo_bar, ring, Out, out_base, stride_om, Lse, DLse, Delta,
              stat_base, DQ, dq_base, stride_dqm, start_m, keys_lo, keys_hi, seqlen_k, band, score, softmax_scale,
              slope, RngState, stream, dropout_threshold, dropout_scale, WG: gl.constexpr,
              CALLS_LAYOUT: gl.constexpr, HAS_DLSE: gl.constexpr, VARIANT: gl.constexpr, ALIBI_ABS: gl.constexpr):
    """One warpgroup: delta and dQ of query rows [start_m + WG * 64, + 64) over the key tiles
    [keys_lo, keys_hi) the producer streams."""
    KEYS: gl.constexpr = k_bufs[0].shape[1]
    s_layout: gl.constexpr = accumulator_layout(KEYS)
    ds_layout: gl.constexpr = operand_layout(k_bufs[0].shape[2])  # (dS's, for dQ's first chunk)
    first_row = start_m + WG * ROWS
    rows = first_row + gl.arange(0, ROWS, gl.SliceLayout(1, s_layout))
    lse_log2 = gl.load(Lse + stat_base + rows) * LOG2E_
    q = chunks_at(q_smem, WG)
    do = chunks_at(do_smem, WG)
    # for delta: O's loads are issued before the wait for dO's TMA, so that they arrive together
    out = load_rows(Out + out_base, first_row, stride_om, do)
    if DROPOUT_ & VARIANT:  # dS = P (keep dP / (1 - p) - delta) = P (keep dP - delta (1 - p)) / (1 - p)
        softmax_scale = softmax_scale * dropout_scale
    dropout = (RngState, stream, dropout_threshold)
    slope_log2 = 0.0
    if ALIBI_ & VARIANT:
        slope_log2 = gl.load(slope) * LOG2E_
    dq = zero_chunks(ROWS, k_bufs)
    # this warpgroup's key tiles: [lo, full_lo) and [full_hi, hi) cross a band edge, the ones
    # before lo and from hi_end on it does not see (streamed for the other warpgroup)
    lo, full_lo, full_hi, hi = key_tiles(first_row, first_row + ROWS - 1, seqlen_k, band, KEYS, VARIANT)
    hi_end = gl.maximum(gl.cdiv(hi, KEYS) * KEYS, lo)
    mbarrier.wait(qdo_bar, 0)
    i = 0
    if MASK_LEFT_ & VARIANT:
        i = release_unread(ring, i, keys_lo, lo, KEYS)
    if lo < hi:
        # prologue: delta while the first tile's S and dP run, then that tile's dS, masked whichever
        # range it lies in
        s, dp = _issue_products(q, do, k_bufs, v_bufs, ring, i, s_layout)
        delta = _make_delta(out, do, Delta, DLse, stat_base, first_row, HAS_DLSE)
        delta = gl.convert_layout(delta, rows.type.layout)
        if DROPOUT_ & VARIANT:
            delta = delta / dropout_scale
        ds = _score_grads(s, dp, lo, first_row, rows, lse_log2, delta, band, score, slope_log2, dropout,
                          k_bufs[0].dtype, s_layout, ds_layout, CALLS_LAYOUT, len(k_bufs), 0, True, VARIANT,
                          ALIBI_ABS)
        i += 1
        second = lo + KEYS
        tiles = (q, do, k_bufs, v_bufs, ring, first_row, rows, lse_log2, delta, band, score, slope_log2, dropout)
        if MASK_LEFT_ & VARIANT:
            dq, ds, i = _key_range(dq, ds, i, second, full_lo, *tiles, s_layout, ds_layout, CALLS_LAYOUT,
                                   True, VARIANT, ALIBI_ABS)
        dq, ds, i = _key_range(dq, ds, i, gl.maximum(full_lo, second), full_hi, *tiles, s_layout, ds_layout,
                               CALLS_LAYOUT, False, VARIANT, ALIBI_ABS)
        if MASK_RIGHT_ & VARIANT:
            dq, ds, i = _key_range(dq, ds, i, gl.maximum(full_hi, second), hi, *tiles, s_layout, ds_layout,
                                   CALLS_LAYOUT, True, VARIANT, ALIBI_ABS)
        # epilogue: the last tile's dQ product
        dq = wait_chunks(0, issue_into_chunks(ds, chunks_at(k_bufs, ring.index(i + ring.STAGES - 1)), dq))
        ring.release(i + ring.STAGES - 1)  # (the last tile's buffer)
    else:  # (no key visible: delta still serves the sinks' gradient)
        _make_delta(out, do, Delta, DLse, stat_base, first_row, HAS_DLSE)
    if MASK_RIGHT_ & VARIANT:
        release_unread(ring, i, hi_end, keys_hi, KEYS)
    # (through this warpgroup's Q buffers: its last S product has finished)
    store_chunks(DQ + dq_base, first_row, stride_dqm, dq, softmax_scale, q)

@gluon.jit
def _dq_kernel(q_desc, k_desc, v_desc, do_desc, q_desc_b, k_desc_b, v_desc_b, do_desc_b,
               q_batch_rows, q_head_rows, q_head_cols, k_batch_rows, k_head_rows, k_head_cols,
               v_batch_rows, v_head_rows, v_head_cols, do_batch_rows, do_head_rows, do_head_cols,
               Out, stride_ob, stride_oh, stride_om, Lse, DLse, Delta, stride_stat_b, stride_stat_h,
               DQ, stride_dqb, stride_dqh, stride_dqm, seqlen_k, diag,
               score_scale, softcap_log2, softmax_scale, window_left, window_right,
               AlibiSlopes, stride_alibi_b, RngState, dropout_threshold, dropout_scale,
               KEYS: gl.constexpr, GROUP_SIZE: gl.constexpr, STAGES: gl.constexpr,
               CALLS_LAYOUT: gl.constexpr, HAS_DLSE: gl.constexpr, VARIANT: gl.constexpr,
               ALIBI_ABS: gl.constexpr):
    """The descriptors and the geometry are ``hopper_gluon.tile_arguments``' (the ``_b`` ones of
    the second head-dim chunk, or None); the arguments after seqlen_k and diag are
    ``hopper_gluon.option_arguments``', VARIANT and ALIBI_ABS its constexprs; CALLS_LAYOUT:
    ``hopper_dropout.row_calls(KEYS)``, the layout of dropout's Philox calls; HAS_DLSE: DLse
    holds the lse's gradient (else it is a stand-in, unread)."""
    band = (diag, window_left, window_right)
    score = (score_scale, softcap_log2)
    start_m, head, batch, kv_head, keys_lo, keys_hi, stream, slope = query_program(
        seqlen_k, band, AlibiSlopes, stride_alibi_b, 2 * ROWS, KEYS, GROUP_SIZE, VARIANT)

    q_descs, do_descs = (q_desc, q_desc_b), (do_desc, do_desc_b)
    k_descs, v_descs = (k_desc, k_desc_b), (v_desc, v_desc_b)
    q_smem = chunk_buffers(q_descs, 2)
    do_smem = chunk_buffers(do_descs, 2)
    k_bufs = chunk_buffers(k_descs, STAGES)
    v_bufs = chunk_buffers(v_descs, STAGES)
    qdo_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(qdo_bar, count=1)
    ring = make_ring(STAGES)

    stat_base = batch.to(gl.int64) * stride_stat_b + head.to(gl.int64) * stride_stat_h
    dq_base = batch.to(gl.int64) * stride_dqb + head.to(gl.int64) * stride_dqh
    out_base = batch.to(gl.int64) * stride_ob + head.to(gl.int64) * stride_oh
    # (each partition's arguments spelled out: adding tuples would turn the constexprs into ints)
    gl.warp_specialize([
        (_consumer, (q_smem, do_smem, k_bufs, v_bufs, qdo_bar, ring, Out, out_base, stride_om, Lse, DLse,
                     Delta, stat_base, DQ, dq_base, stride_dqm, start_m, keys_lo, keys_hi, seqlen_k, band, score,
                     softmax_scale, slope, RngState, stream, dropout_threshold, dropout_scale, FIRST,
                     CALLS_LAYOUT, HAS_DLSE, VARIANT, ALIBI_ABS)),
        (_consumer, (q_smem, do_smem, k_bufs, v_bufs, qdo_bar, ring, Out, out_base, stride_om, Lse, DLse,
                     Delta, stat_base, DQ, dq_base, stride_dqm, start_m, keys_lo, keys_hi, seqlen_k, band, score,
                     softmax_scale, slope, RngState, stream, dropout_threshold, dropout_scale, SECOND,
                     CALLS_LAYOUT, HAS_DLSE, VARIANT, ALIBI_ABS)),
        (_producer, (q_descs, k_descs, v_descs, do_descs,
                     batch * q_batch_rows + head * q_head_rows + start_m, head * q_head_cols,
                     batch * do_batch_rows + head * do_head_rows + start_m, head * do_head_cols,
                     batch * k_batch_rows + kv_head * k_head_rows, kv_head * k_head_cols,
                     batch * v_batch_rows + kv_head * v_head_rows, kv_head * v_head_cols,
                     q_smem, do_smem, k_bufs, v_bufs, qdo_bar, ring, keys_lo, keys_hi)),
    ], [4, 1], [REGISTERS, 24])
