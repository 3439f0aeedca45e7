"""flash_attn_with_kvcache (flash-attn 2.8's inference entry point) against a float64 reference.

The reference is attention_ref run per batch entry on the keys [leftpad, seqlen_k) of that entry's
cache row, with seqlen_k = cache_seqlens[b] + seqlen_new. attention_ref aligns its masks to the
bottom-right corner of the slice it is given: query i sees slice key j' iff
j' <= i + (seqlen_k - leftpad) - seqlen_q (+ right); with j' = j - leftpad that is
j <= i + seqlen_k - seqlen_q, and the window's left edge and the ALiBi distance
|i + seqlen_k - seqlen_q - j| shift the same way, so the slice gives exactly the absolute-index
semantics of flash-attn's KV cache. The keys the reference reads are the cache the call must leave
behind (the prefilled rows plus the new k, v written at cache_seqlens[b]), built here from the
inputs, never read back from the kernel's cache.

What is checked:
- decode steps: one token appended per call, every step's output within the error bar and matching
  flash_attn_func on the keys so far; GQA/MQA, fp16/bf16/fp32, int and per-entry cache_seqlens;
- seqlen_q 1 / 3 / 17 (decode, speculative decoding, chunked prefill) x head dims x options
  (causal, window, softcap, ALiBi, sinks), per-entry cache_seqlens down to 0 and rows that see no
  key (out 0, lse +inf, or the sink with s_aux); the lse against the reference lse;
- paged caches (shuffled pages, page sizes that are multiples of 16) give the contiguous result and
  the new rows land in the right pages;
- cache_leftpad and cache_batch_idx (a permutation into a larger cache);
- num_splits 1, 2, 7 and 0 (heuristic) all within the bar, each bitwise repeatable;
- rotary embeddings (GPT-J and GPT-NeoX pairing, rotary_dim < head dim, q rotated at
  cache_seqlens + i with causal/window and at cache_seqlens otherwise) against an explicit float64
  rotation, and the cache holds the rotated k and the unrotated v;
- every cache slot outside the new rows (other rows of used cache rows, unused cache rows, unused
  pages) is bitwise unchanged, and a per-entry cache_seqlens past the cache's end writes nothing
  out of bounds;
- bad arguments raise errors naming the argument.

Cache rows that must not be read (past cache_seqlens + seqlen_new, before cache_leftpad, unused
pages) hold NaN, so reading one shows up as NaN in the output.
"""

import itertools

import pytest
import torch

from conftest import DEVICE, ON_GPU
from inputs import random_qkv
from reference import FWD_FACTOR, assert_within_bar, attention_ref
from sizes import DTYPES

NAN = float("nan")


# --------------------------------------------------------------------------------------------
# helpers


def _int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _bits(x):
    """x's bits as integers, so that NaN compares equal to itself."""
    return x.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def _assert_bitwise_equal(name, got, want):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(_bits(got), _bits(want)), f"{name}: not bitwise equal"


def _cache(batch_cache, capacity, heads_k, head_dim, dtype, visible=None):
    """Two standard normal caches (batch_cache, capacity, heads_k, head_dim); with ``visible``
    {cache row: (start, stop)} the rows of those cache rows outside [start, stop) hold NaN."""
    caches = [torch.randn(batch_cache, capacity, heads_k, head_dim, device=DEVICE, dtype=dtype) for _ in range(2)]
    for row, (start, stop) in (visible or {}).items():
        for cache in caches:
            cache[row, :start] = NAN
            cache[row, stop:] = NAN
    return caches


def _appended(cache, new, seqlens, batch_idx=None):
    """``cache`` with ``new`` (batch, seqlen_new, heads_k, d) written at rows seqlens[b] onwards of
    cache row batch_idx[b] (or b): what the call must leave behind (in new's dtype)."""
    out = cache.to(new.dtype if new is not None else cache.dtype).clone()
    if new is None:
        return out
    for b in range(new.shape[0]):
        row = b if batch_idx is None else batch_idx[b]
        out[row, seqlens[b]:seqlens[b] + new.shape[1]] = new[b]
    return out


def _new_kv(batch, seqlen_new, heads_k, head_dim, dtype):
    """New k, v (batch, seqlen_new, heads_k, head_dim), standard normal; None, None for 0 rows."""
    if not seqlen_new:
        return None, None
    return tuple(torch.randn(batch, seqlen_new, heads_k, head_dim, device=DEVICE, dtype=dtype) for _ in range(2))


def _written_mask(shape, seqlens, seqlen_new, batch_idx=None):
    """bool (batch_cache, capacity): the slots the call writes in a contiguous cache."""
    mask = torch.zeros(shape[:2], dtype=torch.bool, device=DEVICE)
    for b, start in enumerate(seqlens):
        row = b if batch_idx is None else batch_idx[b]
        mask[row, start:start + seqlen_new] = True
    return mask


def _assert_untouched(name, after, before, written):
    """Every slot of the cache outside ``written`` (bool over its first two dims) is bitwise
    unchanged."""
    keep = ~written
    _assert_bitwise_equal(f"{name} outside the new rows", after[keep], before[keep])


def cache_ref(q, k_cache, v_cache, seqlens_k, dtype, *, leftpad=None, batch_idx=None, causal=False,
              window_size=(-1, -1), softcap=0.0, alibi_slopes=None, s_aux=None, softmax_scale=None):
    """(out (batch, seqlen_q, heads, d), lse (batch, heads, seqlen_q)) in ``dtype``: entry b
    attends to keys [leftpad[b], seqlens_k[b]) of cache row batch_idx[b] (see the module
    docstring for why the slice gives the absolute-index masks). Empty rows: out 0, lse -inf (the
    sink with s_aux)."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        row = b if batch_idx is None else int(batch_idx[b])
        start = 0 if leftpad is None else int(leftpad[b])
        keys = slice(start, max(start, int(seqlens_k[b])))
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b]
        out, lse = attention_ref(q[b:b + 1], k_cache[row:row + 1, keys], v_cache[row:row + 1, keys], causal,
                                 softmax_scale, dtype, window=window_size, softcap=softcap, alibi_slopes=slopes,
                                 sinks=s_aux)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _check(out, lse, truth, truth_lse, same_dtype, name="out", same_dtype_lse=None):
    """out within the error bar of the float64 truth; lse (when given) fp32, +inf exactly where
    the truth is -inf (rows that see no key, no sink), else within 1e-4 (relative past 1), or,
    with ``same_dtype_lse`` (inputs that the call rounds, as rotated q and k), within
    FWD_FACTOR x its error plus that."""
    assert_within_bar(name, out, same_dtype, truth, FWD_FACTOR)
    if lse is None:
        return
    assert lse.dtype == torch.float32 and lse.shape == truth_lse.shape, (lse.dtype, tuple(lse.shape))
    empty = torch.isneginf(truth_lse)
    assert torch.equal(torch.isposinf(lse), empty), "lse must be +inf exactly on rows that see no key"
    if (~empty).any():
        want = truth_lse[~empty]
        err = (lse[~empty].double() - want).abs().max().item()
        bound = 1e-4 * max(1.0, want.abs().max().item())
        if same_dtype_lse is not None:
            bound += FWD_FACTOR * (same_dtype_lse[~empty].double() - want).abs().max().item()
        assert err <= bound, f"lse: max error {err:.3g} > {bound:.3g}"
    if empty.any():  # rows that see no key output exactly 0
        assert (out.transpose(1, 2)[empty] == 0).all(), "rows that see no key must output 0"


def _both_refs(q, k_cache, v_cache, seqlens_k, dtype, **options):
    """(truth out, truth lse, same-dtype out) of cache_ref."""
    truth, truth_lse = cache_ref(q, k_cache, v_cache, seqlens_k, torch.float64, **options)
    same_dtype, _ = cache_ref(q, k_cache, v_cache, seqlens_k, dtype, **options)
    return truth, truth_lse, same_dtype


# --------------------------------------------------------------------------------------------
# 1. decode steps

DECODE = dict(prefill=(1000, 517), capacity=1100, steps=4) if ON_GPU else dict(prefill=(37, 20), capacity=48, steps=3)
DECODE_HEADS = [(4, 2), (4, 1), (4, 4)]


@pytest.mark.parametrize("lengths", ["int", "tensor"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_decode_steps(fa, dtype, causal, lengths):
    """Append one token per call to a prefilled cache; every step's output matches flash_attn_func
    on the keys so far and the float64 reference, and the cache holds the new rows."""
    heads, heads_k = DECODE_HEADS[DTYPES.index(dtype) % len(DECODE_HEADS)]
    head_dim, batch, capacity = 64, 2, DECODE["capacity"]
    prefill = [DECODE["prefill"][0]] * batch if lengths == "int" else list(DECODE["prefill"])
    k_cache, v_cache = _cache(batch, capacity, heads_k, head_dim, dtype,
                              visible={b: (0, prefill[b]) for b in range(batch)})
    for step in range(DECODE["steps"]):
        seqlens = [n + step for n in prefill]
        q, k, v = random_qkv((batch, 1, heads, head_dim), (batch, 1, heads_k, head_dim), dtype)
        want_k, want_v = _appended(k_cache, k, seqlens), _appended(v_cache, v, seqlens)
        cache_seqlens = seqlens[0] if lengths == "int" else _int32(seqlens)
        out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, causal=causal)
        assert out.shape == q.shape and out.dtype == dtype
        _assert_bitwise_equal(f"step {step}: k_cache", k_cache, want_k)
        _assert_bitwise_equal(f"step {step}: v_cache", v_cache, want_v)
        seqlens_k = [n + 1 for n in seqlens]
        truth, _, same_dtype = _both_refs(q, want_k, want_v, seqlens_k, dtype, causal=causal)
        _check(out, None, truth, None, same_dtype, name=f"step {step}: out")
        for b in range(batch):
            dense = fa.flash_attn_func(q[b:b + 1], k_cache[b:b + 1, :seqlens_k[b]], v_cache[b:b + 1, :seqlens_k[b]],
                                       causal=causal)
            assert_within_bar(f"step {step}: flash_attn_func", dense, same_dtype[b:b + 1], truth[b:b + 1], FWD_FACTOR)
            # the two kernels differ only by summation order: at most the bar between them
            diff = (out[b:b + 1].double() - dense.double()).abs().max().item()
            bound = 2 * FWD_FACTOR * (same_dtype[b:b + 1].double() - truth[b:b + 1]).abs().max().item() + 1e-5
            assert diff <= bound, f"step {step}, entry {b}: {diff:.3g} from flash_attn_func (bound {bound:.3g})"


# --------------------------------------------------------------------------------------------
# 2. against the reference: seqlen_q x head dim x options, per-entry cache_seqlens

KV_HEAD_DIMS = [40, 64, 80, 128, 59, 111, 192, 256] if ON_GPU else [40, 64, 80, 128]
REF_SEQLENS_Q = [1, 3, 17]
REF_OPTIONS = ["plain", "causal", "window", "softcap", "alibi", "sinks"]
REF_HEADS = [(4, 2), (4, 1), (2, 2), (6, 3)]
# cache_seqlens per entry: one empty cache, one shorter than seqlen_q, long ones; capacity fits
# the longest plus 17 new rows
REF_CACHE = dict(seqlens=[0, 5, 300, 1061], capacity=1100) if ON_GPU else dict(seqlens=[0, 5, 61], capacity=80)


def _ref_cases():
    cases = []
    for (s, seqlen_q), (o, option) in itertools.product(enumerate(REF_SEQLENS_Q), enumerate(REF_OPTIONS)):
        for j in range(2 if ON_GPU else 1):
            head_dim = KV_HEAD_DIMS[(6 * s + o + 3 * j) % len(KV_HEAD_DIMS)]
            seqlen_new = (0, seqlen_q, 1)[(o + s + j) % 3]
            variant = o + 2 * s + j
            cases.append((seqlen_q, option, head_dim, seqlen_new, variant))
    return cases


def _options(option, heads, batch, dtype):
    """flash_attn_with_kvcache keywords for one of REF_OPTIONS."""
    if option == "plain":
        return {}
    if option == "causal":
        return dict(causal=True)
    if option == "window":
        return dict(window_size=(9, 2))
    if option == "softcap":
        return dict(causal=True, softcap=15.0)
    if option == "alibi":  # per-entry slopes, a causal window given as (left, 0)
        return dict(window_size=(20, 0), alibi_slopes=torch.rand(batch, heads, device=DEVICE, dtype=torch.float32))
    if option == "sinks":
        return dict(causal=True, s_aux=torch.randn(heads, device=DEVICE, dtype=torch.float32))
    raise AssertionError(option)


@pytest.mark.parametrize("case", _ref_cases(), ids=lambda c: "sq{}-{}-d{}-new{}".format(*c[:4]))
def test_against_reference(fa, case):
    seqlen_q, option, head_dim, seqlen_new, variant = case
    dtype = DTYPES[variant % len(DTYPES)]
    heads, heads_k = REF_HEADS[variant % len(REF_HEADS)]
    seqlens, capacity = REF_CACHE["seqlens"], REF_CACHE["capacity"]
    batch = len(seqlens)
    q = torch.randn(batch, seqlen_q, heads, head_dim, device=DEVICE, dtype=dtype)
    k_cache, v_cache = _cache(batch, capacity, heads_k, head_dim, dtype,
                              visible={b: (0, n) for b, n in enumerate(seqlens)})
    k, v = _new_kv(batch, seqlen_new, heads_k, head_dim, dtype)
    want_k, want_v = _appended(k_cache, k, seqlens), _appended(v_cache, v, seqlens)
    options = _options(option, heads, batch, dtype)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=_int32(seqlens),
                                          return_softmax_lse=True, **options)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (batch, heads, seqlen_q)
    _assert_bitwise_equal("k_cache", k_cache, want_k)
    _assert_bitwise_equal("v_cache", v_cache, want_v)
    seqlens_k = [n + seqlen_new for n in seqlens]
    truth, truth_lse, same_dtype = _both_refs(q, want_k, want_v, seqlens_k, dtype, **options)
    _check(out, lse, truth, truth_lse, same_dtype)


def test_full_cache_by_default(fa):
    """cache_seqlens=None: the whole cache is the keys; an int gives the same as a tensor."""
    q = torch.randn(2, 3, 4, 64, device=DEVICE)
    k_cache, v_cache = _cache(2, 45, 2, 64, torch.float32)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, causal=True, return_softmax_lse=True)
    truth, truth_lse, same_dtype = _both_refs(q, k_cache, v_cache, [45, 45], torch.float32, causal=True)
    _check(out, lse, truth, truth_lse, same_dtype)
    short = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=30, num_splits=1)
    short_tensor = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=_int32([30, 30]), num_splits=1)
    truth, _, same_dtype = _both_refs(q, k_cache, v_cache, [30, 30], torch.float32)
    _check(short, None, truth, None, same_dtype)
    _check(short_tensor, None, truth, None, same_dtype)


# --------------------------------------------------------------------------------------------
# 3. paged caches

PAGE_SIZES = [16, 32, 64, 256] if ON_GPU else [16, 32]
PAGED_SEQLENS = [0, 700, 1500, 33] if ON_GPU else [0, 40, 17]


def _paged(k_cache, v_cache, lengths, page_size, spare_pages=2):
    """Rows [0, lengths[b]) of contiguous caches scattered over the same shuffled pages of two
    paged caches (num_blocks, page_size, heads_k, d) whose other rows hold NaN, and the block table
    (its padding entries point at a NaN page no sequence uses)."""
    pages = [max(1, -(-n // page_size)) for n in lengths]
    num_blocks = sum(pages) + spare_pages
    order = torch.randperm(num_blocks).tolist()
    paged = [torch.full((num_blocks, page_size, *c.shape[2:]), NAN, dtype=c.dtype, device=DEVICE)
             for c in (k_cache, v_cache)]
    table = torch.full((len(lengths), max(pages)), order[0], dtype=torch.int32)  # order[0] is never used
    for b, n in enumerate(lengths):
        for p in range(pages[b]):
            page = order.pop()
            table[b, p] = page
            rows = slice(p * page_size, min(n, (p + 1) * page_size))
            for cache, contiguous in zip(paged, (k_cache, v_cache)):
                cache[page, :rows.stop - rows.start] = contiguous[b, rows]
    return paged[0], paged[1], table.to(DEVICE)


def _gather(paged, table, b, n):
    """Rows [0, n) of sequence b of a paged cache."""
    return paged[table[b].long()].reshape(-1, *paged.shape[2:])[:n] if n else paged[:0, 0]


def _paged_written_mask(paged, table, seqlens, seqlen_new):
    mask = torch.zeros(paged.shape[:2], dtype=torch.bool, device=DEVICE)
    page_size = paged.shape[1]
    for b, start in enumerate(seqlens):
        for pos in range(start, start + seqlen_new):
            mask[int(table[b, pos // page_size]), pos % page_size] = True
    return mask


@pytest.mark.parametrize("options", ["causal", "full", "all"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_matches_contiguous(fa, page_size, options):
    dtype = DTYPES[(page_size // 16 + len(options)) % len(DTYPES)]
    heads, heads_k, head_dim, seqlen_q = 4, 2, 64, 3
    seqlens = PAGED_SEQLENS
    batch = len(seqlens)
    lengths = [n + seqlen_q for n in seqlens]
    capacity = page_size * max(-(-n // page_size) for n in lengths)
    k_cache, v_cache = _cache(batch, capacity, heads_k, head_dim, dtype,
                              visible={b: (0, n) for b, n in enumerate(seqlens)})
    k_paged, v_paged, table = _paged(k_cache, v_cache, lengths, page_size)
    q, k, v = random_qkv((batch, seqlen_q, heads, head_dim), (batch, seqlen_q, heads_k, head_dim), dtype)
    kwargs = dict(causal=True) if options == "causal" else {}
    if options == "all":
        kwargs = dict(causal=True, window_size=(24, 0), softcap=20.0,
                      alibi_slopes=torch.rand(heads, device=DEVICE, dtype=torch.float32),
                      s_aux=torch.randn(heads, device=DEVICE, dtype=torch.float32))
    k_before, v_before = k_paged.clone(), v_paged.clone()
    cache_seqlens = _int32(seqlens)
    out, lse = fa.flash_attn_with_kvcache(q, k_paged, v_paged, k, v, cache_seqlens=cache_seqlens, block_table=table,
                                          return_softmax_lse=True, **kwargs)
    contiguous, contiguous_lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                                            return_softmax_lse=True, **kwargs)
    want_k, want_v = _appended(k_cache, k, seqlens), _appended(v_cache, v, seqlens)
    truth, truth_lse, same_dtype = _both_refs(q, want_k, want_v, lengths, dtype, **kwargs)
    _check(out, lse, truth, truth_lse, same_dtype, name="paged out")
    _check(contiguous, contiguous_lse, truth, truth_lse, same_dtype, name="contiguous out")
    for b, n in enumerate(lengths):  # the new rows landed in the right pages, the rest is as it was
        _assert_bitwise_equal(f"k pages of entry {b}", _gather(k_paged, table, b, n), want_k[b, :n])
        _assert_bitwise_equal(f"v pages of entry {b}", _gather(v_paged, table, b, n), want_v[b, :n])
    written = _paged_written_mask(k_paged, table, seqlens, seqlen_q)
    _assert_untouched("k pages", k_paged, k_before, written)
    _assert_untouched("v pages", v_paged, v_before, written)


# --------------------------------------------------------------------------------------------
# 4. cache_leftpad and cache_batch_idx

if ON_GPU:
    LEFTPAD = dict(batch_cache=6, capacity=1100, seqlens=[700, 40, 300], leftpad=[0, 7, 300], batch_idx=[3, 0, 5])
else:
    LEFTPAD = dict(batch_cache=5, capacity=48, seqlens=[25, 40, 30], leftpad=[0, 7, 30], batch_idx=[3, 0, 4])


@pytest.mark.parametrize("seqlen_new", [0, 2], ids=["no-new", "new2"])
@pytest.mark.parametrize("options", ["causal", "window-alibi"])
@pytest.mark.parametrize("which", ["leftpad+batch_idx", "batch_idx"])
def test_leftpad_and_batch_idx(fa, which, options, seqlen_new):
    """Entry b uses cache row batch_idx[b] of a larger cache; keys before leftpad[b] (NaN here)
    are invisible; the last entry has leftpad == cache_seqlens, so it sees only the new keys (or
    none). Masks and ALiBi distances use absolute cache positions."""
    setup = LEFTPAD
    dtype = DTYPES[(len(options) + seqlen_new + len(which)) % len(DTYPES)]
    heads, heads_k, head_dim, seqlen_q = 4, 2, 80, 2
    seqlens, batch_idx = setup["seqlens"], setup["batch_idx"]
    leftpad = setup["leftpad"] if which == "leftpad+batch_idx" else [0] * len(seqlens)
    batch = len(seqlens)
    k_cache, v_cache = _cache(setup["batch_cache"], setup["capacity"], heads_k, head_dim, dtype,
                              visible={row: (leftpad[b], seqlens[b]) for b, row in enumerate(batch_idx)})
    q = torch.randn(batch, seqlen_q, heads, head_dim, device=DEVICE, dtype=dtype)
    k, v = _new_kv(batch, seqlen_new, heads_k, head_dim, dtype)
    kwargs = dict(causal=True)
    if options == "window-alibi":
        kwargs = dict(window_size=(11, 1), alibi_slopes=torch.rand(heads, device=DEVICE, dtype=torch.float32))
    k_before, v_before = k_cache.clone(), v_cache.clone()
    extra = dict(cache_leftpad=_int32(leftpad)) if which == "leftpad+batch_idx" else {}
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=_int32(seqlens),
                                          cache_batch_idx=_int32(batch_idx), return_softmax_lse=True, **extra,
                                          **kwargs)
    want_k, want_v = _appended(k_before, k, seqlens, batch_idx), _appended(v_before, v, seqlens, batch_idx)
    _assert_bitwise_equal("k_cache", k_cache, want_k)
    _assert_bitwise_equal("v_cache", v_cache, want_v)
    seqlens_k = [n + seqlen_new for n in seqlens]
    truth, truth_lse, same_dtype = _both_refs(q, want_k, want_v, seqlens_k, dtype, leftpad=leftpad,
                                              batch_idx=batch_idx, **kwargs)
    _check(out, lse, truth, truth_lse, same_dtype)


# --------------------------------------------------------------------------------------------
# 5. num_splits

SPLITS = dict(seqlens=[1500, 2047, 3], capacity=2100) if ON_GPU else dict(seqlens=[150, 203, 3], capacity=208)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 0])
@pytest.mark.parametrize("case", ["decode", "chunk-causal"])
def test_num_splits(fa, case, num_splits):
    """Every split count is within the bar of the reference (so they agree with each other), and
    each is bitwise repeatable from call to call."""
    seqlen_q = 1 if case == "decode" else 5
    dtype = DTYPES[(num_splits + seqlen_q) % len(DTYPES)]
    heads, heads_k, head_dim = 4, 1, 64
    seqlens = SPLITS["seqlens"]
    batch = len(seqlens)
    k_cache, v_cache = _cache(batch, SPLITS["capacity"], heads_k, head_dim, dtype,
                              visible={b: (0, n) for b, n in enumerate(seqlens)})
    q, k, v = random_qkv((batch, seqlen_q, heads, head_dim), (batch, seqlen_q, heads_k, head_dim), dtype)
    causal = case != "decode"
    call = dict(cache_seqlens=_int32(seqlens), causal=causal, num_splits=num_splits, return_softmax_lse=True)
    want_k, want_v = _appended(k_cache, k, seqlens), _appended(v_cache, v, seqlens)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **call)
    again, again_lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **call)  # rewrites the same rows
    assert torch.equal(out, again) and torch.equal(lse, again_lse), "not bitwise repeatable"
    _assert_bitwise_equal("k_cache", k_cache, want_k)
    _assert_bitwise_equal("v_cache", v_cache, want_v)
    seqlens_k = [n + seqlen_q for n in seqlens]
    truth, truth_lse, same_dtype = _both_refs(q, want_k, want_v, seqlens_k, dtype, causal=causal)
    _check(out, lse, truth, truth_lse, same_dtype)


# --------------------------------------------------------------------------------------------
# 6. rotary embeddings


def _tables(positions, half, dtype, base=10000.0):
    freqs = torch.outer(torch.arange(positions, dtype=torch.float64),
                        base ** -(torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half)))
    return freqs.cos().to(DEVICE, dtype), freqs.sin().to(DEVICE, dtype)


def rotate(x, cos, sin, positions, interleaved, compute_dtype=torch.float64):
    """x (batch, seqlen, heads, d) with each row's first rotary_dim features rotated by its
    position's angle (positions (batch, seqlen)), in ``compute_dtype``: y1 = x1 c - x2 s,
    y2 = x1 s + x2 c, pairs (2i, 2i+1) (GPT-J) or (i, i + rotary_dim / 2) (GPT-NeoX)."""
    rotary_dim = 2 * cos.shape[1]
    if interleaved:
        first, second = torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)
    else:
        first, second = torch.arange(rotary_dim // 2), torch.arange(rotary_dim // 2, rotary_dim)
    x = x.to(compute_dtype)
    c = cos.to(compute_dtype)[positions][:, :, None, :]
    s = sin.to(compute_dtype)[positions][:, :, None, :]
    out = x.clone()
    x1, x2 = x[..., first], x[..., second]
    out[..., first] = x1 * c - x2 * s
    out[..., second] = x1 * s + x2 * c
    return out


ROTARY_DIMS = [(64, 64), (80, 32), (128, 96)]  # (head_dim, rotary_dim)
ROTARY_SEQLENS = [5, 700] if ON_GPU else [5, 30]


@pytest.mark.parametrize("mode", ["full", "causal", "window"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_rotary(fa, interleaved, mode):
    """k is rotated at cache_seqlens[b] + t before it is stored; q at cache_seqlens[b] + i with
    causal or a window, at cache_seqlens[b] otherwise. The output matches attention on the float64
    rotations; the cache holds the rotated k (within the rounding of a rotation in the inputs' dtype)
    and v as given. ``full`` passes cache_seqlens as an int, the others as a tensor."""
    index = ["full", "causal", "window"].index(mode) + 3 * interleaved
    head_dim, rotary_dim = ROTARY_DIMS[index % len(ROTARY_DIMS)]
    dtype = DTYPES[(index + interleaved) % len(DTYPES)]
    heads, heads_k, seqlen_q = 4, 2, 3
    seqlens = [ROTARY_SEQLENS[1]] * 2 if mode == "full" else ROTARY_SEQLENS
    batch, capacity = len(seqlens), max(seqlens) + seqlen_q + 5
    cos, sin = _tables(capacity, rotary_dim // 2, dtype)
    k_cache, v_cache = _cache(batch, capacity, heads_k, head_dim, dtype,
                              visible={b: (0, n) for b, n in enumerate(seqlens)})
    q, k, v = random_qkv((batch, seqlen_q, heads, head_dim), (batch, seqlen_q, heads_k, head_dim), dtype)
    kwargs = dict(causal=mode == "causal", window_size=(6, 3) if mode == "window" else (-1, -1))
    cache_seqlens = seqlens[0] if mode == "full" else _int32(seqlens)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                          cache_seqlens=cache_seqlens, rotary_interleaved=interleaved,
                                          return_softmax_lse=True, **kwargs)
    rows = torch.arange(seqlen_q)[None, :]
    start = torch.tensor(seqlens)[:, None]
    k_positions = (start + rows).to(DEVICE)
    q_positions = (start + rows if mode != "full" else start.expand(batch, seqlen_q)).to(DEVICE)

    # the cache: rotated k (within twice the error of a rotation in dtype), v as given, the rest untouched
    k64 = rotate(k, cos, sin, k_positions, interleaved)
    k_same = rotate(k, cos, sin, k_positions, interleaved, compute_dtype=dtype)
    written = torch.stack([k_cache[b, n:n + seqlen_q] for b, n in enumerate(seqlens)])
    bar = 2 * (k_same.double() - k64).abs().max().item() + 2 * torch.finfo(dtype).eps * k64.abs().max().item()
    err = (written.double() - k64).abs().max().item()
    assert err <= bar, f"rotated k in the cache: error {err:.3g} above {bar:.3g}"
    assert torch.equal(written[..., rotary_dim:], k[..., rotary_dim:]), "features past rotary_dim must not change"
    _assert_bitwise_equal("v_cache", v_cache, _appended(v_before, v, seqlens))
    mask = _written_mask(k_cache.shape, seqlens, seqlen_q)
    _assert_untouched("k_cache", k_cache, k_before, mask)

    # attention on the float64 rotations, the bar from rotation + attention in dtype
    q64 = rotate(q, cos, sin, q_positions, interleaved)
    q_same = rotate(q, cos, sin, q_positions, interleaved, compute_dtype=dtype).to(dtype)
    seqlens_k = [n + seqlen_q for n in seqlens]
    truth, truth_lse = cache_ref(q64, _appended(k_before.double(), k64, seqlens), _appended(v_before.double(),
                                 v.double(), seqlens), seqlens_k, torch.float64, **kwargs)
    same_dtype, same_dtype_lse = cache_ref(q_same, _appended(k_before, k_same.to(dtype), seqlens),
                                           _appended(v_before, v, seqlens), seqlens_k, dtype, **kwargs)
    _check(out, lse, truth, truth_lse, same_dtype, same_dtype_lse=same_dtype_lse)


# --------------------------------------------------------------------------------------------
# 7. the cache outside the new rows


@pytest.mark.parametrize("queries", ["causal", "window", "none"])
@pytest.mark.parametrize("layout", ["contiguous", "batch_idx", "paged"])
def test_cache_untouched_outside_new_rows(fa, layout, queries):
    """A fully random cache (no NaN): after a call with k, v only the slots
    [cache_seqlens[b], cache_seqlens[b] + seqlen_new) of the used cache rows (or pages) change, and
    they hold k, v: also the new rows that no query sees (a window of one key, or no queries at
    all: the kernel that attends writes them)."""
    dtype = DTYPES[["contiguous", "batch_idx", "paged"].index(layout) % len(DTYPES)]
    heads, heads_k, head_dim, seqlen_new = 2, 2, 40, 4
    seqlens = [9, 0, 30]
    batch = len(seqlens)
    batch_idx = [2, 4, 1] if layout == "batch_idx" else None
    batch_cache = 5 if layout == "batch_idx" else batch
    k_cache, v_cache = _cache(batch_cache, 48, heads_k, head_dim, dtype)
    extra = dict(cache_batch_idx=_int32(batch_idx)) if batch_idx else {}
    if layout == "paged":
        num_blocks, page_size = 9, 16
        k_cache = torch.randn(num_blocks, page_size, heads_k, head_dim, device=DEVICE, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        extra = dict(block_table=_int32([[7, 2, 0], [5, 8, 8], [3, 1, 6]]))  # pages 4 and 8 (padding) unused
    seqlen_q = 0 if queries == "none" else 2
    q, k, v = random_qkv((batch, seqlen_q, heads, head_dim), (batch, seqlen_new, heads_k, head_dim), dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    window = (0, 0) if queries == "window" else (-1, -1)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=_int32(seqlens), causal=True,
                                     window_size=window, **extra)
    assert out.shape == q.shape
    if layout == "paged":
        table = extra["block_table"]
        written = _paged_written_mask(k_cache, table, seqlens, seqlen_new)
        for b, n in enumerate(seqlens):
            _assert_bitwise_equal(f"new k of entry {b}", _gather(k_cache, table, b, n + seqlen_new)[n:], k[b])
            _assert_bitwise_equal(f"new v of entry {b}", _gather(v_cache, table, b, n + seqlen_new)[n:], v[b])
    else:
        written = _written_mask(k_cache.shape, seqlens, seqlen_new, batch_idx)
        _assert_bitwise_equal("k_cache", k_cache, _appended(k_before, k, seqlens, batch_idx))
        _assert_bitwise_equal("v_cache", v_cache, _appended(v_before, v, seqlens, batch_idx))
    _assert_untouched("k_cache", k_cache, k_before, written)
    _assert_untouched("v_cache", v_cache, v_before, written)


def test_overflowing_tensor_seqlens_stay_in_bounds(fa):
    """A tensor cache_seqlens is not read on the host: an entry whose new rows run past the cache's
    end is clamped on the device. Nothing outside the cache is written (the caches are views into
    buffers with a guard row), nor anything in the cache outside the entries' new rows."""
    dtype, heads_k, head_dim, capacity, seqlen_new = torch.float16, 2, 32, 32, 4
    seqlens = [30, 10, 32]  # entry 0 runs 2 rows past the end, entry 2 starts at the end
    batch = len(seqlens)
    buffers = [torch.randn(batch + 1, capacity, heads_k, head_dim, device=DEVICE, dtype=dtype) for _ in range(2)]
    before = [buffer.clone() for buffer in buffers]
    k_cache, v_cache = buffers[0][:batch], buffers[1][:batch]
    q, k, v = random_qkv((batch, 1, 4, head_dim), (batch, seqlen_new, heads_k, head_dim), dtype)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=_int32(seqlens))
    assert out.shape == q.shape
    assert torch.isfinite(out[1]).all()
    written = torch.zeros(batch + 1, capacity, dtype=torch.bool, device=DEVICE)
    for b, n in enumerate(seqlens):
        written[b, n:n + seqlen_new] = True
    for name, buffer, old in zip(("k", "v"), buffers, before):
        _assert_untouched(f"{name} buffer", buffer, old, written)
    _assert_bitwise_equal("entry 1's new k", k_cache[1, 10:14], k[1])


# --------------------------------------------------------------------------------------------
# 8. errors


def _error_call(fa, **overrides):
    dtype = torch.float16
    args = dict(q=torch.randn(2, 1, 4, 32, device=DEVICE, dtype=dtype),
                k_cache=torch.randn(2, 32, 2, 32, device=DEVICE, dtype=dtype),
                v_cache=torch.randn(2, 32, 2, 32, device=DEVICE, dtype=dtype),
                k=torch.randn(2, 1, 2, 32, device=DEVICE, dtype=dtype),
                v=torch.randn(2, 1, 2, 32, device=DEVICE, dtype=dtype),
                cache_seqlens=5)
    args.update(overrides)
    return fa.flash_attn_with_kvcache(**args)


def _paged_cache(page_size=16, dtype=torch.float16):
    return torch.randn(4, page_size, 2, 32, device=DEVICE, dtype=dtype)


_TABLE = [[0, 1], [2, 3]]
_COS = torch.ones(40, 8, dtype=torch.float16)  # flash-attn wants tables covering the cache (32 here)

KV_ERRORS = {
    "cache dtype": (lambda: dict(k_cache=torch.randn(2, 32, 2, 32, device=DEVICE),
                                 v_cache=torch.randn(2, 32, 2, 32, device=DEVICE)), r"k_cache|dtype"),
    "head dims differ": (lambda: dict(k_cache=torch.randn(2, 32, 2, 64, device=DEVICE, dtype=torch.float16),
                                      v_cache=torch.randn(2, 32, 2, 64, device=DEVICE, dtype=torch.float16)),
                         r"head dim|k_cache"),
    "nheads": (lambda: dict(q=torch.randn(2, 1, 3, 32, device=DEVICE, dtype=torch.float16)), r"heads"),
    "k without v": (lambda: dict(v=None), r"\bv\b"),
    "rotary without k": (lambda: dict(k=None, v=None, rotary_cos=_COS.to(DEVICE), rotary_sin=_COS.to(DEVICE)),
                         r"rotary"),
    "int64 block_table": (lambda: dict(k_cache=_paged_cache(), v_cache=_paged_cache(),
                                       block_table=torch.tensor(_TABLE, dtype=torch.int64, device=DEVICE)),
                          r"block_table"),
    "1-D block_table": (lambda: dict(k_cache=_paged_cache(), v_cache=_paged_cache(),
                                     block_table=_int32([0, 1])), r"block_table"),
    "page size 8": (lambda: dict(k_cache=_paged_cache(8), v_cache=_paged_cache(8), block_table=_int32(_TABLE)),
                    r"page|k_cache"),
    "batch_idx with block_table": (lambda: dict(k_cache=_paged_cache(), v_cache=_paged_cache(),
                                                block_table=_int32(_TABLE), cache_batch_idx=_int32([1, 0])),
                                   r"cache_batch_idx"),
    "leftpad with block_table": (lambda: dict(k_cache=_paged_cache(), v_cache=_paged_cache(),
                                              block_table=_int32(_TABLE), cache_leftpad=_int32([0, 0])),
                                 r"cache_leftpad"),
    "int cache_seqlens overflow": (lambda: dict(cache_seqlens=32), r"overflow|cache_seqlens"),
    "rotary table too short": (lambda: dict(rotary_cos=_COS[:5].to(DEVICE), rotary_sin=_COS[:5].to(DEVICE)),
                               r"rotary"),
    "negative num_splits": (lambda: dict(num_splits=-1), r"num_splits"),
}


@pytest.mark.parametrize("case", list(KV_ERRORS))
def test_errors(fa, case):
    overrides, message = KV_ERRORS[case]
    with pytest.raises((TypeError, ValueError), match=message):
        _error_call(fa, **overrides())


def test_valid_error_call(fa):
    """The base call of test_errors is valid (so each error comes from its one change)."""
    out = _error_call(fa)
    assert out.shape == (2, 1, 4, 32) and torch.isfinite(out).all()
    paged = _error_call(fa, k_cache=_paged_cache(), v_cache=_paged_cache(), block_table=_int32(_TABLE))
    assert torch.isfinite(paged).all()
    rotary = _error_call(fa, rotary_cos=_COS[:32].to(DEVICE), rotary_sin=_COS[:32].to(DEVICE) * 0)
    assert torch.isfinite(rotary).all()


# --------------------------------------------------------------------------------------------
# 9. return_softmax_lse


@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
def test_return_softmax_lse(fa, sinks):
    """(out, lse) with lse fp32 (batch, heads, seqlen_q) against the reference lse; a row that sees
    no key (an empty cache, or causal rows above the first key) gets out 0 and lse +inf, or
    lse = sink with s_aux; without return_softmax_lse the call returns out alone."""
    heads, heads_k, head_dim, seqlen_q = 4, 2, 64, 6
    seqlens = [0, 3, 29]
    batch = len(seqlens)
    k_cache, v_cache = _cache(batch, 32, heads_k, head_dim, torch.float32,
                              visible={b: (0, n) for b, n in enumerate(seqlens)})
    q = torch.randn(batch, seqlen_q, heads, head_dim, device=DEVICE)
    s_aux = torch.randn(heads, device=DEVICE) if sinks else None
    call = dict(cache_seqlens=_int32(seqlens), causal=True, s_aux=s_aux)
    plain = fa.flash_attn_with_kvcache(q, k_cache, v_cache, **call)
    assert isinstance(plain, torch.Tensor)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **call)
    assert torch.equal(out, plain)
    assert lse.dtype == torch.float32 and lse.shape == (batch, heads, seqlen_q)
    truth, truth_lse, same_dtype = _both_refs(q, k_cache, v_cache, seqlens, torch.float32, causal=True, s_aux=s_aux)
    _check(out, lse, truth, truth_lse, same_dtype)
    assert (out[0] == 0).all() and (out[1, :3] == 0).all(), "rows that see no key must output 0"
    if sinks:
        assert torch.allclose(lse[0], s_aux[:, None].expand(heads, seqlen_q), atol=1e-6, rtol=0)
    else:
        assert torch.isposinf(lse[0]).all() and torch.isposinf(lse[1, :, :3]).all()


def test_opcheck_and_compile(fa):
    """The kvcache op passes torch.library.opcheck (it writes the new rows into its cache arguments),
    and flash_attn_with_kvcache compiles into one graph that gives eager's output and cache."""
    dtype, heads, heads_k, head_dim = torch.float16, 4, 2, 32
    q, k, v = random_qkv((2, 2, heads, head_dim), (2, 2, heads_k, head_dim), dtype)
    k_cache, v_cache = _cache(2, 48, heads_k, head_dim, dtype)
    seqlens = _int32([5, 20])
    options = fa.flash_attention_kernel.AttentionOptions(0.125, True).flatten()
    for new in ((k, v), (None, None)):
        args = (q, k_cache.clone(), v_cache.clone(), *new, None, None, seqlens, None, None, None, 0, True, 2)
        torch.library.opcheck(fa.ops.kvcache.default, (*args, *options))

    def step(q, k_cache, v_cache, k, v):
        return fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True) * 2.0

    caches_eager = (k_cache.clone(), v_cache.clone())
    caches_compiled = (k_cache.clone(), v_cache.clone())
    want = step(q, *caches_eager, k, v)
    got = torch.compile(step, fullgraph=True)(q, *caches_compiled, k, v)
    _assert_bitwise_equal("compiled output", got, want)
    for name, got_cache, want_cache in zip(("k_cache", "v_cache"), caches_compiled, caches_eager):
        _assert_bitwise_equal(f"compiled {name}", got_cache, want_cache)


def test_num_splits_heuristic(fa):
    """The documented rule: no split once the programs fill half the SMs (with two programs per
    SM on a paged cache), else enough splits for one program per SM (two when paged), a split
    being at least one key tile, at most MAX_SPLITS."""
    decode = fa.flash_attention_kernel.decode
    rule = decode.num_splits_heuristic
    assert rule(8, 128, 132) == 16  # batch 1 x 8 KV heads, 16k keys: one program per SM
    assert rule(8, 128, 132, per_sm=2) == 33  # paged: two per SM
    assert rule(64, 256, 132) == 2 and rule(64, 256, 132, per_sm=2) == 4
    assert rule(67, 256, 132) == 1 and rule(512, 4096, 132, per_sm=2) == 1  # programs fill the GPU
    assert rule(8, 4, 132) == 4  # a split holds at least one key tile
    assert rule(8, 1, 132) == 1
    assert rule(1, 10 ** 6, 1000) == decode.MAX_SPLITS
