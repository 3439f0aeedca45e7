"""What the Gluon kernels for Hopper (the forward ``hopper_forward``, the backward's ``hopper_dkdv``
and ``hopper_dq``) share: their arguments, their rings, their score math, and the Gluon names that
moved between Triton releases. Which calls they take is ``hopper_route``'s decision, made without
importing Gluon; this module and the kernels' are imported only once a call needs them.

All three take FlashAttention-3's structure: a producer warp streams tiles by TMA through a ring
of shared-memory buffers, two consumer warpgroups of 64 rows each read the ring out of step, so
that one's per-score work (exp2, the softcap's tanh, the mask, dropout's draws) runs while the
other's tensor-core products do. They run on sm_90 only, on dense bf16/fp16 calls whose tensors
split into TMA rows (``launch.RowGeometry``) in full tiles (a ragged tile would read the next
slice's rows), with head dim 64, 80, 96 or 128; every option (causal, window, softcap, ALiBi,
sinks, dropout) runs in them. Everything else (varlen, paged caches, ragged tiles, other head
dims, fp32, calls traced by torch.compile) takes the tl kernels.

Head dims in chunks: Gluon's tensors are powers of two, so a head dim of 80 or 96 is held as two
blocks, 64 + 16 or 64 + 32 (the tl kernels' split, ``configs.head_dim_chunks``), each with its own
TMA descriptor (``tile_arguments``: the second at the first's width to the right) and shared
buffer (``chunk_buffers``). A product over the head dim (S = Q K^T, dP = dO V^T) is one wgmma per
chunk accumulating into one result (``issue_over_chunks``), a product into it (O += P V, dQ +=
dS K, dK, dV) one accumulator per chunk (``issue_into_chunks``); the kernels carry such tiles and
accumulators as tuples of one or two and count the wgmmas in flight as products times chunks.
Padding 96 to 128 instead would spend a quarter of every product on zeros
(docs/design.md#hopper-gluon-kernels, "Other head dims"). At 64 and 128 the kernels compile as
before: the PTX of each checked kernel holds the same instructions, only the epilogue's stores in
another order.

A ring is one ``Ring`` (a Gluon aggregate, as Triton's own Gluon attention example holds its
channels): its "ready" and "empty" mbarriers, its depth, and the only place that turns a tile's
count into a buffer and a barrier phase (``wait_ready``, ``release``, the producer's ``claim``).

Scores: the Gluon kernels cannot call ``scores.py``'s tl functions. The rules both need in the
same form are written once in ``rules.py`` and compiled here for Gluon: ``band_tiles`` (which
tiles a warpgroup visits: masked ones crossing a window edge, full ones, and the ones it releases
unread because only the other warpgroup sees them), ``tanh_approx`` and ``philox_rounds``
(dropout's draws, ``hopper_dropout``). The score math, which takes other forms here (the
warpgroups' layouts, the forward's pivot folded into one multiply-add), is this module's:
``band_mask``, ``tile_logits`` (softcap, ALiBi, the band mask, minus the row's lse),
``tile_logits_grad`` (the softcap's tanh', and dS = 0 outside the band) and, for the forward,
which has no lse yet, ``forward_logits``. The backward kernels hold their tiles in opposite
orientations (dK/dV: S^T, keys by queries; dQ: S), so ``tile_logits`` takes index vectors
already shaped to broadcast. tests/test_logits_rule.py checks these forms, and scores.py's,
against one host statement of the rule (``logits_rule`` in tests/reference.py).

Gluon's API moved between releases (TMA's load is ``async_copy_global_to_shared`` up to 3.7 and
``async_load`` from 3.8; its reduction into global memory, ``async_atomic_add``, has a function
only from 3.8, while 3.6 and 3.7 have the op in the builder: ``_tma_reduce_add``), so the module
binds the name it finds; ``hopper_route.CHECKED_VERSIONS`` lists the Triton releases the kernels
were run and checked under.
"""

import functools
import math

import torch
from triton.experimental import gluon
from triton._C.libtriton import ir
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.core import _aggregate as aggregate  # (gluon.aggregate from Triton 3.9 on: the same)

from .configs import head_dim_chunks
from .direct_launch import with_launch_facts
from .hopper_route import KERNEL_BITS
from .launch import RowGeometry, SequenceLayout, remembered
from . import rules
from .options import ALIBI, DROPOUT, LOG2E, MASK_LEFT, MASK_RIGHT, SOFTCAP, AttentionOptions

CONSUMER_REGISTERS = 240  # per thread of each consumer warpgroup (setmaxnreg); the producer warp gets 24


def tile_arguments(tensors, layout: SequenceLayout, rows) -> list:
    """The kernels' first arguments: TMA descriptors of each of ``tensors`` (q, k, v, dout) with
    blocks of ``rows[i]`` rows of one head-dim chunk, over the tensor seen as a matrix of rows
    (``launch.RowGeometry``): the first chunk's descriptor of each tensor, then the second chunk's
    (None for each where the head dim is one chunk), then each tensor's (batch_rows, head_rows,
    head_cols). The chunks are ``configs.head_dim_chunks``', the tl kernels' split: Gluon's
    tensors are powers of two, so 80 and 96 are held as 64 + 16 and 64 + 32 (module docstring).

    Everything but the tensors' addresses follows from their shapes, strides, dtypes and
    alignment, so it is built and checked once per such signature (``_TILE_TEMPLATES``) and each
    call copies the checked descriptors onto its own tensors (``_rebased``): building a descriptor
    costs more host time than launching the kernel."""
    key = (rows, layout.is_varlen, *[(x.shape, x.stride(), x.dtype, x.data_ptr() % 16) for x in tensors])
    descriptors, geometry = remembered(_TILE_TEMPLATES, key, lambda: _tile_template(tensors, layout, rows))
    tensors = (*tensors, *tensors)  # (the first chunks' descriptors, then the second ones')
    return [*[d and _rebased(d, x) for d, x in zip(descriptors, tensors)], *geometry]


_TILE_TEMPLATES: dict = {}  # (bounded by launch.remembered)


def _tile_template(tensors, layout: SequenceLayout, rows) -> tuple:
    """(descriptors, geometry values) of ``tile_arguments``, built and checked on these tensors."""
    geometry = [RowGeometry.of(x, layout) for x in tensors]
    descriptors = [
        with_launch_facts(TensorDescriptor(x, [g.num_rows, g.stride_row], [g.stride_row, 1], [block_rows, width],
                                           _shared_layout(block_rows, width, x.dtype))) if width else None
        for width in head_dim_chunks(tensors[0].shape[-1])
        for x, g, block_rows in zip(tensors, geometry, rows)
    ]
    return descriptors, tuple(value for g in geometry for value in (g.batch_rows, g.head_rows, g.head_cols))


def flat_descriptor(x: torch.Tensor, shape: tuple, block_shape: tuple, layout) -> TensorDescriptor:
    """A TMA descriptor of contiguous, 16-byte aligned ``x`` seen as a row-major array of ``shape``
    (its numel elements as a vector, or as a matrix of rows) in blocks of ``block_shape`` with the
    shared ``layout``: checked once per (shape, dtype, block shape, layout), as ``tile_arguments``'
    descriptors are."""
    key = (shape, x.dtype, block_shape, id(layout))
    template = remembered(_FLAT_TEMPLATES, key, lambda: with_launch_facts(TensorDescriptor(
        x, list(shape), [math.prod(shape[i + 1:]) for i in range(len(shape))], list(block_shape), layout)))
    return _rebased(template, x)


def vector_descriptor(x: torch.Tensor, block: int, layout) -> TensorDescriptor:
    """``flat_descriptor`` of ``x``'s numel elements as a vector, in blocks of ``block``."""
    return flat_descriptor(x, (x.numel(),), (block,), layout)


_FLAT_TEMPLATES: dict = {}  # (each template holds its layout, so no other layout takes the id its key holds)


def _rebased(template: TensorDescriptor, tensor: torch.Tensor) -> TensorDescriptor:
    """``template`` over ``tensor``, which has the shape, strides, dtype and alignment of the
    tensor it was checked on (so the dataclass's checks are not run again, and the launch facts
    ``direct_launch.with_launch_facts`` put in the template hold for the copy too)."""
    descriptor = object.__new__(TensorDescriptor)
    descriptor.__dict__.update(template.__dict__)
    descriptor.base = tensor
    return descriptor


@functools.lru_cache(maxsize=None)
def _shared_layout(block_rows: int, width: int, dtype: torch.dtype):
    """The shared-memory layout of a (block_rows, width) block of a 2-byte ``dtype``, built once
    (a Gluon layout costs more host time to build than a launch)."""
    element = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([block_rows, width], element)


def option_arguments(options: AttentionOptions, stand_in: torch.Tensor) -> tuple:
    """(arguments, constexprs) of the options as both kernels take them: ``options.kernel_args``'
    values, as the tl kernels take them. Arguments: score_scale, softcap_log2 (the logit in base 2
    is q.k * score_scale, or under a softcap softcap_log2 * tanh(q.k * score_scale): scores.logits'
    units), softmax_scale, window_left, window_right, AlibiSlopes, stride_alibi_b, RngState,
    dropout_threshold, dropout_scale. ``stand_in`` is q, as for the tl kernels: it fills unused
    pointers, and its dtype sets the units (kernel_args gives fp32 inputs natural units; an fp32
    stand-in such as the lse would hand these 2-byte kernels logits without log2(e)). Constexprs: VARIANT
    (KERNEL_BITS of the options' bit set) and ALIBI_ABS (ALiBi with visible pairs above the
    diagonal, where its distance needs an absolute value)."""
    slopes, stride_alibi_b, _, rng_state, score_scale, softcap_log2, left, right, dropout_threshold, dropout_scale = \
        options.kernel_args(stand_in)
    arguments = (score_scale, softcap_log2, options.softmax_scale, left, right, slopes, stride_alibi_b, rng_state,
                 dropout_threshold, dropout_scale)
    alibi_abs = options.alibi_slopes is not None and options.window[1] != 0
    return arguments, dict(VARIANT=options.variant & KERNEL_BITS, ALIBI_ABS=alibi_abs)


# TMA's global-to-shared copy under its name in this release
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA's reduction of a shared-memory tile into global memory (add): ``tma.async_atomic_add``
    as Triton 3.8 defines it, for 3.6 and 3.7, whose Gluon has the op in its builder (the one tl's
    descriptor ``atomic_add`` lowers through) but no function for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


# TMA's reduction into global memory under its name in this release (``_tma_reduce_add`` before 3.8)
tma_atomic_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add

# the rules the tl kernels share (rules.py: the band's tile ranges, tanh.approx, Philox's rounds), compiled for Gluon
_SHARED = rules.instantiate(gl, gluon.jit)
band_tiles, tanh_approx, philox_rounds = _SHARED.band_tiles, _SHARED.tanh_approx, _SHARED.philox_rounds

@aggregate
class Ring:
    """A ring of STAGES shared-memory buffers that the producer warp fills by TMA and both consumer
    warpgroups read, as Triton's Gluon attention example holds its channels: the i-th tile of a
    stream sits in buffer ``index(i)`` = i % STAGES; its "ready" mbarrier completes when the tile
    has arrived (``wait_ready``), its "empty" one when both warpgroups have released it
    (``release``; count 2), which the producer waits for before it fills the buffer again
    (``claim``). Each use of a buffer is one phase of its barriers, so the i-th waits for phase
    (i // STAGES) & 1; the parities live here and nowhere else. The buffers themselves are the
    kernels' (K and V tiles, Q and dO tiles with their rows' statistics)."""
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    STAGES: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, ready, empty, STAGES):
        self.ready = ready
        self.empty = empty
        self.STAGES = gl.constexpr(STAGES)

    @gluon.jit
    def index(self, i):
        return i % self.STAGES

    @gluon.jit
    def wait_ready(self, i):
        """Wait until the i-th tile has arrived in its buffer."""
        mbarrier.wait(self.ready.index(i % self.STAGES), (i // self.STAGES) & 1)

    @gluon.jit
    def release(self, i):
        """This warpgroup is done with the i-th tile's buffer."""
        mbarrier.arrive(self.empty.index(i % self.STAGES), count=1)

    @gluon.jit
    def claim(self, i, nbytes):
        """(The producer) wait until the i-th tile's buffer is free (a fresh barrier passes parity
        1), announce ``nbytes`` on its "ready" barrier and return that barrier for the loads."""
        buffer = i % self.STAGES
        mbarrier.wait(self.empty.index(buffer), ((i // self.STAGES) & 1) ^ 1)
        arrived = self.ready.index(buffer)
        mbarrier.expect(arrived, nbytes)
        return arrived


@gluon.jit
def opaque(count):
    """``count`` (an int32 scalar, a ring's tile count) through a register copy that LLVM cannot
    see through. A loop that forms its buffers' addresses from its count, base + (i % STAGES) x
    bytes, has LLVM's loop strength reduction carry one address of its own per buffer and barrier
    around the loop instead (i x bytes, less the wraps); in the dK/dV consumer, at 240 registers,
    those registers were what ptxas spilled (docs/design.md#fused-dq-in-the-gluon-dkdv-kernel, "An
    opaque tile count"). From the copy the addresses are formed again in each tile, a few adds."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [count], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def resident_index(count, INDEX: gl.constexpr, OPAQUE: gl.constexpr):
    """The index INDEX of a resident buffer (one loaded before a loop, such as the dK/dV kernel's K
    and V tiles), or with OPAQUE the same value as an int32 that LLVM cannot see is constant, formed
    from ``count`` (the loop's tile count) in each iteration. Indexed by a constant, a wgmma's
    descriptors of the buffer (one 64-bit value per k-step) are loop-invariant: LLVM hoists them and
    holds them in registers across the loop, which ptxas may spill; indexed afresh, they are formed
    again in each tile, in uniform registers (hopper_dkdv.OPAQUE_RESIDENT_RELEASES)."""
    index = INDEX
    if OPAQUE:
        index = gl.inline_asm_elementwise(f"mov.b32 $0, {INDEX};", "=r,r", [count], dtype=gl.int32, is_pure=True,
                                          pack=1)
    return index


@gluon.jit
def make_ring(STAGES: gl.constexpr):
    """A ``Ring`` of STAGES buffers' barriers, initialised: "ready" completes on one arrival (the
    TMA's transaction count), "empty" on two (both consumer warpgroups)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    return Ring(ready, empty, STAGES)

@gluon.constexpr_function
def accumulator_layout(width):
    """The register layout of a warpgroup's wgmma result (S, dP or an accumulator) of 64 rows by
    ``width`` columns."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, width, 16])


@gluon.constexpr_function
def operand_layout(width):
    """The register layout of a wgmma's left operand (P, dS) whose accumulator is ``width`` wide."""
    return gl.DotOperandLayout(operand_index=0, parent=accumulator_layout(width), k_width=2)


# Head-dim chunks (module docstring): tiles, accumulators and descriptor pairs as tuples of one or
# two; each async wgmma is a group of its own, and groups finish in order, so a wait that leaves
# n younger products in flight leaves n * len(chunks) wgmmas.

@gluon.jit
def chunk_buffers(descs, depth: gl.constexpr):
    """Shared memory for ``depth`` tiles of a tensor whose chunks' descriptors are ``descs`` (the
    second None where the head dim is one chunk): (a,) or (a, b), each [depth, *its block]."""
    a = gl.allocate_shared_memory(descs[0].dtype, [depth] + descs[0].block_type.shape, descs[0].layout)
    if descs[1] is None:
        buffers = (a,)
    else:
        b = gl.allocate_shared_memory(descs[1].dtype, [depth] + descs[1].block_type.shape, descs[1].layout)
        buffers = (a, b)
    return buffers


@gluon.constexpr_function
def chunk_bytes(*descs):
    """The bytes one tile's TMA loads bring over its chunks' descriptors (``chunk_bytes(*descs)``:
    a constexpr function, since Triton 3.6's jit functions return ints as tensors, and given the
    descriptors one by one, since 3.6 cannot pass it a tuple holding None)."""
    return sum(desc.block_type.nbytes for desc in descs if desc is not None)


@gluon.jit
def load_chunks(descs, row, col, barrier, buffers, index):
    """Load the tile at (``row``, ``col``) of the row matrix into ``buffers``' block ``index``, one
    TMA load per chunk's descriptor in ``descs`` (the second at the first's width to the right),
    completing on ``barrier``."""
    tma_load(descs[0], [row, col], barrier, buffers[0].index(index))
    if descs[1] is not None:
        tma_load(descs[1], [row, col + descs[0].block_type.shape[1]], barrier, buffers[1].index(index))


@gluon.jit
def chunks_at(buffers, index):
    """Block ``index`` of each chunk's buffer."""
    if len(buffers) == 1:
        blocks = (buffers[0].index(index),)
    else:
        blocks = (buffers[0].index(index), buffers[1].index(index))
    return blocks


@gluon.jit
def issue_over_chunks(a, b, acc, use_acc):
    """Issue ``acc`` (+)= a b^T summed over the head dim: one async wgmma per chunk of the
    shared-memory tiles ``a`` and ``b``, the second accumulating onto the first; returns the
    product in flight (a wait for it must leave only younger wgmmas pending)."""
    acc = warpgroup_mma(a[0], b[0].permute((1, 0)), acc, use_acc=use_acc, is_async=True)
    if len(a) > 1:
        acc = warpgroup_mma(a[1], b[1].permute((1, 0)), acc, is_async=True)
    return acc


@gluon.jit
def issue_into_chunks(a, b, accs):
    """Issue accs[c] += a b[c] for each head-dim chunk c: ``a`` a register operand in the first
    chunk's ``operand_layout``, ``b`` shared-memory tiles; returns the products in flight."""
    first = warpgroup_mma(a, b[0], accs[0], is_async=True)
    if len(b) == 1:
        products = (first,)
    else:
        # (the operand layout does not depend on the accumulator's width: the conversion moves nothing)
        second = warpgroup_mma(gl.convert_layout(a, operand_layout(b[1].shape[1])), b[1], accs[1], is_async=True)
        products = (first, second)
    return products


@gluon.jit
def wait_chunks(pending: gl.constexpr, accs):
    """``accs`` (one product per chunk) once at most ``pending`` younger wgmmas are in flight, as a tuple."""
    done = warpgroup_mma_wait(pending, deps=accs)
    if len(accs) == 1:
        done = (done,)
    return done


@gluon.jit
def wait_chunk_pairs(pending: gl.constexpr, first, second):
    """``wait_chunks`` for two products at once (``first`` issued before ``second``): (first, second)."""
    if len(first) == 1:
        a, b = warpgroup_mma_wait(pending, deps=(first[0], second[0]))
        done = ((a,), (b,))
    else:
        a, a2, b, b2 = warpgroup_mma_wait(pending, deps=(first[0], first[1], second[0], second[1]))
        done = ((a, a2), (b, b2))
    return done


@gluon.jit
def zero_chunks(rows: gl.constexpr, buffers):
    """Zero accumulators of ``rows`` rows, one per chunk of ``buffers`` (as wide as its blocks)."""
    WIDTH: gl.constexpr = buffers[0].shape[2]
    first = gl.zeros([rows, WIDTH], gl.float32, accumulator_layout(WIDTH))
    if len(buffers) == 1:
        accs = (first,)
    else:
        WIDTH_B: gl.constexpr = buffers[1].shape[2]
        accs = (first, gl.zeros([rows, WIDTH_B], gl.float32, accumulator_layout(WIDTH_B)))
    return accs


@gluon.jit
def scale_rows(accs, factor):
    """Each chunk's accumulator times ``factor`` per row (in any layout: converted to each chunk's rows)."""
    first = accs[0] * gl.convert_layout(factor, gl.SliceLayout(1, accs[0].type.layout))[:, None]
    if len(accs) == 1:
        scaled = (first,)
    else:
        scaled = (first, accs[1] * gl.convert_layout(factor, gl.SliceLayout(1, accs[1].type.layout))[:, None])
    return scaled


@gluon.jit
def store_chunks(base, first_row, stride_row, accs, scale, staging):
    """Store rows first_row.. of the chunks' accumulators ``accs`` at ``base`` + row * ``stride_row`` + column,
    each chunk at its columns of the head dim, through shared memory: each chunk times ``scale``, rounded to
    ``base``'s dtype, goes into ``staging`` (the warpgroup's own chunk buffers of the same shapes and dtype,
    whose last reader has finished) and comes back in rows of 16-byte accesses (``_rows_layout``), so that each
    warp stores whole rows. Stored straight from the wgmma accumulator layout, each access holds 4 bytes and a
    warp's store touches 8 rows: the forward's epilogue took 2.8k cycles per program that way, about a key
    tile's time, and takes 0.9-1.1k this way at d128 on an H200
    (docs/design.md#where-a-short-calls-program-spends-its-time)."""
    _store_block(base, first_row, stride_row, 0, accs[0] * scale, staging[0])
    if len(accs) > 1:
        _store_block(base, first_row, stride_row, accs[0].shape[1], accs[1] * scale, staging[1])


@gluon.jit
def _store_block(base, first_row, stride_row, first_col, block, buffer):
    gl.static_assert(buffer.dtype == base.dtype.element_ty, "the staging buffers hold the output's dtype")
    buffer.store(block.to(base.dtype.element_ty))
    layout: gl.constexpr = _rows_layout(block.shape[1])
    pointers = _block_pointers(base, first_row, stride_row, first_col, block.shape[0], block.shape[1], layout)
    gl.store(pointers, buffer.load(layout))


@gluon.constexpr_function
def _rows_layout(width):
    """[64, width] blocks over a warpgroup, 8 elements (16 bytes) per thread and access."""
    across = min(width // 8, 32)
    return gl.BlockedLayout([1, 8], [32 // across, across], [4, 1], [1, 0])


@gluon.jit
def load_rows(base, first_row, stride_row, blocks):
    """A warpgroup's rows first_row.. of the head dim at ``base`` + row * ``stride_row`` + column,
    one register block per chunk, shaped as the shared ``blocks`` (``chunks_at``'s) it will meet
    (the loads' counterpart of ``store_chunks``)."""
    first = _load_block(base, first_row, stride_row, 0, blocks[0])
    if len(blocks) == 1:
        loaded = (first,)
    else:
        loaded = (first, _load_block(base, first_row, stride_row, blocks[0].shape[1], blocks[1]))
    return loaded


@gluon.jit
def _load_block(base, first_row, stride_row, first_col, like):
    layout: gl.constexpr = _rows_layout(like.shape[1])
    return gl.load(_block_pointers(base, first_row, stride_row, first_col, like.shape[0], like.shape[1], layout))


@gluon.jit
def _block_pointers(base, first_row, stride_row, first_col, ROWS: gl.constexpr, WIDTH: gl.constexpr,
                    LAYOUT: gl.constexpr):
    """Pointers of rows first_row.. (64-bit offsets) and columns first_col.. of a [ROWS, WIDTH]
    block at ``base`` in LAYOUT."""
    rows = (first_row + gl.arange(0, ROWS, gl.SliceLayout(1, LAYOUT))).to(gl.int64)
    cols = first_col + gl.arange(0, WIDTH, gl.SliceLayout(0, LAYOUT))
    return base + rows[:, None] * stride_row + cols[None, :]

@gluon.jit
def round_pairs(x, dtype: gl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (bf16 or fp16) two neighbouring elements per cvt, as
    Triton lowers ``x.to(dtype)``, but as inline asm: LLVM then cannot move the rounding of a
    loop-carried value across the loop's phi, where it splits into one cvt per element and
    carries the fp32 values (then the compiled loop swaps each pair's halves back, one PRMT
    per register, and holds twice the registers)."""
    if dtype == gl.bfloat16:
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.float16,
                                         is_pure=True, pack=2)

MASK_LEFT_, MASK_RIGHT_, SOFTCAP_, ALIBI_ = (gl.constexpr(bit) for bit in (MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI))
# which side of the diagonal (i + diag = j) a forward tile's pairs lie on (``forward_logits``)
ALIBI_BELOW, ALIBI_ABOVE, ALIBI_ACROSS = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)
DROPOUT_ = gl.constexpr(DROPOUT)
LOG2E_ = gl.constexpr(LOG2E)

@gluon.jit
def key_tiles(first_row, last_row, seqlen_k, band, KEYS: gl.constexpr, VARIANT: gl.constexpr):
    """``band_tiles`` over the keys for query rows first_row..last_row (the forward and dQ
    kernels): row i sees keys i + diag - left .. i + diag + right, band = (diag, left, right)."""
    diag, left, right = band
    return band_tiles(first_row, last_row, diag - left, diag + right, seqlen_k, KEYS, MASK_LEFT_ & VARIANT,
                      MASK_RIGHT_ & VARIANT, MASK_RIGHT_ & VARIANT)

@gluon.jit
def query_program(seqlen_k, band, AlibiSlopes, stride_alibi_b, ROWS: gl.constexpr, KEYS: gl.constexpr,
                  GROUP_SIZE: gl.constexpr, VARIANT: gl.constexpr):
    """A program of the forward and dQ kernels, which own ROWS query rows of one head each
    (grid: query blocks, heads, batch): (first query row, head, batch, KV head, keys_lo,
    keys_hi, dropout's Philox stream, the head's ALiBi slope pointer), [keys_lo, keys_hi) the
    key tiles any of its rows sees (``key_tiles``; the producer streams these). With an upper
    band edge (causal) the blocks run in reverse, longest rows first, so that the short ones
    fill the last wave."""
    block = gl.program_id(0)
    if MASK_RIGHT_ & VARIANT:
        block = gl.num_programs(0) - 1 - block
    start_m, head, batch = block * ROWS, gl.program_id(1), gl.program_id(2)
    keys_lo, _, _, keys_hi = key_tiles(start_m, start_m + ROWS - 1, seqlen_k, band, KEYS, VARIANT)
    stream = (batch * gl.num_programs(1) + head).to(gl.uint32)  # batch * heads + head
    slope = AlibiSlopes + batch.to(gl.int64) * stride_alibi_b + head
    return start_m, head, batch, head // GROUP_SIZE, keys_lo, keys_hi, stream, slope

@gluon.jit
def stream_key_tiles(k_descs, v_descs, k_row, k_col, v_row, v_col, k_bufs, v_bufs, ring, keys_lo, keys_hi):
    """The producer warp's loop of the forward and dQ kernels: the (K, V) tiles of keys
    [keys_lo, keys_hi) by TMA through the ``ring`` (chunk buffers ``k_bufs``, ``v_bufs``)."""
    KEYS: gl.constexpr = k_bufs[0].shape[1]
    i = 0
    for n in range(keys_lo, keys_hi, KEYS):
        arrived = ring.claim(i, chunk_bytes(*k_descs, *v_descs))
        load_chunks(k_descs, k_row + n, k_col, arrived, k_bufs, ring.index(i))
        load_chunks(v_descs, v_row + n, v_col, arrived, v_bufs, ring.index(i))
        i += 1

@gluon.jit
def release_unread(ring, i, start, end, BLOCK: gl.constexpr):
    """Release the ``ring``'s buffers of tiles [start, end) (start a multiple of BLOCK) unread:
    tiles the producer streams for the other warpgroup. Each is waited for, so that no arrival on
    "empty" completes a later phase early. Returns the next tile's count."""
    for _ in range(start, end, BLOCK):
        ring.wait_ready(i)
        ring.release(i)
        i += 1
    return i

@gluon.jit
def tile_logits(s, lse_log2, queries, keys, key_base, band, score, slope_log2, MASKED: gl.constexpr,
                VARIANT: gl.constexpr, ALIBI_ABS: gl.constexpr):
    """(x, capped): x = the base-2 logits of a tile of q.k products ``s`` minus their rows'
    lse (lse_log2 = lse * log2(e)), -inf where MASKED and outside the band, so that P =
    exp2(x); capped = the softcap's tanh (for ``tile_logits_grad``). ``queries``, ``keys`` and
    ``lse_log2`` are shaped to broadcast against ``s``. band = (diag, left, right): query i sees
    key j iff i + diag - left <= j <= i + diag + right (scores.visible); score = (score_scale,
    softcap_log2), ``option_arguments``'.

    ALiBi adds -slope |i + diag - j|, its distance taken from ``key_base`` (near the tile) so
    that fp32 holds both parts exactly. Without ALIBI_ABS every visible pair has i + diag >= j,
    and the bias splits into a row term, folded into the lse, and a key term: one addition
    per score instead of a subtraction, an absolute value and a multiply-add."""
    diag, left, right = band
    score_scale, softcap_log2 = score
    if SOFTCAP_ & VARIANT:
        capped = tanh_approx(s * score_scale)
        scaled = capped * softcap_log2
    else:
        capped = s
        scaled = s * score_scale
    if ALIBI_ & VARIANT:
        row_distance = (queries + (diag - key_base)).to(gl.float32)
        key_offset = (keys - key_base).to(gl.float32)
        if ALIBI_ABS:
            x = scaled - lse_log2 - slope_log2 * gl.abs(row_distance - key_offset)
        else:
            x = scaled - (lse_log2 + slope_log2 * row_distance) + slope_log2 * key_offset
    else:
        x = scaled - lse_log2
    if MASKED:  # (masked before the exp2: the mask's predicate dies at once)
        x = band_mask(x, queries, keys, band, float("-inf"), VARIANT)
    return x, capped

@gluon.jit
def band_mask(x, queries, keys, band, OUTSIDE: gl.constexpr, VARIANT: gl.constexpr):
    """``x`` where query i sees key j (i + diag - left <= j <= i + diag + right, the edges
    VARIANT has), OUTSIDE elsewhere; ``queries`` and ``keys`` broadcast against ``x``."""
    diag, left, right = band
    if MASK_RIGHT_ & VARIANT:
        x = gl.where(keys <= queries + (diag + right), x, OUTSIDE)
    if MASK_LEFT_ & VARIANT:
        x = gl.where(keys >= queries + (diag - left), x, OUTSIDE)
    return x

@gluon.jit
def forward_logits(s, rows, keys, key_base, band, score, slope_log2, MASKED: gl.constexpr,
                   VARIANT: gl.constexpr, ALIBI_SIDE: gl.constexpr):
    """(t, unit, row_offset): the base-2 logits of a tile of q.k products ``s`` (query ``rows``
    by ``keys``, 1-D index vectors) are t * unit - row_offset (row_offset per row, or 0), with
    t = -inf where MASKED and outside the band. ``tile_logits``' math without an lse, for the
    forward, which subtracts its pivot in the same multiply-add as the unit: without ALiBi t
    is the softcap's tanh or s itself, so the logits cost nothing before that multiply-add.

    ALiBi's bias -slope |d|, d = i + diag - j, in t's units: on a tile whose pairs all have d
    >= 0 (ALIBI_SIDE = ALIBI_BELOW) or all d <= 0 (ALIBI_ABOVE) it splits into a row term,
    folded into row_offset, and a key term: one operation per score; a tile across the
    diagonal (ALIBI_ACROSS) takes two (the absolute value)."""
    score_scale, softcap_log2 = score
    if SOFTCAP_ & VARIANT:
        t = tanh_approx(s * score_scale)
        unit = softcap_log2
    else:
        t = s
        unit = score_scale
    row_offset = 0.0
    if ALIBI_ & VARIANT:
        diag, _, _ = band
        row_distance = (rows + (diag - key_base)).to(gl.float32)
        key_offset = (keys - key_base).to(gl.float32)
        slope = slope_log2 / unit
        key_term = slope * key_offset  # (the same per-key values in every form: held once)
        if ALIBI_SIDE == ALIBI_ACROSS:  # -slope |d| = -sign(slope) |slope d|
            slope_sign = gl.where(slope < 0, -1.0, 1.0)
            t = t - slope_sign * gl.abs((slope * row_distance)[:, None] - key_term[None, :])
        elif ALIBI_SIDE == ALIBI_BELOW:
            t = t + key_term[None, :]
            row_offset = slope_log2 * row_distance
        else:
            t = t - key_term[None, :]
            row_offset = -slope_log2 * row_distance
    if MASKED:
        t = band_mask(t, rows[:, None], keys[None, :], band, float("-inf"), VARIANT)
    return t, unit, row_offset

@gluon.jit
def tile_logits_grad(ds, capped, queries, keys, band, MASKED: gl.constexpr, VARIANT: gl.constexpr):
    """``ds`` = P (dP - delta) times the logits' derivative by the scaled score (the softcap's
    1 - tanh^2, else 1), and exactly 0 where MASKED and outside the band: masked_fill's gradient,
    as ``scores.score_grads`` (P = 0 there, but a row whose output is NaN has delta = NaN, which
    0 * NaN would carry into dK of keys it never sees; the mask decides, not P == 0, which a
    visible pair may underflow to). ``queries`` and ``keys`` as for ``tile_logits``."""
    if SOFTCAP_ & VARIANT:
        ds = ds * (1.0 - capped * capped)
    if MASKED:
        ds = band_mask(ds, queries, keys, band, 0.0, VARIANT)
    return ds
