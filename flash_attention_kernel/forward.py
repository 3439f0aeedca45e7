"""Forward pass: the FlashAttention-2 algorithm with an online softmax.

One program owns BLOCK_M query rows of one (batch, head) and streams the keys and values of the
matching KV head in BLOCK_N tiles, never materialising the (seqlen_q, seqlen_k) score matrix:

    S    = (Q K_j^T) * softmax_scale * log2(e)      fp32, scaled after the dot (not pre-scaled Q)
    m'   = max(m, rowmax(S))                        running row max, base 2
    P    = exp2(S - m'),   alpha = exp2(m - m')
    l    = l * alpha + rowsum(P)                    running row sum
    acc  = acc * alpha + P V_j
    O    = acc / l,        lse = (m + log2(l)) * ln(2)   natural-log logsumexp, as flash-attn returns

Key tiles split in two loops. The first covers tiles every row of the block sees in full and runs
without masks; the second covers the causal diagonal and the ragged sequence end with masks. With
causal masking aligned bottom-right (row i sees keys j <= i + seqlen_k - seqlen_q), tiles above the
diagonal are never visited.

Dense and variable-length batches share the kernel: with IS_VARLEN a program reads its sequence's
first row and length from cu_seqlens, and programs past the end of a shorter sequence exit at once
(the grid is sized for the longest).

A row that sees no key (bottom-right causal with seqlen_q > seqlen_k, or seqlen_k == 0) keeps
m = -inf and l = 0. The masked loop then uses 0 as its exp2 pivot, so no (-inf) - (-inf) NaN
appears, and the row ends with O = 0 and lse = +inf, which makes every backward probability
exp(s - lse) exactly 0.
"""

import torch
import triton
import triton.language as tl

from .configs import head_dim_chunks
from .launch import (
    LOG2E, SequenceLayout, ensure_scratch_allocator, identity_wrap, is_interpreted, last_dim_contiguous, launch_plan,
    precision_mode,
)
from .tiles import (
    key_tile_range, load_tile_from, mma, mma_into_head, mma_over_head, query_tile_start, round_to, sequence_span,
    slice_descriptors, store_tile, tile_base, visible,
)

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _fwd_kv_loop(
    acc_a, acc_b, row_sum, row_max, q_a, q_b,
    k_base, v_base, k_descs, v_descs, stride_kn, stride_vn,
    offs_m, kv_start, kv_end, seqlen_k, causal_offset, qk_scale_log2,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_A: tl.constexpr, DIM_B: tl.constexpr,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(kv_start, kv_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k_a, k_b = load_tile_from(k_descs, k_base, start_n, stride_kn, seqlen_k, BLOCK_N, HEAD_DIM, DIM_A, DIM_B,
                                  MASKED, USE_TMA)
        scores = mma_over_head(q_a, q_b, k_a, k_b, DIM_B, PRECISION) * qk_scale_log2
        if MASKED:
            mask = visible(offs_m[:, None], (start_n + offs_n)[None, :], seqlen_k, causal_offset, IS_CAUSAL)
            scores = tl.where(mask, scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, 1))
            pivot = tl.where(new_max == float("-inf"), 0.0, new_max)
        else:
            new_max = tl.maximum(row_max, tl.max(scores, 1))
            pivot = new_max
        p = tl.exp2(scores - pivot[:, None])
        alpha = tl.exp2(row_max - pivot)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        v_a, v_b = load_tile_from(v_descs, v_base, start_n, stride_vn, seqlen_k, BLOCK_N, HEAD_DIM, DIM_A, DIM_B,
                                  MASKED, USE_TMA)
        acc_a = acc_a * alpha[:, None]
        if DIM_B > 0:
            acc_b = acc_b * alpha[:, None]
            acc_a, acc_b = mma_into_head(p, v_a, v_b, acc_a, acc_b, DIM_B, PRECISION)
        else:  # acc_b must not be a loop variable here: warp specialisation fails on one left unchanged
            acc_a = mma(round_to(p, v_a.dtype, PRECISION), v_a, acc_a, PRECISION)
        row_max = new_max
    return acc_a, acc_b, row_sum, row_max


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, CuSeqlensQ, CuSeqlensK,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_lse_b, stride_lse_h,
    seqlen_q, seqlen_k, qk_scale_log2,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_A: tl.constexpr, DIM_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    start_m = query_tile_start(BLOCK_M, IS_CAUSAL)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    q_first, seqlen_q = sequence_span(batch, CuSeqlensQ, seqlen_q, IS_VARLEN)
    if IS_VARLEN:
        if start_m >= seqlen_q:  # the grid covers the longest sequence
            return
    k_first, seqlen_k = sequence_span(batch, CuSeqlensK, seqlen_k, IS_VARLEN)
    kv_head = head // GROUP_SIZE
    causal_offset = seqlen_k - seqlen_q
    qk_scale_log2 = tl.cast(qk_scale_log2, tl.float32)  # torch.compile passes Python floats as fp64

    q_base = tile_base(Q, batch, head, q_first, stride_qb, stride_qh, stride_qm)
    k_base = tile_base(K, batch, kv_head, k_first, stride_kb, stride_kh, stride_kn)
    v_base = tile_base(V, batch, kv_head, k_first, stride_vb, stride_vh, stride_vn)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    num_kv_heads = tl.num_programs(1) // GROUP_SIZE
    q_descs = slice_descriptors(Q, q_base, batch, head, tl.num_programs(1), seqlen_q, stride_qb, stride_qh, stride_qm,
                                BLOCK_M, HEAD_DIM, DIM_A, DIM_B, USE_TMA, WARP_SPECIALIZE)
    k_descs = slice_descriptors(K, k_base, batch, kv_head, num_kv_heads, seqlen_k, stride_kb, stride_kh, stride_kn,
                                BLOCK_N, HEAD_DIM, DIM_A, DIM_B, USE_TMA, WARP_SPECIALIZE)
    v_descs = slice_descriptors(V, v_base, batch, kv_head, num_kv_heads, seqlen_k, stride_vb, stride_vh, stride_vn,
                                BLOCK_N, HEAD_DIM, DIM_A, DIM_B, USE_TMA, WARP_SPECIALIZE)
    q_a, q_b = load_tile_from(q_descs, q_base, start_m, stride_qm, seqlen_q, BLOCK_M, HEAD_DIM, DIM_A, DIM_B, True,
                              USE_TMA)

    kv_full, kv_end = key_tile_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL)
    acc_a = tl.zeros([BLOCK_M, DIM_A], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, DIM_B if DIM_B > 0 else 16], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc_a, acc_b, row_sum, row_max = _fwd_kv_loop(
        acc_a, acc_b, row_sum, row_max, q_a, q_b, k_base, v_base, k_descs, v_descs, stride_kn, stride_vn,
        offs_m, 0, kv_full, seqlen_k, causal_offset, qk_scale_log2,
        BLOCK_N, HEAD_DIM, DIM_A, DIM_B, False, IS_CAUSAL, PRECISION, USE_TMA, WARP_SPECIALIZE,
    )
    if not WARP_SPECIALIZE:  # (no masked tiles there; a second loop would fail to compile)
        acc_a, acc_b, row_sum, row_max = _fwd_kv_loop(
            acc_a, acc_b, row_sum, row_max, q_a, q_b, k_base, v_base, k_descs, v_descs, stride_kn, stride_vn,
            offs_m, kv_full, kv_end, seqlen_k, causal_offset, qk_scale_log2,
            BLOCK_N, HEAD_DIM, DIM_A, DIM_B, True, IS_CAUSAL, PRECISION, USE_TMA, False,
        )

    empty_row = row_sum == 0.0
    inv_sum = 1.0 / tl.where(empty_row, 1.0, row_sum)
    o_base = tile_base(Out, batch, head, q_first, stride_ob, stride_oh, stride_om)
    store_tile(o_base, acc_a * inv_sum[:, None], acc_b * inv_sum[:, None], start_m, stride_om, seqlen_q, BLOCK_M,
               HEAD_DIM, DIM_A, DIM_B, PRECISION)
    lse = tl.where(empty_row, float("inf"), (row_max + tl.log2(row_sum)) * LN2)
    lse_base = tile_base(Lse, batch, head, q_first, stride_lse_b, stride_lse_h, 1)
    tl.store(lse_base + offs_m, lse, mask=offs_m < seqlen_q)


def attention_forward(q, k, v, softmax_scale: float, causal: bool, cu_seqlens_q=None, cu_seqlens_k=None,
                      max_seqlen_q: int = 0, max_seqlen_k: int = 0, wrap_kernel=identity_wrap):
    """Attention forward, dense or variable-length.

    Dense: q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D); returns out like q and lse (B, Hq, Sq).
    Varlen (cu_seqlens_q/k given, int32 (B + 1,)): q (total_q, Hq, D), k and v (total_k, Hkv, D),
    max_seqlen_q/k at least the longest sequence; returns out like q and lse (Hq, total_q).
    Hq % Hkv == 0; any strides with the last dim contiguous (other tensors are copied); lse is
    fp32, natural log. ``wrap_kernel`` wraps each Triton kernel before launch
    (torch.library.wrap_triton lets torch.compile trace it). Inputs are assumed validated.
    """
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    layout = SequenceLayout.of(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    num_heads, head_dim = q.shape[-2:]
    out = torch.empty_like(q)
    lse = layout.new_row_stats(q)
    if out.numel() == 0:
        return out, lse
    if k.numel() == 0:  # no keys: every row is empty
        return out.zero_(), lse.fill_(float("inf"))

    dim_a, dim_b = head_dim_chunks(head_dim)
    interpreted = is_interpreted(_attn_fwd_kernel)
    config, specialized, tma = launch_plan("fwd", head_dim, q.dtype, causal, layout, interpreted, q, k, v)
    grid = (triton.cdiv(layout.seqlen_q, config.block_m), num_heads, layout.batch)
    cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k = layout.kernel_args()
    if tma and not interpreted:
        ensure_scratch_allocator()
    wrap_kernel(_attn_fwd_kernel)[grid](
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
        *layout.strides(q), *layout.strides(k), *layout.strides(v), *layout.strides(out), *layout.stat_strides(lse),
        seqlen_q, seqlen_k, softmax_scale * LOG2E,
        GROUP_SIZE=num_heads // k.shape[-2], HEAD_DIM=head_dim, DIM_A=dim_a, DIM_B=dim_b,
        IS_CAUSAL=causal, IS_VARLEN=layout.is_varlen, PRECISION=precision_mode(q.dtype, interpreted),
        USE_TMA=tma, WARP_SPECIALIZE=specialized,
        **config.launch_args(),
    )
    return out, lse
