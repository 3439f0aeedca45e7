"""The backward in one kernel for GPUs with mma.sync (the A100 class), written in Gluon, dQ by atomics.

The tl backward (``backward.py``) is two kernels and no atomics: the dK/dV kernel computes S, P,
dP and dS for each (key tile, query tile) pair and the dQ kernel computes them again, 7 matmuls per
pair. On mma.sync that costs a quarter of FlashAttention-2's speed at head dim 128, where every tl
kernel already runs at 255 registers and no tile helps (docs/design.md#ampere-gluon-backward).
This kernel is FlashAttention-2's backward: 5 matmuls per pair, dQ added to an fp32 accumulator
with atomics, so its sum is not bitwise repeatable and the route gives it only calls that do not
ask for determinism (``ampere_route``).

One program per ``key_tile`` keys of one KV head; K and V stay in shared memory. It streams the
(Q, dO) tiles of ``query_tile`` query rows of every query head of the group (GQA), double-buffered
by cp.async, and per tile (the tiles and warp grids are the GPU class's
``configs.FusedBackwardConfig``; in parentheses the A100 class's at head dim 128: 128 keys, 64 rows,
8 warps; at 64 the tiles have 128 rows):

* S^T = K Q^T and dP^T = V dO^T (each warp 32 keys x 32 queries), the head dim in steps of KCHUNK
  (16) read from shared memory per step (FlashAttention-2's warp grid: a grid of one column would
  read all of Q^T into every warp, a quarter more shared-memory traffic, measured slower);
* P^T = exp2(S^T * scale log2 e - lse log2 e) (masked on the tiles that cross the causal
  diagonal), dS^T = P^T (dP^T - delta), both stored to shared memory as bf16/fp16;
* dV += P^T dO and dK += dS^T Q (each warp 32 keys x 64 of the head dim), the queries in steps of
  KCHUNK; dQ = dS K (each warp 32 queries x 32 of the head dim), times softmax_scale, added to
  the fp32 accumulator by ``red.global.add.f32``.

Math and conventions are the tl kernels' (lse includes a sink's term and rows with lse = +inf get
P = 0; dK is scaled by softmax_scale at the end). The caller makes delta and zeroes the
accumulator first (the preprocess kernel, ``ZERO_DQ``) and converts it after
(``backward._dq_from_accumulator_kernel``). Full tiles only (``ampere_route.fits``). Shared
memory on the A100 class: at head dim 128, K, V 2 x 32 KB, two (Q, dO) stages 64 KB, P^T and dS^T
32 KB; at 64 (128-row tiles), K, V 2 x 16 KB, the stages 64 KB, P^T and dS^T 64 KB: 160 KB of
its 163 (configs.GPU_CLASSES) either way.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .configs import FusedBackwardConfig
from .direct_launch import launcher
from .launch import SequenceLayout
from .options import LOG2E, AttentionOptions

KCHUNK = 16  # the depth of one step of each product (32 spilled at head dim 128: 15 loads a tile)
# Names that moved between the releases hopper_route.CHECKED_VERSIONS holds: a CTA-wide barrier
# (gl.thread_barrier up to 3.6, gl.barrier from 3.7) and cp.async's load (async_load from 3.8)
cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


def attention_backward_fused(dout, q, k, v, lse, delta, dq_accumulator, dk, dv, options: AttentionOptions,
                             layout: SequenceLayout, config: FusedBackwardConfig) -> None:
    """Write dK and dV and add softmax_scale * dQ to the zeroed fp32 ``dq_accumulator`` (shaped
    like q) for a call the route gave this kernel, with ``config``, its GPU class's tiles at its
    head dim (configs.FUSED_BACKWARD); lse and delta (batch, heads, seqlen_q) fp32, delta already
    computed. Launched directly: the route keeps traced calls on the tl kernels."""
    batch, _, num_heads, head_dim = q.shape
    num_heads_kv = k.shape[2]
    launcher(_backward_kernel)[(layout.seqlen_k // config.key_tile, num_heads_kv, batch)](
        q, k, v, dout, lse, delta, dq_accumulator, dk, dv,
        *layout.strides(q), *layout.strides(k), *layout.strides(v), *layout.strides(dout),
        *layout.strides(dq_accumulator), *layout.strides(dk), *layout.strides(dv), *layout.stat_strides(lse),
        layout.seqlen_q, layout.seqlen_k, options.softmax_scale * LOG2E, options.softmax_scale,
        GROUP_SIZE=num_heads // num_heads_kv, HEAD_DIM=head_dim, CAUSAL=options.causal, ROWS=config.query_tile,
        KEYS=config.key_tile, S_GRID=config.warp_grids[0], KV_GRID=config.warp_grids[1],
        DQ_GRID=config.warp_grids[2], num_warps=config.num_warps,
    )


_STEP = gl.constexpr(KCHUNK)
_LOG2E = gl.constexpr(LOG2E)
# the shared layout Triton gives mma.sync operands of 2-byte types: 16-byte vectors, 8 phases
_SHARED = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))


@gluon.constexpr_function
def _mma_layout(warps_along_rows, num_warps):
    """An mma.sync result's layout with ``warps_along_rows`` warps along its rows, the rest along
    its columns."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps_along_rows, num_warps // warps_along_rows],
                                     instr_shape=[16, 8])


@gluon.constexpr_function
def _operand(index, parent):
    """The layout of operand ``index`` (0: A, 1: B) of mma.sync products into ``parent`` (2-byte
    types: two elements along the depth per register)."""
    return gl.DotOperandLayout(operand_index=index, parent=parent, k_width=2)


@gluon.jit
def _copy_rows(smem, base, first_row, stride_row):
    """cp.async the rows [first_row, + rows of ``smem``) of a (row, head dim) slice into ``smem``,
    16 bytes a thread."""
    ROWS: gl.constexpr = smem.shape[0]
    HEAD_DIM: gl.constexpr = smem.shape[1]
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [gl.num_warps(), 1],
                                                 [1, 0])
    rows = first_row + gl.arange(0, ROWS, gl.SliceLayout(1, load_layout))
    cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, load_layout))
    async_load(smem, base + rows[:, None].to(gl.int64) * stride_row + cols[None, :])


@gluon.jit
def _times_transposed(a_smem, b_smem, acc):
    """acc + a b^T for a (M, K) and b (N, K) in shared memory, K in steps of _STEP."""
    a_layout: gl.constexpr = _operand(0, acc.type.layout)
    b_layout: gl.constexpr = _operand(1, acc.type.layout)
    for c in gl.static_range(a_smem.shape[1] // _STEP):
        a = a_smem.slice(c * _STEP, _STEP, dim=1).load(a_layout)
        b = b_smem.slice(c * _STEP, _STEP, dim=1).permute((1, 0)).load(b_layout)
        acc = mma_v2(a, b, acc)
    return acc


@gluon.jit
def _query_tile(dk, dv, k_smem, v_smem, q, do, p_smem, ds_smem, keys, m, diag, lse_row, delta_row, dq_ptrs,
                qk_scale_log2, softmax_scale, S_LAYOUT: gl.constexpr, DQ_LAYOUT: gl.constexpr, MASKED: gl.constexpr):
    """dK, dV after query tile [m, + rows of ``q``) (its Q and dO in ``q``, ``do``), with its dQ
    added to the accumulator at ``dq_ptrs``. MASKED: the tile crosses the causal diagonal."""
    dtype: gl.constexpr = q.dtype
    KEYS: gl.constexpr = p_smem.shape[0]
    ROWS: gl.constexpr = p_smem.shape[1]
    HEAD_DIM: gl.constexpr = q.shape[1]
    queries = m + gl.arange(0, ROWS, gl.SliceLayout(0, S_LAYOUT))
    lse_log2 = gl.load(lse_row + queries) * _LOG2E  # (loaded first: their latency under the products)
    delta = gl.load(delta_row + queries)
    s_t = _times_transposed(k_smem, q, gl.zeros([KEYS, ROWS], gl.float32, S_LAYOUT))
    dp_t = _times_transposed(v_smem, do, gl.zeros([KEYS, ROWS], gl.float32, S_LAYOUT))
    x = s_t * qk_scale_log2 - lse_log2[None, :]
    if MASKED:
        x = gl.where(queries[None, :] + diag >= keys[:, None], x, -float("inf"))
    p_t = gl.exp2(x)
    p_smem.store(p_t.to(dtype))
    ds_smem.store((p_t * (dp_t - delta[None, :])).to(dtype))
    cta_barrier()
    a_kv: gl.constexpr = _operand(0, dk.type.layout)
    b_kv: gl.constexpr = _operand(1, dk.type.layout)
    for c in gl.static_range(ROWS // _STEP):  # over the queries: dV += P^T dO, dK += dS^T Q
        dv = mma_v2(p_smem.slice(c * _STEP, _STEP, dim=1).load(a_kv), do.slice(c * _STEP, _STEP, dim=0).load(b_kv), dv)
        dk = mma_v2(ds_smem.slice(c * _STEP, _STEP, dim=1).load(a_kv), q.slice(c * _STEP, _STEP, dim=0).load(b_kv), dk)
    a_dq: gl.constexpr = _operand(0, DQ_LAYOUT)
    b_dq: gl.constexpr = _operand(1, DQ_LAYOUT)
    dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, DQ_LAYOUT)
    for c in gl.static_range(KEYS // _STEP):  # over the keys: dQ = dS K
        dq = mma_v2(ds_smem.slice(c * _STEP, _STEP, dim=0).permute((1, 0)).load(a_dq),
                    k_smem.slice(c * _STEP, _STEP, dim=0).load(b_dq), dq)
    gl.atomic_add(dq_ptrs, dq * softmax_scale, sem="relaxed")
    return dk, dv


@gluon.jit
def _step(t, total, tiles, m_lo, q_smem, do_smem, q_base, do_base, stride_qh, stride_qm, stride_doh, stride_dom):
    """Start loading tile t + 1 (of ``total``: query head t // tiles of the group, its tile from
    m_lo on) into the other buffer, and wait for tile t's; its (Q, dO) buffers."""
    ROWS: gl.constexpr = q_smem.shape[1]
    nxt = t + 1
    if nxt < total:
        group = (nxt // tiles).to(gl.int64)
        m = m_lo + (nxt - group * tiles) * ROWS
        _copy_rows(q_smem.index(nxt % 2), q_base + group * stride_qh, m, stride_qm)
        _copy_rows(do_smem.index(nxt % 2), do_base + group * stride_doh, m, stride_dom)
    async_copy.commit_group()  # (an empty group past the last tile keeps the wait's count)
    async_copy.wait_group(1)
    cta_barrier()
    return q_smem.index(t % 2), do_smem.index(t % 2)


@gluon.jit
def _query_tiles(dk, dv, t, m_from, m_to, stream, k_smem, v_smem, p_smem, ds_smem, keys, diag, lse_row, delta_row,
                 dq_head, dq_tile, stride_dqm, qk_scale_log2, softmax_scale, S_LAYOUT: gl.constexpr,
                 DQ_LAYOUT: gl.constexpr, MASKED: gl.constexpr):
    """dK, dV after the query tiles [m_from, m_to) of one query head, the ring's tiles t on
    (``stream``: _step's arguments after t), and the next tile's index."""
    total, tiles, m_lo, q_smem, do_smem, q_base, do_base, stride_qh, stride_qm, stride_doh, stride_dom = stream
    for m in range(m_from, m_to, q_smem.shape[1]):
        q, do = _step(t, total, tiles, m_lo, q_smem, do_smem, q_base, do_base, stride_qh, stride_qm, stride_doh,
                      stride_dom)
        dk, dv = _query_tile(dk, dv, k_smem, v_smem, q, do, p_smem, ds_smem, keys, m, diag, lse_row, delta_row,
                             dq_head + m.to(gl.int64) * stride_dqm + dq_tile, qk_scale_log2, softmax_scale, S_LAYOUT,
                             DQ_LAYOUT, MASKED)
        cta_barrier()  # (every warp is done with these buffers before the next step loads into them)
        t += 1
    return dk, dv, t


@gluon.jit
def _backward_kernel(Q, K, V, DO, LSE, DELTA, DQ_ACC, DK, DV,
                     stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                     stride_dqb, stride_dqh, stride_dqm, stride_dkb, stride_dkh, stride_dkn,
                     stride_dvb, stride_dvh, stride_dvn, stride_stat_b, stride_stat_h,
                     seqlen_q, seqlen_k, qk_scale_log2, softmax_scale,
                     GROUP_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, ROWS: gl.constexpr,
                     KEYS: gl.constexpr, S_GRID: gl.constexpr, KV_GRID: gl.constexpr, DQ_GRID: gl.constexpr):
    """ROWS query rows per streamed tile, KEYS keys per program; the warps along the keys of S^T
    (S_GRID) and of dK/dV (KV_GRID) and along the rows of dQ (DQ_GRID):
    configs.FusedBackwardConfig.warp_grids."""
    dtype: gl.constexpr = Q.dtype.element_ty
    S_LAYOUT: gl.constexpr = _mma_layout(S_GRID, gl.num_warps())
    KV_LAYOUT: gl.constexpr = _mma_layout(KV_GRID, gl.num_warps())
    DQ_LAYOUT: gl.constexpr = _mma_layout(DQ_GRID, gl.num_warps())
    start_n = gl.program_id(0) * KEYS
    kv_head = gl.program_id(1).to(gl.int64)  # (int64: head strides times heads)
    batch = gl.program_id(2).to(gl.int64)
    head = kv_head * GROUP_SIZE  # the group's first query head
    diag = seqlen_k - seqlen_q  # key j is seen from query i when j <= i + diag (causal)

    k_smem = gl.allocate_shared_memory(dtype, [KEYS, HEAD_DIM], _SHARED)
    v_smem = gl.allocate_shared_memory(dtype, [KEYS, HEAD_DIM], _SHARED)
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], _SHARED)
    do_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], _SHARED)
    p_smem = gl.allocate_shared_memory(dtype, [KEYS, ROWS], _SHARED)
    ds_smem = gl.allocate_shared_memory(dtype, [KEYS, ROWS], _SHARED)

    _copy_rows(k_smem, K + batch * stride_kb + kv_head * stride_kh, start_n, stride_kn)
    _copy_rows(v_smem, V + batch * stride_vb + kv_head * stride_vh, start_n, stride_vn)
    # the query tiles any key of the program is seen from: [m_lo, seqlen_q), of which those
    # before m_full cross the diagonal
    m_lo = 0
    m_full = 0
    if CAUSAL:
        m_lo = gl.minimum(gl.maximum(start_n - diag, 0) // ROWS * ROWS, seqlen_q)
        m_full = gl.minimum(gl.maximum(gl.cdiv(start_n + KEYS - 1 - diag, ROWS) * ROWS, m_lo), seqlen_q)
    tiles = (seqlen_q - m_lo) // ROWS  # (of each query head)
    q_base = Q + batch * stride_qb + head * stride_qh
    do_base = DO + batch * stride_dob + head * stride_doh
    _copy_rows(q_smem.index(0), q_base, m_lo, stride_qm)
    _copy_rows(do_smem.index(0), do_base, m_lo, stride_dom)
    async_copy.commit_group()
    stream = (GROUP_SIZE * tiles, tiles, m_lo, q_smem, do_smem, q_base, do_base, stride_qh, stride_qm, stride_doh,
              stride_dom)

    keys = start_n + gl.arange(0, KEYS, gl.SliceLayout(1, S_LAYOUT))
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, KV_LAYOUT)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, KV_LAYOUT)
    dq_rows = gl.arange(0, ROWS, gl.SliceLayout(1, DQ_LAYOUT))
    dq_cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, DQ_LAYOUT))
    dq_tile = dq_rows[:, None].to(gl.int64) * stride_dqm + dq_cols[None, :]
    dq_base = DQ_ACC + batch * stride_dqb + head * stride_dqh
    stat_base = batch * stride_stat_b + head * stride_stat_h
    t = 0
    for g in range(GROUP_SIZE):
        g = g.to(gl.int64)
        lse_row = LSE + stat_base + g * stride_stat_h
        delta_row = DELTA + stat_base + g * stride_stat_h
        dq_head = dq_base + g * stride_dqh
        dk, dv, t = _query_tiles(dk, dv, t, m_lo, m_full, stream, k_smem, v_smem, p_smem, ds_smem, keys, diag, lse_row,
                                 delta_row, dq_head, dq_tile, stride_dqm, qk_scale_log2, softmax_scale, S_LAYOUT,
                                 DQ_LAYOUT, True)
        dk, dv, t = _query_tiles(dk, dv, t, m_full, seqlen_q, stream, k_smem, v_smem, p_smem, ds_smem, keys, diag,
                                 lse_row, delta_row, dq_head, dq_tile, stride_dqm, qk_scale_log2, softmax_scale,
                                 S_LAYOUT, DQ_LAYOUT, False)
    async_copy.wait_group(0)
    rows = (start_n + gl.arange(0, KEYS, gl.SliceLayout(1, KV_LAYOUT)))[:, None].to(gl.int64)
    cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, KV_LAYOUT))[None, :]
    gl.store(DK + batch * stride_dkb + kv_head * stride_dkh + rows * stride_dkn + cols, (dk * softmax_scale).to(dtype))
    gl.store(DV + batch * stride_dvb + kv_head * stride_dvh + rows * stride_dvn + cols, dv.to(dtype))
