"""Tile loads and stores shared by the forward and backward kernels (masks: scores.py).

Every tensor the kernels touch is addressed as ``base + row * row_stride + col`` inside one
(sequence, head) slice, with the last (head) dimension contiguous. A sequence is either one batch
entry of a dense (batch, seqlen, heads, dim) tensor or, with IS_VARLEN, the rows
[cu_seqlens[b], cu_seqlens[b + 1]) of a packed (total_tokens, heads, dim) tensor (batch stride 0).
Three rules keep the addressing safe:

* 64-bit offsets. ``program_id`` and ``arange`` are int32, so ``row * stride`` silently wraps once
  a slice or the whole tensor passes 2**31 elements. The per-(sequence, head) base and the first
  row of a tile are therefore offset in int64 (``tile_base``); only in-tile offsets stay int32.
* Masks only where needed. ``CHECK_ROWS`` (a tile that may cross the sequence end) and a padded
  head-dim chunk (its columns pass HEAD_DIM) are compile-time facts, so tiles in the interior of
  the sequence with a power-of-two head dim compile to unmasked loads.
* Metadata is never trusted. Every index read from a tensor (cu_seqlens, block-table entries, cache
  lengths and rows) is clamped into the extent of the tensor it addresses before use
  (``sequence_span``, ``load_kv_tile``), so wrong values give wrong results, never an access
  outside a tensor (checks.py states the rule).

The head dim of every tile is held as one or two power-of-two chunks (``load_tile``), so that a
head dim like 80 or 192 costs 64 + 16 or 128 + 64 columns of work instead of 128 or 256.
"""

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# fp32 products over the head dim: summed from parts this wide (tiles.mma_over_head)
FP32_HEAD_PART = tl.constexpr(32)


@triton.jit
def sequence_span(batch, cu_seqlens, seqlen, total_rows, IS_VARLEN: tl.constexpr):
    """(first row, length) of sequence ``batch``: from cu_seqlens when IS_VARLEN, else (0, seqlen).

    The span is clamped into the tensor's ``total_rows`` rows (first in [0, total_rows], end in
    [first, total_rows]), so that whatever cu_seqlens holds, no row outside the tensor is ever
    addressed: a wrong cu_seqlens gives wrong sequences, never an access out of bounds."""
    if IS_VARLEN:
        first = tl.minimum(tl.maximum(tl.load(cu_seqlens + batch), 0), total_rows)
        end = tl.minimum(tl.maximum(tl.load(cu_seqlens + batch + 1), first), total_rows)
        return first, end - first
    else:
        return 0, seqlen


# whether triton.jit made these functions for the CPU interpreter (TRITON_INTERPRET=1 at import)
INTERPRETED = tl.constexpr(isinstance(sequence_span, InterpretedFunction))


@triton.jit
def tile_base(base_ptr, batch, head, first_row, stride_batch, stride_head, stride_row):
    """Pointer to the first row of one (sequence, head) slice, offset in int64."""
    return (base_ptr + batch.to(tl.int64) * stride_batch + head.to(tl.int64) * stride_head
            + tl.cast(first_row, tl.int64) * stride_row)


@triton.jit
def _chunk_ptrs_and_mask(
    base_ptr,
    start_row,
    stride_row,
    num_rows,
    BLOCK_ROWS: tl.constexpr,
    COL_START: tl.constexpr,
    COLS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_ROWS)
    cols = COL_START + tl.arange(0, COLS)
    ptrs = base_ptr + tl.cast(start_row, tl.int64) * stride_row + (rows[:, None] * stride_row + cols[None, :])
    # Both masks are always formed; the callers use them only under their compile-time flags,
    # and an unused mask is dead code that the compiler drops.
    mask = ((start_row + rows)[:, None] < num_rows) & (cols[None, :] < HEAD_DIM)
    return ptrs, mask


@triton.jit
def _load_chunk(base_ptr, start_row, stride_row, num_rows, BLOCK_ROWS: tl.constexpr, COL_START: tl.constexpr,
                COLS: tl.constexpr, HEAD_DIM: tl.constexpr, CHECK_ROWS: tl.constexpr):
    ptrs, mask = _chunk_ptrs_and_mask(base_ptr, start_row, stride_row, num_rows, BLOCK_ROWS, COL_START, COLS, HEAD_DIM)
    if CHECK_ROWS or COL_START + COLS > HEAD_DIM:
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def load_tile(
    base_ptr,
    start_row,
    stride_row,
    num_rows,
    BLOCK_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_A: tl.constexpr,
    DIM_B: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
):
    """Load rows [start_row, start_row + BLOCK_ROWS) of a slice as two head-dim chunks.

    Chunk a holds columns [0, DIM_A), chunk b columns [DIM_A, DIM_A + DIM_B); both widths are
    powers of two (tl.dot needs them), so a head dim of 80 is read as 64 + 16 instead of being
    padded to 128 (see configs.head_dim_chunks). DIM_B == 0 means a single chunk; b is then an
    unused zero tile. Elements outside the slice or past HEAD_DIM read as zeros.
    """
    a = _load_chunk(base_ptr, start_row, stride_row, num_rows, BLOCK_ROWS, 0, DIM_A, HEAD_DIM, CHECK_ROWS)
    if DIM_B > 0:
        b = _load_chunk(base_ptr, start_row, stride_row, num_rows, BLOCK_ROWS, DIM_A, DIM_B, HEAD_DIM, CHECK_ROWS)
    else:
        b = tl.zeros([BLOCK_ROWS, 16], dtype=a.dtype)
    return a, b


@triton.jit
def tile_descriptors(base_ptr, num_rows, stride_row, BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     DIM_A: tl.constexpr, DIM_B: tl.constexpr, USE_TMA: tl.constexpr):
    """Tensor descriptors (TMA on Hopper) for BLOCK_ROWS-row tiles of one (sequence, head) slice of
    ``num_rows`` rows, for ``load_tile_from``: (desc_a, desc_b, first row, first column), one
    descriptor per head-dim chunk, the slice starting at row 0, column 0. Without USE_TMA there are
    none and the base pointer stands in for them (a compiled Triton function cannot return None).

    The hardware copy engine fetches a whole tile asynchronously and fills rows past ``num_rows``
    and columns past HEAD_DIM with zeros, so no mask is computed. The launcher sets USE_TMA only
    when the base pointer and every row stride are 16-byte aligned (launch.use_tma)."""
    if USE_TMA:
        desc_a, desc_b = _chunk_descriptors(base_ptr, num_rows, HEAD_DIM, stride_row, BLOCK_ROWS, DIM_A, DIM_B)
        return desc_a, desc_b, 0, 0
    else:
        return base_ptr


@triton.jit
def tensor_tile_descriptors(tensor_ptr, batch, head, num_batches, num_heads, seqlen, stride_batch, stride_head,
                            stride_row, BLOCK_ROWS: tl.constexpr, DIM_A: tl.constexpr, DIM_B: tl.constexpr):
    """``tile_descriptors`` for the (batch, head) slice of a dense tensor, built over the whole
    tensor seen as a matrix of ``stride_row``-element rows instead of over the slice alone.

    Element (b, h, n, d) sits at row b * batch_rows + h * head_rows + n, column h * head_cols + d,
    where stride_batch = batch_rows * stride_row and stride_head = head_rows * stride_row +
    head_cols: (batch, seqlen, heads, dim) tensors place heads side by side in a row, (batch, heads,
    seqlen, dim) ones one under another. The launcher checks that the layout splits so and that
    the head dim is DIM_A + DIM_B (launch.warp_specialize): unlike ``tile_descriptors``, tiles
    past the slice's last row or last column read the neighbouring slice instead of zeros.

    The warp-specialised forward needs these: Triton 3.6 miscompiles it with per-slice
    descriptors, whose base pointer moves with the program (docs/design.md#warp-specialised-tl-loops)."""
    head_rows = stride_head // stride_row
    head_cols = stride_head % stride_row
    batch_rows = stride_batch // stride_row
    num_rows = (num_batches - 1) * batch_rows + (num_heads - 1) * head_rows + seqlen
    desc_a, desc_b = _chunk_descriptors(tensor_ptr, num_rows, stride_row, stride_row, BLOCK_ROWS, DIM_A, DIM_B)
    return desc_a, desc_b, batch * batch_rows + head * head_rows, head * head_cols


@triton.jit
def slice_descriptors(tensor_ptr, slice_base, batch, head, num_heads, seqlen, stride_batch, stride_head, stride_row,
                      BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_A: tl.constexpr, DIM_B: tl.constexpr,
                      USE_TMA: tl.constexpr, WHOLE_TENSOR: tl.constexpr):
    """The descriptors every kernel reads a (batch, head) slice through (``load_tile_from``): over
    the whole tensor with WHOLE_TENSOR (``tensor_tile_descriptors``, which warp-specialised loops
    need), else over the slice alone, which starts at ``slice_base`` (``tile_descriptors``). The
    batch count is the size of grid axis 2, as in every kernel here."""
    if WHOLE_TENSOR:
        return tensor_tile_descriptors(tensor_ptr, batch, head, tl.num_programs(2), num_heads, seqlen, stride_batch,
                                       stride_head, stride_row, BLOCK_ROWS, DIM_A, DIM_B)
    else:
        return tile_descriptors(slice_base, seqlen, stride_row, BLOCK_ROWS, HEAD_DIM, DIM_A, DIM_B, USE_TMA)


@triton.jit
def _chunk_descriptors(base_ptr, num_rows, num_cols, stride_row, BLOCK_ROWS: tl.constexpr, DIM_A: tl.constexpr,
                       DIM_B: tl.constexpr):
    desc_a = tl.make_tensor_descriptor(base_ptr, shape=[num_rows, num_cols], strides=[stride_row, 1],
                                       block_shape=[BLOCK_ROWS, DIM_A])
    if DIM_B > 0:
        desc_b = tl.make_tensor_descriptor(base_ptr, shape=[num_rows, num_cols], strides=[stride_row, 1],
                                           block_shape=[BLOCK_ROWS, DIM_B])
    else:
        desc_b = desc_a
    return desc_a, desc_b


@triton.jit
def load_tile_from(
    descriptors,
    base_ptr,
    start_row,
    stride_row,
    num_rows,
    BLOCK_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_A: tl.constexpr,
    DIM_B: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """``load_tile``, through the descriptors of ``tile_descriptors`` (or ``tensor_tile_descriptors``)
    when USE_TMA."""
    if USE_TMA:
        desc_a, desc_b, first_row, first_col = descriptors
        a = desc_a.load([first_row + start_row, first_col])
        if DIM_B > 0:
            b = desc_b.load([first_row + start_row, first_col + DIM_A])
        else:
            b = tl.zeros([BLOCK_ROWS, 16], dtype=a.dtype)
        return a, b
    else:
        return load_tile(base_ptr, start_row, stride_row, num_rows, BLOCK_ROWS, HEAD_DIM, DIM_A, DIM_B, CHECK_ROWS)


@triton.jit
def kv_sources(K, V, batch, kv_head, first_row, num_kv_heads, seqlen_k, stride_kb, stride_kh, stride_kn, stride_vb,
               stride_vh, stride_vn, BlockTable, stride_table, num_pages, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr, DIM_A: tl.constexpr, DIM_B: tl.constexpr, USE_TMA: tl.constexpr,
               WHOLE_TENSOR: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """(k_base, v_base, k_source, v_source): what ``load_kv_tile`` reads one (sequence, KV head)'s
    key and value tiles through. Contiguous: the slice starting at row ``first_row`` of entry
    ``batch`` and its descriptors (``slice_descriptors``). Paged (PAGE_SIZE > 0): the caches' page
    0 of this head, and (row ``batch`` of BlockTable, page stride, page count); the table gives
    each row's page."""
    if PAGE_SIZE > 0:
        k_base = K + kv_head.to(tl.int64) * stride_kh
        v_base = V + kv_head.to(tl.int64) * stride_vh
        table_row = BlockTable + batch.to(tl.int64) * stride_table
        return k_base, v_base, (table_row, stride_kb, num_pages), (table_row, stride_vb, num_pages)
    else:
        k_base = tile_base(K, batch, kv_head, first_row, stride_kb, stride_kh, stride_kn)
        v_base = tile_base(V, batch, kv_head, first_row, stride_vb, stride_vh, stride_vn)
        k_descs = slice_descriptors(K, k_base, batch, kv_head, num_kv_heads, seqlen_k, stride_kb, stride_kh, stride_kn,
                                    BLOCK_N, HEAD_DIM, DIM_A, DIM_B, USE_TMA, WHOLE_TENSOR)
        v_descs = slice_descriptors(V, v_base, batch, kv_head, num_kv_heads, seqlen_k, stride_vb, stride_vh, stride_vn,
                                    BLOCK_N, HEAD_DIM, DIM_A, DIM_B, USE_TMA, WHOLE_TENSOR)
        return k_base, v_base, k_descs, v_descs


@triton.jit
def load_kv_tile(source, base_ptr, start_row, stride_row, num_rows, BLOCK_ROWS: tl.constexpr,
                 HEAD_DIM: tl.constexpr, DIM_A: tl.constexpr, DIM_B: tl.constexpr, CHECK_ROWS: tl.constexpr,
                 USE_TMA: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """``load_tile_from`` for key/value tiles, which may live in a paged cache: with PAGE_SIZE > 0,
    ``source`` is (this sequence's block-table row, the cache's page stride, its page count) and row r of the
    sequence is row r % PAGE_SIZE of page table[r // PAGE_SIZE] (``base_ptr`` points at page 0,
    this head); rows past num_rows read as zeros, their table entries unread. A tile inside one
    page (PAGE_SIZE a multiple of BLOCK_ROWS; tiles start at multiples of BLOCK_ROWS) reads one
    table entry and then loads like a contiguous tile; smaller pages are gathered row by row."""
    if PAGE_SIZE > 0 and PAGE_SIZE % BLOCK_ROWS == 0:  # the tile lies in one page: one entry, plain rows
        table_row, stride_page, num_pages = source
        page = tl.load(table_row + start_row // PAGE_SIZE)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
        page_first = start_row - start_row % PAGE_SIZE
        return load_tile(base_ptr + page.to(tl.int64) * stride_page, start_row % PAGE_SIZE, stride_row,
                         num_rows - page_first, BLOCK_ROWS, HEAD_DIM, DIM_A, DIM_B, CHECK_ROWS)
    elif PAGE_SIZE > 0:
        table_row, stride_page, num_pages = source
        rows = start_row + tl.arange(0, BLOCK_ROWS)
        inside = rows < num_rows
        pages = tl.load(table_row + rows // PAGE_SIZE, mask=inside, other=0)
        pages = tl.minimum(tl.maximum(pages, 0), num_pages - 1)  # a bad table reads wrong rows, never outside
        row_offsets = pages.to(tl.int64) * stride_page + (rows % PAGE_SIZE) * stride_row
        a = load_rows(base_ptr, row_offsets, inside, 0, DIM_A, HEAD_DIM)
        if DIM_B > 0:
            b = load_rows(base_ptr, row_offsets, inside, DIM_A, DIM_B, HEAD_DIM)
        else:
            b = tl.zeros([BLOCK_ROWS, 16], dtype=a.dtype)
        return a, b
    else:
        return load_tile_from(source, base_ptr, start_row, stride_row, num_rows, BLOCK_ROWS, HEAD_DIM, DIM_A, DIM_B,
                              CHECK_ROWS, USE_TMA)


@triton.jit
def load_rows(base_ptr, row_offsets, row_mask, COL_START: tl.constexpr, COLS: tl.constexpr, HEAD_DIM: tl.constexpr):
    cols = COL_START + tl.arange(0, COLS)
    mask = row_mask[:, None] & (cols[None, :] < HEAD_DIM)
    return tl.load(base_ptr + row_offsets[:, None] + cols[None, :], mask=mask, other=0.0)


@triton.jit
def store_rows(base_ptr, tile, row_offsets, row_mask, COL_START: tl.constexpr, COLS: tl.constexpr,
               HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr):
    """Store columns [COL_START, COL_START + COLS) of a tile whose rows sit at ``row_offsets``
    from ``base_ptr`` (the mirror of ``load_rows``), dropping masked rows and columns past
    HEAD_DIM."""
    cols = COL_START + tl.arange(0, COLS)
    mask = row_mask[:, None] & (cols[None, :] < HEAD_DIM)
    element_type: tl.constexpr = base_ptr.dtype.element_ty
    if tile.dtype != element_type:  # (a tile loaded in the target's dtype is stored as it is)
        tile = round_to(tile, element_type, PRECISION).to(element_type)
    tl.store(base_ptr + row_offsets[:, None] + cols[None, :], tile, mask=mask)


@triton.jit
def _store_chunk(base_ptr, chunk, start_row, stride_row, num_rows, BLOCK_ROWS: tl.constexpr,
                 COL_START: tl.constexpr, COLS: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr):
    ptrs, mask = _chunk_ptrs_and_mask(base_ptr, start_row, stride_row, num_rows, BLOCK_ROWS, COL_START, COLS, HEAD_DIM)
    element_type: tl.constexpr = base_ptr.dtype.element_ty
    tl.store(ptrs, round_to(chunk, element_type, PRECISION).to(element_type), mask=mask)


@triton.jit
def store_tile(
    base_ptr,
    tile_a,
    tile_b,
    start_row,
    stride_row,
    num_rows,
    BLOCK_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_A: tl.constexpr,
    DIM_B: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Store a tile held as head-dim chunks (as ``load_tile`` returns them), dropping rows past
    num_rows and columns past HEAD_DIM."""
    _store_chunk(base_ptr, tile_a, start_row, stride_row, num_rows, BLOCK_ROWS, 0, DIM_A, HEAD_DIM, PRECISION)
    if DIM_B > 0:
        _store_chunk(base_ptr, tile_b, start_row, stride_row, num_rows, BLOCK_ROWS, DIM_A, DIM_B, HEAD_DIM, PRECISION)


@triton.jit
def load_row_stat(base_ptr, start_row, num_rows, fill, BLOCK_ROWS: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Load a per-query-row fp32 statistic (logsumexp, delta); rows past num_rows read ``fill``."""
    rows = start_row + tl.arange(0, BLOCK_ROWS)
    if CHECK_ROWS:
        return tl.load(base_ptr + rows, mask=rows < num_rows, other=fill)
    else:
        return tl.load(base_ptr + rows)


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr):
    """``a @ b + acc`` with fp32 accumulation (acc may be None).

    PRECISION is "ieee" for fp32 inputs (full fp32, never TF32), "tf32" (ignored) for 2-byte inputs,
    or "bf16_emulated": Triton's CPU interpreter multiplies bf16 tiles as raw uint16 and gets
    garbage, so there bf16 operands are widened to fp32 first. bf16 x bf16 products are exact in
    fp32, so this matches the tensor-core result up to summation order.
    """
    if PRECISION == "bf16_emulated":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def round_to(x, dtype: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (to feed a matmul or a store), round-to-nearest-even.

    Under "bf16_emulated" (the CPU interpreter, whose fp32 -> bf16 cast truncates) the rounding is
    done on the bits and the result stays fp32, holding exactly a bf16 value: ``mma`` takes it as
    it is and a store's cast then drops only zero bits.
    """
    if PRECISION == "bf16_emulated":
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _head_parts_dot(x, y):
    """x @ y^T in full fp32 (the "ieee" path of ``mma_over_head``), the head dim cut into
    FP32_HEAD_PART-wide parts: one batched tl.dot makes each part's product, a chain of at most
    FP32_HEAD_PART terms, and the parts' products are then added."""
    WIDTH: tl.constexpr = x.shape[1]
    PARTS: tl.constexpr = WIDTH // FP32_HEAD_PART
    if PARTS <= 1:
        return tl.dot(x, tl.trans(y), input_precision="ieee")
    else:
        x_parts = tl.permute(tl.reshape(x, [x.shape[0], PARTS, FP32_HEAD_PART]), (1, 0, 2))  # [part, row, head]
        y_parts = tl.permute(tl.reshape(y, [y.shape[0], PARTS, FP32_HEAD_PART]), (1, 2, 0))  # [part, head, row]
        return tl.sum(tl.dot(x_parts, y_parts, input_precision="ieee"), 0)


@triton.jit
def mma_over_head(x_a, x_b, y_a, y_b, DIM_B: tl.constexpr, PRECISION: tl.constexpr):
    """x @ y^T, contracting the head dim held as chunks (x_a, x_b) and (y_a, y_b).

    fp32 ("ieee", fp32 inputs only): a compiled fp32 tl.dot is an FMA loop, one chain of
    head-dim terms per output, whose rounding grows with the chain's length; ``_head_parts_dot``
    cuts it into FP32_HEAD_PART-long chains. PyTorch's fp32 matmul of a small shape (a short
    varlen sequence's q . k and dO . v) sums that accurately, and where the logits are large (q
    scaled by the softcap) and a row has few keys, this error is what the softmax and its
    gradients inherit (docs/design.md#fp32-exactness: varlen softcap d256 dQ at 11.8x PyTorch's
    error, from a 1-query, 5-key sequence, with one 256-term chain).

    Under the CPU interpreter (INTERPRETED) the product is formed in float64 and rounded to fp32
    once: there tl.dot is NumPy's matmul, whose BLAS kernels (the FMA ones of AVX2 CPUs) round a
    dot product by their blocking, so the backward's S^T = K Q^T of one tile shape missed the
    forward's S = Q K^T of another by a rounding of the logits, which exp turns into P = 0 or inf
    at large logits (tests/test_production.py, fp32 logits near 1e31: a difference of 1.2e25).
    Products of fp32 values are exact in float64 and their sums' roundings lie far below fp32's,
    so every tile shape and orientation gets the same fp32 logits, as a GPU's products do."""
    if INTERPRETED:
        product = tl.dot(_float64(x_a), tl.trans(_float64(y_a)), input_precision="ieee")
        if DIM_B > 0:
            product += tl.dot(_float64(x_b), tl.trans(_float64(y_b)), input_precision="ieee")
        product = product.to(tl.float32)
    elif PRECISION == "ieee":
        product = _head_parts_dot(x_a, y_a)
        if DIM_B > 0:
            product = product + _head_parts_dot(x_b, y_b)
    else:
        product = mma(x_a, tl.trans(y_a), None, PRECISION)
        if DIM_B > 0:
            product = mma(x_b, tl.trans(y_b), product, PRECISION)
    return product


@triton.jit
def _float64(x):
    """x (fp32, fp16 or bf16) as float64, through fp32 (the interpreter widens bf16 only to fp32)."""
    return x.to(tl.float32).to(tl.float64)


@triton.jit
def mma_into_head(p, y_a, y_b, acc_a, acc_b, DIM_B: tl.constexpr, PRECISION: tl.constexpr):
    """(acc_a, acc_b) + p @ (y_a, y_b): a product whose columns are the head dim, chunk by chunk.
    ``p`` is fp32 and rounded to the operands' dtype here."""
    p = round_to(p, y_a.dtype, PRECISION)
    acc_a = mma(p, y_a, acc_a, PRECISION)
    if DIM_B > 0:
        acc_b = mma(p, y_b, acc_b, PRECISION)
    return acc_a, acc_b
