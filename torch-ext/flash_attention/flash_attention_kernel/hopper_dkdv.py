"""The backward's dK/dV kernel for Hopper (sm_90), written in Gluon with explicit warp roles.

The tl dK/dV kernel (``backward._attn_bwd_dkdv_kernel``) runs its two warpgroups in lockstep
through S -> P -> dP -> dS -> dV, dK for each query tile, so the per-score work between the
products (exp2, the softcap's tanh and its gradient, the causal mask) leaves the tensor cores idle
(docs/design.md#hopper-gluon-kernels). This kernel takes FlashAttention-3's structure instead:

* one program per 128 keys of one KV head (dense batches); K and V stay in shared memory;
* a producer warp streams the (Q, dO) tiles of 64 query rows, with those rows' lse and delta, for
  every query head that shares the KV head, through a ring of STAGES shared-memory buffers by TMA,
  with a "ready" and an "empty" mbarrier per buffer;
* two consumer warpgroups, each owning 64 of the keys, read the ring independently. Per tile:
  S^T = K Q^T and dP^T = V dO^T (wgmma from shared memory, both in flight at once), P^T =
  exp2(S^T - lse) and dS^T = P^T (dP^T - delta) (times tanh' under a softcap) in registers, then
  dV += P^T dO and dK += dS^T Q with P^T and dS^T as register operands. Nothing holds the two
  warpgroups in step, so one's per-score work runs while the other's products do. Each warpgroup
  visits only the query tiles its keys are seen from (``hopper_gluon.band_tiles``: causal and
  window bounds), and only those that cross a band edge take the mask (loops of their own); the
  tiles the producer streams for the other warpgroup alone are released unread. The logits
  (softcap, ALiBi, mask) are ``hopper_gluon.tile_logits``'.
* dropout: each consumer redraws its pairs' keep bits from Philox while its S^T and dP^T products
  run, bit for bit scores.dropout_keep's draws (``hopper_dropout``); dV takes the kept P^T (1 /
  (1 - p) applied once at the end), dS^T the kept, scaled dP^T.
* FUSED_DQ (``attention_dkdv_dq``, the route ``hopper_route.fused_chosen``): the kernel also adds
  dQ = dS K, FlashAttention-3's split of the backward into one kernel, 5 products per tile pair
  where the dQ kernel beside it makes 7. With a tile's dV and dK products in flight, each
  warpgroup puts its dS^T in shared memory (double-buffered by tile parity); at head dim 128 each
  then forms half of dQ's columns over the program's 128 keys, at 64 the warpgroups take whole
  tiles in turn; the partial dQ goes through a swizzled fp32 staging buffer to the zeroed fp32
  accumulator by TMA reductions (``hopper_gluon.tma_atomic_add``; two boxes of 32 columns,
  DQ_STAGE_LAYOUT). Both warpgroups then visit every query tile the program streams (a tile one
  of them does not see contributes zeros), since each needs the other's dS^T
  (docs/design.md#fused-dq-in-the-gluon-dkdv-kernel); under Triton 3.6-3.8 a masked call indexes
  the resident K and V tiles afresh in each query tile (OPAQUE_RESIDENT_RELEASES), and at head dim
  128 a call without a mask forms dK from the stored dS^T, issued after the store
  (DK_FROM_SHARED_RELEASES).

Math and conventions are the tl kernel's (the lse includes a sink's term, rows with lse = +inf get
P = 0, dK is scaled by softmax_scale at the end); ALiBi's slope is the query head's.
``hopper_route.chosen`` decides where it runs (full tiles here are 64 query rows and 128 keys);
everything else takes the tl kernel.

At head dims 80 and 96 every tile and accumulator over the head dim is two chunks (64 + 16, 64 +
32) and each such product one wgmma per chunk (``hopper_gluon``'s module docstring).
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from .hopper_dropout import drop_unkept, dropout_state, dropout_words
from .hopper_gluon import (
    ALIBI_, CONSUMER_REGISTERS, DROPOUT_, LOG2E_, MASK_LEFT_, MASK_RIGHT_, accumulator_layout, band_tiles,
    chunk_buffers, chunk_bytes, chunks_at, flat_descriptor, issue_into_chunks, issue_over_chunks, load_chunks,
    make_ring, opaque, operand_layout, option_arguments, release_unread, resident_index, store_chunks, tile_arguments,
    tile_logits, tile_logits_grad, tma_atomic_add, tma_load, vector_descriptor, wait_chunk_pairs, zero_chunks,
)
from .configs import GLUON_TILES, GluonConfig, head_dim_chunks
from .direct_launch import launcher
from .launch import RowGeometry, SequenceLayout
from .options import AttentionOptions

# query rows per ring buffer (the wgmma N of S^T, K of dV and dK), keys per consumer warpgroup (the wgmma M of S^T)
# The ring depth is the launch's (configs.GLUON_STAGES, GLUON_WINDOW_STAGES)
QUERY_ROWS, KEY_ROWS = GLUON_TILES["bwd_dkdv"][0], GLUON_TILES["bwd_dkdv"][1] // 2


def _tma_vector(x: torch.Tensor) -> torch.Tensor:
    """x contiguous, starting on the 16-byte boundary TMA needs."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def attention_dkdv(dout, q, k, v, lse, delta, dk, dv, options: AttentionOptions, layout: SequenceLayout,
                   config: GluonConfig, dq_accum=None) -> None:
    """Write dK and dV (softmax_scale applied) of a call the planner gave this kernel, with its
    ``config`` (planner.plan_backward); lse and delta are
    (batch, heads, seqlen_q) fp32 with delta already computed. With ``dq_accum`` (the fused
    backward, ``attention_dkdv_dq``) it also adds dQ there. The kernel launches directly, not
    through torch.library.wrap_triton: the route keeps traced calls on the tl kernels."""
    batch, seqlen_k, num_heads_kv, _ = k.shape
    # lse and delta as flat vectors (row (batch * heads + head) * seqlen_q + i), read by TMA with each (Q, dO) tile
    rows, keys = config.query_tile, config.key_tile // 2  # (keys per consumer warpgroup)
    stats = [vector_descriptor(x, rows, STAT_LAYOUT) for x in (_tma_vector(lse), _tma_vector(delta))]
    arguments, constexprs = option_arguments(options, q)
    dq_target, dq_target_b, dq_geometry = None, None, (0, 0, 0)
    if dq_accum is not None:
        # (contiguous fp32 in q's shape: rows of heads * head_dim, in boxes of DQ_BOX_COLUMNS; one
        # consumer warpgroup adds 64 columns of a tile's dQ, half of head dim 128, all of the first
        # chunk's 64 at 64, 80 and 96, and there the second chunk's 16 or 32 as one box of its own)
        assert dq_accum.is_contiguous() and dq_accum.dtype == torch.float32
        g = RowGeometry.of(dq_accum, layout)
        dq_target = flat_descriptor(dq_accum, (g.num_rows, g.stride_row), (rows, DQ_BOX_COLUMNS), DQ_STAGE_LAYOUT)
        second_chunk = head_dim_chunks(q.shape[-1])[1]
        if second_chunk:
            dq_target_b = flat_descriptor(dq_accum, (g.num_rows, g.stride_row), (rows, second_chunk),
                                          dq_stage_layout(second_chunk))
        dq_geometry = (g.batch_rows, g.head_rows, g.head_cols)
    launcher(_dkdv_kernel)[(seqlen_k // config.key_tile, num_heads_kv, batch)](
        *tile_arguments((q, k, v, dout), layout, (rows, keys, keys, rows)),
        *stats, dk, dv, *layout.strides(dk), *layout.strides(dv),
        layout.seqlen_q, layout.seqlen_k - layout.seqlen_q, q.shape[2], *arguments, dq_target, dq_target_b,
        *dq_geometry,
        GROUP_SIZE=q.shape[2] // num_heads_kv, STAGES=config.stages, **constexprs, FUSED_DQ=dq_accum is not None,
        num_warps=4,
    )


def attention_dkdv_dq(dout, q, k, v, lse, delta, dq_accumulator, dk, dv, options: AttentionOptions,
                      layout: SequenceLayout, config: GluonConfig) -> None:
    """The fused backward's launch (FUSED_DQ; backward.py calls it as it calls ampere_backward's):
    dK and dV, and softmax_scale * dQ added to the zeroed fp32 ``dq_accumulator`` (q's shape,
    contiguous), delta already made."""
    attention_dkdv(dout, q, k, v, lse, delta, dk, dv, options, layout, config, dq_accum=dq_accumulator)


STAT_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)  # lse, delta in the ring
# the fused dQ's fp32 staging, in boxes of 32 columns (128 bytes: a TMA box's rows may not exceed
# the swizzle) under the 128-byte swizzle, which spreads the 8 rows a warp's store touches over the
# banks. Unswizzled 256-byte rows put all 8 on the same banks: 8-way conflicts, 22 % of the kernel's
# shared-memory wavefronts and its largest stall; swizzled, a half-warp's 4 rows still pair up
# (2-way), and the one-box layout that avoids that gave wrong dQ under Triton 3.8
# (docs/design.md#fused-dq-in-the-gluon-dkdv-kernel)
DQ_BOX_COLUMNS = 32
DQ_STAGE_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)


def dq_stage_layout(columns: int):
    """The fp32 staging layout of a box of dQ ``columns`` wide: swizzled over its whole row (a
    box's row may not exceed the swizzle), DQ_STAGE_LAYOUT at 32 columns, 64 bytes at head dim
    80's second chunk of 16."""
    return DQ_STAGE_LAYOUT if columns == DQ_BOX_COLUMNS else gl.NVMMASharedLayout(
        swizzle_byte_width=columns * 4, element_bitwidth=32, rank=2)

# The releases under which the fused kernel, on a masked call, indexes its resident K and V tiles (and
# both warpgroups' K for dQ) through hopper_gluon.resident_index in each query tile (_query_tile's
# OPAQUE_RESIDENT). Indexed once, their wgmma descriptors (one 64-bit value per k-step, loop-invariant)
# are hoisted out of the loop by LLVM and held in registers; 3.6-3.8 then spill them (3.6, d128 causal:
# 48 spill stores with the masked and unmasked loops, 18 with one masked loop) and move each to a uniform
# register before its wgmma; formed in each tile, they stay in uniform registers (3 spill stores). At
# d128 causal under 3.6 that ran 1.09-1.11x the landed kernel from 8k and let the fused kernel take
# causal calls from 1k keys a row (FUSED_DQ_MIN_KEYS); calls without a mask, which spilled little,
# lost 2-4 %, and so did 3.9, whose own code keeps the descriptors in uniform registers (stop 71,
# docs/design.md#fused-dq-in-the-gluon-dkdv-kernel, "Resident tiles indexed in each tile")
OPAQUE_RESIDENT_RELEASES = ("3.6.", "3.7.", "3.8.")
OPAQUE_RESIDENT_HERE = gl.constexpr(triton.__version__.startswith(OPAQUE_RESIDENT_RELEASES))
# The releases under which the fused kernel at head dim 128, on a call without a mask, forms dK from the
# dS^T it stores for dQ (_fused_dq's ISSUE_DK) rather than from a register operand held until the tile's
# last wait: under 3.6 1.02-1.05x at N = 2k-16k non-causal, 0.97-0.99x causal, so masked calls keep the
# register operand (docs/design.md#fused-dq-in-the-gluon-dkdv-kernel, "dK from the stored dS^T"); 3.7 and
# 3.8 were compiled (non-causal spill stores 32 -> 0 bytes), not timed; 3.9 was not timed
DK_FROM_SHARED_RELEASES = ("3.6.", "3.7.", "3.8.")
DK_FROM_SHARED_HERE = gl.constexpr(triton.__version__.startswith(DK_FROM_SHARED_RELEASES))
KEYS = gl.constexpr(KEY_ROWS)
ROWS = gl.constexpr(QUERY_ROWS)
FIRST, SECOND = gl.constexpr(0), gl.constexpr(1)  # the consumer warpgroups
REGISTERS = gl.constexpr(CONSUMER_REGISTERS)
DQ_BOX = gl.constexpr(DQ_BOX_COLUMNS)

@gluon.jit
def _query_tiles(first_key, last_key, seqlen_q, band, VARIANT: gl.constexpr):
    """``band_tiles`` over the query rows for keys first_key..last_key: key j is seen by rows
    j - diag - right .. j - diag + left."""
    diag, left, right = band
    return band_tiles(first_key, last_key, -diag - right, -diag + left, seqlen_q, ROWS, MASK_RIGHT_ & VARIANT,
                      MASK_LEFT_ & VARIANT, MASK_LEFT_ & VARIANT)

@gluon.jit
def _producer(q_descs, k_descs, v_descs, do_descs, lse_desc, delta_desc, q_rows, do_rows, k_row, v_row, stat_row,
              q_col, do_col, k_col, v_col, q_head_rows, do_head_rows, q_head_cols, do_head_cols, k_smem, v_smem,
              q_bufs, do_bufs, lse_bufs, delta_bufs, kv_bar, ring, m_lo, m_hi, seqlen_q, GROUP_SIZE: gl.constexpr):
    """One warp: K and V once, then the (Q, dO) tiles [m_lo, m_hi) of each query head, with
    their rows' lse and delta, through the ring."""
    mbarrier.expect(kv_bar, 2 * chunk_bytes(*k_descs, *v_descs))
    for w in gl.static_range(2):
        load_chunks(k_descs, k_row + w * KEYS, k_col, kv_bar, k_smem, w)
        load_chunks(v_descs, v_row + w * KEYS, v_col, kv_bar, v_smem, w)
    i = 0
    for g in range(GROUP_SIZE):
        for m in range(m_lo, m_hi, ROWS):
            idx = ring.index(i)
            arrived = ring.claim(i, chunk_bytes(*q_descs, *do_descs, lse_desc, delta_desc))
            tma_load(lse_desc, [(stat_row + g) * seqlen_q + m], arrived, lse_bufs.index(idx))
            tma_load(delta_desc, [(stat_row + g) * seqlen_q + m], arrived, delta_bufs.index(idx))
            load_chunks(q_descs, q_rows + g * q_head_rows + m, q_col + g * q_head_cols, arrived, q_bufs, idx)
            load_chunks(do_descs, do_rows + g * do_head_rows + m, do_col + g * do_head_cols, arrived, do_bufs, idx)
            i += 1

@gluon.jit
def _query_tile(dk, dv, k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ring, i, m, keys, first_key, band,
                score, slope_log2, dropout, dropout_scale, stream, fused, dq_at, S_LAYOUT: gl.constexpr,
                OPERAND_LAYOUT: gl.constexpr, MASKED: gl.constexpr, VARIANT: gl.constexpr, ALIBI_ABS: gl.constexpr,
                WG: gl.constexpr, FUSED_DQ: gl.constexpr):
    """dK, dV of a warpgroup's 64 keys after query tile [m, m + 64), ring buffer ``i`` (K, V: both
    warpgroups' resident tiles, this one's at index WG; Q, dO, dK and dV in head-dim chunks).
    MASKED: the tile crosses a band edge."""
    dtype: gl.constexpr = q_bufs[0].dtype
    CHUNKS: gl.constexpr = len(q_bufs)  # (wgmmas per product)
    i = opaque(i)  # (the buffers' addresses from the count, not carried: hopper_gluon.opaque)
    BANDED: gl.constexpr = (MASK_LEFT_ | MASK_RIGHT_) & VARIANT  # (causal or windowed: some tiles cross a band edge)
    OPAQUE_RESIDENT: gl.constexpr = OPAQUE_RESIDENT_HERE and FUSED_DQ and BANDED
    own = resident_index(i, WG, OPAQUE_RESIDENT)  # (this warpgroup's K and V)
    k = chunks_at(k_smem, own)
    v = chunks_at(v_smem, own)
    idx = ring.index(i)
    ring.wait_ready(i)
    q = chunks_at(q_bufs, idx)
    do = chunks_at(do_bufs, idx)
    zero_s = gl.zeros([KEYS, ROWS], gl.float32, S_LAYOUT)
    s = issue_over_chunks(k, q, zero_s, False)
    dp = issue_over_chunks(v, do, zero_s, False)
    row_layout: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
    queries = m + gl.arange(0, ROWS, row_layout)
    lse_log2 = lse_bufs.index(idx).load(row_layout) * LOG2E_
    delta = delta_bufs.index(idx).load(row_layout)
    if DROPOUT_ & VARIANT:  # (drawn while the products run)
        rng_state, threshold = dropout
        state = dropout_state(rng_state, threshold, first_key, keys)
        words = dropout_words(state, m, stream, S_LAYOUT)
    s = warpgroup_mma_wait(CHUNKS, deps=(s,))
    x, capped = tile_logits(s, lse_log2[None, :], queries[None, :], keys[:, None], first_key, band, score,
                            slope_log2, MASKED, VARIANT, ALIBI_ABS)
    p = gl.exp2(x)
    dp = warpgroup_mma_wait(0, deps=(dp,))
    p_kept = p
    if DROPOUT_ & VARIANT:  # dV takes the kept probabilities (1 / (1 - p) at the end), dS the kept dP
        p_kept, dp = drop_unkept(state, words, p, dp)
        dp = dp * dropout_scale
    ds = tile_logits_grad(p * (dp - delta[None, :]), capped, queries[None, :], keys[:, None], band, MASKED,
                          VARIANT)
    dv = issue_into_chunks(gl.convert_layout(p_kept.to(dtype), OPERAND_LAYOUT), do, dv)
    ds_rounded = ds.to(dtype)
    DK_FROM_SHARED: gl.constexpr = DK_FROM_SHARED_HERE and FUSED_DQ and q_bufs[0].shape[2] == 128 and not BANDED
    if not DK_FROM_SHARED:  # (else _fused_dq issues it, from the dS^T it stores)
        dk = issue_into_chunks(gl.convert_layout(ds_rounded, OPERAND_LAYOUT), q, dk)
    if FUSED_DQ:
        k_at = (resident_index(i, 0, OPAQUE_RESIDENT), resident_index(i, 1, OPAQUE_RESIDENT))
        dk, dv = _fused_dq(dk, dv, ds_rounded, q, ring, i, fused, dq_at, k_at, WG, DK_FROM_SHARED)
    else:
        dv, dk = wait_chunk_pairs(0, dv, dk)
        ring.release(i)
    return dk, dv

@gluon.jit
def _query_range(dk, dv, i, start, end, tile, dq_at, S_LAYOUT: gl.constexpr, OPERAND_LAYOUT: gl.constexpr,
                 MASKED: gl.constexpr, VARIANT: gl.constexpr, ALIBI_ABS: gl.constexpr, WG: gl.constexpr,
                 FUSED_DQ: gl.constexpr):
    """dK, dV and the ring's count after the query tiles [start, end) (_query_tile each; ``tile``:
    its loop-invariant arguments, ``dq_at``: the query head's first dQ row and column, FUSED_DQ)."""
    (k, v, q_bufs, do_bufs, lse_bufs, delta_bufs, ring, keys, first_key, band, score, slope_log2, dropout,
     dropout_scale, stream, fused) = tile
    dq_row, dq_col = dq_at
    for m in range(start, end, ROWS):
        dk, dv = _query_tile(dk, dv, k, v, q_bufs, do_bufs, lse_bufs, delta_bufs, ring, i, m, keys, first_key,
                             band, score, slope_log2, dropout, dropout_scale, stream, fused, (dq_row + m, dq_col),
                             S_LAYOUT, OPERAND_LAYOUT, MASKED, VARIANT, ALIBI_ABS, WG, FUSED_DQ)
        i += 1
    return dk, dv, i


@gluon.jit
def _fused_dq(dk, dv, ds, q, ring, i, fused, dq_at, k_at, WG: gl.constexpr, ISSUE_DK: gl.constexpr):
    """With this tile's dV and dK products in flight, add its dQ = dS K for the tile's 64 query
    rows, times softmax_scale, into dq_accum (ISSUE_DK: dK's product is issued here instead, from
    the stored dS^T and the tile's Q chunks ``q``). Both warpgroups put their dS^T (keys by rows) in
    shared memory; dQ is formed over all 128 keys of the program from there, staged in shared
    memory and added by reductions (``_add_dq``). At head dim 128
    each warpgroup forms half of dQ's columns once both dS^T are in (FlashAttention-3's split);
    at 64, whose 64-column K tiles cannot be split at a 128-byte swizzle boundary, and at 80 and
    96, whose two chunks (64 + 16, 64 + 32) cannot be halved either, the warpgroups take whole
    tiles in turn (the tile's parity), so that only the one forming dQ waits for the other's dS^T.
    ``fused`` = (ds_bufs [4, KEYS, ROWS]: (tile parity, warpgroup), k_all: both warpgroups' keys,
    [2, KEYS, width] per head-dim chunk, dq_stages: fp32 staging per chunk, [4, ROWS, DQ_BOX]
    (warpgroup, box) for the first and [2, ROWS, width] (warpgroup) for a second, ds_ready and
    ds_free [2, 1] mbarriers, dq_targets: the accumulator's descriptors per chunk, softmax_scale);
    ``dq_at`` = (row, column) of the tile's dQ in dq_accum's rows; ``k_at``: the indices of the two
    warpgroups' keys in k_all (``resident_index``)."""
    ds_bufs, k_all, dq_stages, ds_ready, ds_free, dq_targets, softmax_scale = fused
    dq_row, dq_col = dq_at
    WIDTH: gl.constexpr = 2 * dq_stages[0].shape[2]  # (dQ columns of the first chunk one warpgroup forms: two boxes)
    SPLIT: gl.constexpr = k_all[0].shape[2] == 2 * WIDTH
    gl.static_assert(SPLIT or not ISSUE_DK, "dK from the stored dS^T is the head-dim-128 kernel's")
    gl.static_assert(SPLIT or k_all[0].shape[2] == WIDTH, "the fused dQ's first head-dim chunk is 64 or 128 wide")
    parity = i % 2
    phase = (i // 2) & 1
    # the buffers of this parity are free once the dQ products that read them two tiles ago have finished
    mbarrier.wait(ds_free.index(parity), phase ^ 1)
    ds_bufs.index(parity * 2 + WG).store(ds)
    fence_async_shared()
    if ISSUE_DK:  # (dK = dS^T Q from the stored dS^T, one chunk at head dim 128)
        dk = (warpgroup_mma(ds_bufs.index(parity * 2 + WG), q[0], dk[0], is_async=True),)
    mbarrier.arrive(ds_ready.index(parity), count=1)
    if SPLIT:
        mbarrier.wait(ds_ready.index(parity), phase)
        acc = _dq_product(ds_bufs, parity, k_all[0], k_at, WG * WIDTH, WIDTH)
        dk, dv, acc = _wait_with_dq(dk, dv, (acc,))
        mbarrier.arrive(ds_free.index(parity), count=1)
        ring.release(i)
        _add_dq(acc, softmax_scale, dq_stages, WG, dq_targets, dq_row, dq_col + WG * WIDTH)
    else:
        if parity == WG:  # (this warpgroup's turn)
            mbarrier.wait(ds_ready.index(parity), phase)
            acc = (_dq_product(ds_bufs, parity, k_all[0], k_at, 0, WIDTH),)
            if len(k_all) > 1:
                acc = (acc[0], _dq_product(ds_bufs, parity, k_all[1], k_at, 0, k_all[1].shape[2]))
            dk_done, dv_done, acc = _wait_with_dq(dk, dv, acc)
            mbarrier.arrive(ds_free.index(parity), count=1)
            _add_dq(acc, softmax_scale, dq_stages, WG, dq_targets, dq_row, dq_col)
        else:
            dk_done, dv_done = wait_chunk_pairs(0, dk, dv)
        ring.release(i)
        dk, dv = dk_done, dv_done
    return dk, dv

@gluon.jit
def _wait_with_dq(dk, dv, dq):
    """The tile's dK, dV and dQ products (each a tuple per head-dim chunk) finished: (dk, dv, dq)."""
    if len(dq) == 1:
        a, b, c = warpgroup_mma_wait(0, deps=(dk[0], dv[0], dq[0]))
        done = ((a,), (b,), (c,))
    else:
        a, a2, b, b2, c, c2 = warpgroup_mma_wait(0, deps=(dk[0], dk[1], dv[0], dv[1], dq[0], dq[1]))
        done = ((a, a2), (b, b2), (c, c2))
    return done

@gluon.jit
def _drain_fused(fused, count):
    """After a warpgroup's ``count`` tiles: its reductions done, and every dQ product of the last
    two tiles finished, whichever warpgroup issued it. Those read both warpgroups' K tiles, and the
    epilogue stages dK through this warpgroup's."""
    ds_free = fused[4]
    tma.store_wait(0)
    if count > 0:
        mbarrier.wait(ds_free.index((count - 1) % 2), ((count - 1) // 2) & 1)
    if count > 1:
        mbarrier.wait(ds_free.index((count - 2) % 2), ((count - 2) // 2) & 1)

@gluon.jit
def _dq_product(ds_bufs, parity, k_chunk, k_at, first_col, WIDTH: gl.constexpr):
    """dS [ROWS, 128 keys] times the program's K at columns first_col.. (WIDTH of them) of one
    head-dim chunk (``k_chunk``: both warpgroups' keys, at its indices ``k_at``), from both
    warpgroups' dS^T of this parity; in flight."""
    acc = gl.zeros([ROWS, WIDTH], gl.float32, accumulator_layout(WIDTH))
    acc = warpgroup_mma(ds_bufs.index(parity * 2).permute((1, 0)), k_chunk.index(k_at[0]).slice(first_col, WIDTH, 1),
                        acc, use_acc=False, is_async=True)
    return warpgroup_mma(ds_bufs.index(parity * 2 + 1).permute((1, 0)),
                         k_chunk.index(k_at[1]).slice(first_col, WIDTH, 1), acc, is_async=True)

@gluon.jit
def _add_dq(dq, scale, stages, WG: gl.constexpr, dq_targets, row, col):
    """Add fp32 ``dq`` times ``scale`` at (row, col) of the accumulator's rows by TMA reductions:
    its first chunk (2 * DQ_BOX columns) staged as two boxes in stages[0]'s buffers 2 WG and 2 WG + 1,
    a second chunk (head dims 80 and 96) as one box in stages[1]'s buffer WG; ``dq_targets``: the
    accumulator's descriptors for those boxes. (The accumulator layout holds each column's bit 5
    in registers, so the split into boxes moves no data.)"""
    BOX: gl.constexpr = stages[0].shape[2]
    left, right = (dq[0] * scale).reshape([ROWS, 2, BOX]).permute((0, 2, 1)).split()
    tma.store_wait(0)  # (the last reductions have read the staging buffers)
    stages[0].index(2 * WG).store(left)
    stages[0].index(2 * WG + 1).store(right)
    if len(dq) > 1:
        stages[1].index(WG).store(dq[1] * scale)
    fence_async_shared()
    tma_atomic_add(dq_targets[0], [row, col], stages[0].index(2 * WG))
    tma_atomic_add(dq_targets[0], [row, col + BOX], stages[0].index(2 * WG + 1))
    if len(dq) > 1:
        tma_atomic_add(dq_targets[1], [row, col + 2 * BOX], stages[1].index(WG))

@gluon.jit
def _consumer(k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, kv_bar, ring,
              DK, DV, dk_base, dv_base, stride_dkn, stride_dvn, start_key, m_lo, m_hi, seqlen_q, band, score,
              softmax_scale, slopes, RngState, first_row, dropout_threshold, dropout_scale, fused, dq_rows,
              WG: gl.constexpr, GROUP_SIZE: gl.constexpr, VARIANT: gl.constexpr, ALIBI_ABS: gl.constexpr,
              FUSED_DQ: gl.constexpr):
    """One warpgroup: dK, dV of keys [start_key + WG * 64, + 64) over the query tiles [m_lo,
    m_hi) the producer streams, of every query head of the group."""
    s_layout: gl.constexpr = accumulator_layout(ROWS)
    pds_layout: gl.constexpr = operand_layout(q_bufs[0].shape[2])  # (P^T's and dS^T's, for the first chunks)
    first_key = start_key + WG * KEYS
    keys = first_key + gl.arange(0, KEYS, gl.SliceLayout(1, s_layout))
    k = chunks_at(k_smem, WG)
    v = chunks_at(v_smem, WG)
    dk = zero_chunks(KEYS, q_bufs)
    dv = zero_chunks(KEYS, do_bufs)
    # what dropout_state needs: the state itself is formed again for each tile (even the seed,
    # loaded from L1), since held across the loop its registers doubled the causal kernel's
    # spills (docs/design.md#gluon-dkdv)
    dropout = (RngState, dropout_threshold)
    # this warpgroup's query tiles: [lo, full_lo) and [full_hi, hi) cross a band edge, the
    # ones before lo and from hi_end on it does not see (streamed for the other warpgroup)
    lo, full_lo, full_hi, hi = _query_tiles(first_key, first_key + KEYS - 1, seqlen_q, band, VARIANT)
    if FUSED_DQ:  # both warpgroups visit every tile the program streams (masked where one sees none)
        lo = m_lo
        hi = m_hi
    hi_end = gl.maximum(gl.cdiv(hi, ROWS) * ROWS, lo)
    dq_row0, q_head_rows, dq_col0, q_head_cols = dq_rows
    mbarrier.wait(kv_bar, 0)
    i = 0
    for g in range(GROUP_SIZE):
        stream = (first_row + g).to(gl.uint32)  # dropout's Philox stream: batch * heads + head
        dq_at = (dq_row0 + g * q_head_rows, dq_col0 + g * q_head_cols)  # (its dQ in the accumulator, FUSED_DQ)
        slope_log2 = 0.0
        if ALIBI_ & VARIANT:
            slope_log2 = gl.load(slopes + g) * LOG2E_
        # (what every query tile of this head takes)
        tile = (k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ring, keys, first_key, band, score, slope_log2,
                dropout, dropout_scale, stream, fused)
        if MASK_RIGHT_ & VARIANT:
            i = release_unread(ring, i, m_lo, lo, ROWS)
            dk, dv, i = _query_range(dk, dv, i, lo, full_lo, tile, dq_at, s_layout, pds_layout, True, VARIANT,
                                     ALIBI_ABS, WG, FUSED_DQ)
        dk, dv, i = _query_range(dk, dv, i, full_lo, full_hi, tile, dq_at, s_layout, pds_layout, False, VARIANT,
                                 ALIBI_ABS, WG, FUSED_DQ)
        if MASK_LEFT_ & VARIANT:
            dk, dv, i = _query_range(dk, dv, i, full_hi, hi, tile, dq_at, s_layout, pds_layout, True, VARIANT,
                                     ALIBI_ABS, WG, FUSED_DQ)
            i = release_unread(ring, i, hi_end, m_hi, ROWS)
    if FUSED_DQ:
        _drain_fused(fused, i)
    dv_scale = 1.0
    if DROPOUT_ & VARIANT:
        dv_scale = dropout_scale
    # (through this warpgroup's K and V buffers: their last products have finished)
    store_chunks(DK + dk_base, first_key, stride_dkn, dk, softmax_scale, k)
    store_chunks(DV + dv_base, first_key, stride_dvn, dv, dv_scale, v)

@gluon.jit
def _dkdv_kernel(q_desc, k_desc, v_desc, do_desc, q_desc_b, k_desc_b, v_desc_b, do_desc_b,
                 q_batch_rows, q_head_rows, q_head_cols, k_batch_rows, k_head_rows, k_head_cols,
                 v_batch_rows, v_head_rows, v_head_cols, do_batch_rows, do_head_rows, do_head_cols,
                 lse_desc, delta_desc, DK, DV, stride_dkb, stride_dkh, stride_dkn,
                 stride_dvb, stride_dvh, stride_dvn, seqlen_q, diag, num_heads,
                 score_scale, softcap_log2, softmax_scale, window_left, window_right,
                 AlibiSlopes, stride_alibi_b, RngState, dropout_threshold, dropout_scale,
                 dq_target, dq_target_b, dq_batch_rows, dq_head_rows, dq_head_cols,
                 GROUP_SIZE: gl.constexpr, STAGES: gl.constexpr,
                 VARIANT: gl.constexpr, ALIBI_ABS: gl.constexpr, FUSED_DQ: gl.constexpr):
    """The descriptors and the geometry are ``hopper_gluon.tile_arguments``' (the ``_b`` ones of
    the second head-dim chunk, or None); the arguments after num_heads are
    ``hopper_gluon.option_arguments``', VARIANT and ALIBI_ABS its constexprs. With FUSED_DQ,
    dq_target is the fp32 accumulator's descriptor in boxes of DQ_BOX columns, dq_target_b in boxes
    of the second head-dim chunk (None at head dims 64 and 128; ``attention_dkdv``) and the dq_
    geometry its rows' (``launch.RowGeometry``); else None, None and zeros."""
    start_key = gl.program_id(0) * (2 * KEYS)
    kv_head = gl.program_id(1)
    batch = gl.program_id(2)
    head = kv_head * GROUP_SIZE  # the group's first query head
    band = (diag, window_left, window_right)
    score = (score_scale, softcap_log2)
    # the query tiles any of the program's keys is seen from: the producer streams these
    m_lo, _, _, m_hi = _query_tiles(start_key, start_key + 2 * KEYS - 1, seqlen_q, band, VARIANT)

    q_descs, do_descs = (q_desc, q_desc_b), (do_desc, do_desc_b)
    k_descs, v_descs = (k_desc, k_desc_b), (v_desc, v_desc_b)
    k_smem = chunk_buffers(k_descs, 2)
    v_smem = chunk_buffers(v_descs, 2)
    q_bufs = chunk_buffers(q_descs, STAGES)
    do_bufs = chunk_buffers(do_descs, STAGES)
    lse_bufs = gl.allocate_shared_memory(lse_desc.dtype, [STAGES, ROWS], lse_desc.layout)
    delta_bufs = gl.allocate_shared_memory(delta_desc.dtype, [STAGES, ROWS], delta_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    ring = make_ring(STAGES)

    dk_base = batch.to(gl.int64) * stride_dkb + kv_head.to(gl.int64) * stride_dkh
    dv_base = batch.to(gl.int64) * stride_dvb + kv_head.to(gl.int64) * stride_dvh
    # the group's first query head as a row of (batch, heads): its lse / delta row, its Philox stream
    first_row = batch * num_heads + head
    slopes = AlibiSlopes + batch.to(gl.int64) * stride_alibi_b + head  # (the group's ALiBi slopes)
    fused = kv_bar  # (a stand-in: partitions take no None)
    if FUSED_DQ:  # (_fused_dq)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, ROWS], q_desc.dtype)
        ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [4, KEYS, ROWS], ds_layout)
        dq_stage = gl.allocate_shared_memory(gl.float32, [4, ROWS, DQ_BOX], DQ_STAGE_LAYOUT)  # (_fused_dq)
        if dq_target_b is None:
            dq_stages = (dq_stage,)
        else:  # (the second head-dim chunk's box, one a warpgroup)
            dq_stages = (dq_stage, gl.allocate_shared_memory(gl.float32, [2] + dq_target_b.block_type.shape,
                                                              dq_target_b.layout))
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(2):  # (at head dim 64 one warpgroup reads a parity's dS^T: _fused_dq)
            mbarrier.init(ds_ready.index(b), count=2)
            mbarrier.init(ds_free.index(b), count=2 if k_smem[0].shape[2] == 2 * KEYS else 1)
        fused = (ds_bufs, k_smem, dq_stages, ds_ready, ds_free, (dq_target, dq_target_b), softmax_scale)
    dq_rows = (batch * dq_batch_rows + head * dq_head_rows, dq_head_rows, head * dq_head_cols, dq_head_cols)
    # (each partition's arguments spelled out: adding tuples would turn the constexprs into ints)
    gl.warp_specialize([
        (_consumer, (k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, kv_bar, ring,
                     DK, DV, dk_base, dv_base, stride_dkn, stride_dvn, start_key, m_lo, m_hi, seqlen_q, band,
                     score, softmax_scale, slopes, RngState, first_row, dropout_threshold, dropout_scale, fused,
                     dq_rows, FIRST, GROUP_SIZE, VARIANT, ALIBI_ABS, FUSED_DQ)),
        (_consumer, (k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, kv_bar, ring,
                     DK, DV, dk_base, dv_base, stride_dkn, stride_dvn, start_key, m_lo, m_hi, seqlen_q, band,
                     score, softmax_scale, slopes, RngState, first_row, dropout_threshold, dropout_scale, fused,
                     dq_rows, SECOND, GROUP_SIZE, VARIANT, ALIBI_ABS, FUSED_DQ)),
        (_producer, (q_descs, k_descs, v_descs, do_descs, lse_desc, delta_desc,
                     batch * q_batch_rows + head * q_head_rows, batch * do_batch_rows + head * do_head_rows,
                     batch * k_batch_rows + kv_head * k_head_rows + start_key,
                     batch * v_batch_rows + kv_head * v_head_rows + start_key, first_row,
                     head * q_head_cols, head * do_head_cols, kv_head * k_head_cols, kv_head * v_head_cols,
                     q_head_rows, do_head_rows, q_head_cols, do_head_cols, k_smem, v_smem, q_bufs, do_bufs,
                     lse_bufs, delta_bufs, kv_bar, ring, m_lo, m_hi, seqlen_q, GROUP_SIZE)),
    ], [4, 1], [REGISTERS, 24])
