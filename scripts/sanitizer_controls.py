"""Control kernels for compute-sanitizer: what Triton's own code generation shows, with no
attention code in the kernel (``scripts/sanitize.py`` compares the attention kernels with them).

* ``warp_specialize``: Triton's warp-specialisation dispatch alone. ``gl.warp_specialize`` lowers
  to a dispatch: the default warpgroup writes each worker warp's partition index into a few bytes
  of shared memory and meets the workers at a named barrier (``barrier.sync 1``); the workers read
  their index after it and run their partition, and the default warps write the exit state at
  the end. The kernel has the attention kernels' partitions (a default warpgroup, a worker
  warpgroup with 240 registers, a worker warp with 24) and grid size, and each partition only
  stores one number, with no shared memory of its own: every racecheck hazard it shows is the
  dispatch's.
* ``warp_specialize_ring``: the same partitions around a TMA ring as the attention kernels use
  one (a producer warp loads tiles into two shared-memory buffers, ``ready``/``empty`` mbarriers
  hand them to the two consumer warpgroups, which each sum half of every tile), with no attention
  code: hazards at its dispatch lines are the dispatch's, hazards at its ring lines the ring
  pattern's.
* ``tensor_descriptor``: a device-side TMA descriptor (``tl.make_tensor_descriptor``, built in
  the global scratch memory Triton's allocator hands out) used for one tile load: what initcheck
  reports for descriptor creation itself.

Run on an sm_90 GPU (Gluon and TMA).
"""

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # (renamed in Triton 3.9)
TILES, ROWS, COLS = 16, 64, 64  # the ring control's tiles per program and tile shape
RING_TILES, RING_ROWS, RING_COLS = gl.constexpr(TILES), gl.constexpr(ROWS), gl.constexpr(COLS)
TOP, BOTTOM = gl.constexpr(0), gl.constexpr(1)  # which half of each tile a consumer warpgroup sums

CONTROL_PROGRAMS = 264  # two CTAs per SM of an H100, as the attention grids of the sanitizer's cases fill


@gluon.jit
def _store_partition(X, INDEX: gl.constexpr):
    gl.store(X + gl.program_id(0) * 3 + INDEX, 1.0 + INDEX)


@gluon.jit
def _warp_specialize_control(X):
    gl.warp_specialize([(_store_partition, (X, 0)), (_store_partition, (X, 1)), (_store_partition, (X, 2))],
                       [4, 1], [240, 24])


@gluon.jit
def _ring_producer(desc, bufs, ready, empty):
    for i in range(RING_TILES):
        idx = i % 2
        mbarrier.wait(empty.index(idx), ((i // 2) & 1) ^ 1)  # (a fresh barrier passes parity 1)
        mbarrier.expect(ready.index(idx), desc.block_type.nbytes)
        tma_load(desc, [(gl.program_id(0) * RING_TILES + i) * RING_ROWS, 0], ready.index(idx), bufs.index(idx))


@gluon.jit
def _ring_consumer(bufs, ready, empty, Out, HALF: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    total = gl.zeros([RING_ROWS // 2, RING_COLS], gl.float32, layout)
    for i in range(RING_TILES):
        idx = i % 2
        mbarrier.wait(ready.index(idx), (i // 2) & 1)
        total += bufs.index(idx).slice(HALF * (RING_ROWS // 2), RING_ROWS // 2).load(layout).to(gl.float32)
        mbarrier.arrive(empty.index(idx), count=1)
    rows = gl.arange(0, RING_ROWS // 2, gl.SliceLayout(1, layout))
    cols = gl.arange(0, RING_COLS, gl.SliceLayout(0, layout))
    offsets = (gl.program_id(0) * RING_ROWS + HALF * (RING_ROWS // 2) + rows)[:, None] * RING_COLS + cols[None, :]
    gl.store(Out + offsets, total)


@gluon.jit
def _warp_specialize_ring_control(desc, Out):
    bufs = gl.allocate_shared_memory(desc.dtype, [2, RING_ROWS, RING_COLS], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    gl.warp_specialize([(_ring_consumer, (bufs, ready, empty, Out, TOP)),
                        (_ring_consumer, (bufs, ready, empty, Out, BOTTOM)),
                        (_ring_producer, (desc, bufs, ready, empty))], [4, 1], [240, 24])


@triton.jit
def _tensor_descriptor_control(X, Y, num_rows, ROWS: tl.constexpr, COLS: tl.constexpr):
    descriptor = tl.make_tensor_descriptor(X, shape=[num_rows, COLS], strides=[COLS, 1], block_shape=[ROWS, COLS])
    tile = descriptor.load([tl.program_id(0) * ROWS, 0])
    offsets = (tl.program_id(0) * ROWS + tl.arange(0, ROWS))[:, None] * COLS + tl.arange(0, COLS)[None, :]
    tl.store(Y + offsets, tile)


def warp_specialize():
    x = torch.zeros(CONTROL_PROGRAMS, 3, device="cuda")
    _warp_specialize_control[(CONTROL_PROGRAMS,)](x, num_warps=4)
    assert (x == torch.tensor([1.0, 2.0, 3.0], device="cuda")).all(), "the warp_specialize control stored wrong values"


def tensor_descriptor():
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    _tensor_descriptor_control[(4,)](x, y, 256, ROWS=64, COLS=64)
    assert torch.equal(x, y), "the tensor-descriptor control copied wrong values"


def warp_specialize_ring():
    x = torch.randn(CONTROL_PROGRAMS * TILES * ROWS, COLS, device="cuda", dtype=torch.bfloat16)
    layout = gl.NVMMASharedLayout.get_default_for([ROWS, COLS], gl.bfloat16)
    desc = TensorDescriptor(x, list(x.shape), [COLS, 1], [ROWS, COLS], layout)
    out = torch.empty(CONTROL_PROGRAMS * ROWS, COLS, device="cuda")
    _warp_specialize_ring_control[(CONTROL_PROGRAMS,)](desc, out, num_warps=4)
    expected = x.float().view(CONTROL_PROGRAMS, TILES, ROWS, COLS).sum(1).view_as(out)
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-4, msg="the ring control summed wrong values")
