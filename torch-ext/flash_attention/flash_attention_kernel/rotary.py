"""Rotary position embeddings (RoPE): rotate the first ``rotary_dim`` features of each head.

For a row at position t (its index in its sequence plus that sequence's offset) and feature pair
i < rotary_dim / 2, with c = cos[t, i] and s = sin[t, i] from tables of shape
(seqlen_ro, rotary_dim / 2):

    y1 = x1 c - x2 s
    y2 = x1 s + x2 c

where (x1, x2) is features (i, i + rotary_dim / 2) (GPT-NeoX style) or, ``interleaved``, features
(2i, 2i + 1) (GPT-J style). Features from rotary_dim on are copied unchanged. ``conjugate``
rotates by -t (s -> -s): the rotation's inverse and its transpose, hence its gradient. Positions
at or past seqlen_ro rotate by 0 (c = 1, s = 0), as flash-attn's kernel does, and so do negative
ones (a wrong offsets tensor); varlen sequences are clamped into x's rows (tiles.sequence_span),
so wrong metadata never moves an access outside x, out or the tables. The arithmetic is
fp32 whatever the input dtype; results are stored in the input's dtype, in place or to a new tensor.

One program rotates BLOCK_M rows x BLOCK_H heads of one sequence, so cos/sin are read once per
row for all of its heads. Layouts: dense (batch, seqlen, heads, head_dim) or varlen
(total_tokens, heads, head_dim) with int32 cu_seqlens; any strides with a contiguous last dim.
Offsets: one int for every sequence, or an integer tensor (batch,).
"""

import torch
import triton
import triton.language as tl

from .direct_launch import launcher
from .launch import (
    cdiv, identity_wrap, is_interpreted, last_dim_contiguous, next_power_of_2, on_tensor_device, precision_mode,
)
from .tiles import load_rows, round_to, sequence_span


@triton.jit(do_not_specialize=["seqlen", "seqlen_ro", "offset", "total_rows"])
def _rotary_kernel(
    X, Out, Cos, Sin, Offsets, CuSeqlens, total_rows,
    stride_xb, stride_xm, stride_xh,
    stride_ob, stride_om, stride_oh,
    stride_cos, stride_sin,
    seqlen, num_heads, seqlen_ro, offset,
    HALF: tl.constexpr, HALF_PADDED: tl.constexpr, TAIL: tl.constexpr, TAIL_PADDED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr, IS_VARLEN: tl.constexpr,
    OFFSETS_PER_SEQUENCE: tl.constexpr, COPY_TAIL: tl.constexpr, PRECISION: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    head_start = tl.program_id(1) * BLOCK_H
    batch = tl.program_id(2)
    if IS_VARLEN:
        first, seqlen = sequence_span(batch, CuSeqlens, seqlen, total_rows, IS_VARLEN)
        x_base = X + first.to(tl.int64) * stride_xm
        out_base = Out + first.to(tl.int64) * stride_om
    else:
        x_base = X + batch.to(tl.int64) * stride_xb
        out_base = Out + batch.to(tl.int64) * stride_ob
    if start_m >= seqlen:
        return
    if OFFSETS_PER_SEQUENCE:
        offset = tl.load(Offsets + batch)

    rows = start_m + tl.arange(0, BLOCK_M)
    heads = head_start + tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, HALF_PADDED)
    positions = (rows + offset).to(tl.int64)
    table_mask = ((positions >= 0) & (positions < seqlen_ro))[:, None] & (pairs < HALF)[None, :]
    cos = tl.load(Cos + positions[:, None] * stride_cos + pairs[None, :], mask=table_mask, other=1.0)
    sin = tl.load(Sin + positions[:, None] * stride_sin + pairs[None, :], mask=table_mask, other=0.0)
    cos = cos.to(tl.float32)[:, None, :]
    sin = sin.to(tl.float32)[:, None, :]
    if CONJUGATE:
        sin = -sin

    row_head = (rows < seqlen)[:, None, None] & (heads < num_heads)[None, :, None]
    x_rows = x_base + rows.to(tl.int64)[:, None, None] * stride_xm + heads[None, :, None] * stride_xh
    out_rows = out_base + rows.to(tl.int64)[:, None, None] * stride_om + heads[None, :, None] * stride_oh
    element_type: tl.constexpr = Out.dtype.element_ty
    if INTERLEAVED:  # pairs are neighbours: one contiguous load, split into (even, odd) in registers
        features = tl.arange(0, 2 * HALF_PADDED)
        mask = row_head & (features < 2 * HALF)[None, None, :]
        x = tl.load(x_rows + features[None, None, :], mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_H, HALF_PADDED, 2]))
        rotated = tl.join(x1 * cos - x2 * sin, x1 * sin + x2 * cos)
        rotated = tl.reshape(rotated, [BLOCK_M, BLOCK_H, 2 * HALF_PADDED])
        tl.store(out_rows + features[None, None, :], round_to(rotated, element_type, PRECISION).to(element_type),
                 mask=mask)
    else:
        mask = row_head & (pairs < HALF)[None, None, :]
        x1 = tl.load(x_rows + pairs[None, None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_rows + HALF + pairs[None, None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_rows + pairs[None, None, :],
                 round_to(x1 * cos - x2 * sin, element_type, PRECISION).to(element_type), mask=mask)
        tl.store(out_rows + HALF + pairs[None, None, :],
                 round_to(x1 * sin + x2 * cos, element_type, PRECISION).to(element_type), mask=mask)
    if COPY_TAIL:  # features past rotary_dim, unchanged
        tail = 2 * HALF + tl.arange(0, TAIL_PADDED)
        tail_mask = row_head & (tail < 2 * HALF + TAIL)[None, None, :]
        tl.store(out_rows + tail[None, None, :], tl.load(x_rows + tail[None, None, :], mask=tail_mask),
                 mask=tail_mask)


@triton.jit
def load_rotated_rows(base_ptr, row_offsets, row_mask, positions, Cos, Sin, stride_cos, seqlen_ro,
                      COL_START: tl.constexpr, COLS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, PRECISION: tl.constexpr):
    """Columns [COL_START, COL_START + COLS) of rows at ``row_offsets`` from ``base_ptr`` (as
    tiles.load_rows), the first ROTARY_DIM features rotated by each row's position (0: none), for
    kernels that rotate what they load (the KV-cache kernels rotate q and the new keys so). Each
    feature is paired with its partner (i +- ROTARY_DIM / 2, or i ^ 1 when INTERLEAVED), read by a
    second gather that the cache serves: y = x cos -+ partner sin. Rounded to the input's dtype, as
    a rotation stored by ``_rotary_kernel`` would be."""
    x = load_rows(base_ptr, row_offsets, row_mask, COL_START, COLS, HEAD_DIM)
    if ROTARY_DIM == 0 or COL_START >= ROTARY_DIM:
        return x
    HALF: tl.constexpr = ROTARY_DIM // 2
    cols = COL_START + tl.arange(0, COLS)
    rotating = cols < ROTARY_DIM
    if INTERLEAVED:
        partner = cols ^ 1
        pair = cols // 2
        first = cols % 2 == 0
    else:
        first = cols < HALF
        partner = tl.where(first, cols + HALF, cols - HALF)
        pair = tl.where(first, cols, cols - HALF)
    mask = row_mask[:, None] & rotating[None, :]
    other = tl.load(base_ptr + row_offsets[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    table = (positions.to(tl.int64) * stride_cos)[:, None] + pair[None, :]
    in_table = mask & (positions < seqlen_ro)[:, None]  # positions past the tables rotate by 0 (never negative:
    # the KV-cache kernel clamps cache_seqlens into [0, capacity])
    cos = tl.load(Cos + table, mask=in_table, other=1.0).to(tl.float32)
    sin = tl.load(Sin + table, mask=in_table, other=0.0).to(tl.float32)
    rotated = x.to(tl.float32) * cos + tl.where(first[None, :], -other, other) * sin
    return tl.where(rotating[None, :], round_to(rotated, x.dtype, PRECISION), x)


@on_tensor_device
def apply_rotary(x, cos, sin, seqlen_offsets=0, cu_seqlens=None, max_seqlen: int = 0, interleaved: bool = False,
                 inplace: bool = False, conjugate: bool = False, wrap_kernel=identity_wrap) -> torch.Tensor:
    """Rotate ``x`` (see the module docstring) and return the result: ``x`` itself, rotated in
    place, with ``inplace``, else a new tensor. ``seqlen_offsets``: an int or an integer tensor
    (batch,); ``cu_seqlens``: int32 (batch + 1,) for varlen ``x``, whose longest sequence has at
    most ``max_seqlen`` rows. Any strides with a contiguous last dim (others are copied; in place
    needs one). Arguments are assumed validated."""
    cos, sin = last_dim_contiguous(cos), last_dim_contiguous(sin)
    if not inplace:
        x = last_dim_contiguous(x)
    out = x if inplace else torch.empty_like(x)
    if x.numel() == 0:
        return out
    head_dim = x.shape[-1]
    half = cos.shape[-1]
    tail = head_dim - 2 * half
    if cu_seqlens is None:
        batch, seqlen, num_heads = x.shape[:3]
        strides_x, strides_out = (x.stride(0), x.stride(1), x.stride(2)), (out.stride(0), out.stride(1), out.stride(2))
        stand_in = x
    else:
        batch, seqlen, num_heads = cu_seqlens.shape[0] - 1, max_seqlen, x.shape[1]
        strides_x, strides_out = (0, x.stride(0), x.stride(1)), (0, out.stride(0), out.stride(1))
        stand_in = cu_seqlens
    per_sequence = isinstance(seqlen_offsets, torch.Tensor)
    interpreted = is_interpreted(_rotary_kernel)
    # 64 (row, head) pairs a program (decode steps, with one row, take more heads instead)
    block_m = 4 if interpreted else min(8, next_power_of_2(max(seqlen, 1)))
    block_h = min(next_power_of_2(num_heads), 64 // block_m)
    grid = (cdiv(seqlen, block_m), cdiv(num_heads, block_h), batch)
    launcher(_rotary_kernel, wrap_kernel)[grid](
        x, out, cos, sin, seqlen_offsets if per_sequence else stand_in,
        cu_seqlens if cu_seqlens is not None else stand_in, x.shape[0] if cu_seqlens is not None else 0,
        *strides_x, *strides_out, cos.stride(0), sin.stride(0),
        seqlen, num_heads, cos.shape[0], 0 if per_sequence else int(seqlen_offsets),
        HALF=half, HALF_PADDED=next_power_of_2(half), TAIL=tail,
        TAIL_PADDED=next_power_of_2(max(tail, 1)), BLOCK_M=block_m, BLOCK_H=block_h,
        INTERLEAVED=interleaved, CONJUGATE=conjugate, IS_VARLEN=cu_seqlens is not None,
        OFFSETS_PER_SEQUENCE=per_sequence, COPY_TAIL=tail > 0 and not inplace,
        PRECISION=precision_mode(x.dtype, interpreted), num_warps=4,
    )
    return out
