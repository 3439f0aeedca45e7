"""Launch configurations: tile sizes, warps and pipeline stages for each kernel.

Configs are picked from a small fixed table keyed by the head-dim width the kernels compute
(the padded head dim, or the sum of its two chunks where one exists), the kind of masking
("none", "causal" or "window"), a sequence-length bucket (SEQLEN_BUCKETS) and the element size;
there is no run-time autotuning, so a new shape never pays for a tuning sweep and a new sequence
length never recompiles (sequence lengths are plain runtime integers in every kernel). The tuner
replaces an entry for a whole run through ``set_override``.

Under ``TRITON_INTERPRET=1`` (CPU tests) the kernels run with small, deliberately unequal tiles
(BLOCK_M != BLOCK_N) so that the small test sequences still cross several tiles, partial tiles and
causal diagonals that do not fall on tile boundaries.
"""

import functools
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class TileConfig:
    """Tile shape of one kernel: BLOCK_M query rows x BLOCK_N key rows."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False

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

# Sequence-length buckets: a problem whose longest sequence (the longer of seqlen_q and seqlen_k)
# has at most this many rows takes that bucket's _GPU_SHORT entries, where it has one (the smallest
# such bucket first), and _GPU's otherwise.
SEQLEN_BUCKETS = (1024, 2048)

# Masks without entries of their own take another mask's: windows mask on both sides of the
# band, as causal calls mask the diagonal.
_FALLBACK_MASK = {"window": "causal"}

# GPU table for 2-byte inputs: (kernel, computed head-dim width, mask) -> config, tuned by
# benchmarks/tune_configs.py on an H200 (Triton 3.6, N = 4096, 16k tokens, bf16; see
# benchmarks/NOTES.md, v2 to v4; the causal d128 forward and dQ entries read through descriptors
# since v9, 3-14 % faster in both layouts with and without options). tma=True reads the tiles
# through tensor descriptors where the GPU and the inputs allow it (launch.use_tma), plain loads
# elsewhere, e.g. on Ampere. Widths of two chunks (80, 96, 160, 192, ...) take the padded power
# of two's entry where they have none.
_GPU = {
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
}

# Entries that beat _GPU's on short sequences, per bucket (tuned with --seqlen 1024 / 2048; at
# N = 512 too for the first bucket). The causal d128 dK/dV kernel takes 128-key tiles from 4k rows
# on and the smaller ones below (benchmarks/NOTES.md, v8).
_GPU_SHORT = {
    1024: {
        ("fwd", 64, "causal"): TileConfig(64, 64, 4, 3),
        ("fwd", 128, "none"): TileConfig(128, 32, 8, 3),
        ("fwd", 128, "causal"): TileConfig(64, 64, 4, 3),
        ("bwd_dkdv", 128, "causal"): TileConfig(32, 64, 4, 2),
    },
    2048: {
        ("fwd", 128, "none"): TileConfig(64, 64, 4, 3, tma=True),
        ("bwd_dkdv", 128, "causal"): TileConfig(32, 64, 4, 2),
    },
}

# Warp-specialised entries, (kernel, width, mask) -> (config, shortest sequence it is used at):
# launch.warp_specialize decides whether a call can take one, the plain entries above serve every
# other call. Only where they beat the plain loop on the H200 (benchmarks/NOTES.md, v6): the plain
# loop is faster for the forward at widths 64, 80 and 96, for the dQ kernel below 4k rows, and for
# the dK/dV kernel always (Triton 3.6 also fails to compile it and the dQ kernel warp-specialised
# with 4 warps).
_GPU_WARP_SPECIALIZED = {
    ("fwd", 128, "none"): (TileConfig(128, 128, 4, 2, tma=True), 0),
    ("fwd", 192, "none"): (TileConfig(128, 64, 4, 2, tma=True), 0),
    ("fwd", 256, "none"): (TileConfig(128, 64, 4, 2, tma=True), 0),
    ("bwd_dq", 128, "none"): (TileConfig(128, 128, 8, 2, tma=True), 4096),
}

# With dropout (scores.dropout_keep draws one Philox call per thread and 16 pairs), the dQ kernel
# at width 128 is faster with 64-key tiles than with the 32-key tiles of its non-causal entry
# (H200, NOTES v11: 1.18-1.19x its dropout backward).
_GPU_DROPOUT = {
    ("bwd_dq", 128): TileConfig(128, 64, 8, 3, tma=True),
}

# fp32 inputs multiply in full precision (FMA loops, no tensor cores), whose operands live in
# registers: small tiles keep them out of local memory (benchmarks/resource_report.py).
_GPU_FP32 = {
    "fwd": TileConfig(64, 32, 8, 2),
    "bwd_dkdv": TileConfig(32, 32, 8, 2),
    "bwd_dq": TileConfig(64, 32, 8, 2),
}
_GPU_FP32_HEAD_DIM_256 = {**_GPU_FP32, "bwd_dkdv": TileConfig(16, 32, 8, 1), "bwd_dq": TileConfig(32, 16, 8, 1)}


# The tuner's hook (benchmarks/tune_configs.py): kernel -> (config, warp-specialised?) that
# replaces the table's choice for every launch of that kernel. Empty in normal use.
OVERRIDES: dict = {}


def set_override(kernel: str, config: Optional[TileConfig], warp_specialized: bool = False) -> None:
    """Make every launch of ``kernel`` use ``config`` (None: the table again), as its
    warp-specialised entry or as its plain one with warp specialisation off."""
    if config is None:
        OVERRIDES.pop(kernel, None)
    else:
        OVERRIDES[kernel] = (config, warp_specialized)


def tile_config(kernel: str, head_dim: int, dtype: torch.dtype, interpreted: bool, mask: str = "none",
                seqlen: int = 0, dropout: bool = False) -> TileConfig:
    """Config for ``kernel`` in {"fwd", "bwd_dkdv", "bwd_dq"} at ``head_dim``, for a problem with
    ``mask`` ("none", "causal" or "window": options.AttentionOptions.mask_kind), with or without
    dropout, whose longest sequence has ``seqlen`` rows."""
    if kernel in OVERRIDES and not OVERRIDES[kernel][1]:
        return OVERRIDES[kernel][0]
    # int/bool: under torch.compile's dynamic shapes these may be symbolic (then specialised here)
    bucket = next((bucket for bucket in SEQLEN_BUCKETS if bool(seqlen <= bucket)), None)
    return _table_entry(kernel, int(head_dim), dtype, interpreted, mask, bucket, bool(dropout))


def warp_specialized_config(kernel: str, head_dim: int, dtype: torch.dtype, interpreted: bool, mask: str,
                            seqlen: int) -> Optional[TileConfig]:
    """The table's warp-specialised config for ``kernel`` on a problem whose longest sequence has
    ``seqlen`` rows, or None where it has none. Under the interpreter the small test tiles stand in
    for it, at any length, so that the tests reach this path."""
    if kernel in OVERRIDES:
        config, warp_specialized = OVERRIDES[kernel]
        return config if warp_specialized else None
    entry = _warp_specialized_entry(kernel, int(head_dim), dtype, mask)
    if entry is None:
        return None
    config, shortest = entry
    if interpreted:
        return _INTERPRETER[kernel]
    return config if bool(seqlen >= shortest) else None


@functools.lru_cache(maxsize=None)
def _warp_specialized_entry(kernel: str, head_dim: int, dtype: torch.dtype, mask: str):
    if dtype == torch.float32:
        return None
    return _GPU_WARP_SPECIALIZED.get((kernel, sum(head_dim_chunks(head_dim)), mask))


@functools.lru_cache(maxsize=None)  # a lookup per launch: keep it off the host's critical path
def _table_entry(kernel: str, head_dim: int, dtype: torch.dtype, interpreted: bool, mask: str,
                 bucket: Optional[int], dropout: bool) -> TileConfig:
    if interpreted:
        return _INTERPRETER[kernel]
    padded = padded_head_dim(head_dim)
    if dtype == torch.float32:
        return (_GPU_FP32_HEAD_DIM_256 if padded == 256 else _GPU_FP32)[kernel]
    width = sum(head_dim_chunks(head_dim))
    if dropout:
        for key in ((kernel, width), (kernel, padded)):
            if key in _GPU_DROPOUT:
                return _GPU_DROPOUT[key]
    for key_mask in dict.fromkeys((mask, _FALLBACK_MASK.get(mask, mask))):
        if (kernel, width, key_mask) in _GPU_SHORT.get(bucket, {}):
            return _GPU_SHORT[bucket][(kernel, width, key_mask)]
        if (kernel, width, key_mask) in _GPU:
            return _GPU[(kernel, width, key_mask)]
    return _GPU[(kernel, padded, _FALLBACK_MASK.get(mask, mask))]
