"""Attention over a KV cache (flash_attn_with_kvcache): append, split-KV attention, merge.

Inference reads a long cache with few queries (decode: one token; speculative decoding and
chunked prefill: a few to a few hundred). Two kernels, launched in order on one stream:

1. ``_decode_kernel``: the forward pass of forward.py, with three changes.
   * GQA packing. A program owns one KV head, and its BLOCK_M rows are (query row, query head)
     pairs of every query head sharing that KV head, row r holding query i = r // GROUP_SIZE of
     head kv_head * GROUP_SIZE + r % GROUP_SIZE. K and V are read once per KV head instead of
     once per query head, and a decode step's 1 x GROUP_SIZE rows fill a tensor-core tile.
   * Split-KV (flash-decoding). With NUM_SPLITS > 1 the visible key tiles of each block of rows
     are cut into NUM_SPLITS contiguous ranges, one program each (grid axis 0 = row block x
     split), so that a batch with few KV heads still fills the GPU. Each split stores its output
     normalised by its own row sum, in fp32, and its logsumexp (-inf where it saw nothing).
   * Appending (HAS_NEW). New keys and values are written into the cache (contiguous, with
     ``cache_batch_idx`` choosing the row, or paged through the block table) at each sequence's
     ``cache_seqlens``, the keys rotated first when rotary tables are given, by the kernel that
     reads them: each program writes the new rows inside its own key range before its loop (a
     barrier orders its writes before its reads), and the program of split 0 and row block 0
     writes all of them (rows no query sees still belong in the cache). No program reads a row
     that another one writes, so no launch is needed in between. A ``cache_seqlens`` entry is
     clamped into [0, capacity] and rows past the capacity are dropped, cache_batch_idx,
     cache_leftpad and block-table entries are clamped into what they index, so wrong values
     never read or write outside a tensor.
   Queries are rotated as they are loaded (rotary.load_rotated_rows) at cache_seqlens + i with a
   causal mask or a window, else all at cache_seqlens, as flash-attn does. Masks, softcap, ALiBi
   and sinks come from scores.py as in the forward kernel; causal masks and windows are aligned to
   each sequence's end, seqlen_k = cache_seqlens + seqlen_new. ``cache_leftpad`` moves the start
   of a sequence's keys: the kernel sees keys [leftpad, seqlen_k) as a sequence of their own
   (absolute and relative positions give the same masks and biases).
2. ``_merge_kernel`` (NUM_SPLITS > 1): out = sum_s w_s out_s / sum_s w_s, w_s = exp(lse_s - max),
   lse = max + log(sum_s w_s), all splits of a row loaded at once and summed in a fixed order, so
   a given split count is bitwise repeatable. A sink joins split 0's row start, hence every row's
   denominator exactly once.

A row that sees no key gets out 0 and lse +inf (with a sink: lse = sink), as in the forward.
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import configs
from .configs import GPU_CLASSES, TileConfig, decode_config, head_dim_chunks
from .direct_launch import launcher
from .forward import forward_key_loop, reciprocal, row_lse
from .launch import (
    TlLaunch, cdiv, check_gpu_supports, device_gpu_class, fixed_tl_launch, identity_wrap, is_interpreted,
    kernel_variant, last_dim_contiguous, launch_fitting, on_tensor_device, precision_mode, refitted,
)
from .options import AttentionOptions
from .replay import replayed
from .rotary import load_rotated_rows
from .scores import ALIBI, MASK_LEFT, SINKS, head_options, row_start, rows_key_tile_ranges
from .tiles import kv_sources, store_rows

NEW_ROWS_BLOCK = tl.constexpr(16)  # new key/value rows written per step
MAX_SPLITS = 128
MERGE_ELEMENTS = 4096  # fp32 values of the splits' outputs the merge kernel loads at once


@triton.jit
def _cache_rows(positions, inside, batch, cache_row, BlockTable, stride_table, cache_entries, stride_cache_b,
                stride_cache_n, PAGE_SIZE: tl.constexpr):
    """Element offsets (int64) of sequence rows ``positions`` in a cache: row ``position`` of cache
    entry ``cache_row``, or with PAGE_SIZE > 0 row position % PAGE_SIZE of page
    table[batch, position // PAGE_SIZE] (entries clamped into the cache)."""
    if PAGE_SIZE > 0:
        pages = tl.load(BlockTable + batch.to(tl.int64) * stride_table + positions // PAGE_SIZE, mask=inside, other=0)
        pages = tl.minimum(tl.maximum(pages, 0), cache_entries - 1)
        return pages.to(tl.int64) * stride_cache_b + (positions % PAGE_SIZE) * stride_cache_n
    else:
        return cache_row.to(tl.int64) * stride_cache_b + positions.to(tl.int64) * stride_cache_n


@triton.jit
def _sequence_start(CacheSeqlens, CacheBatchIdx, batch, cache_seqlen, capacity, cache_entries,
                    SEQLENS_PER_BATCH: tl.constexpr, HAS_BATCH_IDX: tl.constexpr):
    """(keys already in the cache, cache row) of batch entry ``batch``; a cache_seqlens entry is
    clamped into [0, capacity] and a cache_batch_idx entry into the cache's ``cache_entries`` rows
    (an int cache_seqlen is checked on the host)."""
    if SEQLENS_PER_BATCH:
        cache_seqlen = tl.minimum(tl.maximum(tl.load(CacheSeqlens + batch), 0), capacity)
    cache_row = batch
    if HAS_BATCH_IDX:
        cache_row = tl.minimum(tl.maximum(tl.load(CacheBatchIdx + batch), 0), cache_entries - 1)
    return cache_seqlen, cache_row


@triton.jit
def _write_new_rows(KNew, VNew, K, V, first, last, cache_seqlen, capacity, batch, kv_head, cache_row, BlockTable,
                    stride_table, cache_entries, Cos, Sin, stride_cos, seqlen_ro, new_strides, cache_strides,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, ROTARY_DIM: tl.constexpr,
                    INTERLEAVED: tl.constexpr, PAGE_SIZE: tl.constexpr, PRECISION: tl.constexpr):
    """New rows [first, last) of one (batch entry, KV head) into the caches at cache_seqlen + row,
    the keys rotated by that position; rows at or past ``capacity`` are dropped."""
    stride_knb, stride_knn, stride_knh, stride_vnb, stride_vnn, stride_vnh = new_strides
    stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh = cache_strides
    for start in range(first, last, NEW_ROWS_BLOCK):
        rows = start + tl.arange(0, NEW_ROWS_BLOCK)
        positions = cache_seqlen + rows
        inside = (rows < last) & (positions < capacity)
        k_rows = batch.to(tl.int64) * stride_knb + kv_head * stride_knh + rows.to(tl.int64) * stride_knn
        v_rows = batch.to(tl.int64) * stride_vnb + kv_head * stride_vnh + rows.to(tl.int64) * stride_vnn
        k = load_rotated_rows(KNew, k_rows, inside, positions, Cos, Sin, stride_cos, seqlen_ro, 0, HEAD_DIM_PADDED,
                              HEAD_DIM, ROTARY_DIM, INTERLEAVED, PRECISION)
        v = load_rotated_rows(VNew, v_rows, inside, positions, Cos, Sin, stride_cos, seqlen_ro, 0, HEAD_DIM_PADDED,
                              HEAD_DIM, 0, INTERLEAVED, PRECISION)
        k_cache = _cache_rows(positions, inside, batch, cache_row, BlockTable, stride_table, cache_entries, stride_kb,
                              stride_kn, PAGE_SIZE) + kv_head * stride_kh
        v_cache = _cache_rows(positions, inside, batch, cache_row, BlockTable, stride_table, cache_entries, stride_vb,
                              stride_vn, PAGE_SIZE) + kv_head * stride_vh
        store_rows(K, k, k_cache, inside, 0, HEAD_DIM_PADDED, HEAD_DIM, PRECISION)
        store_rows(V, v, v_cache, inside, 0, HEAD_DIM_PADDED, HEAD_DIM, PRECISION)


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_new", "capacity", "cache_seqlen", "num_splits"])
def _decode_kernel(
    Q, K, V, KNew, VNew, Out, Lse, CacheSeqlens, CacheBatchIdx, CacheLeftpad, BlockTable, stride_table, cache_entries,
    Cos, Sin, stride_cos, seqlen_ro,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_knb, stride_knn, stride_knh, stride_vnb, stride_vnn, stride_vnh,
    stride_os, stride_ob, stride_om, stride_oh,
    stride_ls, stride_lb, stride_lh,
    seqlen_q, seqlen_new, capacity, cache_seqlen, num_splits,
    AlibiSlopes, stride_alibi_b, Sinks, RngState, score_scale, softcap_log2, window_left, window_right,
    dropout_threshold, dropout_scale,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, DIM_A: tl.constexpr,
    DIM_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARIANT: tl.constexpr,
    PRECISION: tl.constexpr, PAGE_SIZE: tl.constexpr, SEQLENS_PER_BATCH: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr, HAS_NEW: tl.constexpr, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    ROTATE_BY_ROW: tl.constexpr, SPLIT: tl.constexpr,
):
    """Rows of BLOCK_M (query, head) pairs of one KV head x one split of its keys (module
    docstring). Out / Lse are the output and lse, or with SPLIT the per-split buffers
    (splits, batch, seqlen_q, heads, dim) fp32 and (splits, batch, heads, seqlen_q). With HAS_NEW,
    KNew / VNew (batch, seqlen_new, heads_k, dim) are first written into the caches."""
    split = tl.program_id(0) % num_splits
    start_r = (tl.program_id(0) // num_splits) * BLOCK_M
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    cache_seqlen, cache_row = _sequence_start(CacheSeqlens, CacheBatchIdx, batch, cache_seqlen, capacity,
                                              cache_entries, SEQLENS_PER_BATCH, HAS_BATCH_IDX)
    seqlen_k = tl.minimum(cache_seqlen + seqlen_new, capacity)
    key_start = 0
    if HAS_LEFTPAD:
        key_start = tl.minimum(tl.maximum(tl.load(CacheLeftpad + batch), 0), seqlen_k)
    seqlen_k = seqlen_k - key_start  # keys [key_start, seqlen_k) seen as a sequence of their own

    rows = start_r + tl.arange(0, BLOCK_M)
    row_inside = rows < seqlen_q * GROUP_SIZE
    queries = rows // GROUP_SIZE
    heads = kv_head * GROUP_SIZE + rows % GROUP_SIZE
    score, dropout, sink_log2 = head_options(AlibiSlopes, stride_alibi_b, Sinks, RngState, score_scale, softcap_log2,
                                             dropout_threshold, batch, heads, tl.num_programs(1) * GROUP_SIZE, VARIANT)
    if ALIBI & VARIANT:  # one slope per row: broadcast against the key columns
        score = (score[0], score[1], score[2][:, None])

    q_rows = batch.to(tl.int64) * stride_qb + queries * stride_qm + heads * stride_qh
    positions = cache_seqlen + queries if ROTATE_BY_ROW else cache_seqlen + tl.zeros_like(queries)
    q_a = load_rotated_rows(Q, q_rows, row_inside, positions, Cos, Sin, stride_cos, seqlen_ro, 0, DIM_A, HEAD_DIM,
                            ROTARY_DIM, INTERLEAVED, PRECISION)
    if DIM_B > 0:
        q_b = load_rotated_rows(Q, q_rows, row_inside, positions, Cos, Sin, stride_cos, seqlen_ro, DIM_A, DIM_B,
                                HEAD_DIM, ROTARY_DIM, INTERLEAVED, PRECISION)
    else:
        q_b = tl.zeros([BLOCK_M, 16], dtype=q_a.dtype)

    # (with a block table cache_row is the batch entry: cache_batch_idx is refused there)
    k_base, v_base, k_source, v_source = kv_sources(
        K, V, cache_row, kv_head, key_start, tl.num_programs(1), seqlen_k, stride_kb, stride_kh, stride_kn, stride_vb,
        stride_vh, stride_vn, BlockTable, stride_table, cache_entries, BLOCK_N, HEAD_DIM, DIM_A, DIM_B, False, False,
        PAGE_SIZE)

    # This split's share of the visible key tiles, in three ranges: masked left edge, full, masked right edge
    window = (window_left, window_right)
    last_row = tl.minimum(start_r + BLOCK_M, seqlen_q * GROUP_SIZE) - 1
    lo, full_lo, full_hi, hi = rows_key_tile_ranges(start_r // GROUP_SIZE, last_row // GROUP_SIZE, seqlen_q,
                                                    seqlen_k, window, BLOCK_N, VARIANT)
    tiles_per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits)
    split_lo = lo + split * tiles_per_split * BLOCK_N
    split_hi = tl.minimum(split_lo + tiles_per_split * BLOCK_N, hi)

    if HAS_NEW:  # the new rows this program reads, and from split 0 of row block 0 all of them, into the caches
        first_new = cache_seqlen - key_start  # (a key index relative to key_start, as split_lo / split_hi)
        everything = (split == 0) & (start_r == 0)
        _write_new_rows(KNew, VNew, K, V, tl.where(everything, 0, tl.maximum(split_lo - first_new, 0)),
                        tl.where(everything, seqlen_new, tl.minimum(split_hi - first_new, seqlen_new)), cache_seqlen,
                        capacity, batch, kv_head, cache_row, BlockTable, stride_table, cache_entries, Cos, Sin,
                        stride_cos, seqlen_ro, (stride_knb, stride_knn, stride_knh, stride_vnb, stride_vnn, stride_vnh),
                        (stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh), HEAD_DIM, HEAD_DIM_PADDED,
                        ROTARY_DIM, INTERLEAVED, PAGE_SIZE, PRECISION)
        tl.debug_barrier()  # this program's writes before its reads
        if start_r >= seqlen_q * GROUP_SIZE:  # (seqlen_q = 0: a program that only writes)
            return

    diag = seqlen_k - seqlen_q
    acc_a = tl.zeros([BLOCK_M, DIM_A], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, DIM_B if DIM_B > 0 else 16], dtype=tl.float32)
    row_max, row_sum = row_start(sink_log2, score, BLOCK_M, VARIANT)
    if SINKS & VARIANT:  # the sink belongs to split 0 alone
        row_max = tl.where(split == 0, row_max, float("-inf"))
        row_sum = tl.where(split == 0, row_sum, 0.0)
    no_skip = (split_hi, 0)
    if MASK_LEFT & VARIANT:
        acc_a, acc_b, row_sum, row_max = forward_key_loop(
            acc_a, acc_b, row_sum, row_max, q_a, q_b, None, k_base, v_base, k_source, v_source, stride_kn, stride_vn,
            queries, split_lo, tl.minimum(split_hi, full_lo), no_skip, seqlen_k, diag, window, score, dropout,
            BLOCK_N, HEAD_DIM, DIM_A, DIM_B, True, VARIANT, PRECISION, False, False, PAGE_SIZE, False,
        )
    acc_a, acc_b, row_sum, row_max = forward_key_loop(
        acc_a, acc_b, row_sum, row_max, q_a, q_b, None, k_base, v_base, k_source, v_source, stride_kn, stride_vn,
        queries, tl.maximum(split_lo, full_lo), tl.minimum(split_hi, full_hi), no_skip, seqlen_k, diag, window, score,
        dropout, BLOCK_N, HEAD_DIM, DIM_A, DIM_B, False, VARIANT, PRECISION, False, False, PAGE_SIZE, False,
    )
    acc_a, acc_b, row_sum, row_max = forward_key_loop(
        acc_a, acc_b, row_sum, row_max, q_a, q_b, None, k_base, v_base, k_source, v_source, stride_kn, stride_vn,
        queries, tl.maximum(split_lo, full_hi), split_hi, no_skip, seqlen_k, diag, window, score, dropout,
        BLOCK_N, HEAD_DIM, DIM_A, DIM_B, True, VARIANT, PRECISION, False, False, PAGE_SIZE, False,
    )

    empty_row = row_sum == 0.0
    inv_sum = reciprocal(tl.where(empty_row, 1.0, row_sum), VARIANT)
    out_rows = split.to(tl.int64) * stride_os + batch.to(tl.int64) * stride_ob + queries * stride_om + heads * stride_oh
    store_rows(Out, acc_a * inv_sum[:, None], out_rows, row_inside, 0, DIM_A, HEAD_DIM, PRECISION)
    if DIM_B > 0:
        store_rows(Out, acc_b * inv_sum[:, None], out_rows, row_inside, DIM_A, DIM_B, HEAD_DIM, PRECISION)
    lse = row_lse(row_max, tl.where(empty_row, 1.0, row_sum), VARIANT)
    lse = tl.where(empty_row, float("-inf") if SPLIT else float("inf"), lse)
    lse_rows = split.to(tl.int64) * stride_ls + batch.to(tl.int64) * stride_lb + heads * stride_lh + queries
    tl.store(Lse + lse_rows, lse, mask=row_inside)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(OutSplits, LseSplits, Out, Lse, num_splits,
                  stride_ss, stride_sb, stride_sm, stride_sh, stride_ls, stride_lb, stride_lh,
                  stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Merge the splits of one (query row, head, batch entry) (module docstring), SPLIT_BLOCK
    splits per load: all of them in one round trip to memory where they fit."""
    query = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    cols = tl.arange(0, HEAD_DIM_PADDED)
    splits = tl.arange(0, SPLIT_BLOCK)
    out_base = OutSplits + batch * stride_sb + query * stride_sm + head * stride_sh
    lse_base = LseSplits + batch * stride_lb + head * stride_lh + query
    row_max = tl.full([1], float("-inf"), tl.float32)
    row_sum = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM_PADDED], dtype=tl.float32)
    for first in range(0, num_splits, SPLIT_BLOCK):
        inside = first + splits < num_splits
        lse = tl.load(lse_base + (first + splits).to(tl.int64) * stride_ls, mask=inside, other=float("-inf"))
        out = tl.load(out_base + (first + splits).to(tl.int64)[:, None] * stride_ss + cols[None, :],
                      mask=inside[:, None] & (cols < HEAD_DIM)[None, :], other=0.0)
        new_max = tl.maximum(row_max, tl.max(lse, 0))
        pivot = tl.where(new_max == float("-inf"), 0.0, new_max)
        alpha = tl.exp(row_max - pivot)
        weights = tl.exp(lse - pivot)
        row_sum = row_sum * alpha + tl.sum(weights, 0)
        acc = acc * alpha + tl.sum(weights[:, None] * out, 0)
        row_max = new_max
    empty_row = row_sum == 0.0
    if PRECISION == "ieee":  # fp32 (scores.FP32_EXACT): IEEE division, not div.full.f32's 2 ulp
        out = tl.math.div_rn(acc, tl.where(empty_row, 1.0, row_sum))
    else:
        out = acc / tl.where(empty_row, 1.0, row_sum)
    store_rows(Out + batch * stride_ob + query * stride_om + head * stride_oh, out[None, :], tl.zeros([1], tl.int64),
               tl.full([1], True, tl.int1), 0, HEAD_DIM_PADDED, HEAD_DIM, PRECISION)
    lse = tl.where(empty_row, float("inf"), row_max + tl.log(tl.where(empty_row, 1.0, row_sum)))
    tl.store(Lse + batch * stride_lse_b + head * stride_lse_h + query + tl.arange(0, 1), lse)


MIN_TILES_PER_SPLIT = 1


def num_splits_heuristic(programs: int, key_tiles: int, num_sms: int, per_sm: int = 1) -> int:
    """Splits for a launch of ``programs`` (row block, KV head, batch entry) programs over at most
    ``key_tiles`` key tiles each: none when they fill at least half of ``per_sm`` programs on each
    of the GPU's ``num_sms`` multiprocessors, else as many as make ``per_sm`` programs per
    multiprocessor, each keeping at least MIN_TILES_PER_SPLIT tiles, at most MAX_SPLITS. Measured
    on an H200 (docs/design.md#decode): on a contiguous cache one program per multiprocessor
    beats two or more, whose shorter splits pay the pipeline's fill and the merge more often, down
    to splits of a single tile (batch 1, 1k keys: 8 splits 12.2 us, 2 splits 14.4 us); on a
    paged cache two do (Triton pipelines a gathered tile one buffer deep, as its loads wait on the
    block table, so a second program hides the latency: batch 8 x 32k, page 16, 3.10 -> 4.36 TB/s)."""
    if 2 * programs > per_sm * num_sms or key_tiles < 2 * MIN_TILES_PER_SPLIT:
        return 1
    return max(1, min(per_sm * num_sms // programs, key_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


@dataclass(frozen=True)
class _DecodeSetup:
    """What one launch shape decides, once (``_decode_setup``): the decode kernel's config, its
    programs before splitting, the number of multiprocessors, and each kernel's grid and keywords."""

    config: TileConfig
    programs: int
    num_sms: int
    tl_launch: TlLaunch  # (launch.launch_fitting steps down from the config where it does not fit)
    decode: dict  # SPLIT -> keywords, with the config's
    merge: tuple  # (grid, keywords)


@configs.cleared_by_overrides
@functools.lru_cache(maxsize=1024)
def _decode_setup(device, dtype, batch, seqlen_q, num_heads, head_dim, heads_k, seqlen_new, page_size, variant,
                  rotate_by_row, seqlens_per_batch, has_batch_idx, has_leftpad, rotary_dim, interleaved,
                  interpreted) -> _DecodeSetup:
    if not interpreted:
        check_gpu_supports(device, dtype)
    precision = precision_mode(dtype, interpreted)
    per_batch = dict(SEQLENS_PER_BATCH=seqlens_per_batch, HAS_BATCH_IDX=has_batch_idx, PAGE_SIZE=page_size,
                     ROTARY_DIM=rotary_dim, INTERLEAVED=interleaved, PRECISION=precision)
    rows = seqlen_q * (num_heads // heads_k)
    config = decode_config(rows, head_dim, dtype, interpreted, GPU_CLASSES[0] if interpreted else
                           device_gpu_class(device))
    dim_a, dim_b = head_dim_chunks(head_dim)
    decode = {split: dict(GROUP_SIZE=num_heads // heads_k, HEAD_DIM=head_dim, HEAD_DIM_PADDED=_pow2(head_dim),
                          DIM_A=dim_a, DIM_B=dim_b, VARIANT=variant, HAS_LEFTPAD=has_leftpad, HAS_NEW=seqlen_new > 0,
                          ROTATE_BY_ROW=rotate_by_row, SPLIT=split, **per_batch, **config.launch_args())
              for split in (False, True)}
    merge = ((seqlen_q, num_heads, batch),
             dict(HEAD_DIM=head_dim, HEAD_DIM_PADDED=_pow2(head_dim), PRECISION=precision, num_warps=4))
    num_sms = 4 if interpreted else torch.cuda.get_device_properties(device).multi_processor_count
    tl_launch = fixed_tl_launch("decode", config, head_dim, dtype, variant, device)
    return _DecodeSetup(config, max(1, -(-rows // config.block_m)) * heads_k * batch, num_sms, tl_launch, decode,
                        merge)


@on_tensor_device
@replayed
def attention_with_kvcache(q, k_cache, v_cache, options: AttentionOptions, k_new=None, v_new=None, rotary_cos=None,
                           rotary_sin=None, cache_seqlens=None, cache_seqlen: int = 0, cache_batch_idx=None,
                           cache_leftpad=None, block_table=None, rotary_interleaved: bool = True, num_splits: int = 0,
                           wrap_kernel=identity_wrap):
    """flash_attn_with_kvcache's computation (module docstring); returns (out, lse).

    q (batch, seqlen_q, heads, dim); k_cache, v_cache (batch_cache, capacity, heads_k, dim), or
    paged (pages, page_size, heads_k, dim) with ``block_table`` int32 (batch, pages_per_sequence);
    k_new, v_new (batch, seqlen_new, heads_k, dim) or None, written into the caches in place.
    Keys already cached: ``cache_seqlens`` int32 (batch,), else the int ``cache_seqlen`` for every
    sequence. rotary_cos/sin (seqlen_ro, rotary_dim / 2) or None. num_splits: 0 = heuristic.
    out like q; lse fp32 (batch, heads, seqlen_q). Inputs are assumed validated.

    Host time matters here as much as the kernels' (a decode step's kernels take microseconds):
    what depends only on the shapes and options is decided once per shape (``_decode_setup``) and the
    kernels launch through direct_launch.launcher.
    """
    q = last_dim_contiguous(q)
    batch, seqlen_q, num_heads, head_dim = q.shape
    heads_k = k_cache.shape[2]
    page_size = k_cache.shape[1] if block_table is not None else 0
    capacity = block_table.shape[1] * page_size if page_size else k_cache.shape[1]
    seqlen_new = k_new.shape[1] if k_new is not None else 0
    rotary_dim = 2 * rotary_cos.shape[1] if rotary_cos is not None else 0
    interpreted = is_interpreted(_decode_kernel)
    device = q.device
    # (int(): symbolic sizes under torch.compile's dynamic shapes are specialised here)
    setup = _decode_setup(device, q.dtype, int(batch), int(seqlen_q), int(num_heads), int(head_dim), int(heads_k),
                          int(seqlen_new), int(page_size),
                          kernel_variant(options, q.dtype, interpreted), options.mask_kind != "none",
                          cache_seqlens is not None, cache_batch_idx is not None, cache_leftpad is not None,
                          rotary_dim, bool(rotary_interleaved), interpreted)
    stand_in = q
    if rotary_dim:
        rotary_cos, rotary_sin = rotary_cos.contiguous(), rotary_sin.contiguous()
        rotary_args = (rotary_cos, rotary_sin, rotary_cos.stride(0), rotary_cos.shape[0])
    else:
        rotary_args = (stand_in, stand_in, 0, 0)
    table_args = (block_table, block_table.stride(0), k_cache.shape[0]) if page_size else (stand_in, 0,
                                                                                          k_cache.shape[0])
    seqlens_arg = cache_seqlens if cache_seqlens is not None else stand_in
    batch_idx_arg = cache_batch_idx if cache_batch_idx is not None else stand_in
    k_strides, v_strides = k_cache.stride()[:3], v_cache.stride()[:3]

    if seqlen_new > 0:
        k_new, v_new = last_dim_contiguous(k_new), last_dim_contiguous(v_new)
        new_args = (k_new, v_new), (*k_new.stride()[:3], *v_new.stride()[:3])
    else:
        new_args = (stand_in, stand_in), (0,) * 6

    out = torch.empty_like(q)
    lse = torch.empty((batch, num_heads, seqlen_q), dtype=torch.float32, device=device)
    if batch == 0 or (out.numel() == 0 and seqlen_new == 0):
        return out, lse
    if seqlen_q == 0:  # (a launch that only appends)
        num_splits = 1
    elif num_splits == 0:
        longest = capacity if cache_seqlens is not None else min(capacity, cache_seqlen + seqlen_new)
        num_splits = num_splits_heuristic(setup.programs, cdiv(longest, setup.config.block_n), setup.num_sms,
                                          2 if page_size else 1)
    split = num_splits > 1
    if split:
        out_splits = torch.empty((num_splits, batch, seqlen_q, num_heads, head_dim), dtype=torch.float32,
                                 device=device)
        lse_splits = torch.empty((num_splits, batch, num_heads, seqlen_q), dtype=torch.float32, device=device)
        targets = (out_splits, lse_splits, *out_splits.stride()[:4], *lse_splits.stride()[:3])
    else:
        targets = (out, lse, 0, *out.stride()[:3], 0, *lse.stride()[:2])
    rows = seqlen_q * (num_heads // heads_k)

    def launch(config, specialized):
        keywords = setup.decode[split] if config is setup.config else {**setup.decode[split], **config.launch_args()}
        launcher(_decode_kernel, wrap_kernel)[(max(1, cdiv(rows, config.block_m)) * num_splits, heads_k, batch)](
            q, k_cache, v_cache, *new_args[0], targets[0], targets[1], seqlens_arg, batch_idx_arg,
            cache_leftpad if cache_leftpad is not None else stand_in, *table_args, *rotary_args,
            *q.stride()[:3], *k_strides, *v_strides, *new_args[1], *targets[2:],
            seqlen_q, seqlen_new, capacity, cache_seqlen, num_splits, *options.kernel_args(q), **keywords,
        )

    launch_fitting(refitted(setup.tl_launch), launch)
    if split:
        grid, keywords = setup.merge
        launcher(_merge_kernel, wrap_kernel)[grid](
            out_splits, lse_splits, out, lse, num_splits, *out_splits.stride()[:4], *lse_splits.stride()[:3],
            *out.stride()[:3], *lse.stride()[:2], SPLIT_BLOCK=min(_pow2(num_splits), MERGE_ELEMENTS // _pow2(head_dim)),
            **keywords,
        )
    return out, lse
