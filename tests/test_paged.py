"""Paged KV caches in flash_attn_varlen_func (block_table): the keys and values of each sequence
scattered over shuffled pages of a cache give the output and lse of the same keys stored
contiguously, within the error bar of a float64 per-sequence reference; pages and rows outside
each sequence's keys are never read (they hold NaN here); bad tables and what paging leaves out
(dropout; a backward, tests/test_bad_metadata.py) raise errors naming the argument."""

import math

import pytest
import torch

from conftest import DEVICE, ON_GPU
from inputs import cu_seqlens, paged_caches, random_qkv
from reference import FWD_FACTOR, assert_within_bar, run_varlen_ref
from sizes import BF16, DTYPES

PAGE_SIZES = [16, 32, 64, 256] if ON_GPU else [16, 32]
BATCHES = {  # (q lengths, k lengths)
    "prefill": ([17, 113, 1, 40], [17, 113, 1, 40]),
    "decode": ([1, 1, 1], [1, 203, 64]),
    "chunked": ([16, 5, 0], [203, 21, 7]),
}
if ON_GPU:
    BATCHES["long"] = ([512, 1, 300], [4093, 1024, 300])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_paged_matches_contiguous(fa, page_size, batch, causal):
    lens_q, lens_k = BATCHES[batch]
    dtype = DTYPES[(page_size // 16 + len(batch)) % len(DTYPES)]
    heads_q, heads_k, head_dim = 4, 2, 80
    q, k, v = random_qkv((sum(lens_q), heads_q, head_dim), (sum(lens_k), heads_k, head_dim), dtype)
    k_cache, v_cache, table = paged_caches(k, v, lens_k, page_size)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    out, lse, _ = fa.flash_attn_varlen_func(q, k_cache, v_cache, *args, causal=causal, block_table=table,
                                            return_attn_probs=True)
    contiguous, contiguous_lse, _ = fa.flash_attn_varlen_func(q, k, v, *args, causal=causal, return_attn_probs=True)
    scale = 1.0 / math.sqrt(head_dim)
    dout = torch.zeros_like(q)
    truth, _, truth_lse = run_varlen_ref(q, k, v, dout, cu_q, cu_k, causal, scale, torch.float64)
    same_dtype, _, _ = run_varlen_ref(q, k, v, dout, cu_q, cu_k, causal, scale, dtype)
    assert_within_bar("out", out, same_dtype, truth, FWD_FACTOR)
    assert_within_bar("out (contiguous)", contiguous, same_dtype, truth, FWD_FACTOR)
    assert torch.equal(torch.isposinf(lse), torch.isposinf(contiguous_lse))
    finite = torch.isfinite(truth_lse)
    if finite.any():
        assert (lse[finite].double() - truth_lse[finite]).abs().max().item() <= 1e-4


def test_paged_with_options(fa):
    """Window, softcap, ALiBi and sinks read the paged keys as they read contiguous ones."""
    lens = [40, 113, 9]
    q, k, v = random_qkv((sum(lens), 4, 64), (sum(lens), 1, 64), BF16)
    k_cache, v_cache, table = paged_caches(k, v, lens, 16)
    cu = cu_seqlens(lens)
    options = dict(causal=True, window_size=(24, 0), softcap=20.0,
                   alibi_slopes=torch.rand(4, device=DEVICE, dtype=torch.float32),
                   s_aux=torch.randn(4, device=DEVICE, dtype=BF16))
    paged = fa.flash_attn_varlen_func(q, k_cache, v_cache, cu, cu, max(lens), max(lens), block_table=table, **options)
    contiguous = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), **options)
    assert (paged.double() - contiguous.double()).abs().max().item() <= 2 * torch.finfo(BF16).eps * 4


def _paged_call(fa, **overrides):
    q = torch.randn(8, 2, 32, device=DEVICE)
    cache = torch.randn(4, 16, 2, 32, device=DEVICE)
    cu = cu_seqlens([3, 5])
    args = dict(q=q, k=cache, v=cache, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5,
                block_table=torch.tensor([[0], [2]], dtype=torch.int32, device=DEVICE))
    args.update(overrides)
    return fa.flash_attn_varlen_func(**args)


PAGED_ERRORS = {
    "dense k": (dict(k=torch.randn(8, 2, 32, device=DEVICE)), r"k must have 4 dims \(num_blocks, page_size"),
    "page size 8": (dict(k=torch.randn(8, 8, 2, 32, device=DEVICE), v=torch.randn(8, 8, 2, 32, device=DEVICE)),
                    r"page size that is a positive multiple of 16"),
    "int64 table": (dict(block_table=torch.zeros(2, 1, dtype=torch.int64, device=DEVICE)),
                    r"block_table must be an int32 tensor"),
    "table rows": (dict(block_table=torch.zeros(3, 1, dtype=torch.int32, device=DEVICE)),
                   r"one row per sequence \(2\)"),
    "too few pages": (dict(max_seqlen_k=17), r"max_seqlen_k \(17\) is longer than block_table's 1 pages of 16"),
    "dropout": (dict(dropout_p=0.1), r"dropout_p must be 0"),
}


@pytest.mark.parametrize("case", list(PAGED_ERRORS))
def test_paged_errors(fa, case):
    overrides, message = PAGED_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        _paged_call(fa, **overrides)


def test_paged_debug_check(fa, monkeypatch):
    """Table entries outside the cache are refused under the debug switch; without it the kernel
    clamps them into the cache (wrong rows, never outside memory)."""
    table = torch.tensor([[0], [9]], dtype=torch.int32, device=DEVICE)
    out = _paged_call(fa, block_table=table)
    assert torch.isfinite(out).all()
    monkeypatch.setenv("FLASH_ATTENTION_CHECK_INPUTS", "1")
    with pytest.raises(ValueError, match=r"block_table row 1 lists pages outside the cache's 4"):
        _paged_call(fa, block_table=table)
