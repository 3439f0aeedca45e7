"""The backward's dQ kernel for Hopper (sm_90), written in Gluon with explicit warp roles: the
dK/dV kernel's structure (``hopper_dkdv``) turned around, keys streamed past resident queries.

The tl dQ kernel (``backward._attn_bwd_dq_kernel``) runs its warps in lockstep through S -> P ->
dP -> dS -> dQ for each key tile, so the per-score work between the products (exp2, the softcap's
tanh and its gradient, the mask) leaves the tensor cores idle; under a softcap that made it 27%
slower (benchmarks/NOTES.md, v21). Here:

* one program per 128 query rows of one query head (dense batches); their Q and dO stay in
  shared memory, their lse and delta in registers;
* a producer warp streams the (K, V) tiles of 64 keys of the head's KV head through a ring of
  STAGES shared-memory buffers by TMA, with a "ready" and an "empty" mbarrier per buffer;
* two consumer warpgroups, each owning 64 of the query rows, read the ring independently. Per
  tile: S = Q K^T and dP = dO V^T (wgmma from shared memory, both in flight at once), P =
  exp2(S - lse) and dS = P (dP - delta) (times tanh' under a softcap) in registers, then dQ += dS K
  with dS as the register operand. Nothing holds the two warpgroups in step, so one's per-score
  work runs while the other's products do.
* causal: each warpgroup splits the key tiles into those its rows all see, those that cross its
  diagonal (masked, a loop of their own) and those past it (released unread: the other warpgroup
  may need them). Programs run longest rows first.
* dropout: each consumer redraws its pairs' keep bits while its S and dP products run
  (``hopper_dropout.dropout_rows``, bit for bit ``scores.dropout_keep``); dS takes the kept dP,
  with the 1 / (1 - p) of dP moved into delta and applied to dQ once at the end.

Math and conventions are the tl kernel's (the lse includes a sink's term, rows with lse = +inf get
P = 0, dQ is scaled by softmax_scale at the end), and delta comes from the preprocess kernel.
``plan`` decides where it runs (``hopper_gluon.fits``: full tiles here are 128 query rows and 64
keys; dropout only with causal masking); everything else takes the tl kernel.
"""

import torch

from . import hopper_gluon
from .hopper_gluon import CONSUMER_REGISTERS, gluon, score_arguments, tile_arguments
from .launch import SequenceLayout
from .options import DROPOUT, LOG2E, SINKS, SOFTCAP, AttentionOptions

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
    from .hopper_dropout import drop_unkept_rows, dropout_rows, row_calls
    from .hopper_gluon import ring_barriers, tanh_approx, tma_load

QUERY_ROWS = 64  # query rows per consumer warpgroup: the wgmma M of S and dQ
# keys per ring buffer: the wgmma N of S, K of dQ (the kernel and hopper_dropout.dropout_rows take
# 128 too: with half the ring it measured within 2% of 64 either way and spills, NOTES v22)
KEY_ROWS = 64
# Ring depth per head dim (shared memory: Q and dO 4 * 64 * d elements, each stage 2 * KEY_ROWS * d)
STAGES = {64: 6, 128: 4}


def plan(options: AttentionOptions, layout: SequenceLayout, interpreted: bool, *tensors: torch.Tensor) -> bool:
    """Whether the dQ of this call runs here rather than in the tl kernel (``hopper_gluon.fits``).
    ``tensors``: q, k, v, dout. Dropout without causal masking stays on the tl kernel, which is
    4% faster there (the Philox draws weigh more against this kernel's products, NOTES v22)."""
    allowed = SOFTCAP | SINKS | (DROPOUT if options.causal else 0)
    return hopper_gluon.fits(options, layout, interpreted, tensors, 2 * QUERY_ROWS, KEY_ROWS, allowed)


def attention_dq(dout, q, k, v, lse, delta, dq, options: AttentionOptions, layout: SequenceLayout) -> None:
    """Write dQ (softmax_scale applied) of a call ``plan`` accepted; lse and delta are contiguous
    (batch, heads, seqlen_q) fp32 (``SequenceLayout.new_row_stats``) with delta already computed.
    The kernel launches directly, not through torch.library.wrap_triton: ``plan`` keeps traced
    calls on the tl kernels."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    _, _, _, rng_state, _, _, _, _, dropout_threshold, dropout_scale = options.kernel_args(lse)
    _dq_kernel[(seqlen_q // (2 * QUERY_ROWS), num_heads, batch)](
        *tile_arguments((q, k, v, dout), layout, (QUERY_ROWS, KEY_ROWS, KEY_ROWS, QUERY_ROWS)),
        lse, delta, *layout.stat_strides(delta), dq, *layout.strides(dq),
        layout.seqlen_k, layout.seqlen_k - layout.seqlen_q, *score_arguments(options),
        rng_state, dropout_threshold, dropout_scale,
        HEAD_DIM=head_dim, KEYS=KEY_ROWS, GROUP_SIZE=num_heads // k.shape[2], STAGES=STAGES[head_dim],
        CAUSAL=options.causal, SOFTCAP=options.softcap > 0, DROPOUT=options.dropout_p > 0, CALLS_LAYOUT=CALLS,
        num_warps=4,
    )


if gluon is not None:
    CALLS = row_calls(KEY_ROWS)  # the layout of dropout's Philox calls (the kernel's CALLS_LAYOUT)
    ROWS = gl.constexpr(QUERY_ROWS)
    FIRST, SECOND = gl.constexpr(0), gl.constexpr(1)  # the consumer warpgroups
    REGISTERS = gl.constexpr(CONSUMER_REGISTERS)
    LOG2E_ = gl.constexpr(LOG2E)

    @gluon.jit
    def _visible_keys_end(last_row, diag, seqlen_k, KEYS: gl.constexpr, CAUSAL: gl.constexpr):
        """End of the key tiles that rows up to ``last_row`` see (causal row i sees keys j <= i + diag)."""
        if CAUSAL:
            return gl.minimum(gl.cdiv(gl.maximum(last_row + 1 + diag, 0), KEYS) * KEYS, seqlen_k)
        else:
            return seqlen_k

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, do_desc, q_row, q_col, do_row, do_col, k_row, k_col, v_row, v_col,
                  q_smem, do_smem, k_bufs, v_bufs, qdo_bar, ready, empty, keys_end, STAGES: gl.constexpr):
        """One warp: the program's Q and dO once, then the (K, V) tiles of keys [0, keys_end) through the ring."""
        KEYS: gl.constexpr = k_bufs.shape[1]
        mbarrier.expect(qdo_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
        for w in gl.static_range(2):
            tma_load(q_desc, [q_row + w * ROWS, q_col], qdo_bar, q_smem.index(w))
            tma_load(do_desc, [do_row + w * ROWS, do_col], qdo_bar, do_smem.index(w))
        i = 0
        for n in range(0, keys_end, KEYS):
            idx = i % STAGES
            mbarrier.wait(empty.index(idx), ((i // STAGES) & 1) ^ 1)  # (a fresh barrier passes parity 1)
            mbarrier.expect(ready.index(idx), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma_load(k_desc, [k_row + n, k_col], ready.index(idx), k_bufs.index(idx))
            tma_load(v_desc, [v_row + n, v_col], ready.index(idx), v_bufs.index(idx))
            i += 1

    @gluon.jit
    def _key_tile(dq, q, do, k_bufs, v_bufs, ready, empty, i, n, first_row, rows, lse_log2, delta, diag,
                  qk_log2, tanh_scale, softcap_log2, dropout, S_LAYOUT: gl.constexpr, OPERAND_LAYOUT: gl.constexpr,
                  CALLS_LAYOUT: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr, SOFTCAP: gl.constexpr,
                  DROPOUT: gl.constexpr):
        """dQ of a warpgroup's 64 query rows after key tile [n, n + KEYS), ring buffer ``i``. MASKED:
        the tile crosses the causal diagonal."""
        dtype: gl.constexpr = k_bufs.dtype
        KEYS: gl.constexpr = k_bufs.shape[1]
        idx = i % STAGES
        mbarrier.wait(ready.index(idx), (i // STAGES) & 1)
        k = k_bufs.index(idx)
        v = v_bufs.index(idx)
        zero_s = gl.zeros([ROWS, KEYS], gl.float32, S_LAYOUT)
        s = warpgroup_mma(q, k.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp = warpgroup_mma(do, v.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        if DROPOUT:  # (drawn while the products run)
            words = dropout_rows(dropout, first_row, n, S_LAYOUT, CALLS_LAYOUT)
        s = warpgroup_mma_wait(1, deps=(s,))
        if SOFTCAP:
            capped = tanh_approx(s * tanh_scale)
            logits = capped * softcap_log2 - lse_log2[:, None]
        else:
            logits = s * qk_log2 - lse_log2[:, None]
        if MASKED:  # (masked before the exp2: the mask's predicate dies at once)
            keys = n + gl.arange(0, KEYS, gl.SliceLayout(0, S_LAYOUT))
            logits = gl.where(keys[None, :] <= rows[:, None] + diag, logits, float("-inf"))
        p = gl.exp2(logits)
        dp = warpgroup_mma_wait(0, deps=(dp,))
        if DROPOUT:  # (dP's 1 / (1 - p) is in delta and in the final scale)
            dp = drop_unkept_rows(dropout, words, dp)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - capped * capped)
        dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), OPERAND_LAYOUT), k, dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq,))
        mbarrier.arrive(empty.index(idx), count=1)
        return dq

    @gluon.jit
    def _consumer(q_smem, do_smem, k_bufs, v_bufs, qdo_bar, ready, empty, Lse, Delta, stat_base, DQ, dq_base,
                  stride_dqm, start_m, keys_end, diag, qk_log2, tanh_scale, softcap_log2, softmax_scale,
                  RngState, stream, dropout_threshold, dropout_scale, WG: gl.constexpr, HEAD_DIM: gl.constexpr,
                  CALLS_LAYOUT: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, SOFTCAP: gl.constexpr,
                  DROPOUT: gl.constexpr):
        """One warpgroup: dQ of query rows [start_m + WG * 64, + 64) over every key tile."""
        KEYS: gl.constexpr = k_bufs.shape[1]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, KEYS, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        operand_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        first_row = start_m + WG * ROWS
        rows = first_row + gl.arange(0, ROWS, gl.SliceLayout(1, s_layout))
        lse_log2 = gl.load(Lse + stat_base + rows) * LOG2E_
        delta = gl.load(Delta + stat_base + rows)
        if DROPOUT:  # dS = P (keep dP / (1 - p) - delta) = P (keep dP - delta (1 - p)) / (1 - p)
            delta = delta / dropout_scale
            softmax_scale = softmax_scale * dropout_scale
        dropout = (RngState, stream, dropout_threshold)
        q = q_smem.index(WG)
        do = do_smem.index(WG)
        dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, acc_layout)
        # key tiles [0, full_end) are visible to all 64 rows, [full_end, own_end) cross their
        # diagonal, [own_end, keys_end) lie past it (only the other warpgroup reads them)
        own_end = _visible_keys_end(first_row + ROWS - 1, diag, keys_end, KEYS, CAUSAL)
        full_end = own_end
        if CAUSAL:
            full_end = gl.minimum(gl.maximum(first_row + 1 + diag, 0) // KEYS * KEYS, own_end)
        mbarrier.wait(qdo_bar, 0)
        i = 0
        for n in range(0, full_end, KEYS):
            dq = _key_tile(dq, q, do, k_bufs, v_bufs, ready, empty, i, n, first_row, rows, lse_log2, delta, diag,
                           qk_log2, tanh_scale, softcap_log2, dropout, s_layout, operand_layout, CALLS_LAYOUT,
                           STAGES, False, SOFTCAP, DROPOUT)
            i += 1
        for n in range(full_end, own_end, KEYS):
            dq = _key_tile(dq, q, do, k_bufs, v_bufs, ready, empty, i, n, first_row, rows, lse_log2, delta, diag,
                           qk_log2, tanh_scale, softcap_log2, dropout, s_layout, operand_layout, CALLS_LAYOUT,
                           STAGES, True, SOFTCAP, DROPOUT)
            i += 1
        for n in range(own_end, keys_end, KEYS):  # (waited for, so that no arrival runs a phase ahead)
            idx = i % STAGES
            mbarrier.wait(ready.index(idx), (i // STAGES) & 1)
            mbarrier.arrive(empty.index(idx), count=1)
            i += 1
        out_rows = (first_row + gl.arange(0, ROWS, gl.SliceLayout(1, acc_layout))).to(gl.int64)
        dims = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, acc_layout))
        dq = dq * softmax_scale
        gl.store(DQ + dq_base + out_rows[:, None] * stride_dqm + dims[None, :], dq.to(DQ.dtype.element_ty))

    @gluon.jit
    def _dq_kernel(q_desc, k_desc, v_desc, do_desc,
                   q_batch_rows, q_head_rows, q_head_cols, k_batch_rows, k_head_rows, k_head_cols,
                   v_batch_rows, v_head_rows, v_head_cols, do_batch_rows, do_head_rows, do_head_cols,
                   Lse, Delta, stride_stat_b, stride_stat_h, DQ, stride_dqb, stride_dqh, stride_dqm,
                   seqlen_k, diag, qk_log2, tanh_scale, softcap_log2, softmax_scale,
                   RngState, dropout_threshold, dropout_scale,
                   HEAD_DIM: gl.constexpr, KEYS: gl.constexpr, GROUP_SIZE: gl.constexpr, STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, SOFTCAP: gl.constexpr, DROPOUT: gl.constexpr, CALLS_LAYOUT: gl.constexpr):
        """CALLS_LAYOUT: ``hopper_dropout.row_calls(KEYS)``, the layout of dropout's Philox calls."""
        tile = gl.program_id(0)
        if CAUSAL:  # longest rows first, so that the short ones fill the last wave
            tile = gl.num_programs(0) - 1 - tile
        start_m = tile * (2 * ROWS)
        head = gl.program_id(1)
        batch = gl.program_id(2)
        kv_head = head // GROUP_SIZE
        keys_end = _visible_keys_end(start_m + 2 * ROWS - 1, diag, seqlen_k, KEYS, CAUSAL)

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, ROWS, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [2, ROWS, HEAD_DIM], do_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, KEYS, HEAD_DIM], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, KEYS, HEAD_DIM], v_desc.layout)
        qdo_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(qdo_bar, count=1)
        ready, empty = ring_barriers(STAGES)

        stat_base = batch.to(gl.int64) * stride_stat_b + head.to(gl.int64) * stride_stat_h
        dq_base = batch.to(gl.int64) * stride_dqb + head.to(gl.int64) * stride_dqh
        stream = (batch * gl.num_programs(1) + head).to(gl.uint32)  # dropout's Philox stream
        # (each partition's arguments spelled out: adding tuples would turn the constexprs into ints)
        gl.warp_specialize([
            (_consumer, (q_smem, do_smem, k_bufs, v_bufs, qdo_bar, ready, empty, Lse, Delta, stat_base, DQ, dq_base,
                         stride_dqm, start_m, keys_end, diag, qk_log2, tanh_scale, softcap_log2, softmax_scale,
                         RngState, stream, dropout_threshold, dropout_scale, FIRST, HEAD_DIM, CALLS_LAYOUT, STAGES,
                         CAUSAL, SOFTCAP, DROPOUT)),
            (_consumer, (q_smem, do_smem, k_bufs, v_bufs, qdo_bar, ready, empty, Lse, Delta, stat_base, DQ, dq_base,
                         stride_dqm, start_m, keys_end, diag, qk_log2, tanh_scale, softcap_log2, softmax_scale,
                         RngState, stream, dropout_threshold, dropout_scale, SECOND, HEAD_DIM, CALLS_LAYOUT, STAGES,
                         CAUSAL, SOFTCAP, DROPOUT)),
            (_producer, (q_desc, k_desc, v_desc, do_desc,
                         batch * q_batch_rows + head * q_head_rows + start_m, head * q_head_cols,
                         batch * do_batch_rows + head * do_head_rows + start_m, head * do_head_cols,
                         batch * k_batch_rows + kv_head * k_head_rows, kv_head * k_head_cols,
                         batch * v_batch_rows + kv_head * v_head_rows, kv_head * v_head_cols,
                         q_smem, do_smem, k_bufs, v_bufs, qdo_bar, ready, empty, keys_end, STAGES)),
        ], [4, 1], [REGISTERS, 24])
