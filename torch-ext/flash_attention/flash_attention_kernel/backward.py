"""Backward pass: two or three kernels, no atomics, so every gradient is bitwise repeatable.

With S the logits of ``scores.logits`` (softmax_scale * Q K^T, capped, biased, masked),
P = exp(S - lse) (recomputed from the forward's logsumexp, which includes a sink's term), Z the
dropout keep mask scaled by 1 / (1 - p) (all ones without dropout) and dO the output gradient,
the gradients are

    delta = rowsum(dO * O) - dlse                  (dlse = grad of the lse output)
    dV    = (P * Z)^T dO
    dP    = (dO V^T) * Z
    dS    = P * (dP - delta) * tanh'               (tanh' = 1 - tanh^2 of the softcap, else 1;
                                                    exactly 0 at masked pairs: ``scores.score_grads``)
    dK    = softmax_scale * dS^T Q
    dQ    = softmax_scale * dS K
    dsink = -sum over rows of exp(sink - lse) * delta     (attention sinks; ``_sink_grad_kernel``)

* delta comes first: from the dQ kernel's prologue (the plain tl kernel's, or the Gluon kernel's
  consumers'), which then runs before the dK/dV kernel, or, where that prologue would slow the dQ
  kernel down (tl warp-specialised or varlen), from ``_attn_bwd_preprocess_kernel``. fp32 inputs
  (FP32_EXACT) take delta = sum_j P_ij dP_ij - dlse instead, PyTorch's form, from a first pass of
  the dQ kernel (``_attn_bwd_dq_kernel``).
* ``_attn_bwd_dkdv_kernel``: one program per BLOCK_N keys of one KV head. It streams the query
  tiles of every query head that shares this KV head (GQA/MQA), so shared K/V gradients are summed
  in registers, never by expanding K/V in memory or by atomics.
* ``_attn_bwd_dq_kernel``: one program per BLOCK_M query rows; it streams key tiles like the
  forward and recomputes P and dP (7 matmuls per tile pair in all instead of 5 with atomics).
* On Hopper, dense bf16/fp16 calls with full tiles and head dim 64, 80, 96 or 128, with any options,
  take ``hopper_dkdv`` and ``hopper_dq`` instead: the same math in Gluon, with a producer warp and
  two consumer warpgroups that run out of step (FlashAttention-3's structure, ``hopper_gluon``).
  ``planner.plan_backward`` makes these choices (delta's source, each pass's kernel and config).
* On the A100 class, dense bf16/fp16 calls at head dim 64 or 128 that do not ask for determinism
  take one fused kernel for both passes, ``ampere_backward`` (dQ added to an fp32 accumulator by
  atomics), between the preprocess kernel (delta, and the accumulator zeroed: ``ZERO_DQ``) and
  ``_dq_from_accumulator_kernel``; on Hopper the Gluon dK/dV kernel can take that place where
  ``hopper_route.fused_chosen`` says so (dQ added by TMA reductions, ``hopper_dkdv``).

Dense and varlen (IS_VARLEN) batches share these kernels, as in the forward. Both kernels visit only
the tiles the causal and window masks leave visible (``scores.key_tile_ranges`` /
``scores.query_tile_ranges``) and mask only tiles that cross a band edge or a sequence end. Rows
with lse = +inf (no visible key) get P = 0 and therefore zero gradients; query rows past the
sequence end read lse = +inf and contribute nothing.
"""

import torch
import triton
import triton.language as tl

from .configs import head_dim_chunks
from .direct_launch import launcher
from .forward import reciprocal
from .launch import (
    SequenceLayout, cdiv, ensure_scratch_allocator, identity_wrap, is_interpreted, kernel_variant, last_dim_contiguous,
    launch_fitting, on_tensor_device, precision_mode,
)
from .options import AttentionOptions
from .planner import DELTA_FP32_PASS, DELTA_IN_DQ, plan_backward
from .replay import replayed
from .scores import (
    DROPOUT, FP32_EXACT, MASK_LEFT, MASK_RIGHT, SINKS, dropout_keep, exp_logits, head_options, key_tile_ranges,
    logit_unit, logit_units, logits, logits_grad, query_tile_ranges, query_tile_start, score_grads, visible,
)
from .tiles import (
    kv_sources, load_row_stat, load_tile, load_tile_from, mma, mma_into_head, mma_over_head, round_to, sequence_span,
    store_tile, tile_base, tile_descriptors,
)


@triton.jit(do_not_specialize=["seqlen_q", "total_q"])
def _attn_bwd_preprocess_kernel(
    Out, DO, DLse, Delta, DqAcc, CuSeqlensQ, total_q,
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom,
    stride_dqab, stride_dqah, stride_dqam,
    stride_stat_b, stride_stat_h,
    seqlen_q,
    HEAD_DIM: tl.constexpr, DIM_A: tl.constexpr, DIM_B: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_DLSE: tl.constexpr, IS_VARLEN: tl.constexpr, ZERO_DQ: tl.constexpr,
):
    """delta of BLOCK_M query rows; ZERO_DQ: and zeroes their rows of the fp32 dQ accumulator
    (the fused backward's, ``ampere_backward``)."""
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2)
    q_first, seqlen_q = sequence_span(batch, CuSeqlensQ, seqlen_q, total_q, IS_VARLEN)
    if start_m >= seqlen_q:
        return
    do_a, do_b = load_tile(tile_base(DO, batch, head, q_first, stride_dob, stride_doh, stride_dom), start_m,
                           stride_dom, seqlen_q, BLOCK_M, HEAD_DIM, DIM_A, DIM_B, True)
    _store_row_delta(tile_base(Out, batch, head, q_first, stride_ob, stride_oh, stride_om), do_a, do_b,
                     tile_base(DLse, batch, head, q_first, stride_stat_b, stride_stat_h, 1),
                     tile_base(Delta, batch, head, q_first, stride_stat_b, stride_stat_h, 1),
                     start_m, stride_om, seqlen_q, BLOCK_M, HEAD_DIM, DIM_A, DIM_B, HAS_DLSE)
    if ZERO_DQ:  # (each chunk its own width: 64 + 16 at head dim 80, 64 + 32 at 96)
        store_tile(tile_base(DqAcc, batch, head, q_first, stride_dqab, stride_dqah, stride_dqam),
                   tl.zeros(do_a.shape, dtype=tl.float32), tl.zeros(do_b.shape, dtype=tl.float32),
                   start_m, stride_dqam, seqlen_q, BLOCK_M, HEAD_DIM, DIM_A, DIM_B, "ieee")


@triton.jit(do_not_specialize=["seqlen_q"])
def _dq_from_accumulator_kernel(
    DqAcc, DQ, stride_dqab, stride_dqah, stride_dqam, stride_dqb, stride_dqh, stride_dqm, seqlen_q,
    HEAD_DIM: tl.constexpr, DIM_A: tl.constexpr, DIM_B: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr,
):
    """dQ of BLOCK_M query rows (dense) from the fused backward's fp32 accumulator, which holds it
    scaled already."""
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2)
    dq_a, dq_b = load_tile(tile_base(DqAcc, batch, head, 0, stride_dqab, stride_dqah, stride_dqam), start_m,
                           stride_dqam, seqlen_q, BLOCK_M, HEAD_DIM, DIM_A, DIM_B, True)
    store_tile(tile_base(DQ, batch, head, 0, stride_dqb, stride_dqh, stride_dqm), dq_a, dq_b, start_m, stride_dqm,
               seqlen_q, BLOCK_M, HEAD_DIM, DIM_A, DIM_B, PRECISION)


@triton.jit
def _store_row_delta(out_base, do_a, do_b, dlse_base, delta_base, start_m, stride_om, seqlen_q,
                     BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_A: tl.constexpr, DIM_B: tl.constexpr,
                     HAS_DLSE: tl.constexpr):
    """Store and return delta = rowsum(dO * O) - dlse of query rows [start_m, start_m + BLOCK_M),
    given their dO tile."""
    o_a, o_b = load_tile(out_base, start_m, stride_om, seqlen_q, BLOCK_M, HEAD_DIM, DIM_A, DIM_B, True)
    delta = tl.sum(o_a.to(tl.float32) * do_a.to(tl.float32), 1)
    if DIM_B > 0:
        delta += tl.sum(o_b.to(tl.float32) * do_b.to(tl.float32), 1)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    if HAS_DLSE:
        delta -= tl.load(dlse_base + offs_m, mask=offs_m < seqlen_q, other=0.0)
    tl.store(delta_base + offs_m, delta, mask=offs_m < seqlen_q)
    return delta


@triton.jit
def _dkdv_query_loop(
    dk_a, dk_b, dv_a, dv_b, k_a, k_b, v_a, v_b,
    q_base, do_base, q_descs, do_descs, lse_base, scale_base, delta_base, stride_qm, stride_dom,
    start_n, q_start, q_end, seqlen_q, seqlen_k, diag, window, score, dropout, dropout_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_A: tl.constexpr, DIM_B: tl.constexpr,
    MASKED: tl.constexpr, VARIANT: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    """Accumulate dK, dV of one key tile over query tiles [q_start, q_end), in transposed form
    (rows = keys) so that every product lands directly in the key tile's accumulators. Under
    FP32_EXACT, P takes each query row's RowScale (``_attn_bwd_dq_kernel``) at ``scale_base``."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    for start_m in range(q_start, q_end, BLOCK_M):
        q_a, q_b = load_tile_from(q_descs, q_base, start_m, stride_qm, seqlen_q, BLOCK_M, HEAD_DIM,
                                  DIM_A, DIM_B, MASKED, USE_TMA)
        lse_units = logit_units(load_row_stat(lse_base, start_m, seqlen_q, float("inf"), BLOCK_M, MASKED), VARIANT)
        offs_m = (start_m + tl.arange(0, BLOCK_M))[None, :]
        qk_t = mma_over_head(k_a, k_b, q_a, q_b, DIM_B, PRECISION)
        s_t, capped_t = logits(qk_t, offs_m, offs_n[:, None], seqlen_k, diag, window, score, MASKED, VARIANT)
        p_t = exp_logits(s_t * logit_unit(score, VARIANT) - lse_units[None, :], VARIANT)
        if FP32_EXACT & VARIANT:
            p_t = p_t * load_row_stat(scale_base, start_m, seqlen_q, 1.0, BLOCK_M, MASKED)[None, :]
        do_a, do_b = load_tile_from(do_descs, do_base, start_m, stride_dom, seqlen_q, BLOCK_M, HEAD_DIM,
                                    DIM_A, DIM_B, MASKED, USE_TMA)
        dp_t = mma_over_head(v_a, v_b, do_a, do_b, DIM_B, PRECISION)
        if DROPOUT & VARIANT:
            keep_t = dropout_keep(start_m + tl.arange(0, BLOCK_M), start_n, dropout, BLOCK_N, True, VARIANT)
            dv_a, dv_b = mma_into_head(tl.where(keep_t, p_t * dropout_scale, 0.0), do_a, do_b, dv_a, dv_b, DIM_B,
                                       PRECISION)
            dp_t = tl.where(keep_t, dp_t * dropout_scale, 0.0)
        else:
            dv_a, dv_b = mma_into_head(p_t, do_a, do_b, dv_a, dv_b, DIM_B, PRECISION)
        delta = load_row_stat(delta_base, start_m, seqlen_q, 0.0, BLOCK_M, MASKED)
        ds_t = score_grads(logits_grad(p_t, capped_t, VARIANT), dp_t, delta[None, :], offs_m, offs_n[:, None],
                           seqlen_k, diag, window, MASKED, VARIANT)
        dk_a, dk_b = mma_into_head(ds_t, q_a, q_b, dk_a, dk_b, DIM_B, PRECISION)
    return dk_a, dk_b, dv_a, dv_b


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "total_q", "total_k"])
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, RowScale, DK, DV, CuSeqlensQ, CuSeqlensK, total_q, total_k,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_stat_b, stride_stat_h,
    seqlen_q, seqlen_k, softmax_scale,
    AlibiSlopes, stride_alibi_b, Sinks, RngState, score_scale, softcap_log2, window_left, window_right,
    dropout_threshold, dropout_scale,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_A: tl.constexpr, DIM_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARIANT: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    k_first, seqlen_k = sequence_span(batch, CuSeqlensK, seqlen_k, total_k, IS_VARLEN)
    if start_n >= seqlen_k:  # varlen: the grid covers the longest sequence
        return
    q_first, seqlen_q = sequence_span(batch, CuSeqlensQ, seqlen_q, total_q, IS_VARLEN)
    diag = seqlen_k - seqlen_q
    window = (window_left, window_right)
    softmax_scale = tl.cast(softmax_scale, tl.float32)  # torch.compile passes Python floats as fp64

    k_a, k_b = load_tile(tile_base(K, batch, kv_head, k_first, stride_kb, stride_kh, stride_kn), start_n,
                         stride_kn, seqlen_k, BLOCK_N, HEAD_DIM, DIM_A, DIM_B, True)
    v_a, v_b = load_tile(tile_base(V, batch, kv_head, k_first, stride_vb, stride_vh, stride_vn), start_n,
                         stride_vn, seqlen_k, BLOCK_N, HEAD_DIM, DIM_A, DIM_B, True)
    dk_a = tl.zeros([BLOCK_N, DIM_A], dtype=tl.float32)
    dv_a = tl.zeros([BLOCK_N, DIM_A], dtype=tl.float32)
    dk_b = tl.zeros([BLOCK_N, DIM_B if DIM_B > 0 else 16], dtype=tl.float32)
    dv_b = tl.zeros([BLOCK_N, DIM_B if DIM_B > 0 else 16], dtype=tl.float32)
    lo, full_lo, full_hi, hi = query_tile_ranges(start_n, seqlen_q, seqlen_k, window, BLOCK_M, BLOCK_N, VARIANT)

    # fp32 with GQA sums each query head's terms apart, then adds them: a sum of one chain over
    # GROUP_SIZE heads' rows loses GROUP_SIZE times the bits of PyTorch's per-head products, about
    # sqrt(GROUP_SIZE) times its error (3-4.7x at 8:1 on an H100, issue 39). Costs a second set of
    # accumulators, on the fp32 path only.
    SUM_PER_HEAD: tl.constexpr = (FP32_EXACT & VARIANT) != 0 and GROUP_SIZE > 1
    for group_member in range(GROUP_SIZE):
        if SUM_PER_HEAD:
            hk_a, hk_b = tl.zeros_like(dk_a), tl.zeros_like(dk_b)
            hv_a, hv_b = tl.zeros_like(dv_a), tl.zeros_like(dv_b)
        else:
            hk_a, hk_b, hv_a, hv_b = dk_a, dk_b, dv_a, dv_b
        head = kv_head * GROUP_SIZE + group_member
        score, dropout, _ = head_options(AlibiSlopes, stride_alibi_b, Sinks, RngState, score_scale, softcap_log2,
                                         dropout_threshold, batch, head, tl.num_programs(1) * GROUP_SIZE, VARIANT)
        q_base = tile_base(Q, batch, head, q_first, stride_qb, stride_qh, stride_qm)
        do_base = tile_base(DO, batch, head, q_first, stride_dob, stride_doh, stride_dom)
        lse_base = tile_base(Lse, batch, head, q_first, stride_stat_b, stride_stat_h, 1)
        delta_base = tile_base(Delta, batch, head, q_first, stride_stat_b, stride_stat_h, 1)
        scale_base = tile_base(RowScale, batch, head, q_first, stride_stat_b, stride_stat_h, 1)
        q_descs = tile_descriptors(q_base, seqlen_q, stride_qm, BLOCK_M, HEAD_DIM, DIM_A, DIM_B, USE_TMA)
        do_descs = tile_descriptors(do_base, seqlen_q, stride_dom, BLOCK_M, HEAD_DIM, DIM_A, DIM_B, USE_TMA)
        if MASK_RIGHT & VARIANT:  # query tiles crossing the causal diagonal / the window's right edge
            hk_a, hk_b, hv_a, hv_b = _dkdv_query_loop(
                hk_a, hk_b, hv_a, hv_b, k_a, k_b, v_a, v_b, q_base, do_base, q_descs, do_descs, lse_base,
                scale_base, delta_base, stride_qm, stride_dom,
                start_n, lo, full_lo, seqlen_q, seqlen_k, diag, window, score, dropout, dropout_scale,
                BLOCK_M, BLOCK_N, HEAD_DIM, DIM_A, DIM_B, True, VARIANT, PRECISION, USE_TMA,
            )
        hk_a, hk_b, hv_a, hv_b = _dkdv_query_loop(
            hk_a, hk_b, hv_a, hv_b, k_a, k_b, v_a, v_b, q_base, do_base, q_descs, do_descs, lse_base, scale_base,
            delta_base, stride_qm, stride_dom,
            start_n, full_lo, full_hi, seqlen_q, seqlen_k, diag, window, score, dropout, dropout_scale,
            BLOCK_M, BLOCK_N, HEAD_DIM, DIM_A, DIM_B, False, VARIANT, PRECISION, USE_TMA,
        )
        hk_a, hk_b, hv_a, hv_b = _dkdv_query_loop(
            hk_a, hk_b, hv_a, hv_b, k_a, k_b, v_a, v_b, q_base, do_base, q_descs, do_descs, lse_base, scale_base,
            delta_base, stride_qm, stride_dom,
            start_n, full_hi, hi, seqlen_q, seqlen_k, diag, window, score, dropout, dropout_scale,
            BLOCK_M, BLOCK_N, HEAD_DIM, DIM_A, DIM_B, True, VARIANT, PRECISION, USE_TMA,
        )
        if SUM_PER_HEAD:
            dk_a, dk_b, dv_a, dv_b = dk_a + hk_a, dk_b + hk_b, dv_a + hv_a, dv_b + hv_b
        else:
            dk_a, dk_b, dv_a, dv_b = hk_a, hk_b, hv_a, hv_b

    store_tile(tile_base(DK, batch, kv_head, k_first, stride_dkb, stride_dkh, stride_dkn), dk_a * softmax_scale,
               dk_b * softmax_scale, start_n, stride_dkn, seqlen_k, BLOCK_N, HEAD_DIM, DIM_A, DIM_B, PRECISION)
    store_tile(tile_base(DV, batch, kv_head, k_first, stride_dvb, stride_dvh, stride_dvn), dv_a, dv_b,
               start_n, stride_dvn, seqlen_k, BLOCK_N, HEAD_DIM, DIM_A, DIM_B, PRECISION)


@triton.jit
def _dq_key_loop(
    dq_a, dq_b, q_a, q_b, do_a, do_b, lse_units, delta,
    k_base, v_base, k_descs, v_descs, stride_kn, stride_vn,
    offs_m, kv_start, kv_end, seqlen_k, diag, window, score, dropout,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_A: tl.constexpr, DIM_B: tl.constexpr,
    MASKED: tl.constexpr, VARIANT: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """Accumulate dQ of one query tile over key tiles [kv_start, kv_end)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(kv_start, kv_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k_a, k_b = load_tile_from(k_descs, k_base, start_n, stride_kn, seqlen_k, BLOCK_N, HEAD_DIM, DIM_A, DIM_B,
                                  MASKED, USE_TMA)
        v_a, v_b = load_tile_from(v_descs, v_base, start_n, stride_vn, seqlen_k, BLOCK_N, HEAD_DIM, DIM_A, DIM_B,
                                  MASKED, USE_TMA)
        cols = (start_n + offs_n)[None, :]
        qk = mma_over_head(q_a, q_b, k_a, k_b, DIM_B, PRECISION)
        s, capped = logits(qk, offs_m[:, None], cols, seqlen_k, diag, window, score, MASKED, VARIANT)
        p_grad = logits_grad(exp_logits(s * logit_unit(score, VARIANT) - lse_units[:, None], VARIANT), capped, VARIANT)
        dp = mma_over_head(do_a, do_b, v_a, v_b, DIM_B, PRECISION)
        if DROPOUT & VARIANT:
            dp = tl.where(dropout_keep(offs_m, start_n, dropout, BLOCK_N, False, VARIANT), dp, 0.0)
        # (dropout: delta and dQ carry dP's 1 / (1 - p), the kernel's prologue)
        ds = score_grads(p_grad, dp, delta[:, None], offs_m[:, None], cols, seqlen_k, diag, window, MASKED, VARIANT)
        if DIM_B > 0:
            dq_a, dq_b = mma_into_head(ds, k_a, k_b, dq_a, dq_b, DIM_B, PRECISION)
        else:  # dq_b must not be a loop variable here: warp specialisation fails on one left unchanged
            dq_a = mma(round_to(ds, k_a.dtype, PRECISION), k_a, dq_a, PRECISION)
    return dq_a, dq_b


@triton.jit
def _dq_row_sums_loop(
    p_sum, p_dp, q_a, q_b, do_a, do_b, lse_units,
    k_base, v_base, k_descs, v_descs, stride_kn, stride_vn,
    offs_m, kv_start, kv_end, seqlen_k, diag, window, score, dropout,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_A: tl.constexpr, DIM_B: tl.constexpr,
    MASKED: tl.constexpr, VARIANT: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    """The fp32 dQ kernel's first pass over key tiles [kv_start, kv_end): add each query row's sum
    of P to ``p_sum`` and of P * dP to ``p_dp`` (dP with dropout's mask but not its 1 / (1 - p); 0
    at pairs the row does not see), P and dP recomputed as ``_dq_key_loop`` and the dK/dV kernel
    recompute them (``_attn_bwd_dq_kernel``)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(kv_start, kv_end, BLOCK_N):
        k_a, k_b = load_tile_from(k_descs, k_base, start_n, stride_kn, seqlen_k, BLOCK_N, HEAD_DIM, DIM_A, DIM_B,
                                  MASKED, USE_TMA)
        v_a, v_b = load_tile_from(v_descs, v_base, start_n, stride_vn, seqlen_k, BLOCK_N, HEAD_DIM, DIM_A, DIM_B,
                                  MASKED, USE_TMA)
        cols = (start_n + offs_n)[None, :]
        s, _ = logits(mma_over_head(q_a, q_b, k_a, k_b, DIM_B, PRECISION), offs_m[:, None], cols, seqlen_k, diag,
                      window, score, MASKED, VARIANT)
        p = exp_logits(s * logit_unit(score, VARIANT) - lse_units[:, None], VARIANT)
        dp = mma_over_head(do_a, do_b, v_a, v_b, DIM_B, PRECISION)
        if DROPOUT & VARIANT:
            dp = tl.where(dropout_keep(offs_m, start_n, dropout, BLOCK_N, False, VARIANT), dp, 0.0)
        p_times_dp = p * dp
        if MASKED:  # (a NaN dP of a pair the row does not see stays out, as it does of dS: score_grads)
            p_times_dp = tl.where(visible(offs_m[:, None], cols, seqlen_k, diag, window, VARIANT), p_times_dp, 0.0)
        p_sum += tl.sum(p, 1)
        p_dp += tl.sum(p_times_dp, 1)
    return p_sum, p_dp


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "total_q", "total_k"])
def _attn_bwd_dq_kernel(
    Q, K, V, DO, Out, Lse, DLse, Delta, RowScale, DQ, CuSeqlensQ, CuSeqlensK, total_q, total_k,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_ob, stride_oh, stride_om,
    stride_dqb, stride_dqh, stride_dqm,
    stride_stat_b, stride_stat_h,
    seqlen_q, seqlen_k, softmax_scale,
    AlibiSlopes, stride_alibi_b, Sinks, RngState, score_scale, softcap_log2, window_left, window_right,
    dropout_threshold, dropout_scale,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_A: tl.constexpr, DIM_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARIANT: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, COMPUTE_DELTA: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """dQ of BLOCK_M query rows. COMPUTE_DELTA: compute and store their delta here (the preprocess
    kernel's work; dense calls only, since every query row then has a program) instead of reading it.

    FP32_EXACT: a first pass over the key tiles (``_dq_row_sums_loop``, two matmuls per tile)
    makes two row statistics, stored for the dK/dV kernel and the sinks' gradient, which run after
    this kernel, and used by its own loop:
    * RowScale = 1 / c. P recomputed from the stored fp32 lse carries its rounding, one factor c
      per row (2^-19 relative at lse ~30), which PyTorch's fp32 softmax does not have. c is the
      row's sum of P (plus the sink's term), since the true P sums to 1; P is multiplied by 1 / c
      (here dQ, once).
    * Delta = sum_j P_ij dP_ij - dlse (P times 1 / c), PyTorch's softmax-backward form, instead of
      rowsum(dO * O) - dlse. Both equal the true delta up to rounding, but this one is made of the
      very P and dP that dS = P (dP - delta) takes: where one key holds nearly all of a row's P,
      dP - delta of that key is a small difference in which dP's rounding cancels, as it does in
      PyTorch; rowsum(dO * O) holds O's rounding instead, which does not cancel (tests/test_fuzz.py
      case 82: dK at 7x PyTorch's error with it, 0.5x with this one)."""
    start_m = query_tile_start(BLOCK_M, VARIANT)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    q_first, seqlen_q = sequence_span(batch, CuSeqlensQ, seqlen_q, total_q, IS_VARLEN)
    if IS_VARLEN:
        if start_m >= seqlen_q:  # the grid covers the longest sequence
            return
    k_first, seqlen_k = sequence_span(batch, CuSeqlensK, seqlen_k, total_k, IS_VARLEN)
    kv_head = head // GROUP_SIZE
    diag = seqlen_k - seqlen_q
    window = (window_left, window_right)
    score, dropout, sink = head_options(AlibiSlopes, stride_alibi_b, Sinks, RngState, score_scale, softcap_log2,
                                        dropout_threshold, batch, head, tl.num_programs(1), VARIANT)
    softmax_scale = tl.cast(softmax_scale, tl.float32)  # torch.compile passes Python floats as fp64
    offs_m = start_m + tl.arange(0, BLOCK_M)

    q_a, q_b = load_tile(tile_base(Q, batch, head, q_first, stride_qb, stride_qh, stride_qm), start_m, stride_qm,
                         seqlen_q, BLOCK_M, HEAD_DIM, DIM_A, DIM_B, True)
    do_a, do_b = load_tile(tile_base(DO, batch, head, q_first, stride_dob, stride_doh, stride_dom), start_m,
                           stride_dom, seqlen_q, BLOCK_M, HEAD_DIM, DIM_A, DIM_B, True)
    lse_base = tile_base(Lse, batch, head, q_first, stride_stat_b, stride_stat_h, 1)
    delta_base = tile_base(Delta, batch, head, q_first, stride_stat_b, stride_stat_h, 1)
    lse_units = logit_units(load_row_stat(lse_base, start_m, seqlen_q, float("inf"), BLOCK_M, True), VARIANT)
    if COMPUTE_DELTA:
        delta = _store_row_delta(tile_base(Out, batch, head, q_first, stride_ob, stride_oh, stride_om), do_a, do_b,
                                 tile_base(DLse, batch, head, q_first, stride_stat_b, stride_stat_h, 1), delta_base,
                                 start_m, stride_om, seqlen_q, BLOCK_M, HEAD_DIM, DIM_A, DIM_B, HAS_DLSE)
    elif not (FP32_EXACT & VARIANT):  # (fp32: from the first pass below)
        delta = load_row_stat(delta_base, start_m, seqlen_q, 0.0, BLOCK_M, True)
    if DROPOUT & VARIANT:  # dS = P (keep dP / (1 - p) - delta) = P (keep dP - delta (1 - p)) / (1 - p): the
        dropout_scale = tl.cast(dropout_scale, tl.float32)  # loop leaves 1 / (1 - p) to the end
        if not (FP32_EXACT & VARIANT):
            delta = delta / dropout_scale
        softmax_scale = softmax_scale * dropout_scale
    k_base, v_base, k_descs, v_descs = kv_sources(
        K, V, batch, kv_head, k_first, tl.num_programs(1) // GROUP_SIZE, seqlen_k, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, K, 0, 0, BLOCK_N, HEAD_DIM, DIM_A, DIM_B, USE_TMA, WARP_SPECIALIZE, 0)
    lo, full_lo, full_hi, hi = key_tile_ranges(start_m, seqlen_q, seqlen_k, window, BLOCK_M, BLOCK_N, VARIANT)
    if FP32_EXACT & VARIANT:  # delta and RowScale from a first pass over the same key tiles
        p_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        p_dp = tl.zeros([BLOCK_M], dtype=tl.float32)
        if MASK_LEFT & VARIANT:
            p_sum, p_dp = _dq_row_sums_loop(
                p_sum, p_dp, q_a, q_b, do_a, do_b, lse_units, k_base, v_base, k_descs, v_descs, stride_kn, stride_vn,
                offs_m, lo, full_lo, seqlen_k, diag, window, score, dropout,
                BLOCK_N, HEAD_DIM, DIM_A, DIM_B, True, VARIANT, PRECISION, USE_TMA,
            )
        p_sum, p_dp = _dq_row_sums_loop(
            p_sum, p_dp, q_a, q_b, do_a, do_b, lse_units, k_base, v_base, k_descs, v_descs, stride_kn, stride_vn,
            offs_m, full_lo, full_hi, seqlen_k, diag, window, score, dropout,
            BLOCK_N, HEAD_DIM, DIM_A, DIM_B, False, VARIANT, PRECISION, USE_TMA,
        )
        p_sum, p_dp = _dq_row_sums_loop(
            p_sum, p_dp, q_a, q_b, do_a, do_b, lse_units, k_base, v_base, k_descs, v_descs, stride_kn, stride_vn,
            offs_m, full_hi, hi, seqlen_k, diag, window, score, dropout,
            BLOCK_N, HEAD_DIM, DIM_A, DIM_B, True, VARIANT, PRECISION, USE_TMA,
        )
        if SINKS & VARIANT:
            p_sum += exp_logits(sink - lse_units, VARIANT)
        row_scale = reciprocal(tl.where(p_sum > 0, p_sum, 1.0), VARIANT)  # (rows that see nothing: P = 0 anyway)
        scale_base = tile_base(RowScale, batch, head, q_first, stride_stat_b, stride_stat_h, 1)
        tl.store(scale_base + offs_m, row_scale, mask=offs_m < seqlen_q)
        delta = p_dp * row_scale
        if DROPOUT & VARIANT:
            delta = delta * dropout_scale
        if HAS_DLSE:
            delta -= load_row_stat(tile_base(DLse, batch, head, q_first, stride_stat_b, stride_stat_h, 1), start_m,
                                   seqlen_q, 0.0, BLOCK_M, True)
        tl.store(delta_base + offs_m, delta, mask=offs_m < seqlen_q)
        if DROPOUT & VARIANT:  # (the loop's units, as above)
            delta = delta / dropout_scale

    dq_a = tl.zeros([BLOCK_M, DIM_A], dtype=tl.float32)
    dq_b = tl.zeros([BLOCK_M, DIM_B if DIM_B > 0 else 16], dtype=tl.float32)
    if MASK_LEFT & VARIANT:  # key tiles crossing the window's left edge
        dq_a, dq_b = _dq_key_loop(
            dq_a, dq_b, q_a, q_b, do_a, do_b, lse_units, delta, k_base, v_base, k_descs, v_descs,
            stride_kn, stride_vn,
            offs_m, lo, full_lo, seqlen_k, diag, window, score, dropout,
            BLOCK_N, HEAD_DIM, DIM_A, DIM_B, True, VARIANT, PRECISION, USE_TMA, False,
        )
    dq_a, dq_b = _dq_key_loop(
        dq_a, dq_b, q_a, q_b, do_a, do_b, lse_units, delta, k_base, v_base, k_descs, v_descs,
        stride_kn, stride_vn,
        offs_m, full_lo, full_hi, seqlen_k, diag, window, score, dropout,
        BLOCK_N, HEAD_DIM, DIM_A, DIM_B, False, VARIANT, PRECISION, USE_TMA, WARP_SPECIALIZE,
    )
    if not WARP_SPECIALIZE:  # (no masked tiles there; a second loop would fail to compile)
        dq_a, dq_b = _dq_key_loop(
            dq_a, dq_b, q_a, q_b, do_a, do_b, lse_units, delta, k_base, v_base, k_descs, v_descs,
            stride_kn, stride_vn,
            offs_m, full_hi, hi, seqlen_k, diag, window, score, dropout,
            BLOCK_N, HEAD_DIM, DIM_A, DIM_B, True, VARIANT, PRECISION, USE_TMA, False,
        )
    if FP32_EXACT & VARIANT:
        dq_a, dq_b = dq_a * row_scale[:, None], dq_b * row_scale[:, None]
    store_tile(tile_base(DQ, batch, head, q_first, stride_dqb, stride_dqh, stride_dqm), dq_a * softmax_scale,
               dq_b * softmax_scale, start_m, stride_dqm, seqlen_q, BLOCK_M, HEAD_DIM, DIM_A, DIM_B, PRECISION)


@on_tensor_device
@replayed
def attention_backward(dout, q, k, v, out, lse, options: AttentionOptions, dlse=None, cu_seqlens_q=None,
                       cu_seqlens_k=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0, block_table=None, grads=None,
                       delta_out=None, wrap_kernel=identity_wrap):
    """Gradients (dq, dk, dv, dsinks) of ``attention_forward``; same layouts and conventions, but
    no paged caches (``block_table``: a ValueError; they serve inference). dsinks is None without
    sinks.

    ``dlse`` is the gradient flowing into the logsumexp output, or None when it is unused.
    ``grads``, if given, is (dq, dk, dv) to write into (e.g. views of one packed qkv gradient,
    with unit last stride); otherwise they are allocated like q, k, v. ``delta_out``, if given, is
    a contiguous fp32 row statistic shaped like lse that receives delta = rowsum(dO * O) - dlse
    (flash-attn's private backward returns it).
    """
    if block_table is not None:
        raise ValueError("flash_attention: no backward through a paged KV cache (block_table); it is an inference path")
    dout, q, k, v, out = (last_dim_contiguous(t) for t in (dout, q, k, v, out))
    lse = lse.contiguous()
    layout = SequenceLayout.of(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dq, dk, dv = grads if grads is not None else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    has_dlse = dlse is not None
    delta = delta_out if delta_out is not None else layout.new_row_stats(q)
    if q.numel() == 0 or k.numel() == 0:  # nothing attends or nothing to attend to
        delta = delta.copy_(-dlse) if has_dlse else delta.zero_()  # (O = 0)
        return dq.zero_(), dk.zero_(), dv.zero_(), _sink_grad(options, lse, delta, wrap_kernel)
    num_heads, head_dim = q.shape[-2:]
    num_heads_kv = k.shape[-2]

    dim_a, dim_b = head_dim_chunks(head_dim)
    interpreted = is_interpreted(_attn_bwd_dq_kernel)
    common = dict(HEAD_DIM=head_dim, DIM_A=dim_a, DIM_B=dim_b, IS_VARLEN=layout.is_varlen)
    dlse = dlse.contiguous() if has_dlse else delta  # (an unread stand-in without dlse)
    plan = plan_backward(options, layout, interpreted, q, k, v, dout)
    if plan.dq.tl is not None or plan.dkdv.tl is not None:  # (what only the tl kernels take)
        matmul = dict(GROUP_SIZE=num_heads // num_heads_kv, VARIANT=kernel_variant(options, q.dtype, interpreted),
                      PRECISION=precision_mode(q.dtype, interpreted))
        option_args = (*layout.seqlens(), options.softmax_scale, *options.kernel_args(q))
    # fp32: the dQ kernel makes delta itself (from P and dP, not O) and the row scale 1 / c of the
    # stored lse's rounding, and runs before the dK/dV kernel and the sinks' gradient, which take
    # both (_attn_bwd_dq_kernel)
    exact = plan.delta_source == DELTA_FP32_PASS
    row_scale = layout.new_row_stats(q) if exact else delta  # (an unread stand-in otherwise)
    if any(step.tl is not None and step.tl.tma for step in (plan.dq, plan.dkdv)) and not interpreted:
        ensure_scratch_allocator()
    # delta from the tl dQ kernel (its prologue, or the fp32 first pass), which then runs first
    delta_in_dq = plan.delta_source in (DELTA_IN_DQ, DELTA_FP32_PASS)

    def launch_dq(config, specialized):
        grid = (cdiv(layout.seqlen_q, config.block_m), num_heads, layout.batch)
        launcher(_attn_bwd_dq_kernel, wrap_kernel)[grid](
            q, k, v, dout, out, lse, dlse, delta, row_scale, dq, *layout.cu_seqlens(q, k),
            *layout.strides(q), *layout.strides(k), *layout.strides(v), *layout.strides(dout), *layout.strides(out),
            *layout.strides(dq), *layout.stat_strides(delta), *option_args, **common, **matmul,
            USE_TMA=plan.dq.tl.tma, WARP_SPECIALIZE=specialized, COMPUTE_DELTA=plan.delta_source == DELTA_IN_DQ,
            HAS_DLSE=has_dlse, **config.launch_args(),
        )

    def launch_dkdv(config, specialized):
        grid = (cdiv(layout.seqlen_k, config.block_n), num_heads_kv, layout.batch)
        launcher(_attn_bwd_dkdv_kernel, wrap_kernel)[grid](
            q, k, v, dout, lse, delta, row_scale, dk, dv, *layout.cu_seqlens(q, k),
            *layout.strides(q), *layout.strides(k), *layout.strides(v), *layout.strides(dout),
            *layout.strides(dk), *layout.strides(dv), *layout.stat_strides(delta),
            *option_args, **common, **matmul,
            USE_TMA=plan.dkdv.tl.tma, **config.launch_args(),
        )

    pre_block = 64 if not interpreted else 32
    row_tiles = (cdiv(layout.seqlen_q, pre_block), num_heads, layout.batch)

    def launch_preprocess(dq_accumulator=None):
        zero_dq = dq_accumulator is not None
        dq_accumulator = dq_accumulator if zero_dq else dout  # (an unread stand-in otherwise)
        launcher(_attn_bwd_preprocess_kernel, wrap_kernel)[row_tiles](
            out, dout, dlse, delta, dq_accumulator, layout.cu_seqlens_q, layout.cu_seqlens(q, k)[2],
            *layout.strides(out), *layout.strides(dout), *layout.strides(dq_accumulator), *layout.stat_strides(delta),
            layout.seqlen_q, BLOCK_M=pre_block, HAS_DLSE=has_dlse, ZERO_DQ=zero_dq, **common,
        )

    if plan.fused:  # one kernel for dK, dV and dQ, added to a zeroed fp32 accumulator (ampere_backward, hopper_dkdv)
        dq_accumulator = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        launch_preprocess(dq_accumulator)
        plan.dq.gluon(dout, q, k, v, lse, delta, dq_accumulator, dk, dv, options, layout, plan.dq.gluon_config)
        launcher(_dq_from_accumulator_kernel, wrap_kernel)[row_tiles](
            dq_accumulator, dq, *layout.strides(dq_accumulator), *layout.strides(dq), layout.seqlen_q,
            BLOCK_M=pre_block, HEAD_DIM=head_dim, DIM_A=dim_a, DIM_B=dim_b,
            PRECISION=precision_mode(q.dtype, interpreted),
        )
        return dq, dk, dv, _sink_grad(options, lse, delta, wrap_kernel)

    def dq_pass():
        if plan.dq.gluon is not None:  # (it makes delta: DELTA_IN_DQ)
            plan.dq.gluon(dout, q, k, v, out, lse, dlse if has_dlse else None, delta, dq, options, layout,
                          plan.dq.gluon_config)
        else:
            launch_fitting(plan.dq.tl, launch_dq)

    if delta_in_dq:
        dq_pass()
    else:
        launch_preprocess()
    if plan.dkdv.gluon is not None:
        plan.dkdv.gluon(dout, q, k, v, lse, delta, dk, dv, options, layout, plan.dkdv.gluon_config)
    else:
        launch_fitting(plan.dkdv.tl, launch_dkdv)
    if not delta_in_dq:
        dq_pass()
    return dq, dk, dv, _sink_grad(options, lse, delta, wrap_kernel, row_scale if exact else None)


@triton.jit
def _sink_grad_kernel(Lse, Delta, RowScale, Sinks, DSinks, stride_b, stride_h, num_batches, num_rows,
                      BLOCK: tl.constexpr, SCALED: tl.constexpr):
    """d loss / d sink of one head (grid axis 0): -sum over its rows of exp(sink - lse) * delta
    (0 on rows with lse = +inf), summed in a fixed order, so bitwise repeatable. SCALED (fp32):
    each row's term times its RowScale (the dQ kernel's correction of the stored lse's rounding);
    delta is then the dQ kernel's sum_j P_ij dP_ij - dlse."""
    head = tl.program_id(0)
    sink = tl.load(Sinks + head).to(tl.float32)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for batch in range(num_batches):
        base = tl.cast(batch, tl.int64) * stride_b + head.to(tl.int64) * stride_h
        for start in range(0, num_rows, BLOCK):
            rows = start + tl.arange(0, BLOCK)
            lse = tl.load(Lse + base + rows, mask=rows < num_rows, other=float("inf"))
            delta = tl.load(Delta + base + rows, mask=rows < num_rows, other=0.0)
            if SCALED:
                delta = delta * tl.load(RowScale + base + rows, mask=rows < num_rows, other=1.0)
            total += tl.exp(sink - lse) * delta
    tl.store(DSinks + head, (-tl.sum(total, 0)).to(DSinks.dtype.element_ty))


def _sink_grad(options: AttentionOptions, lse, delta, wrap_kernel, row_scale=None):
    """The sinks' gradient (``_sink_grad_kernel``), None without sinks. lse and delta (and the fp32
    ``row_scale``) are contiguous, (batch, heads, seqlen_q) or, varlen, (heads, total_q). A kernel
    rather than a torch reduction, whose summation order torch.compile may change."""
    if options.sinks is None:
        return None
    dsinks = torch.empty_like(options.sinks)
    if dsinks.numel() == 0:
        return dsinks
    if lse.dim() == 2:
        stride_b, stride_h, num_batches, num_rows = 0, lse.stride(0), 1, lse.shape[1]
    else:
        stride_b, stride_h, num_batches, num_rows = lse.stride(0), lse.stride(1), lse.shape[0], lse.shape[2]
    launcher(_sink_grad_kernel, wrap_kernel)[(dsinks.numel(),)](
        lse, delta, delta if row_scale is None else row_scale, options.sinks, dsinks, stride_b, stride_h, num_batches,
        num_rows, BLOCK=256, SCALED=row_scale is not None)
    return dsinks
