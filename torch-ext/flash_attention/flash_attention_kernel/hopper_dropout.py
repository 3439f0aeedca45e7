"""Dropout's keep mask in Gluon, for the score tiles of the Hopper kernels: the transposed ones
of the dK/dV kernel (hopper_dkdv.py) and the S tiles of the dQ kernel (hopper_dq.py) and the
forward (hopper_forward.py).

Every kernel draws dropout's bits from Philox-4x32-7 (scores.dropout_keep): one call per 16
(query, key) pairs, keyed by the seed at counter (key group, query group, stream, offset), and a
pair is kept iff its 8-bit draw reaches round(p * 256). The tl kernels call tl.philox or, with
WIDE_PRODUCTS, ``rules.philox_rounds``; Gluon has no philox, so its kernels call the latter (its
Gluon instantiation, ``hopper_gluon.philox_rounds``). A warpgroup of the dK/dV kernel holds a
[64 keys, 64 queries] S^T tile in the wgmma accumulator layout, where a call's 16 pairs lie on 4
threads (the forward's tiles hold them on one), so the calls are arranged around that layout:
each thread makes 4 calls per tile and takes 4 more from its neighbour lane (``dropout_words``).
``dropout_state`` holds a warpgroup's constants, ``drop_unkept`` zeroes P and dP where the draw
stays under the threshold. tests/test_hopper_backward.py checks the result bit for bit against
the mask the forward returns.

The [64 queries, KEYS] S tiles of the dQ kernel and the forward hold each call's 16 pairs on one
thread: ``dropout_rows`` makes KEYS / 32 calls per thread and spreads their words over the pairs
by joins alone, ``keep_pairs`` zeroes dP (dQ) or P (forward) where the draw stays under the
threshold, deciding the two keys of a pair, whose draws are neighbouring bytes of a word, by one
fp16x2 compare.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .hopper_gluon import philox_rounds

TILE = gl.constexpr(64)  # keys (rows) and queries (columns) of a consumer warpgroup's S^T tile

# The calls of an S^T tile. OWN_CALLS: the calls a thread makes, [32 keys with key % 16 < 8,
# 16 (query // 16, query % 8 // 2)], 4 per thread. CALLS: the 8 calls a thread needs, [32 keys,
# 32 queries with query % 16 < 8]. Row kc is key 16 (kc // 8) + kc % 8 in both; each is S^T's
# accumulator layout without the register bits of key + 8 and query + 8 (and, in OWN_CALLS, with
# query + 1 moved from a register to the lane bit of key + 1).
OWN_CALLS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 4], [0, 8]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[8, 0], [16, 0]], block_bases=[], shape=[32, 16]))
CALLS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 8], [0, 16]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[8, 0], [16, 0]], block_bases=[], shape=[32, 32]))


def row_calls(keys: int):
    """The calls of an S tile of 64 queries by ``keys`` keys (queries on rows, ``dropout_rows``):
    [32 (query // 16, query % 8), keys // 8 (key // 32, key % 8 // 2)], S's accumulator layout
    without the register bits of query + 8, key + 1, key + 8 and key + 16."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 4 << bit] for bit in range((keys // 32).bit_length() - 1)],
        lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], warp_bases=[[8, 0], [16, 0]], block_bases=[],
        shape=[32, keys // 8])


@gluon.jit
def _spread_rows(index):
    """Row of the S^T tile of call row ``index``: 16 (index // 8) + index % 8."""
    return index // 8 * 16 + index % 8


@gluon.jit
def _from_key_neighbour(x):
    """x as the thread holding the neighbouring keys (key ^ 1: lane ^ 4 in S^T's layout) has it."""
    return gl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 4, 0x1f, 0xffffffff;", "=r,r", [x],
                                     dtype=gl.uint32, is_pure=True, pack=1)


@gluon.jit
def _with_neighbours_calls(own, odd_keys):
    """[32, 32] in CALLS (column qc = query // 16 * 8 + query % 8) from one word of a thread's own
    calls, [32, 16] in OWN_CALLS, and the same word of its neighbour's calls."""
    theirs = _from_key_neighbour(own)
    even_queries = gl.where(odd_keys, theirs, own)
    odd_queries = gl.where(odd_keys, own, theirs)
    return gl.reshape(gl.join(even_queries, odd_queries), [TILE // 2, TILE // 2])


@gluon.jit
def _half_limits(threshold):
    """The threshold round(p * 256) in both 16-bit halves of a word as the draws are compared
    there: 0x04 above the byte (fp16 2^-14 (1 + t / 1024)); its byte 1 is also the 0x04 that the
    PRMTs of ``keep_pairs`` and ``drop_unkept`` take as their second source (byte 5)."""
    return (threshold.to(gl.uint32) | 0x400) * 0x10001


@gluon.jit
def dropout_state(RngState, threshold, first_key, keys):
    """A consumer warpgroup's dropout state for keys [first_key, first_key + 64) (``keys``: the
    tile's key indices in S^T's row layout): the Philox key and offset (RngState: seed, offset),
    the counters of its calls, where each key's bytes sit in its words, and the threshold
    (round(p * 256)) as ``keep_pairs`` compares it. Cheap enough to form for every tile."""
    seed = gl.load(RngState)
    seed_lo = (seed & 0xFFFFFFFF).to(gl.uint32)
    seed_hi = (seed >> 32).to(gl.uint32)
    offset = (gl.load(RngState + 1) & 0xFFFFFFFF).to(gl.uint32)
    call_keys = first_key + _spread_rows(gl.arange(0, TILE // 2, gl.SliceLayout(1, OWN_CALLS)))
    key_groups = gl.expand_dims((call_keys // 32 * 4 + call_keys % 8 // 2).to(gl.uint32), 1)
    upper_keys = gl.expand_dims(call_keys // 16 % 2 == 1, 1)
    odd_keys = gl.expand_dims(call_keys % 2 == 1, 1)
    call_index = gl.arange(0, TILE // 4, gl.SliceLayout(0, OWN_CALLS))  # 4 (query // 16) + query % 8 // 2
    call_queries = (gl.expand_dims(call_index // 4 * 16 + call_index % 4 * 2, 0)
                    + gl.expand_dims(call_keys % 2, 1))  # (+ e: the calls of the thread's own e)
    # PRMT selector of a key's two bytes (keys k and k + 8 of a thread: bytes k % 2 and 2 + k % 2)
    key_bytes = gl.where(keys % 2 == 1, 0x5351, 0x5250).to(gl.uint32)
    return (seed_lo, seed_hi, offset, key_groups, upper_keys, odd_keys, call_queries, key_bytes,
            _half_limits(threshold))


@gluon.jit
def dropout_words(state, m, stream, LAYOUT: gl.constexpr):
    """[64, 64] uint32 in LAYOUT (S^T's accumulator layout) for query rows [m, m + 64) of Philox
    stream ``stream`` (batch * heads + head): for each (key, query) pair, the word that holds its
    8-bit draw. scores.dropout_keep's mapping: pair (query 16 a + 8 h + r, key 32 t + 8 j + 2 c +
    e) draws byte 8 h + 2 j + e of the call at counter (4 t + c, 16 a + r, stream, offset), that is
    byte 2 (j % 2) + e of word 2 h + j // 2.

    A thread of S^T holds keys r and r + 8 (j and j + 1 of one c and e) and queries 2 c' + e' +
    8 i (i < 8) of each 16 x 64 block: it needs 8 calls (query groups 16 (i // 2) + 2 c' + e'),
    4 pairs of each. The thread holding the neighbouring keys (e ^ 1) needs the same 8, so each
    makes the 4 with e' = its e (OWN_CALLS) and takes the other 4 from its neighbour by a
    shuffle. Of each call it keeps words j // 2 and 2 + j // 2 (h = 0, 1; j // 2 = (key // 16) % 2
    is the same for both its keys). The calls, then in CALLS, and their h and j % 2 are joined back
    in as S^T's register bits, so the final conversion only renames registers."""
    seed_lo, seed_hi, offset, key_groups, upper_keys, odd_keys, call_queries, _, _ = state
    r0, r1, r2, r3 = philox_rounds(key_groups, (m + call_queries).to(gl.uint32), stream, offset, seed_lo, seed_hi,
                                   False)
    words = gl.join(_with_neighbours_calls(gl.where(upper_keys, r1, r0), odd_keys),  # [kc, qc, h]
                    _with_neighbours_calls(gl.where(upper_keys, r3, r2), odd_keys))
    # [key // 16, key % 8, query // 16, query % 8, h, key // 8 % 2] -> S^T's [key, query]
    words = gl.reshape(gl.join(words, words), [4, 8, 4, 8, 2, 2])
    words = gl.reshape(gl.permute(words, (0, 5, 1, 2, 4, 3)), [TILE, TILE])
    return gl.convert_layout(words, LAYOUT)


@gluon.jit
def drop_unkept(state, words, p, dp):
    """(p, dp) where the pair's draw (its byte of ``words``) reaches the threshold, else (0, 0).

    A thread of S^T holds keys k and k + 8 of each query, whose draws are bytes k % 2 and 2 + k %
    2 of one word: as in ``keep_pairs``, one PRMT spreads them into fp16x2 lanes under the byte
    0x04 and one f16x2 compare against the threshold sets both predicates; the selects follow in
    the same asm block, so that the compiler keeps them before p's conversion to 16 bits (moved
    after it, it selects each half on its own). Elements come in fours: (k, q), (k, q + 1), (k +
    8, q), (k + 8, q + 1) (S^T's register order); 3 instructions per score, against 4 for a
    shift, a compare and two selects."""
    key_bytes = state[7]
    limit = state[8]
    return gl.inline_asm_elementwise(
        "{ .reg .b32 lanes; .reg .pred k0, k1, k2, k3; "
        "prmt.b32 lanes, $16, $24, $20; setp.ge.f16x2 k0|k2, lanes, $24; "
        "prmt.b32 lanes, $17, $24, $20; setp.ge.f16x2 k1|k3, lanes, $24; "
        "selp.b32 $0, $8, 0, k0; selp.b32 $1, $9, 0, k1; selp.b32 $2, $10, 0, k2; selp.b32 $3, $11, 0, k3; "
        "selp.b32 $4, $12, 0, k0; selp.b32 $5, $13, 0, k1; selp.b32 $6, $14, 0, k2; selp.b32 $7, $15, 0, k3; }",
        "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",  # (a literal: Triton 3.6 takes no other)
        [p, dp, words, key_bytes[:, None], limit],
        dtype=(gl.float32, gl.float32), is_pure=True, pack=4)


@gluon.jit
def dropout_rows(dropout, first_row, n, LAYOUT: gl.constexpr, CALLS: gl.constexpr):
    """[64, KEYS] uint32 in LAYOUT (S's accumulator layout) for query rows [first_row, first_row +
    64) (first_row a multiple of 64) and keys [n, n + KEYS) (n a multiple of KEYS, 64 or 128; CALLS
    = row_calls(KEYS)): for each pair, the Philox word that holds its 8-bit draw. ``dropout`` =
    (RngState, stream, threshold), stream = batch * heads + head.

    scores.dropout_keep's mapping: pair (query 16 a + 8 h + r, key 32 t + 8 j + 2 c + e) draws
    byte 2 (j % 2) + e of word 2 h + j // 2 of the call at counter (4 t + c, 16 a + r, stream,
    offset). A thread of S holds queries r and r + 8 and keys 2 c + e + 8 j of its 16 rows, so the
    call's 16 pairs are its own: the words, joined with copies for j % 2 and e, become S's
    register bits and the final conversion only renames registers."""
    RngState, stream, _ = dropout
    seed = gl.load(RngState)
    offset = (gl.load(RngState + 1) & 0xFFFFFFFF).to(gl.uint32)
    KEYS: gl.constexpr = CALLS.shape[1] * 8
    calls = gl.arange(0, KEYS // 8, gl.SliceLayout(0, CALLS))  # 4 (key // 32) + key % 8 // 2 - n // 8
    groups = gl.arange(0, 32, gl.SliceLayout(1, CALLS))  # (query // 16) * 8 + query % 8
    key_groups = gl.expand_dims((n // 8 + calls).to(gl.uint32), 0)
    query_groups = gl.expand_dims((first_row + groups // 8 * 16 + groups % 8).to(gl.uint32), 1)
    r0, r1, r2, r3 = philox_rounds(key_groups, query_groups, stream, offset, (seed & 0xFFFFFFFF).to(gl.uint32),
                             (seed >> 32).to(gl.uint32), True)
    words = gl.join(gl.join(r0, r1), gl.join(r2, r3))  # [.., .., j // 2, h]
    words = gl.join(gl.join(words, words), gl.join(words, words))  # [.., .., j // 2, h, e, j % 2]
    # [query // 16, query % 8, key // 32, key % 8 // 2, j // 2, h, e, j % 2] -> S's [query, key]
    words = gl.reshape(words, [4, 8, KEYS // 32, 4, 2, 2, 2, 2])
    words = gl.reshape(gl.permute(words, (0, 5, 1, 2, 4, 7, 3, 6)), [TILE, KEYS])
    return gl.convert_layout(words, LAYOUT)


@gluon.jit
def _by_key_halves(x):
    """[64, KEYS] tile ``x`` in S's accumulator layout split by bit 3 of the key (j % 2, a register
    bit): (the keys with key % 16 < 8, the others), each [64, KEYS // 16, 8] with the key's bit 0
    (e) as register bit 0, so that neighbouring registers hold a pair of neighbouring keys."""
    KEYS: gl.constexpr = x.shape[1]
    return gl.split(gl.permute(gl.reshape(x, [TILE, KEYS // 16, 2, 8]), (0, 1, 3, 2)))


@gluon.jit
def _keep_half(x, words, limit, selector):
    """``keep_pairs`` of one half of ``_by_key_halves``: PRMT's ``selector`` picks the pair's
    bytes, (0, 1) or (2, 3), of (word, limit) as (byte, 5, byte + 1, 5); the limit's byte 1 is 0x04
    (an immediate 0x04040404 as the second source would cost a move per PRMT)."""
    if x.dtype == gl.float32:
        return gl.inline_asm_elementwise(
            "{ .reg .b32 lanes; .reg .pred low, high; prmt.b32 lanes, $4, $6, $8; "
            "setp.ge.f16x2 low|high, lanes, $6; selp.b32 $0, $2, 0, low; selp.b32 $1, $3, 0, high; }",
            "=r,=r,r,r,r,r,r,r,r,r", [x, words, limit, selector], dtype=x.dtype, is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise(
            "{ .reg .b32 lanes, keep; prmt.b32 lanes, $2, $4, $6; set.ge.u32.f16x2 keep, lanes, $4; "
            "and.b32 $0, $1, keep; }",
            "=r,r,r,r,r,r,r,r", [x, words, limit, selector], dtype=x.dtype, is_pure=True, pack=2)


@gluon.jit
def keep_pairs(dropout, words, x):
    """x where the pair's draw (its byte of ``words``, ``dropout_rows``) reaches the threshold,
    else 0: the forward's P, already rounded to bf16 or fp16, or the dQ kernel's dP in fp32, in S's
    accumulator layout.

    The draws of two neighbouring keys (e = 0, 1) are neighbouring bytes of one word. One PRMT
    puts the two bytes in the low bytes of the word's 16-bit halves under the byte 0x04: fp16
    numbers 2^-14 (1 + byte / 1024), normal and ordered as the bytes, and one f16x2 compare with
    the threshold spread the same way decides both. For P, whose two 16-bit values share a
    register, the compare gives each half a mask of ones (kept) or zeros and one AND applies it:
    1.5 instructions per score. For dP the compare sets two predicates and a select each applies
    them: 2 per score. (A shift of the byte to the top, a compare and a select took 3.)"""
    x_low, x_high = _by_key_halves(x)
    words_low, words_high = _by_key_halves(words)
    limit = gl.zeros_like(words_low) + _half_limits(dropout[2])
    kept = gl.join(_keep_half(x_low, words_low, limit, gl.full_like(words_low, 0x5150)),
                   _keep_half(x_high, words_high, limit, gl.full_like(words_high, 0x5352)))
    return gl.convert_layout(gl.reshape(gl.permute(kept, (0, 1, 3, 2)), x.shape), x.type.layout)  # (a renaming)
