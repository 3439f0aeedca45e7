"""The attention probabilities with their dropout mask, flash-attn's ``S_dmask`` (a debugging and
testing output of ``return_attn_probs=True`` with dropout).

One program writes BLOCK_M query rows x every key of one (batch, head): P = exp(S - lse), S from
``scores.logits`` and lse from the forward, so P is the softmax the forward used (sinks included),
0 where a pair is masked. Entries that dropout removes are stored negated (-P, a negative zero
where P = 0), so the exact keep mask is ``~torch.signbit(S_dmask)``. The keep mask is drawn by
``scores.dropout_keep`` from the same counters as in the forward and backward kernels.

Output: (batch, heads, max_seqlen_q, max_seqlen_k) in the inputs' dtype; for varlen batches the
entries past a sequence's own lengths are 0.
"""

import torch
import triton
import triton.language as tl

from .configs import TileConfig, head_dim_chunks
from .direct_launch import launcher
from .launch import (
    SequenceLayout, cdiv, fixed_tl_launch, identity_wrap, is_interpreted, kernel_variant, last_dim_contiguous,
    launch_fitting, on_tensor_device, precision_mode,
)
from .options import AttentionOptions
from .scores import dropout_keep, exp_logits, head_options, logit_unit, logit_units, logits
from .tiles import load_row_stat, load_tile, mma_over_head, sequence_span, tile_base


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "total_q", "total_k"])
def _attn_probs_kernel(
    Q, K, Lse, Probs, CuSeqlensQ, CuSeqlensK, total_q, total_k,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_stat_b, stride_stat_h,
    stride_pb, stride_ph, stride_pm,
    seqlen_q, seqlen_k,
    AlibiSlopes, stride_alibi_b, Sinks, RngState, score_scale, softcap_log2, window_left, window_right,
    dropout_threshold, dropout_scale,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_A: tl.constexpr, DIM_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARIANT: tl.constexpr, IS_VARLEN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2)
    rows_out, cols_out = seqlen_q, seqlen_k  # Probs' (max_seqlen_q, max_seqlen_k) per (batch, head)
    q_first, seqlen_q = sequence_span(batch, CuSeqlensQ, seqlen_q, total_q, IS_VARLEN)
    if start_m >= seqlen_q:
        return
    k_first, seqlen_k = sequence_span(batch, CuSeqlensK, seqlen_k, total_k, IS_VARLEN)
    kv_head = head // GROUP_SIZE
    diag = seqlen_k - seqlen_q
    score, dropout, _sink = head_options(AlibiSlopes, stride_alibi_b, Sinks, RngState, score_scale, softcap_log2,
                                         dropout_threshold, batch, head, tl.num_programs(1), VARIANT)
    q_a, q_b = load_tile(tile_base(Q, batch, head, q_first, stride_qb, stride_qh, stride_qm), start_m, stride_qm,
                         seqlen_q, BLOCK_M, HEAD_DIM, DIM_A, DIM_B, True)
    lse_units = logit_units(load_row_stat(tile_base(Lse, batch, head, q_first, stride_stat_b, stride_stat_h, 1),
                                          start_m, seqlen_q, float("inf"), BLOCK_M, True), VARIANT)
    k_base = tile_base(K, batch, kv_head, k_first, stride_kb, stride_kh, stride_kn)
    probs_base = Probs + batch.to(tl.int64) * stride_pb + head.to(tl.int64) * stride_ph
    offs_m = start_m + tl.arange(0, BLOCK_M)
    for start_n in range(0, seqlen_k, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_a, k_b = load_tile(k_base, start_n, stride_kn, seqlen_k, BLOCK_N, HEAD_DIM, DIM_A, DIM_B, True)
        qk = mma_over_head(q_a, q_b, k_a, k_b, DIM_B, PRECISION)
        s, capped = logits(qk, offs_m[:, None], offs_n[None, :], seqlen_k, diag, (window_left, window_right), score,
                           True, VARIANT)
        p = exp_logits(s * logit_unit(score, VARIANT) - lse_units[:, None], VARIANT)
        p = tl.where(dropout_keep(offs_m, start_n, dropout, BLOCK_N, False, VARIANT), p, p * -1.0)  # (-0.0 for 0, unlike 0 - p)
        ptrs = probs_base + offs_m[:, None].to(tl.int64) * stride_pm + offs_n[None, :]
        inside = ((offs_m < tl.minimum(seqlen_q, rows_out))[:, None]  # (a sequence longer than max_seqlen:
                  & (offs_n < tl.minimum(seqlen_k, cols_out))[None, :])  # its rows past it are not stored)
        tl.store(ptrs, p.to(Probs.dtype.element_ty), mask=inside)


@on_tensor_device
def attention_probabilities(q, k, lse, options: AttentionOptions, cu_seqlens_q=None, cu_seqlens_k=None,
                            max_seqlen_q: int = 0, max_seqlen_k: int = 0, block_table=None, wrap_kernel=identity_wrap):
    """S_dmask of a forward with dropout (module docstring), from its inputs and its lse; not for
    paged caches (``block_table``: a ValueError)."""
    if block_table is not None:
        raise ValueError("flash_attention: no attention probabilities from a paged KV cache (block_table)")
    q, k = last_dim_contiguous(q), last_dim_contiguous(k)
    lse = lse.contiguous()
    layout = SequenceLayout.of(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    num_heads, head_dim = q.shape[-2:]
    probs = torch.zeros(layout.batch, num_heads, layout.seqlen_q, layout.seqlen_k, dtype=q.dtype, device=q.device)
    if probs.numel() == 0 or q.numel() == 0 or k.numel() == 0:
        return probs
    dim_a, dim_b = head_dim_chunks(head_dim)
    interpreted = is_interpreted(_attn_probs_kernel)
    # A test and debugging path, not a hot one: small tiles, no pipelining, so it fits every GPU class
    small = interpreted or q.dtype == torch.float32 or dim_a + dim_b > 128
    config = TileConfig(32, 32, 4, 1) if small else TileConfig(64, 64, 4, 1)

    def launch(config, _specialized):
        grid = (cdiv(layout.seqlen_q, config.block_m), num_heads, layout.batch)
        launcher(_attn_probs_kernel, wrap_kernel)[grid](
            q, k, lse, probs, *layout.cu_seqlens(q, k),
            *layout.strides(q), *layout.strides(k), *layout.stat_strides(lse), *probs.stride()[:3],
            *layout.seqlens(), *options.kernel_args(q),
            GROUP_SIZE=num_heads // k.shape[-2], HEAD_DIM=head_dim, DIM_A=dim_a, DIM_B=dim_b,
            VARIANT=kernel_variant(options, q.dtype, interpreted), IS_VARLEN=layout.is_varlen,
            PRECISION=precision_mode(q.dtype, interpreted), **config.launch_args(),
        )

    launch_fitting(fixed_tl_launch("probs", config, head_dim, q.dtype, options.variant, q.device), launch)
    return probs
