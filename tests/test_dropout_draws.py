"""Dropout's draws (scores.dropout_keep) against a Philox written here in numpy.

The kernels must agree on every pair's draw whatever their tiles: the forward and dQ kernels
draw [query rows, keys] tiles, the dK/dV kernel [keys, query rows] tiles (KEYS_FIRST), with key
tiles of 16 to 128 keys and 16 or 64 query rows. Each tiling's mask must equal the documented
mapping: pair (i, j) is byte 8 ((i % 16) // 8) + 2 ((j % 32) // 8) + j % 2 of Philox-4x32-7 keyed
by the seed at counter (4 (j // 32) + (j % 8) // 2, 16 (i // 16) + i % 8, stream, offset), kept iff
the byte reaches the threshold.
"""

import sys

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE, PACKAGE_SOURCE

sys.path.insert(0, str(PACKAGE_SOURCE))
from flash_attention_kernel import scores  # noqa: E402  (the source the built package copies)

SEED, STREAM, OFFSET, THRESHOLD = 0x1234_5678_9ABC_DEF1, 37, 0xDEAD_BEEF, 26  # threshold: p = 0.1
QUERIES, KEYS = 64, 256


def philox_4x32(seed, counters, rounds=7):
    """Philox-4x32 (Salmon et al. 2011) on uint32 counter arrays (c0, c1, c2, c3), key = seed."""
    mask = np.uint64(0xFFFFFFFF)
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counters)
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    for _ in range(rounds):
        p0, p1 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & mask)
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    return c0, c1, c2, c3


def expected_keep():
    """[QUERIES, KEYS] keep mask from the documented mapping."""
    rows, keys = np.meshgrid(np.arange(QUERIES), np.arange(KEYS), indexing="ij")
    key_group = 4 * (keys // 32) + (keys % 8) // 2
    query_group = 16 * (rows // 16) + rows % 8
    byte = 8 * ((rows % 16) // 8) + 2 * ((keys % 32) // 8) + keys % 2
    words = philox_4x32(SEED, (key_group, query_group, np.full_like(rows, STREAM), np.full_like(rows, OFFSET)))
    word = np.choose(byte // 4, words)
    draws = (word >> (8 * (byte % 4)).astype(np.uint64)) & np.uint64(0xFF)
    return torch.from_numpy(draws >= THRESHOLD)


@triton.jit
def _keep_kernel(RngState, Out, stream, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 KEYS_FIRST: tl.constexpr, KEYS: tl.constexpr, VARIANT: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    start_n = tl.program_id(1) * BLOCK_N
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    seed = tl.load(RngState)
    offset = tl.load(RngState + 1).to(tl.uint32)
    keep = scores.dropout_keep(offs_m, start_n, (seed, stream, offset, threshold), BLOCK_N, KEYS_FIRST, VARIANT)
    if KEYS_FIRST:
        tl.store(Out + offs_m[None, :] * KEYS + offs_n[:, None], keep.to(tl.int8))
    else:
        tl.store(Out + offs_m[:, None] * KEYS + offs_n[None, :], keep.to(tl.int8))


# the compiled kernels' Philox takes its products by mul.wide.u32 (inline asm: not on the interpreter)
PHILOX_FORMS = [scores.DROPOUT] + ([scores.DROPOUT | scores.WIDE_PRODUCTS] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("variant", PHILOX_FORMS, ids=["tl_philox", "wide_products"][:len(PHILOX_FORMS)])
@pytest.mark.parametrize("keys_first", [False, True], ids=["rows_first", "keys_first"])
@pytest.mark.parametrize("block_m", [16, 64], ids=["m16", "m64"])
@pytest.mark.parametrize("block_n", [16, 32, 64, 128])
def test_draws_follow_the_mapping_in_every_tiling(block_n, block_m, keys_first, variant):
    rng_state = torch.tensor([SEED, OFFSET], dtype=torch.int64, device=DEVICE)
    out = torch.full((QUERIES, KEYS), -1, dtype=torch.int8, device=DEVICE)  # poisoned
    _keep_kernel[(QUERIES // block_m, KEYS // block_n)](rng_state, out, STREAM, THRESHOLD, BLOCK_M=block_m,
                                                        BLOCK_N=block_n, KEYS_FIRST=keys_first, KEYS=KEYS,
                                                        VARIANT=variant)
    expected = expected_keep()
    assert torch.equal(out.cpu().bool(), expected) and (out >= 0).all()
    assert abs(1 - expected.float().mean().item() - THRESHOLD / 256) < 0.03  # ~10 % dropped
