"""Launch configurations: tile sizes, warps and pipeline stages for each kernel.

Configs are picked from a small fixed table per GPU class (GPU_CLASSES: the GPU's capability and
per-block shared memory), keyed by the head-dim width the kernels compute (the padded head dim,
or the sum of its two chunks where one exists), the kind of masking ("none", "causal" or
"window"), a sequence-length bucket (SEQLEN_BUCKETS) and the element size; there is no run-time
autotuning, so a new shape never pays for a tuning sweep and a new sequence length never
recompiles (sequence lengths are plain runtime integers in every kernel). The tuner replaces an
entry for a whole run through ``set_override``. Every entry fits its class's shared memory
(tests/test_resource_arch.py); should a Triton release allocate more, the launchers step down
through ``smaller_config`` (launch.launch_fitting).

Under ``TRITON_INTERPRET=1`` (CPU tests) the kernels run with small, deliberately unequal tiles
(BLOCK_M != BLOCK_N) so that the small test sequences still cross several tiles, partial tiles and
causal diagonals that do not fall on tile boundaries.
"""

import functools
from dataclasses import dataclass, field, replace
from typing import Optional

import torch


@dataclass(frozen=True)
class TileConfig:
    """Tile shape of one kernel: BLOCK_M query rows x BLOCK_N key rows. ``tma``: tiles read through
    tensor descriptors where the GPU and the inputs allow it. ``q_per_tile`` (forward only): Q read
    again for each key tile, staged through shared memory beside K and V, instead of held in
    registers across the loop (on mma.sync at head dim 64, docs/design.md#config-rules)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    q_per_tile: bool = False

    def launch_args(self) -> dict:
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, num_warps=self.num_warps, num_stages=self.num_stages)


def padded_head_dim(head_dim: int) -> int:
    """The power of two (at least 16, the smallest tl.dot operand) a head dim pads to; it keys
    the config table."""
    return max(16, 1 << (head_dim - 1).bit_length())


def head_dim_chunks(head_dim: int) -> tuple[int, int]:
    """(DIM_A, DIM_B): the head dim as one or two power-of-two chunks (DIM_B == 0: one chunk).

    Two chunks when they are narrower than padding to one power of two: 80 -> 64 + 16,
    96 -> 64 + 32, 160 -> 128 + 32, 192 -> 128 + 64; but 111 -> 128 and 224 -> 256, where the
    two chunks would be as wide as the padding.
    """
    padded = padded_head_dim(head_dim)
    first = max(16, 1 << (head_dim.bit_length() - 1))
    rest = head_dim - first
    second = padded_head_dim(rest) if rest > 0 else 0
    if second and first + second < padded:
        return first, second
    return padded, 0


_INTERPRETER = {
    "fwd": TileConfig(64, 32, 4, 1),
    "bwd_dkdv": TileConfig(32, 64, 4, 1),
    "bwd_dq": TileConfig(64, 32, 4, 1),
}

# GPU classes. What bounds a config on a GPU is its per-block shared memory (the pipeline's
# buffers live there) and which matrix instructions Triton compiles tl.dot to: wgmma (sm_90) or
# tcgen05 (sm_100), Ampere's mma.sync (sm_80 to sm_89, sm_120), and below sm_80 plain FMAs
# (Triton has no tensor-core path for Turing since 3.2). Each class has its own table below; every
# entry of every class is compiled for each member architecture by
# tests/test_resource_arch.py, which checks it against the class's limit.
@dataclass(frozen=True)
class GpuClass:
    """GPUs that share one config table: ``shared_memory`` is the class's per-block limit in
    bytes (torch's shared_memory_per_block_optin), ``capabilities`` its members."""

    name: str
    shared_memory: int
    capabilities: tuple


GPU_CLASSES = (
    GpuClass("sm90", 232448, ((9, 0),)),  # H100, H200, GH200 (227 KB)
    GpuClass("sm100", 232448, ((10, 0), (10, 3))),  # B200, GB200, B300 (227 KB)
    GpuClass("sm80", 166912, ((8, 0), (8, 7))),  # A100, A800, A30; Jetson Orin (163 KB)
    GpuClass("sm86", 101376, ((8, 6), (8, 9), (12, 0))),  # RTX 30xx, A10, A40; RTX 40xx, L4, L40; RTX 50xx (99 KB)
    GpuClass("sm75", 65536, ((7, 5),)),  # T4, RTX 20xx (64 KB)
)
MIN_CAPABILITY = (7, 5)


def gpu_class(capability: tuple, shared_memory: int) -> GpuClass:
    """The class of a GPU of ``capability`` (major, minor) with ``shared_memory`` bytes per
    block: its own where its capability is listed and it has that class's memory, else (an
    unknown GPU) the largest class whose memory it has among those whose instructions it has (the
    newest of equals)."""
    for cls in GPU_CLASSES:
        if tuple(capability) in cls.capabilities and shared_memory >= cls.shared_memory:
            return cls
    fitting = [cls for cls in GPU_CLASSES
               if cls.shared_memory <= shared_memory and tuple(capability) >= min(cls.capabilities)]
    if not fitting:
        raise ValueError(f"no config class for a GPU of capability {capability} with {shared_memory} bytes of "
                         f"shared memory per block (the smallest class needs {GPU_CLASSES[-1].shared_memory})")
    return max(fitting, key=lambda cls: (cls.shared_memory, min(cls.capabilities)))


@dataclass(frozen=True)
class ConfigTable:
    """The configs of one GPU class.

    ``two_byte``: (kernel, width, mask) -> config for fp16/bf16, width the head-dim width the
    kernels compute (configs.head_dim_chunks); a width without an entry takes its padded power of
    two's, a mask without one takes _FALLBACK_MASK's. ``fp32``: (kernel, widest width) -> config,
    the narrowest entry that holds the width (none: a ValueError, the GPU is too small).
    ``short``: per sequence-length bucket, entries that beat ``two_byte``'s on short sequences.
    ``warp_specialized``: (kernel, width, mask) -> (config, shortest sequence it is used at).
    ``dropout``: (kernel, width) -> config with dropout."""

    two_byte: dict
    fp32: dict
    short: dict = field(default_factory=dict)
    warp_specialized: dict = field(default_factory=dict)
    dropout: dict = field(default_factory=dict)


def _any_mask(entries: dict) -> dict:
    """(kernel, width) -> config entries as (kernel, width, mask) entries, one per mask kind."""
    return {(kernel, width, mask): config for (kernel, width), config in entries.items() for mask in ("none", "causal")}


# Sequence-length buckets: a problem whose longest sequence (the longer of seqlen_q and seqlen_k)
# has at most this many rows takes that bucket's ``short`` entries, where it has one (the smallest
# such bucket first), and ``two_byte``'s otherwise.
SEQLEN_BUCKETS = (1024, 2048)

# Masks without entries of their own take another mask's: windows mask on both sides of the
# band, as causal calls mask the diagonal.
_FALLBACK_MASK = {"window": "causal"}

# sm90: tuned by benchmarks/tune_configs.py on an H200 (Triton 3.6, N = 4096, 16k tokens, bf16;
# see docs/design.md#config-rules; the causal d128 forward and dQ entries read through
# descriptors, 3-14 % faster in both layouts with and without options). tma=True reads
# the tiles through tensor descriptors where the GPU and the inputs allow it (launch.use_tma),
# plain loads elsewhere. Widths of two chunks (80, 96, 160, 192, ...) take the padded power of
# two's entry where they have none.
_SM90 = ConfigTable(
    two_byte={
        ("fwd", 16, "none"): TileConfig(64, 64, 4, 3),
        ("fwd", 16, "causal"): TileConfig(64, 64, 4, 3),
        ("fwd", 32, "none"): TileConfig(64, 64, 4, 3),
        ("fwd", 32, "causal"): TileConfig(64, 64, 4, 3),
        ("fwd", 64, "none"): TileConfig(128, 64, 8, 3),
        ("fwd", 64, "causal"): TileConfig(128, 64, 8, 3),
        ("fwd", 128, "none"): TileConfig(128, 128, 8, 3, tma=True),
        ("fwd", 128, "causal"): TileConfig(128, 128, 8, 3, tma=True),
        ("fwd", 256, "none"): TileConfig(128, 64, 8, 2),
        ("fwd", 256, "causal"): TileConfig(128, 64, 8, 2),
        ("fwd", 80, "none"): TileConfig(128, 64, 8, 3, tma=True),
        ("fwd", 80, "causal"): TileConfig(128, 64, 4, 3),
        ("fwd", 96, "none"): TileConfig(128, 64, 8, 3, tma=True),
        ("fwd", 96, "causal"): TileConfig(128, 64, 4, 3, tma=True),
        ("fwd", 192, "none"): TileConfig(128, 64, 8, 3),
        ("fwd", 192, "causal"): TileConfig(128, 64, 8, 3),
        ("bwd_dkdv", 16, "none"): TileConfig(64, 64, 4, 2),
        ("bwd_dkdv", 16, "causal"): TileConfig(64, 64, 4, 2),
        ("bwd_dkdv", 32, "none"): TileConfig(64, 64, 4, 2),
        ("bwd_dkdv", 32, "causal"): TileConfig(64, 64, 4, 2),
        ("bwd_dkdv", 64, "none"): TileConfig(64, 64, 4, 2),
        ("bwd_dkdv", 64, "causal"): TileConfig(64, 64, 4, 2),
        ("bwd_dkdv", 128, "none"): TileConfig(64, 64, 4, 2, tma=True),
        ("bwd_dkdv", 128, "causal"): TileConfig(64, 128, 8, 3, tma=True),
        ("bwd_dkdv", 256, "none"): TileConfig(64, 64, 8, 2),
        ("bwd_dkdv", 256, "causal"): TileConfig(64, 64, 8, 2),
        ("bwd_dkdv", 80, "none"): TileConfig(64, 64, 4, 2, tma=True),
        ("bwd_dkdv", 80, "causal"): TileConfig(64, 64, 4, 2, tma=True),
        ("bwd_dkdv", 96, "causal"): TileConfig(64, 64, 4, 3, tma=True),
        ("bwd_dkdv", 192, "none"): TileConfig(32, 128, 8, 3),
        ("bwd_dkdv", 192, "causal"): TileConfig(32, 128, 8, 3),
        ("bwd_dq", 16, "none"): TileConfig(64, 64, 4, 3),
        ("bwd_dq", 16, "causal"): TileConfig(64, 64, 4, 3),
        ("bwd_dq", 32, "none"): TileConfig(64, 64, 4, 3),
        ("bwd_dq", 32, "causal"): TileConfig(64, 64, 4, 3),
        ("bwd_dq", 64, "none"): TileConfig(128, 64, 8, 3),
        ("bwd_dq", 64, "causal"): TileConfig(128, 64, 8, 3),
        ("bwd_dq", 128, "none"): TileConfig(128, 32, 8, 3),
        ("bwd_dq", 128, "causal"): TileConfig(128, 64, 8, 3, tma=True),
        ("bwd_dq", 256, "none"): TileConfig(128, 32, 8, 3),
        ("bwd_dq", 256, "causal"): TileConfig(128, 32, 8, 3),
        ("bwd_dq", 80, "causal"): TileConfig(128, 32, 4, 3),
        ("bwd_dq", 96, "causal"): TileConfig(128, 32, 8, 3),
    },
    # fp32 inputs multiply in full precision (FMA loops, no tensor cores), whose operands live in
    # registers: small tiles keep them out of local memory (benchmarks/resource_report.py).
    fp32={
        ("fwd", 128): TileConfig(64, 32, 8, 2),
        ("bwd_dkdv", 128): TileConfig(32, 32, 8, 2),
        ("bwd_dq", 128): TileConfig(64, 32, 8, 2),
        ("fwd", 256): TileConfig(64, 32, 8, 2),
        ("bwd_dkdv", 256): TileConfig(16, 32, 8, 1),
        ("bwd_dq", 256): TileConfig(32, 16, 8, 1),
    },
    # Tuned with --seqlen 1024 / 2048 (at N = 512 too for the first bucket). The causal d128 dK/dV
    # kernel takes 128-key tiles from 4k rows on and the smaller ones below (docs/design.md#config-rules).
    # The d64 causal forward at 2048 (H100, stop 56): 1.04x under Triton 3.6 and 1.05x under 3.9.
    short={
        1024: {
            ("fwd", 64, "causal"): TileConfig(64, 64, 4, 3),
            ("fwd", 128, "none"): TileConfig(128, 32, 8, 3),
            ("fwd", 128, "causal"): TileConfig(64, 64, 4, 3),
            ("bwd_dkdv", 128, "causal"): TileConfig(32, 64, 4, 2),
        },
        2048: {
            ("fwd", 64, "causal"): TileConfig(64, 64, 4, 3),
            ("fwd", 128, "none"): TileConfig(64, 64, 4, 3, tma=True),
            ("bwd_dkdv", 128, "causal"): TileConfig(32, 64, 4, 2),
        },
    },
    # Only where they beat the plain loop on the H200 (docs/design.md#warp-specialised-tl-loops): the
    # plain loop is faster for the forward at widths 64, 80 and 96, for the dQ kernel below 4k rows, and for
    # the dK/dV kernel always (Triton 3.6 crashes on it warp-specialised at 4 warps, as on the dQ kernel).
    warp_specialized={
        ("fwd", 128, "none"): (TileConfig(128, 128, 4, 2, tma=True), 0),
        ("fwd", 192, "none"): (TileConfig(128, 64, 4, 2, tma=True), 0),
        ("fwd", 256, "none"): (TileConfig(128, 64, 4, 2, tma=True), 0),
        ("bwd_dq", 128, "none"): (TileConfig(128, 128, 8, 2, tma=True), 4096),
    },
    # With dropout (scores.dropout_keep draws one Philox call per thread and 16 pairs), the dQ
    # kernel at width 128 is faster with 64-key tiles than with the 32-key tiles of its non-causal
    # entry (H200: 1.18-1.19x its dropout backward, docs/design.md#config-rules).
    dropout={
        ("bwd_dq", 128): TileConfig(128, 64, 8, 3, tma=True),
    },
)

# sm100 (227 KB, tcgen05; B200): Hopper's table where its entries fit (tl.dot there keeps its
# accumulator in tensor memory and stages its operands differently, so some take more shared
# memory: resource_report.py --table sm100), one stage or tile step less where they do not; no
# warp-specialised loops (launch.warp_specialize: checked on Hopper only). Not timed on a B200.
_SM100 = ConfigTable(
    two_byte={
        **_SM90.two_byte,
        ("fwd", 128, "none"): TileConfig(128, 128, 8, 2, tma=True),
        ("fwd", 128, "causal"): TileConfig(128, 128, 8, 2, tma=True),
        ("bwd_dkdv", 256, "none"): TileConfig(64, 64, 8, 1),
        ("bwd_dkdv", 256, "causal"): TileConfig(64, 64, 8, 1),
        ("bwd_dq", 256, "none"): TileConfig(128, 32, 8, 2),
        ("bwd_dq", 256, "causal"): TileConfig(128, 32, 8, 2),
    },
    fp32=_SM90.fp32,
    short=_SM90.short,
    dropout=_SM90.dropout,
)

# sm80 (163 KB, mma.sync): widths 64 and 128 tuned by benchmarks/tune_configs.py on an H200
# emulating an A100 (mma.sync, 163 KB; N = 4096, 16k tokens, bf16; docs/design.md#config-rules): four warps win
# every kernel there, 1.04-1.23x over FlashAttention-2's eight-warp shapes. The other widths keep
# FlashAttention-2's A100 shapes where they fit with few spills (resource_report.py --arch 80).
# The non-causal d64 forward reads Q per key tile (stop 72: 1.006-1.017x the held Q at N = 2k-16k,
# where causal lost 0.5-2.7 %; docs/design.md#config-rules). Not timed on an A100.
_SM80 = ConfigTable(
    two_byte=_any_mask({
        ("fwd", 16): TileConfig(64, 64, 4, 3),
        ("fwd", 32): TileConfig(64, 64, 4, 3),
        ("fwd", 64): TileConfig(128, 64, 4, 3),
        ("fwd", 128): TileConfig(128, 32, 4, 2),
        ("fwd", 256): TileConfig(128, 64, 8, 2),
        ("bwd_dkdv", 16): TileConfig(64, 64, 4, 2),
        ("bwd_dkdv", 32): TileConfig(64, 64, 4, 2),
        ("bwd_dkdv", 64): TileConfig(32, 128, 4, 2),
        ("bwd_dkdv", 128): TileConfig(64, 64, 4, 2),
        ("bwd_dkdv", 256): TileConfig(64, 64, 8, 2),
        ("bwd_dq", 16): TileConfig(64, 64, 4, 3),
        ("bwd_dq", 32): TileConfig(64, 64, 4, 3),
        ("bwd_dq", 64): TileConfig(128, 32, 4, 3),
        ("bwd_dq", 128): TileConfig(128, 32, 4, 3),
        ("bwd_dq", 256): TileConfig(64, 32, 8, 2),
    }) | {("fwd", 64, "none"): TileConfig(128, 64, 4, 3, q_per_tile=True)},
    fp32=_SM90.fp32,
)

# sm86 (99 KB, mma.sync): sm80's shapes (the same timings apply: emulation changes the limit, not
# the SMs), with a shallower dQ pipeline at width 128 and narrower tiles at 256, to stay below
# 99 KB with a margin (resource_report.py --table sm86: sm_86, 89, 120).
_SM86 = ConfigTable(
    two_byte={
        **_SM80.two_byte,
        **_any_mask({
            ("fwd", 256): TileConfig(64, 32, 4, 2),
            ("bwd_dkdv", 256): TileConfig(32, 32, 4, 2),
            ("bwd_dq", 128): TileConfig(128, 32, 4, 2),
            ("bwd_dq", 256): TileConfig(32, 32, 4, 2),
        }),
    },
    fp32={
        **_SM90.fp32,
        ("bwd_dq", 128): TileConfig(32, 32, 8, 2),
        ("fwd", 256): TileConfig(32, 16, 8, 2),
        # the 32-term head-dim parts (tiles.mma_over_head) stage 114688 B at 16 x 32: 16 x 16 takes 81920
        ("bwd_dkdv", 256): TileConfig(16, 16, 8, 1),
    },
)

# sm75 (64 KB): Triton multiplies with FMAs below sm_80 (fp16 operands widened to fp32 in
# registers, as for fp32 inputs), so fp16 takes fp32's small tiles. The backward kernels hold four
# head-dim-wide tiles in shared memory (K, V and a block of Q, dO): 16-row fp32 tiles of width
# 256 take 64 KB plus their statistics, and of width 192 with dropout 73 KB (as compiled on an
# H200 emulating sm_75), so the fp32 backward stops at width 128 there (a ValueError names the
# head dim); fp16 tiles take half the bytes and go to 256.
_SM75 = ConfigTable(
    two_byte=_any_mask({
        **{("fwd", width): TileConfig(64, 32, 8, 2) for width in (16, 32, 64, 128)},
        **{("bwd_dkdv", width): TileConfig(16, 32, 4, 2) for width in (16, 32, 64, 128)},
        **{("bwd_dq", width): TileConfig(32, 32, 8, 2) for width in (16, 32, 64, 128)},
        ("fwd", 256): TileConfig(32, 16, 8, 2),
        ("bwd_dkdv", 256): TileConfig(16, 16, 4, 1),
        ("bwd_dq", 256): TileConfig(16, 16, 4, 2),
    }),
    fp32={  # one stage: the sm_90 compile of an H200 emulating a T4 needs 69-74 KB for two
        ("fwd", 128): TileConfig(64, 32, 8, 1),
        ("bwd_dkdv", 128): TileConfig(16, 32, 4, 2),
        ("bwd_dq", 128): TileConfig(32, 32, 8, 1),
        ("fwd", 256): TileConfig(32, 16, 8, 1),
    },
)

TABLES = {"sm90": _SM90, "sm100": _SM100, "sm80": _SM80, "sm86": _SM86, "sm75": _SM75}


# The Hopper Gluon kernels (hopper_forward, hopper_dq, hopper_dkdv; routed by hopper_route).
# (query rows, keys) of one program of each: a call fits only if its sequence lengths are
# multiples of both (TMA reads full tiles; a ragged one would read the next slice's rows). The
# forward and dQ hold two consumer warpgroups of 64 query rows each and stream key tiles of 128
# (forward) or 64 (dQ); dK/dV holds two warpgroups of 64 keys each and streams query tiles of 64.
# The kernels compile these in (their ROWS and KEYS constexprs), so an override keeps them.
GLUON_TILES = {"fwd": (128, 128), "bwd_dq": (128, 64), "bwd_dkdv": (64, 128)}
# Ring depth (shared-memory buffers of the streamed tiles) per (kernel, head dim), as deep as the
# 227 KB hold where that helped (docs/design.md#hopper-gluon-kernels): forward Q 2 * 64 * d
# elements + each stage 2 * 128 * d (d128: 32 + 3 * 64 KB); dQ Q and dO 4 * 64 * d + each stage
# 2 * 64 * d (5 stages gained nothing at d128); dK/dV K and V 4 * 64 * d + each stage 2 * 64 * d.
# d80 and d96 (two head-dim chunks, hopper_gluon.tile_arguments) from a sweep of every depth that fits
# (stop 53, H100, Triton 3.6, N = 4k and 16k): the d80 forward ran 15-20% faster non-causal at 3 than
# at 4 or 5, d96's dQ 3-5% at 6 than at 5, and both dK/dV kernels best at 2.
GLUON_STAGES = {
    ("fwd", 64): 4, ("fwd", 80): 3, ("fwd", 96): 3, ("fwd", 128): 3,
    ("bwd_dq", 64): 6, ("bwd_dq", 80): 5, ("bwd_dq", 96): 6, ("bwd_dq", 128): 4,
    ("bwd_dkdv", 64): 4, ("bwd_dkdv", 80): 2, ("bwd_dkdv", 96): 2, ("bwd_dkdv", 128): 3,
}
# Under a window's left edge a dK/dV program visits few query tiles, two of them masked and some
# released unread, and a deeper ring keeps the producer ahead: +2-7% on the window backward at
# d128, where the other variants lost 3-5% (docs/design.md#gluon-dkdv)
GLUON_WINDOW_STAGES = {("bwd_dkdv", 64): 4, ("bwd_dkdv", 80): 4, ("bwd_dkdv", 96): 4, ("bwd_dkdv", 128): 4}
# The fused dK/dV/dQ kernel's ring per head dim (hopper_route.fused_chosen), every mask: its dS^T and
# dQ staging buffers take 64 KB more (d128: 198 KB at 2 stages, 231 KB at 3, past sm_90's 227; d64:
# 164 KB at 4; d80 and d96, whose dQ is formed in two head-dim chunks: 199 KB at 4 and 207 KB at 3,
# no spill stores under 3.7.1)
GLUON_FUSED_STAGES = {64: 4, 80: 4, 96: 3, 128: 2}


@dataclass(frozen=True)
class FusedBackwardConfig:
    """The fused backward's tiles on one GPU class at one head dim (ampere_backward): ``key_tile``
    keys per program, ``query_tile`` query rows per streamed tile, ``num_warps``, and the warp grids
    (``warp_grids``: the warps along the keys of S^T / dP^T, along the keys of dK / dV and along
    the rows of dQ, the rest of each along the other side)."""

    query_tile: int
    key_tile: int
    num_warps: int
    warp_grids: tuple


# The fused backward's config per GPU class and head dim (what it runs on: ampere_route), each
# 160 KB of shared memory on the A100 class (docs/design.md#ampere-gluon-backward). d128:
# FlashAttention-2's A100 tiles and grids. d64: query tiles of 128 rows, which halve the barriers
# and copy waits per product against d128's 64 and ran 2-11 % faster than the split tl backward
# from 4k tokens (level at 2k) where 64-row tiles ran 4-8 % slower; 2 warps along the keys of S^T,
# which held the causal kernel to 16 spilled bytes where 4 spilled 456 (stop 55)
FUSED_BACKWARD = {"sm80": {128: FusedBackwardConfig(64, 128, 8, (4, 4, 2)),
                           64: FusedBackwardConfig(128, 128, 8, (2, 4, 4))}}


@dataclass(frozen=True)
class GluonConfig:
    """Launch shape of one Hopper Gluon kernel: ``query_tile`` query rows and ``key_tile`` keys per
    program (GLUON_TILES: compiled into the kernel) and a ring of ``stages`` buffers."""

    query_tile: int
    key_tile: int
    stages: int


@dataclass(frozen=True)
class Override:
    """What ``set_override`` fixes for every launch of one pass: ``implementation`` "tl" or
    "gluon" (None: hopper_route decides), and ``config`` (None: the table's) of that kernel, a
    TileConfig taken as the tl kernel's warp-specialised entry if ``warp_specialized`` else as its
    plain entry, or a GluonConfig."""

    implementation: Optional[str]
    config: object = None
    warp_specialized: bool = False


# The one hook over launch decisions (set_override): pass (fwd, bwd_dq, bwd_dkdv, decode) ->
# Override. Empty in normal use; the tuner, benchmarks and tests set it.
OVERRIDES: dict = {}
PASSES = ("fwd", "bwd_dq", "bwd_dkdv", "decode")


# Caches of launch decisions made from this module's configs (functools.lru_cache'd functions),
# emptied when an override changes them
_DERIVED_CACHES: list = []


def cleared_by_overrides(cached_function):
    """Register an lru_cache'd function whose results depend on the configs (decode._decode_setup)."""
    _DERIVED_CACHES.append(cached_function)
    return cached_function


def set_override(kernel: str, config=None, warp_specialized: bool = False,
                 implementation: Optional[str] = None) -> None:
    """Make every launch of pass ``kernel`` (fwd, bwd_dq, bwd_dkdv, decode) run ``implementation``
    ("tl" or "gluon") with ``config``; both None: the table and hopper_route again.

    A TileConfig is the tl kernel's (its warp-specialised entry if ``warp_specialized``, else its
    plain one with warp specialisation off) and implies "tl"; a GluonConfig is the Gluon kernel's
    (its tiles must be GLUON_TILES', which the kernel compiles in; its stages are free) and implies
    "gluon". "gluon" runs the Gluon kernel on every call it can run (hopper_route.fits, whatever
    FLASH_ATTENTION_GLUON says) and raises a ValueError on the others; "tl" never runs it."""
    if kernel not in PASSES:
        raise ValueError(f"set_override: no pass {kernel!r}; one of {PASSES}")
    implied = {TileConfig: "tl", GluonConfig: "gluon"}.get(type(config))
    if config is not None and implied is None:
        raise TypeError(f"set_override: {config!r} is neither a TileConfig nor a GluonConfig")
    if implementation not in (None, "tl", "gluon") or (implied and implementation not in (None, implied)):
        raise ValueError(f"set_override: implementation {implementation!r} with {config!r}")
    if implementation == "gluon" and kernel not in GLUON_TILES:
        raise ValueError(f"set_override: the {kernel} pass has no Gluon kernel")
    if isinstance(config, GluonConfig) and (config.query_tile, config.key_tile) != GLUON_TILES.get(kernel):
        raise ValueError(f"set_override: the Gluon {kernel} kernel's tiles are {GLUON_TILES.get(kernel)} "
                         f"(compiled in), not {(config.query_tile, config.key_tile)}")
    if config is None and implementation is None:
        OVERRIDES.pop(kernel, None)
    else:
        OVERRIDES[kernel] = Override(implementation or implied, config, warp_specialized)
    for cached_function in _DERIVED_CACHES:
        cached_function.cache_clear()


def overridden_implementation(kernel: str) -> Optional[str]:
    """The implementation ("tl", "gluon") an override forces on pass ``kernel``, None if none does."""
    override = OVERRIDES.get(kernel)
    return override.implementation if override is not None else None


def _overridden_config(kernel: str, config_type) -> Optional[Override]:
    """The override of pass ``kernel`` where it sets a config of ``config_type``."""
    override = OVERRIDES.get(kernel)
    return override if override is not None and isinstance(override.config, config_type) else None


def gluon_config(kernel: str, head_dim: int, mask: str) -> GluonConfig:
    """The Gluon ``kernel``'s (fwd, bwd_dq, bwd_dkdv) config at ``head_dim`` (hopper_route.HEAD_DIMS) for
    ``mask`` (options.AttentionOptions.mask_kind)."""
    override = _overridden_config(kernel, GluonConfig)
    if override is not None:
        return override.config
    stages = GLUON_WINDOW_STAGES.get((kernel, head_dim)) if mask == "window" else None
    return GluonConfig(*GLUON_TILES[kernel], stages or GLUON_STAGES[kernel, head_dim])


def tile_config(kernel: str, head_dim: int, dtype: torch.dtype, interpreted: bool, mask: str = "none",
                seqlen: int = 0, dropout: bool = False, gpu: str = "sm90") -> TileConfig:
    """Config for ``kernel`` in {"fwd", "bwd_dkdv", "bwd_dq"} at ``head_dim``, for a problem with
    ``mask`` ("none", "causal" or "window": options.AttentionOptions.mask_kind), with or without
    dropout, whose longest sequence has ``seqlen`` rows, on a GPU of class ``gpu`` (a name in
    TABLES)."""
    override = _overridden_config(kernel, TileConfig)
    if override is not None and not override.warp_specialized:
        return override.config
    # int/bool: under torch.compile's dynamic shapes these may be symbolic (then specialised here)
    bucket = next((bucket for bucket in SEQLEN_BUCKETS if bool(seqlen <= bucket)), None)
    return _table_entry(kernel, int(head_dim), dtype, interpreted, mask, bucket, bool(dropout), gpu)


def warp_specialized_config(kernel: str, head_dim: int, dtype: torch.dtype, interpreted: bool, mask: str,
                            seqlen: int, gpu: str = "sm90") -> Optional[TileConfig]:
    """The table's warp-specialised config for ``kernel`` on a problem whose longest sequence has
    ``seqlen`` rows, or None where it has none. Under the interpreter the small test tiles stand in
    for it, at any length, so that the tests reach this path."""
    override = _overridden_config(kernel, TileConfig)
    if override is not None:
        return override.config if override.warp_specialized else None
    entry = _warp_specialized_entry(kernel, int(head_dim), dtype, mask, gpu)
    if entry is None:
        return None
    config, shortest = entry
    if interpreted:
        return _INTERPRETER[kernel]
    return config if bool(seqlen >= shortest) else None


@functools.lru_cache(maxsize=None)
def _warp_specialized_entry(kernel: str, head_dim: int, dtype: torch.dtype, mask: str, gpu: str):
    if dtype == torch.float32:
        return None
    return TABLES[gpu].warp_specialized.get((kernel, sum(head_dim_chunks(head_dim)), mask))


@functools.lru_cache(maxsize=None)  # a lookup per launch: keep it off the host's critical path
def _table_entry(kernel: str, head_dim: int, dtype: torch.dtype, interpreted: bool, mask: str,
                 bucket: Optional[int], dropout: bool, gpu: str) -> TileConfig:
    if interpreted:
        return _INTERPRETER[kernel]
    table = TABLES[gpu]
    padded = padded_head_dim(head_dim)
    width = sum(head_dim_chunks(head_dim))
    if dtype == torch.float32:
        fitting = [(bound, config) for (name, bound), config in table.fp32.items() if name == kernel and bound >= width]
        if not fitting:
            widest = max(bound for name, bound in table.fp32 if name == kernel)
            raise ValueError(f"flash_attention: {str(dtype)[6:]} inputs of head dim {head_dim} need more shared memory "
                             f"in the {kernel} kernel than a GPU of class {gpu} has per block (at most head dim "
                             f"{widest} there); use {'float16' if gpu == 'sm75' else 'bfloat16 or float16'}")
        return min(fitting, key=lambda entry: entry[0])[1]
    if dropout:
        for key in ((kernel, width), (kernel, padded)):
            if key in table.dropout:
                return table.dropout[key]
    for key_mask in dict.fromkeys((mask, _FALLBACK_MASK.get(mask, mask))):
        if (kernel, width, key_mask) in table.short.get(bucket, {}):
            return table.short[bucket][(kernel, width, key_mask)]
        if (kernel, width, key_mask) in table.two_byte:
            return table.two_byte[(kernel, width, key_mask)]
    return table.two_byte[(kernel, padded, _FALLBACK_MASK.get(mask, mask))]


def smaller_config(config: TileConfig) -> Optional[TileConfig]:
    """The next config to try when ``config`` does not fit a GPU (launch.launch_fitting): one
    pipeline stage less, then half the longer tile side (at least 16 rows) with two stages; None
    when nothing smaller is left."""
    if config.num_stages > 1:
        return replace(config, num_stages=config.num_stages - 1)
    if max(config.block_m, config.block_n) <= 16:
        return None
    if config.block_m >= config.block_n:
        return replace(config, block_m=config.block_m // 2, num_stages=2)
    return replace(config, block_n=config.block_n // 2, num_stages=2)


def decode_config(rows: int, head_dim: int, dtype: torch.dtype, interpreted: bool,
                  gpu: GpuClass = GPU_CLASSES[0]) -> TileConfig:
    """Config of the KV-cache kernel (decode.py), whose blocks hold ``rows`` (query, head) pairs
    per KV head: blocks of the fewest rows that a tensor-core tile takes (16) up to 128 (chunked
    prefill; eight warps from 128 rows, four below), and the longest key tile (at most 32 KB, at
    most 32 scores per thread, which beyond spill registers) of which two stages fit, as deep a
    pipeline as the GPU's shared memory holds up to three stages (decode streams the cache once,
    so the loads in flight set its speed). Measured on an H200 (docs/design.md#decode): bf16
    d128 decode best at 16 x 128 x 4 warps x 3 stages; 512 queries x 32k keys 561 us at
    128 x 64 x 8 x 3 against 715 us at 64 x 128 x 4 x 3."""
    override = _overridden_config("decode", TileConfig)
    if override is not None:
        return override.config
    block_m = min(max(16, 1 << (max(rows, 1) - 1).bit_length()), 128)
    if interpreted:
        return TileConfig(min(block_m, 64), 32, 4, 1)
    width = sum(head_dim_chunks(head_dim))
    element = 4 if dtype == torch.float32 else 2
    # (without tensor cores, sm_75, the dots stage q and the probabilities through shared memory too)
    operand_copies = 2 if min(gpu.capabilities) < (8, 0) else 1
    while True:  # (a GPU too small for a block's tiles takes half the rows)
        num_warps = 4 if block_m <= 64 else 8
        for block_n in (128, 64, 32, 16):  # the longest tile of which two stages fit
            # q, the probabilities' layout conversion and some room, then stages of one K and one V tile
            free = gpu.shared_memory - operand_copies * (block_m * width + block_m * block_n) * element - 8192
            stages = min(3, free // (2 * block_n * width * element))
            # (a score tile of more than 32 values per thread spills registers)
            if block_n * width * element <= 32768 and block_m * block_n <= 1024 * num_warps and stages >= 2:
                return TileConfig(block_m, block_n, num_warps, stages)
        if block_m == 16:
            return TileConfig(16, 16, 4, 1)
        block_m //= 2
