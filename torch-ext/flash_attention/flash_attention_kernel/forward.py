"""Forward pass: the FlashAttention-2 algorithm with an online softmax.

One program owns BLOCK_M query rows of one (batch, head) and streams the keys and values of the
matching KV head in BLOCK_N tiles, never materialising the (seqlen_q, seqlen_k) score matrix:

    S    = (Q K_j^T) * softmax_scale * log2(e)      fp32, scaled after the dot (not pre-scaled Q)
    m'   = max(m, rowmax(S))                        running row max, base 2
    P    = exp2(S - m'),   alpha = exp2(m - m')
    l    = l * alpha + rowsum(P)                    running row sum
    acc  = acc * alpha + P V_j
    O    = acc / l,        lse = (m + log2(l)) * ln(2)   natural-log logsumexp, as flash-attn returns

fp32 inputs keep S, m and the lse in natural units and take P = exp2((S - m') * log2(e)), so that
the base-2 factor's rounding scales S - m' only (scores.FP32_EXACT).

S comes from ``scores.logits``, which applies the options (softcap, ALiBi, the window and causal
masks). A softcap bounds S, so there (scores.FIXED_PIVOT) m is a constant and alpha is 1: no row
max, no rescaling. With attention sinks the running max and sum start from the sink's logit instead
of (-inf, 0), and with dropout P is masked after it enters the row sum, the 1 / (1 - p) scale
joining the final 1 / l. Key tiles come in the three ranges of ``scores.key_tile_ranges``: tiles
crossing the window's left edge (masked), tiles every row of the block sees in full (no mask), and
tiles crossing the causal diagonal, the window's right edge or the ragged sequence end (masked);
tiles outside the band are never visited. A window's kernel runs its full tiles first and then both
masked ranges in one loop, which saves a pipeline fill and drain per program; other kernels run the
full range, then the masked one.

On Hopper, dense calls with full tiles (bf16/fp16, head dim 64, 80, 96 or 128, any options) take the
Gluon kernel ``hopper_forward`` instead (``planner.plan_forward``): the same math with warp roles and
FlashAttention-3's overlap of each tile's softmax with the previous tile's P V product. On
mma.sync (the A100 and RTX classes) Triton holds the query tile in registers across the key loop;
a config's ``q_per_tile`` reads it again for each key tile instead (Q_PER_TILE), which the
non-causal d64 entry does (configs.py, docs/design.md#config-rules).

Dense and variable-length batches share the kernel: with IS_VARLEN a program reads its sequence's
first row and length from cu_seqlens, and programs past the end of a shorter sequence exit at once
(the grid is sized for the longest).

A row that sees no key (bottom-right causal with seqlen_q > seqlen_k, a window, or
seqlen_k == 0) keeps m = -inf and l = 0. The masked loops then use 0 as their exp2 pivot, so no
(-inf) - (-inf) NaN appears, and the row ends with O = 0 and lse = +inf, which makes every
backward probability exp(s - lse) exactly 0. With a sink such a row ends with O = 0, lse = sink.
"""

import torch
import triton
import triton.language as tl

from .configs import head_dim_chunks
from .direct_launch import launcher
from .launch import (
    SequenceLayout, cdiv, ensure_scratch_allocator, identity_wrap, is_interpreted, kernel_variant, last_dim_contiguous,
    launch_fitting, on_tensor_device, precision_mode,
)
from .options import AttentionOptions
from .planner import plan_forward
from .replay import replayed
from .scores import (
    DROPOUT, FIXED_PIVOT, FP32_EXACT, LN2, MASK_LEFT, dropout_keep, exp_logits, head_options, key_tile_ranges,
    logit_unit, logits, query_tile_start, row_start,
)
from .tiles import kv_sources, load_kv_tile, load_tile_from, mma, mma_into_head, mma_over_head, round_to, \
    sequence_span, slice_descriptors, store_tile, tile_base



@triton.jit
def reciprocal(row_sum, VARIANT: tl.constexpr):
    """1 / row_sum, which normalises a row's output: under FP32_EXACT by IEEE division (div.rn,
    half an ulp); else the compiled default, div.full.f32 (2 ulp), far below a 2-byte output's
    rounding."""
    if FP32_EXACT & VARIANT:
        return tl.math.div_rn(1.0, row_sum)
    else:
        return 1.0 / row_sum


@triton.jit
def row_lse(row_max, row_sum, VARIANT: tl.constexpr):
    """Natural-log logsumexp of rows with row_sum > 0, from their running max in logit units:
    (row_max + log2(row_sum)) * ln 2, or under FP32_EXACT, where row_max is natural,
    row_max + log2(row_sum) * ln 2 (one fused multiply-add)."""
    if FP32_EXACT & VARIANT:
        return tl.fma(tl.log2(row_sum), LN2, row_max)
    else:
        return (row_max + tl.log2(row_sum)) * LN2


@triton.jit
def forward_key_loop(
    acc_a, acc_b, row_sum, row_max, q_a, q_b, q_source,
    k_base, v_base, k_descs, v_descs, stride_kn, stride_vn,
    offs_m, kv_start, kv_end, skip, seqlen_k, diag, window, score, dropout,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_A: tl.constexpr, DIM_B: tl.constexpr,
    MASKED: tl.constexpr, VARIANT: tl.constexpr, PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PAGE_SIZE: tl.constexpr, Q_PER_TILE: tl.constexpr,
):
    """Accumulate key tiles [kv_start, kv_end) into one query tile's output and row statistics.
    A window's masked loop (MASK_LEFT and MASKED) visits both band edges: ``skip`` = (from, by)
    moves the tiles from key ``from`` on by ``by`` keys, over the full tiles between the edges.
    Q is the query tile (q_a, q_b) held across the loop, or with Q_PER_TILE read again for each
    key tile from ``q_source`` (``load_tile_from``'s descriptors, base, first row, row stride and
    row count), which the pipeline stages through shared memory beside K and V."""
    offs_n = tl.arange(0, BLOCK_N)
    for tile_start in tl.range(kv_start, kv_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tile_start
        if (MASK_LEFT & VARIANT) and MASKED:
            start_n = tl.where(tile_start >= skip[0], tile_start + skip[1], tile_start)
        if Q_PER_TILE:
            tile_q_a, tile_q_b = load_tile_from(*q_source, offs_m.shape[0], HEAD_DIM, DIM_A, DIM_B, True, USE_TMA)
        else:
            tile_q_a, tile_q_b = q_a, q_b
        k_a, k_b = load_kv_tile(k_descs, k_base, start_n, stride_kn, seqlen_k, BLOCK_N, HEAD_DIM, DIM_A, DIM_B,
                                MASKED, USE_TMA, PAGE_SIZE)
        qk = mma_over_head(tile_q_a, tile_q_b, k_a, k_b, DIM_B, PRECISION)
        cols = (start_n + offs_n)[None, :]
        s, _ = logits(qk, offs_m[:, None], cols, seqlen_k, diag, window, score, MASKED, VARIANT)
        unit = logit_unit(score, VARIANT)
        if FIXED_PIVOT & VARIANT:  # bounded logits: row_max is a constant pivot, nothing to rescale
            p = tl.exp2(s * unit - row_max[:, None])
            row_sum = row_sum + tl.sum(p, 1)
        else:
            new_max = tl.maximum(row_max, tl.max(s, 1) * unit)
            if MASKED:
                pivot = tl.where(new_max == float("-inf"), 0.0, new_max)
            else:
                pivot = new_max
            p = exp_logits(s * unit - pivot[:, None], VARIANT)
            alpha = exp_logits(row_max - pivot, VARIANT)
            row_sum = row_sum * alpha + tl.sum(p, 1)
        if DROPOUT & VARIANT:
            p = tl.where(dropout_keep(offs_m, start_n, dropout, BLOCK_N, False, VARIANT), p, 0.0)
        v_a, v_b = load_kv_tile(v_descs, v_base, start_n, stride_vn, seqlen_k, BLOCK_N, HEAD_DIM, DIM_A, DIM_B,
                                MASKED, USE_TMA, PAGE_SIZE)
        if not (FIXED_PIVOT & VARIANT):
            acc_a = acc_a * alpha[:, None]
            if DIM_B > 0:
                acc_b = acc_b * alpha[:, None]
            row_max = new_max
        if DIM_B > 0:
            acc_a, acc_b = mma_into_head(p, v_a, v_b, acc_a, acc_b, DIM_B, PRECISION)
        else:  # acc_b must not be a loop variable here: warp specialisation fails on one left unchanged
            acc_a = mma(round_to(p, v_a.dtype, PRECISION), v_a, acc_a, PRECISION)
    return acc_a, acc_b, row_sum, row_max


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "total_q", "total_k"])
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, CuSeqlensQ, CuSeqlensK, total_q, total_k, BlockTable, stride_table, num_pages,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_lse_b, stride_lse_h,
    seqlen_q, seqlen_k,
    AlibiSlopes, stride_alibi_b, Sinks, RngState, score_scale, softcap_log2, window_left, window_right,
    dropout_threshold, dropout_scale,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_A: tl.constexpr, DIM_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARIANT: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PAGE_SIZE: tl.constexpr, Q_PER_TILE: tl.constexpr,
):
    """PAGE_SIZE > 0: K and V are paged caches (pages, PAGE_SIZE, heads_k, head_dim), stride_kb and
    stride_vb their page strides, sequence b's key rows listed by row b of BlockTable (varlen), its
    key count capped at seqlen_k (max_seqlen_k, which the table's columns cover). total_q /
    total_k: the rows of varlen Q / K that cu_seqlens may address (tiles.sequence_span)."""
    start_m = query_tile_start(BLOCK_M, VARIANT)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    q_first, seqlen_q = sequence_span(batch, CuSeqlensQ, seqlen_q, total_q, IS_VARLEN)
    if IS_VARLEN:
        if start_m >= seqlen_q:  # the grid covers the longest sequence
            return
    k_first, sequence_k = sequence_span(batch, CuSeqlensK, seqlen_k, total_k, IS_VARLEN)
    if PAGE_SIZE > 0:  # (keys past max_seqlen_k would read past the block table's row)
        sequence_k = tl.minimum(sequence_k, seqlen_k)
    seqlen_k = sequence_k
    kv_head = head // GROUP_SIZE
    diag = seqlen_k - seqlen_q
    window = (window_left, window_right)
    score, dropout, sink_log2 = head_options(AlibiSlopes, stride_alibi_b, Sinks, RngState, score_scale, softcap_log2,
                                             dropout_threshold, batch, head, tl.num_programs(1), VARIANT)

    q_base = tile_base(Q, batch, head, q_first, stride_qb, stride_qh, stride_qm)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q_descs = slice_descriptors(Q, q_base, batch, head, tl.num_programs(1), seqlen_q, stride_qb, stride_qh, stride_qm,
                                BLOCK_M, HEAD_DIM, DIM_A, DIM_B, USE_TMA, WARP_SPECIALIZE)
    k_base, v_base, k_descs, v_descs = kv_sources(
        K, V, batch, kv_head, k_first, tl.num_programs(1) // GROUP_SIZE, seqlen_k, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, BlockTable, stride_table, num_pages, BLOCK_N, HEAD_DIM, DIM_A, DIM_B, USE_TMA,
        WARP_SPECIALIZE, PAGE_SIZE)
    q_source = (q_descs, q_base, start_m, stride_qm, seqlen_q)
    q_a, q_b = load_tile_from(*q_source, BLOCK_M, HEAD_DIM, DIM_A, DIM_B, True, USE_TMA)  # (unused with Q_PER_TILE)

    lo, full_lo, full_hi, hi = key_tile_ranges(start_m, seqlen_q, seqlen_k, window, BLOCK_M, BLOCK_N, VARIANT)
    acc_a = tl.zeros([BLOCK_M, DIM_A], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, DIM_B if DIM_B > 0 else 16], dtype=tl.float32)
    row_max, row_sum = row_start(sink_log2, score, BLOCK_M, VARIANT)
    acc_a, acc_b, row_sum, row_max = forward_key_loop(
        acc_a, acc_b, row_sum, row_max, q_a, q_b, q_source, k_base, v_base, k_descs, v_descs, stride_kn, stride_vn,
        offs_m, full_lo, full_hi, (0, 0), seqlen_k, diag, window, score, dropout,
        BLOCK_N, HEAD_DIM, DIM_A, DIM_B, False, VARIANT, PRECISION, USE_TMA, WARP_SPECIALIZE, PAGE_SIZE,
        Q_PER_TILE,
    )
    if MASK_LEFT & VARIANT:  # a window: the tiles crossing either band edge, in one loop
        acc_a, acc_b, row_sum, row_max = forward_key_loop(
            acc_a, acc_b, row_sum, row_max, q_a, q_b, q_source, k_base, v_base, k_descs, v_descs, stride_kn, stride_vn,
            offs_m, lo, full_lo + (hi - full_hi), (full_lo, full_hi - full_lo), seqlen_k, diag, window, score,
            dropout, BLOCK_N, HEAD_DIM, DIM_A, DIM_B, True, VARIANT, PRECISION, USE_TMA, False, PAGE_SIZE, Q_PER_TILE,
        )
    elif not WARP_SPECIALIZE:  # (no masked tiles there; a second loop would fail to compile)
        acc_a, acc_b, row_sum, row_max = forward_key_loop(
            acc_a, acc_b, row_sum, row_max, q_a, q_b, q_source, k_base, v_base, k_descs, v_descs, stride_kn, stride_vn,
            offs_m, full_hi, hi, (0, 0), seqlen_k, diag, window, score, dropout,
            BLOCK_N, HEAD_DIM, DIM_A, DIM_B, True, VARIANT, PRECISION, USE_TMA, False, PAGE_SIZE, Q_PER_TILE,
        )

    empty_row = row_sum == 0.0
    inv_sum = reciprocal(tl.where(empty_row, 1.0, row_sum), VARIANT)
    if DROPOUT & VARIANT:
        inv_sum = inv_sum * dropout_scale
    o_base = tile_base(Out, batch, head, q_first, stride_ob, stride_oh, stride_om)
    store_tile(o_base, acc_a * inv_sum[:, None], acc_b * inv_sum[:, None], start_m, stride_om, seqlen_q, BLOCK_M,
               HEAD_DIM, DIM_A, DIM_B, PRECISION)
    lse = tl.where(empty_row, float("inf"), row_lse(row_max, tl.where(empty_row, 1.0, row_sum), VARIANT))
    lse_base = tile_base(Lse, batch, head, q_first, stride_lse_b, stride_lse_h, 1)
    tl.store(lse_base + offs_m, lse, mask=offs_m < seqlen_q)


@on_tensor_device
@replayed
def attention_forward(q, k, v, options: AttentionOptions, cu_seqlens_q=None, cu_seqlens_k=None,
                      max_seqlen_q: int = 0, max_seqlen_k: int = 0, block_table=None, wrap_kernel=identity_wrap):
    """Attention forward, dense or variable-length, with ``options`` (options.AttentionOptions).

    Dense: q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D); returns out like q and lse (B, Hq, Sq).
    Varlen (cu_seqlens_q/k given, int32 (B + 1,)): q (total_q, Hq, D), k and v (total_k, Hkv, D),
    max_seqlen_q/k at least the longest sequence; returns out like q and lse (Hq, total_q).
    Paged (varlen with ``block_table``, int32 (B, max_pages)): k and v are caches (pages,
    page_size, Hkv, D), sequence b's key row j at page block_table[b, j // page_size], row
    j % page_size; cu_seqlens_k gives the sequences' key counts only.
    Hq % Hkv == 0; any strides with the last dim contiguous (other tensors are copied); lse is
    fp32, natural log. ``wrap_kernel`` wraps each Triton kernel before launch
    (torch.library.wrap_triton lets torch.compile trace it). Inputs are assumed validated.
    """
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    layout = SequenceLayout.of(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table)
    num_heads, head_dim = q.shape[-2:]
    out = torch.empty_like(q)
    lse = layout.new_row_stats(q)
    if out.numel() == 0:
        return out, lse
    if k.numel() == 0:  # no keys: every row is empty (or sees its sink only)
        return out.zero_(), _lse_without_keys(lse, options)

    interpreted = is_interpreted(_attn_fwd_kernel)
    plan = plan_forward(options, layout, interpreted, q, k, v)
    if plan.gluon is not None:
        plan.gluon(q, k, v, out, lse, options, layout, plan.gluon_config)
        return out, lse
    dim_a, dim_b = head_dim_chunks(head_dim)
    if plan.tl.tma and not interpreted:
        ensure_scratch_allocator()

    def launch(config, specialized):
        grid = (cdiv(layout.seqlen_q, config.block_m), num_heads, layout.batch)
        launcher(_attn_fwd_kernel, wrap_kernel)[grid](
            q, k, v, out, lse, *layout.cu_seqlens(q, k), *layout.paging(k),
            *layout.strides(q), *layout.kv_strides(k), *layout.kv_strides(v), *layout.strides(out),
            *layout.stat_strides(lse), *layout.seqlens(), *options.kernel_args(q),
            GROUP_SIZE=num_heads // k.shape[-2], HEAD_DIM=head_dim, DIM_A=dim_a, DIM_B=dim_b,
            VARIANT=kernel_variant(options, q.dtype, interpreted, forward=True, max_keys=layout.seqlen_k),
            IS_VARLEN=layout.is_varlen,
            PRECISION=precision_mode(q.dtype, interpreted),
            USE_TMA=plan.tl.tma, WARP_SPECIALIZE=specialized, PAGE_SIZE=layout.page_size,
            Q_PER_TILE=config.q_per_tile, **config.launch_args(),
        )

    launch_fitting(plan.tl, launch)
    return out, lse


def _lse_without_keys(lse, options: AttentionOptions):
    """lse of rows that see no key: +inf, or the sink's logit."""
    if options.sinks is None:
        return lse.fill_(float("inf"))
    heads_axis = 0 if lse.dim() == 2 else 1
    shape = [1] * lse.dim()
    shape[heads_axis] = -1
    return lse.copy_(options.sinks.float().view(shape).expand_as(lse))
