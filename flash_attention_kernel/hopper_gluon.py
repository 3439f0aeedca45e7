"""What the backward's Gluon kernels for Hopper (``hopper_dkdv``, ``hopper_dq``) share: where they
may run, and the Gluon names that moved between Triton releases.

Both kernels take FlashAttention-3's structure: a producer warp streams tiles by TMA through a
ring of shared-memory buffers, two consumer warpgroups of 64 rows each read the ring out of step,
so that one's per-score work (exp2, the softcap's tanh, the mask, dropout's draws) runs while the
other's tensor-core products do. They run on sm_90 only, on dense bf16/fp16 calls whose tensors
split into TMA rows (``launch.RowGeometry``) in full tiles (a ragged tile would read the next
slice's rows), with head dim 64 or 128 and no option beyond causal, softcap, sinks and dropout.
Everything else takes the tl kernels.

Gluon's API moved between releases (TMA's load is ``async_copy_global_to_shared`` up to 3.7 and
``async_load`` from 3.9), so the module binds the name it finds and ``CHECKED_VERSIONS`` lists the
Triton releases the kernels were run and checked under.
"""

import os

import torch
import triton
from torch._subclasses.fake_tensor import is_fake

from .launch import RowGeometry, SequenceLayout, _splits_into_rows, _tma_possible
from .options import DROPOUT, LOG2E, MASK_RIGHT, SINKS, SOFTCAP, AttentionOptions

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon: the tl kernels serve every call
    gluon = None

# Triton releases under which these kernels ran the GPU suite (benchmarks/NOTES.md, v19, v20, v22)
CHECKED_VERSIONS = ("3.6.", "3.9.")
HEAD_DIMS = (64, 128)
CONSUMER_REGISTERS = 240  # per thread of each consumer warpgroup (setmaxnreg); the producer warp gets 24


def fits(options: AttentionOptions, layout: SequenceLayout, interpreted: bool, tensors, query_tile: int,
         key_tile: int, allowed_options: int = SOFTCAP | SINKS | DROPOUT) -> bool:
    """Whether a Gluon backward kernel whose tiles are ``query_tile`` query rows and ``key_tile``
    keys can run this call (see the module docstring), with options among ``allowed_options`` (and
    plain causal masking). ``tensors``: q, k, v, dout.

    FLASH_ATTENTION_GLUON unset: every call the kernels can run, under a Triton they were checked
    with (they are faster than the tl kernels on each, NOTES v20, v22); "1": also under other
    Tritons; "0": none."""
    if gluon is None or interpreted or any(is_fake(x) for x in tensors):  # (traced: the graph keeps the tl kernels)
        return False
    setting = os.environ.get("FLASH_ATTENTION_GLUON", "")
    if setting == "0" or os.environ.get("FLASH_ATTENTION_TMA", "") == "0":
        return False
    if setting != "1" and not triton.__version__.startswith(CHECKED_VERSIONS):
        return False
    q = tensors[0]
    if (options.variant & ~allowed_options & ~_causal_bits(options) or layout.is_varlen
            or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] not in HEAD_DIMS):
        return False
    if layout.seqlen_q % query_tile or layout.seqlen_k % key_tile:
        return False
    if q.device.type != "cuda" or torch.version.hip or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    return _tma_possible(False, tensors) and all(_splits_into_rows(x, layout) for x in tensors)


def tile_arguments(tensors, layout: SequenceLayout, rows) -> list:
    """The kernels' first arguments: a TMA descriptor for each of ``tensors`` (q, k, v, dout) with
    blocks of ``rows[i]`` rows of the head dim, over the tensor seen as a matrix of rows
    (``launch.RowGeometry``), then each tensor's (batch_rows, head_rows, head_cols)."""
    element = gl.bfloat16 if tensors[0].dtype == torch.bfloat16 else gl.float16
    head_dim = tensors[0].shape[-1]
    geometry = [RowGeometry.of(x, layout) for x in tensors]
    descriptors = [
        TensorDescriptor(x, [g.num_rows, g.stride_row], [g.stride_row, 1], [block_rows, head_dim],
                         gl.NVMMASharedLayout.get_default_for([block_rows, head_dim], element))
        for x, g, block_rows in zip(tensors, geometry, rows)
    ]
    return [*descriptors, *(value for g in geometry for value in (g.batch_rows, g.head_rows, g.head_cols))]


def score_arguments(options: AttentionOptions) -> tuple:
    """(qk_log2, tanh_scale, softcap_log2, softmax_scale) as the kernels take them: the logit in
    base 2 is q.k * qk_log2, or under a softcap softcap_log2 * tanh(q.k * tanh_scale)."""
    softcap = options.softcap
    return (options.softmax_scale * LOG2E, options.softmax_scale / softcap if softcap > 0 else 0.0,
            softcap * LOG2E, options.softmax_scale)


def _causal_bits(options: AttentionOptions) -> int:
    """The variant's mask bits that plain causal masking sets (a right band edge at 0, no left)."""
    return MASK_RIGHT if options.causal and options.window_left < 0 else 0


if gluon is not None:
    # TMA's global-to-shared copy under its name in this release
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    @gluon.jit
    def ring_barriers(STAGES: gl.constexpr):
        """(ready, empty) mbarriers of a ring of STAGES buffers: the producer's TMA completes
        "ready", both consumer warpgroups arrive on "empty" to release a buffer."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)
        return ready, empty

    @gluon.jit
    def tanh_approx(x):
        """tanh by the GPU's tanh.approx.f32 (one special-function op), as the tl kernels' TANH_APPROX."""
        return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                         pack=1)
