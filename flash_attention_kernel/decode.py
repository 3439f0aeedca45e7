"""Attention over a KV cache (flash_attn_with_kvcache): append, split-KV attention, merge.

Inference reads a long cache with few queries (decode: one token; speculative decoding and
chunked prefill: a few to a few hundred). Three kernels, launched in order on one stream:

1. ``_append_kernel`` (only with new keys and values): writes them into the cache at each
   sequence's ``cache_seqlens`` (contiguous, with ``cache_batch_idx`` choosing the cache row, or
   paged through the block table), the keys rotated first when rotary tables are given. Rows that
   would land past the cache's capacity are dropped on the device: a bad ``cache_seqlens`` never
   writes out of bounds.
2. ``_decode_kernel``: the forward pass of forward.py, with two changes.
   * GQA packing. A program owns one KV head, and its BLOCK_M rows are (query row, query head)
     pairs of every query head sharing that KV head, row r holding query i = r // GROUP_SIZE of
     head kv_head * GROUP_SIZE + r % GROUP_SIZE. K and V are read once per KV head instead of
     once per query head, and a decode step's 1 x GROUP_SIZE rows fill a tensor-core tile.
   * Split-KV (flash-decoding). With NUM_SPLITS > 1 the visible key tiles of each block of rows
     are cut into NUM_SPLITS contiguous ranges, one program each (grid axis 0 = row block x
     split), so that a batch with few KV heads still fills the GPU. Each split stores its output
     normalised by its own row sum, in fp32, and its logsumexp (-inf where it saw nothing).
   Queries are rotated as they are loaded (rotary.load_rotated_rows) at cache_seqlens + i with a
   causal mask or a window, else all at cache_seqlens, as flash-attn does. Masks, softcap, ALiBi
   and sinks come from scores.py as in the forward kernel; causal masks and windows are aligned to
   each sequence's end, seqlen_k = cache_seqlens + seqlen_new. ``cache_leftpad`` moves the start
   of a sequence's keys: the kernel sees keys [leftpad, seqlen_k) as a sequence of their own
   (absolute and relative positions give the same masks and biases).
3. ``_merge_kernel`` (NUM_SPLITS > 1): out = sum_s w_s out_s / sum_s w_s, w_s = exp(lse_s - max),
   lse = max + log(sum_s w_s), in split order, so a given split count is bitwise repeatable. A
   sink joins split 0's row start, hence every row's denominator exactly once.

A row that sees no key gets out 0 and lse +inf (with a sink: lse = sink), as in the forward.
"""

import torch
import triton
import triton.language as tl

from .configs import GPU_CLASSES, decode_config, head_dim_chunks
from .forward import forward_key_loop
from .launch import (
    check_gpu_supports, device_gpu_class, fixed_launch_plan, identity_wrap, is_interpreted, kernel_variant,
    last_dim_contiguous, launch_fitting, precision_mode,
)
from .options import AttentionOptions
from .rotary import load_rotated_rows
from .scores import ALIBI, MASK_LEFT, SINKS, head_options, row_start, rows_key_tile_ranges
from .tiles import store_rows

LN2 = tl.constexpr(0.6931471805599453)
MAX_SPLITS = 128


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
def _sequence_start(CacheSeqlens, CacheBatchIdx, batch, cache_seqlen, cache_entries,
                    SEQLENS_PER_BATCH: tl.constexpr, HAS_BATCH_IDX: tl.constexpr):
    """(keys already in the cache, cache row) of batch entry ``batch``; a cache_batch_idx entry is
    clamped into the cache's ``cache_entries`` rows."""
    if SEQLENS_PER_BATCH:
        cache_seqlen = tl.load(CacheSeqlens + batch)
    cache_row = batch
    if HAS_BATCH_IDX:
        cache_row = tl.minimum(tl.maximum(tl.load(CacheBatchIdx + batch), 0), cache_entries - 1)
    return cache_seqlen, cache_row


@triton.jit(do_not_specialize=["seqlen_new", "capacity", "cache_seqlen"])
def _append_kernel(
    KNew, VNew, KCache, VCache, CacheSeqlens, CacheBatchIdx, BlockTable, stride_table, cache_entries,
    Cos, Sin, stride_cos, seqlen_ro,
    stride_knb, stride_knn, stride_knh, stride_vnb, stride_vnn, stride_vnh,
    stride_kcb, stride_kcn, stride_kch, stride_vcb, stride_vcn, stride_vch,
    seqlen_new, capacity, cache_seqlen,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    SEQLENS_PER_BATCH: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, PAGE_SIZE: tl.constexpr,
    ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, PRECISION: tl.constexpr,
):
    """Rows [BLOCK_ROWS x program 0, ...) of the new keys and values of one (KV head, batch entry)
    into the cache, at cache_seqlens + row; rows at or past ``capacity`` are dropped."""
    head = tl.program_id(1)
    batch = tl.program_id(2)
    cache_seqlen, cache_row = _sequence_start(CacheSeqlens, CacheBatchIdx, batch, cache_seqlen, cache_entries,
                                              SEQLENS_PER_BATCH, HAS_BATCH_IDX)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    positions = cache_seqlen + rows
    inside = (rows < seqlen_new) & (positions < capacity) & (positions >= 0)
    k_rows = batch.to(tl.int64) * stride_knb + head * stride_knh + rows.to(tl.int64) * stride_knn
    v_rows = batch.to(tl.int64) * stride_vnb + head * stride_vnh + rows.to(tl.int64) * stride_vnn
    k = load_rotated_rows(KNew, k_rows, inside, positions, Cos, Sin, stride_cos, seqlen_ro, 0, HEAD_DIM_PADDED,
                          HEAD_DIM, ROTARY_DIM, INTERLEAVED, PRECISION)
    v = load_rotated_rows(VNew, v_rows, inside, positions, Cos, Sin, stride_cos, seqlen_ro, 0, HEAD_DIM_PADDED,
                          HEAD_DIM, 0, INTERLEAVED, PRECISION)
    k_cache = _cache_rows(positions, inside, batch, cache_row, BlockTable, stride_table, cache_entries, stride_kcb,
                          stride_kcn, PAGE_SIZE) + head * stride_kch
    v_cache = _cache_rows(positions, inside, batch, cache_row, BlockTable, stride_table, cache_entries, stride_vcb,
                          stride_vcn, PAGE_SIZE) + head * stride_vch
    store_rows(KCache, k, k_cache, inside, 0, HEAD_DIM_PADDED, HEAD_DIM, PRECISION)
    store_rows(VCache, v, v_cache, inside, 0, HEAD_DIM_PADDED, HEAD_DIM, PRECISION)


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_new", "capacity", "cache_seqlen", "num_splits"])
def _decode_kernel(
    Q, K, V, Out, Lse, CacheSeqlens, CacheBatchIdx, CacheLeftpad, BlockTable, stride_table, cache_entries,
    Cos, Sin, stride_cos, seqlen_ro,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_os, stride_ob, stride_om, stride_oh,
    stride_ls, stride_lb, stride_lh,
    seqlen_q, seqlen_new, capacity, cache_seqlen, num_splits,
    AlibiSlopes, stride_alibi_b, Sinks, RngState, score_scale, softcap_log2, window_left, window_right,
    dropout_threshold, dropout_scale,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_A: tl.constexpr, DIM_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARIANT: tl.constexpr, PRECISION: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SEQLENS_PER_BATCH: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, ROTATE_BY_ROW: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Rows of BLOCK_M (query, head) pairs of one KV head x one split of its keys (module
    docstring). Out / Lse are the output and lse, or with SPLIT the per-split buffers
    (splits, batch, seqlen_q, heads, dim) fp32 and (splits, batch, heads, seqlen_q)."""
    split = tl.program_id(0) % num_splits
    start_r = (tl.program_id(0) // num_splits) * BLOCK_M
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    cache_seqlen, cache_row = _sequence_start(CacheSeqlens, CacheBatchIdx, batch, cache_seqlen, cache_entries,
                                              SEQLENS_PER_BATCH, HAS_BATCH_IDX)
    seqlen_k = tl.minimum(tl.maximum(cache_seqlen + seqlen_new, 0), capacity)
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

    if PAGE_SIZE > 0:  # rows found through the block table (tiles.load_kv_tile)
        k_base = K + kv_head.to(tl.int64) * stride_kh
        v_base = V + kv_head.to(tl.int64) * stride_vh
        table_row = BlockTable + batch.to(tl.int64) * stride_table
        k_source = (table_row, stride_kb, cache_entries)
        v_source = (table_row, stride_vb, cache_entries)
    else:
        k_base = K + cache_row.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh + key_start * stride_kn
        v_base = V + cache_row.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh + key_start * stride_vn
        k_source = k_base
        v_source = v_base

    # This split's share of the visible key tiles, in three ranges: masked left edge, full, masked right edge
    window = (window_left, window_right)
    last_row = tl.minimum(start_r + BLOCK_M, seqlen_q * GROUP_SIZE) - 1
    lo, full_lo, full_hi, hi = rows_key_tile_ranges(start_r // GROUP_SIZE, last_row // GROUP_SIZE, seqlen_q,
                                                    seqlen_k, window, BLOCK_N, VARIANT)
    tiles_per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits)
    split_lo = lo + split * tiles_per_split * BLOCK_N
    split_hi = tl.minimum(split_lo + tiles_per_split * BLOCK_N, hi)

    diag = seqlen_k - seqlen_q
    acc_a = tl.zeros([BLOCK_M, DIM_A], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, DIM_B if DIM_B > 0 else 16], dtype=tl.float32)
    row_max, row_sum = row_start(sink_log2, BLOCK_M, VARIANT)
    if SINKS & VARIANT:  # the sink belongs to split 0 alone
        row_max = tl.where(split == 0, row_max, float("-inf"))
        row_sum = tl.where(split == 0, row_sum, 0.0)
    no_skip = (split_hi, 0)
    if MASK_LEFT & VARIANT:
        acc_a, acc_b, row_sum, row_max = forward_key_loop(
            acc_a, acc_b, row_sum, row_max, q_a, q_b, k_base, v_base, k_source, v_source, stride_kn, stride_vn,
            queries, split_lo, tl.minimum(split_hi, full_lo), no_skip, seqlen_k, diag, window, score, dropout,
            BLOCK_N, HEAD_DIM, DIM_A, DIM_B, True, VARIANT, PRECISION, False, False, PAGE_SIZE,
        )
    acc_a, acc_b, row_sum, row_max = forward_key_loop(
        acc_a, acc_b, row_sum, row_max, q_a, q_b, k_base, v_base, k_source, v_source, stride_kn, stride_vn,
        queries, tl.maximum(split_lo, full_lo), tl.minimum(split_hi, full_hi), no_skip, seqlen_k, diag, window, score,
        dropout, BLOCK_N, HEAD_DIM, DIM_A, DIM_B, False, VARIANT, PRECISION, False, False, PAGE_SIZE,
    )
    acc_a, acc_b, row_sum, row_max = forward_key_loop(
        acc_a, acc_b, row_sum, row_max, q_a, q_b, k_base, v_base, k_source, v_source, stride_kn, stride_vn,
        queries, tl.maximum(split_lo, full_hi), split_hi, no_skip, seqlen_k, diag, window, score, dropout,
        BLOCK_N, HEAD_DIM, DIM_A, DIM_B, True, VARIANT, PRECISION, False, False, PAGE_SIZE,
    )

    empty_row = row_sum == 0.0
    inv_sum = 1.0 / tl.where(empty_row, 1.0, row_sum)
    out_rows = split.to(tl.int64) * stride_os + batch.to(tl.int64) * stride_ob + queries * stride_om + heads * stride_oh
    store_rows(Out, acc_a * inv_sum[:, None], out_rows, row_inside, 0, DIM_A, HEAD_DIM, PRECISION)
    if DIM_B > 0:
        store_rows(Out, acc_b * inv_sum[:, None], out_rows, row_inside, DIM_A, DIM_B, HEAD_DIM, PRECISION)
    lse = (row_max + tl.log2(tl.where(empty_row, 1.0, row_sum))) * LN2
    lse = tl.where(empty_row, float("-inf") if SPLIT else float("inf"), lse)
    lse_rows = split.to(tl.int64) * stride_ls + batch.to(tl.int64) * stride_lb + heads * stride_lh + queries
    tl.store(Lse + lse_rows, lse, mask=row_inside)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(OutSplits, LseSplits, Out, Lse, num_heads, num_splits,
                  stride_ss, stride_sb, stride_sm, stride_sh, stride_ls, stride_lb, stride_lh,
                  stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_H: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Merge the splits of query row program 0, heads [BLOCK_H x program 1, ...), batch program 2
    (module docstring)."""
    query = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    batch = tl.program_id(2).to(tl.int64)
    head_inside = heads < num_heads
    cols = tl.arange(0, HEAD_DIM_PADDED)
    mask = head_inside[:, None] & (cols < HEAD_DIM)[None, :]
    split_rows = batch * stride_sb + query * stride_sm + heads * stride_sh
    lse_rows = batch * stride_lb + heads * stride_lh + query
    row_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_PADDED], dtype=tl.float32)
    for split in range(num_splits):
        split_offset = tl.cast(split, tl.int64)
        lse = tl.load(LseSplits + split_offset * stride_ls + lse_rows, mask=head_inside, other=float("-inf"))
        out = tl.load(OutSplits + split_offset * stride_ss + split_rows[:, None] + cols[None, :], mask=mask, other=0.0)
        new_max = tl.maximum(row_max, lse)
        pivot = tl.where(new_max == float("-inf"), 0.0, new_max)
        alpha = tl.exp(row_max - pivot)
        weight = tl.exp(lse - pivot)
        row_sum = row_sum * alpha + weight
        acc = acc * alpha[:, None] + weight[:, None] * out
        row_max = new_max
    empty_row = row_sum == 0.0
    out = acc / tl.where(empty_row, 1.0, row_sum)[:, None]
    out_rows = batch * stride_ob + query * stride_om + heads * stride_oh
    store_rows(Out, out, out_rows, head_inside, 0, HEAD_DIM_PADDED, HEAD_DIM, PRECISION)
    lse = tl.where(empty_row, float("inf"), row_max + tl.log(tl.where(empty_row, 1.0, row_sum)))
    tl.store(Lse + batch * stride_lse_b + heads * stride_lse_h + query, lse, mask=head_inside)


def num_splits_heuristic(programs: int, key_tiles: int, num_sms: int) -> int:
    """Splits for a launch of ``programs`` (row block, KV head, batch entry) programs over at most
    ``key_tiles`` key tiles each: none when they already fill the GPU's ``num_sms``
    multiprocessors, else enough for about two programs per multiprocessor, each keeping at least
    MIN_TILES_PER_SPLIT tiles (fewer, longer splits read the cache at a better rate and merge
    less), at most MAX_SPLITS."""
    if programs >= num_sms or key_tiles < 2 * MIN_TILES_PER_SPLIT:
        return 1
    wanted = triton.cdiv(2 * num_sms, programs)
    return max(1, min(wanted, key_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))


MIN_TILES_PER_SPLIT = 4


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
    """
    q = last_dim_contiguous(q)
    batch, seqlen_q, num_heads, head_dim = q.shape
    heads_k = k_cache.shape[2]
    page_size = k_cache.shape[1] if block_table is not None else 0
    capacity = block_table.shape[1] * page_size if page_size else k_cache.shape[1]
    seqlen_new = k_new.shape[1] if k_new is not None else 0
    rotary_dim = 2 * rotary_cos.shape[1] if rotary_cos is not None else 0
    if rotary_dim:
        rotary_cos, rotary_sin = rotary_cos.contiguous(), rotary_sin.contiguous()
    interpreted = is_interpreted(_decode_kernel)
    if not interpreted:
        check_gpu_supports(q.device, q.dtype)
    precision = precision_mode(q.dtype, interpreted)
    stand_in = q
    table_args = (block_table if page_size else stand_in, block_table.stride(0) if page_size else 0, k_cache.shape[0])
    rotary_args = (rotary_cos, rotary_sin, rotary_cos.stride(0), rotary_cos.shape[0]) if rotary_dim else (
        stand_in, stand_in, 0, 0)
    seqlens_arg = cache_seqlens if cache_seqlens is not None else stand_in
    batch_idx_arg = cache_batch_idx if cache_batch_idx is not None else stand_in
    per_batch = dict(SEQLENS_PER_BATCH=cache_seqlens is not None, HAS_BATCH_IDX=cache_batch_idx is not None,
                     PAGE_SIZE=page_size, ROTARY_DIM=rotary_dim, INTERLEAVED=bool(rotary_interleaved),
                     PRECISION=precision)

    if seqlen_new > 0:
        k_new, v_new = last_dim_contiguous(k_new), last_dim_contiguous(v_new)
        block_rows = min(16, triton.next_power_of_2(seqlen_new))
        wrap_kernel(_append_kernel)[(triton.cdiv(seqlen_new, block_rows), heads_k, batch)](
            k_new, v_new, k_cache, v_cache, seqlens_arg, batch_idx_arg, *table_args, *rotary_args,
            k_new.stride(0), k_new.stride(1), k_new.stride(2), v_new.stride(0), v_new.stride(1), v_new.stride(2),
            *_cache_strides(k_cache), *_cache_strides(v_cache), seqlen_new, capacity, cache_seqlen,
            HEAD_DIM=head_dim, HEAD_DIM_PADDED=triton.next_power_of_2(head_dim), BLOCK_ROWS=block_rows, **per_batch,
            num_warps=4,
        )

    out = torch.empty_like(q)
    lse = torch.empty((batch, num_heads, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    group = num_heads // heads_k
    rows = seqlen_q * group
    config = decode_config(rows, head_dim, q.dtype, interpreted,
                           GPU_CLASSES[0] if interpreted else device_gpu_class(q.device))
    row_blocks = triton.cdiv(rows, config.block_m)
    if num_splits == 0:
        key_tiles = triton.cdiv(min(capacity, cache_seqlen + seqlen_new) if cache_seqlens is None else capacity,
                                config.block_n)
        num_splits = num_splits_heuristic(row_blocks * heads_k * batch, key_tiles, _sm_count(q.device, interpreted))
    split = num_splits > 1
    if split:
        out_splits = torch.empty((num_splits, batch, seqlen_q, num_heads, head_dim), dtype=torch.float32,
                                 device=q.device)
        lse_splits = torch.empty((num_splits, batch, num_heads, seqlen_q), dtype=torch.float32, device=q.device)
        targets = (out_splits, lse_splits, *out_splits.stride()[:4], *lse_splits.stride()[:3])
    else:
        targets = (out, lse, 0, *out.stride()[:3], 0, *lse.stride()[:2])
    dim_a, dim_b = head_dim_chunks(head_dim)
    plan = fixed_launch_plan("decode", config, head_dim, q.dtype, options, q.device)

    def launch(config, specialized):
        grid = (triton.cdiv(rows, config.block_m) * num_splits, heads_k, batch)
        wrap_kernel(_decode_kernel)[grid](
            q, k_cache, v_cache, targets[0], targets[1], seqlens_arg, batch_idx_arg,
            cache_leftpad if cache_leftpad is not None else stand_in, *table_args, *rotary_args,
            q.stride(0), q.stride(1), q.stride(2), *_cache_strides(k_cache), *_cache_strides(v_cache), *targets[2:],
            seqlen_q, seqlen_new, capacity, cache_seqlen, num_splits, *options.kernel_args(q),
            GROUP_SIZE=group, HEAD_DIM=head_dim, DIM_A=dim_a, DIM_B=dim_b,
            VARIANT=kernel_variant(options, q.dtype, interpreted), HAS_LEFTPAD=cache_leftpad is not None,
            ROTATE_BY_ROW=options.mask_kind != "none", SPLIT=split, **per_batch,
            **config.launch_args(),
        )

    launch_fitting(plan, launch)
    if split:
        block_h = min(triton.next_power_of_2(num_heads), 16)
        wrap_kernel(_merge_kernel)[(seqlen_q, triton.cdiv(num_heads, block_h), batch)](
            out_splits, lse_splits, out, lse, num_heads, num_splits, *out_splits.stride()[:4],
            *lse_splits.stride()[:3], *out.stride()[:3], *lse.stride()[:2],
            HEAD_DIM=head_dim, HEAD_DIM_PADDED=triton.next_power_of_2(head_dim), BLOCK_H=block_h, PRECISION=precision,
            num_warps=4,
        )
    return out, lse


def _cache_strides(cache: torch.Tensor) -> tuple:
    """(entry or page, row, head) strides of a cache (batch_cache or pages, rows, heads, dim)."""
    return cache.stride(0), cache.stride(1), cache.stride(2)


def _sm_count(device: torch.device, interpreted: bool) -> int:
    if interpreted or device.type != "cuda":
        return 4
    return _SM_COUNTS.setdefault(device, torch.cuda.get_device_properties(device).multi_processor_count)


_SM_COUNTS: dict = {}
