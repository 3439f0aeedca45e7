"""The tile ranges of scores.py against brute force: which key tiles a block of query rows visits
(forward, dQ) and which query tiles a block of keys visits (dK/dV).

For many small (seqlen_q, seqlen_k, window, causal, block) cases, every tile holding a visible
(query, key) pair must be visited exactly once, no other tile may be visited (so the work grows
with the window, not with the sequence), and every tile of the unmasked middle range must be
visible in full (no pair past a band edge or a sequence end).
"""

import itertools
import random
import sys

import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE, PACKAGE_SOURCE

sys.path.insert(0, str(PACKAGE_SOURCE))
from flash_attention_kernel import scores  # noqa: E402  (the source the built package copies)

BLOCK_M, BLOCK_N = 16, 8


@triton.jit
def _ranges_kernel(Cases, Out, KEYS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, VARIANT: tl.constexpr):
    case = tl.program_id(0)
    seqlen_q = tl.load(Cases + case * 5)
    seqlen_k = tl.load(Cases + case * 5 + 1)
    window = (tl.load(Cases + case * 5 + 2), tl.load(Cases + case * 5 + 3))
    start = tl.load(Cases + case * 5 + 4)
    if KEYS:
        lo, full_lo, full_hi, hi = scores.key_tile_ranges(start, seqlen_q, seqlen_k, window, BM, BN, VARIANT)
    else:
        lo, full_lo, full_hi, hi = scores.query_tile_ranges(start, seqlen_q, seqlen_k, window, BM, BN, VARIANT)
    tl.store(Out + case * 4, lo)
    tl.store(Out + case * 4 + 1, full_lo)
    tl.store(Out + case * 4 + 2, full_hi)
    tl.store(Out + case * 4 + 3, hi)


def _visible(i, j, seqlen_q, seqlen_k, left, right):
    diag = seqlen_k - seqlen_q
    return (0 <= i < seqlen_q and 0 <= j < seqlen_k and (left < 0 or j >= i + diag - left)
            and (right < 0 or j <= i + diag + right))


def _visited(lo, full_lo, full_hi, hi, block, has_lower_range):
    """Tile starts visited by the three loops, with the masked/unmasked flag."""
    tiles = [(t, False) for t in range(full_lo, full_hi, block)] + [(t, True) for t in range(full_hi, hi, block)]
    if has_lower_range:
        tiles += [(t, True) for t in range(lo, full_lo, block)]
    return tiles


@pytest.mark.parametrize("keys", [True, False], ids=["key_tiles", "query_tiles"])
@pytest.mark.parametrize("causal, left, right", [(False, -1, -1), (True, -1, -1), (False, 5, -1), (False, -1, 3),
                                                  (False, 6, 9), (True, 20, -1), (False, 0, 0), (True, 0, -1)])
def test_tile_ranges_match_brute_force(fa, keys, causal, left, right):
    options = fa.flash_attention_kernel.AttentionOptions(1.0, causal, window_left=left, window_right=right)
    left, right = options.window
    variant = options.variant
    rng = random.Random(0)
    seqlens = [(sq, sk) for sq, sk in itertools.product((1, 7, 16, 29, 40), (0, 1, 8, 23, 41)) if sq]
    cases = []
    for seqlen_q, seqlen_k in seqlens:
        block, length = (BLOCK_M, seqlen_q) if keys else (BLOCK_N, seqlen_k)
        cases += [(seqlen_q, seqlen_k, left, right, start) for start in range(0, length, block)]
    rng.shuffle(cases)
    cases_tensor = torch.tensor(cases, dtype=torch.int32, device=DEVICE)
    out = torch.full((len(cases), 4), -99, dtype=torch.int32, device=DEVICE)
    _ranges_kernel[(len(cases),)](cases_tensor, out, KEYS=keys, BM=BLOCK_M, BN=BLOCK_N, VARIANT=variant)

    lower_edge = variant & (1 if keys else 2)  # MASK_LEFT for key tiles, MASK_RIGHT for query tiles
    for (seqlen_q, seqlen_k, _, _, start), (lo, full_lo, full_hi, hi) in zip(cases, out.tolist()):
        if keys:  # rows [start, start + BLOCK_M) visit key tiles of BLOCK_N
            owners = range(start, min(start + BLOCK_M, seqlen_q))
            block, length = BLOCK_N, seqlen_k

            def pair(owner, other):
                return _visible(owner, other, seqlen_q, seqlen_k, left, right)
        else:  # keys [start, start + BLOCK_N) visit query tiles of BLOCK_M
            owners = range(start, min(start + BLOCK_N, seqlen_k))
            block, length = BLOCK_M, seqlen_q

            def pair(owner, other):
                return _visible(other, owner, seqlen_q, seqlen_k, left, right)
        visited = _visited(lo, full_lo, full_hi, hi, block, lower_edge)
        starts = [t for t, _ in visited]
        label = f"sq={seqlen_q} sk={seqlen_k} window=({left}, {right}) start={start}: ranges {lo, full_lo, full_hi, hi}"
        assert len(starts) == len(set(starts)), f"{label} visits a tile twice"
        assert all(t % block == 0 for t in starts), label
        needed = {t for t in range(0, length, block)
                  if any(pair(o, x) for o in owners for x in range(t, min(t + block, length)))}
        assert set(starts) == needed, f"{label}: visits {sorted(starts)}, needs {sorted(needed)}"
        for t, masked in visited:
            if not masked:
                assert t + block <= length and all(pair(o, x) for o in owners for x in range(t, t + block)), \
                    f"{label}: tile {t} is not visible in full but runs unmasked"
