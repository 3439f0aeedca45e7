"""Wrong metadata (cu_seqlens, block_table, cache_seqlens, cache_batch_idx, cache_leftpad, rotary
offsets) never touches memory outside a tensor (issue 39).

* Default mode: every case of bad_metadata_cases.py runs in a process of its own (an access out of
  bounds can abort the interpreter) and must return with its outputs contained: the rows its
  clamped sequences cover finite, the NaN borders around every tensor untouched.
* Shape-level inconsistencies, visible without reading a tensor, raise at once.
* FLASH_ATTENTION_CHECK_INPUTS=1 turns each value-level one into an error naming the argument.
* A paged (block_table) prefill runs its forward on tensors that require grad; its backward raises.
"""

import os
import subprocess
import sys

import pytest
import torch

import bad_metadata_cases
from conftest import DEVICE, ON_GPU, REPO_ROOT

CHECK_INPUTS = "FLASH_ATTENTION_CHECK_INPUTS"


@pytest.mark.parametrize("case", list(bad_metadata_cases.CASES))
def test_default_mode_is_contained(build_dir, case):
    env = {k: v for k, v in os.environ.items() if k != CHECK_INPUTS}
    if not ON_GPU:
        env["TRITON_INTERPRET"] = "1"
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "bad_metadata_cases.py"), str(build_dir), case],
                            env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "CONTAINED" in result.stdout, (
        f"rc {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")


def _i32(values, device=DEVICE):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _qkv(tokens=10):
    return (torch.randn(tokens, 2, 32, device=DEVICE) for _ in range(3))


# -- shape-level: raised at once, whatever the debug switch says ------------------------------------

def test_varlen_batch_of_zero_beside_tokens(fa):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"cu_seqlens_q has a single entry \(a batch of 0 sequences\), but q has 10"):
        fa.flash_attn_varlen_func(q, k, v, _i32([0]), _i32([0]), 10, 10)
    with pytest.raises(ValueError, match=r"cu_seqlens_k has a single entry .* but k has 10 tokens"):
        fa.flash_attn_varlen_func(q[:0], k, v, _i32([0]), _i32([0]), 0, 10)
    with pytest.raises(ValueError, match=r"cu_seqlens_q has a single entry .* but q has 10 tokens"):
        fa.flash_attn_varlen_qkvpacked_func(torch.randn(10, 3, 2, 32, device=DEVICE), _i32([0]), 10)
    with pytest.raises(ValueError, match=r"cu_seqlens has a single entry .* but x has 10 tokens"):
        fa.apply_rotary_emb(q, torch.randn(10, 8, device=DEVICE), torch.randn(10, 8, device=DEVICE),
                            cu_seqlens=_i32([0]), max_seqlen=10)


def test_varlen_batch_of_zero_without_tokens(fa):
    """A batch of 0 sequences over 0 tokens is consistent: an empty output."""
    q, k, v = _qkv(0)
    assert fa.flash_attn_varlen_func(q, k, v, _i32([0]), _i32([0]), 0, 0).shape == (0, 2, 32)


def _paged(fa, **overrides):
    q, _, _ = _qkv(8)
    cache = torch.randn(4, 16, 2, 32, device=DEVICE)
    args = dict(q=q, k=cache, v=cache, cu_seqlens_q=_i32([0, 3, 8]), cu_seqlens_k=_i32([0, 3, 8]), max_seqlen_q=5,
                max_seqlen_k=5, block_table=_i32([[0], [2]]))
    args.update(overrides)
    return fa.flash_attn_varlen_func(**args)


def _kvcache(fa, **overrides):
    args = dict(q=torch.randn(2, 1, 2, 32, device=DEVICE), k_cache=torch.randn(2, 32, 2, 32, device=DEVICE),
                v_cache=torch.randn(2, 32, 2, 32, device=DEVICE), k=torch.randn(2, 3, 2, 32, device=DEVICE),
                v=torch.randn(2, 3, 2, 32, device=DEVICE), cache_seqlens=_i32([4, 5]))
    args.update(overrides)
    return fa.flash_attn_with_kvcache(**args)


def _paged_kvcache(fa, **overrides):
    cache = torch.randn(4, 16, 2, 32, device=DEVICE)
    return _kvcache(fa, **{"k_cache": cache, "v_cache": cache.clone(), "block_table": _i32([[0, 1], [2, 3]]),
                           **overrides})


SHAPE_ERRORS = {
    "block_table without columns": (_paged, dict(block_table=torch.zeros(2, 0, dtype=torch.int32, device=DEVICE),
                                                 max_seqlen_k=0), r"block_table must have at least one column"),
    "block_table 1-D": (_paged, dict(block_table=_i32([0, 2])), r"block_table must be an int32 tensor of shape"),
    "block_table on another device": (_paged, dict(block_table=_i32([[0], [2]], device="meta")),
                                      r"block_table must be on q's device"),
    "cu_seqlens_k on another device": (_paged, dict(cu_seqlens_k=_i32([0, 3, 8], device="meta")),
                                       r"cu_seqlens_k must be on the same device"),
    "kvcache block_table without columns": (
        _paged_kvcache, dict(block_table=torch.zeros(2, 0, dtype=torch.int32, device=DEVICE), k=None, v=None),
        r"block_table must have at least one column"),
    "cache_seqlens int64": (_kvcache, dict(cache_seqlens=torch.tensor([4, 5], device=DEVICE)),
                            r"cache_seqlens must be an int32 tensor of shape \(batch,\)"),
    "cache_seqlens 2-D": (_kvcache, dict(cache_seqlens=_i32([[4, 5]])), r"cache_seqlens must be an int32 tensor"),
    "cache_seqlens on another device": (_kvcache, dict(cache_seqlens=_i32([4, 5], device="meta")),
                                        r"cache_seqlens must be on q's device"),
    "cache_batch_idx int64": (_kvcache, dict(cache_batch_idx=torch.tensor([0, 1], device=DEVICE)),
                              r"cache_batch_idx must be an int32 tensor"),
    "cache_leftpad rows": (_kvcache, dict(cache_leftpad=_i32([0, 0, 0])), r"cache_leftpad must be an int32 tensor "
                                                                          r"of shape \(batch,\) = \(2,\)"),
}


@pytest.mark.parametrize("case", list(SHAPE_ERRORS))
def test_shape_level_errors(fa, case):
    call, overrides, message = SHAPE_ERRORS[case]
    with pytest.raises((ValueError, TypeError), match=message):
        call(fa, **overrides)


# -- value-level: FLASH_ATTENTION_CHECK_INPUTS=1 names the argument ----------------------------------

N = 16
VALUE_ERRORS = {
    "cu_seqlens end past the tokens": (
        lambda fa: fa.flash_attn_varlen_func(*_qkv(N), _i32([0, 5, 40]), _i32([0, 5, N]), N, N),
        r"cu_seqlens_q must end at the number of tokens \(16\), got 40"),
    "cu_seqlens_k end short of the tokens": (
        lambda fa: fa.flash_attn_varlen_func(*_qkv(N), _i32([0, 5, N]), _i32([0, 5, 12]), N, N),
        r"cu_seqlens_k must end at the number of tokens \(16\), got 12"),
    "cu_seqlens negative entry": (
        lambda fa: fa.flash_attn_varlen_func(*_qkv(N), _i32([0, -3, N]), _i32([0, 5, N]), N, N),
        r"cu_seqlens_q must be non-decreasing"),
    "max_seqlen too small": (
        lambda fa: fa.flash_attn_varlen_func(*_qkv(N), _i32([0, 5, N]), _i32([0, 5, N]), N, 8),
        r"max_seqlen_k \(8\) is smaller than the longest sequence in cu_seqlens_k \(11\)"),
    "paged key count past max_seqlen_k": (
        lambda fa: _paged(fa, cu_seqlens_k=_i32([0, 3, 40])), r"max_seqlen_k \(5\) is smaller than the longest"),
    "paged table entry outside": (
        lambda fa: _paged(fa, block_table=_i32([[0], [9]])), r"block_table row 1 lists pages outside the cache's 4"),
    "cache_seqlens past capacity": (
        lambda fa: _kvcache(fa, cache_seqlens=_i32([100, 5])), r"cache_seqlens \(\[100, 5\]\) must be >= 0, and with "
                                                               r"the 3 new keys stay within the cache's 32"),
    "negative cache_seqlens": (lambda fa: _kvcache(fa, cache_seqlens=_i32([-3, 5])), r"cache_seqlens \(\[-3, 5\]\)"),
    "new keys overflow": (lambda fa: _kvcache(fa, cache_seqlens=_i32([30, 5])), r"cache_seqlens \(\[30, 5\]\)"),
    "cache_batch_idx outside": (
        lambda fa: _kvcache(fa, cache_batch_idx=_i32([0, 2])), r"cache_batch_idx lists rows outside the cache's 2"),
    "cache_leftpad negative": (
        lambda fa: _kvcache(fa, cache_leftpad=_i32([-1, 0])), r"cache_leftpad \(\[-1, 0\]\) must lie in \[0, "),
    "cache_leftpad past the keys": (
        lambda fa: _kvcache(fa, cache_leftpad=_i32([0, 9])), r"cache_leftpad \(\[0, 9\]\) must lie in .*\[7, 8\]"),
    "kvcache table entry outside": (
        lambda fa: _paged_kvcache(fa, block_table=_i32([[0, 1], [-2, 3]])), r"block_table row 1 lists pages outside"),
    "rotary cu_seqlens end past the tokens": (
        lambda fa: fa.apply_rotary_emb(next(_qkv(N)), torch.randn(N, 8, device=DEVICE),
                                       torch.randn(N, 8, device=DEVICE), cu_seqlens=_i32([0, 5, 40]), max_seqlen=N),
        r"cu_seqlens must end at the number of tokens \(16\), got 40"),
    "rotary negative offsets": (
        lambda fa: fa.apply_rotary_emb(torch.randn(2, 4, 2, 32, device=DEVICE), torch.randn(N, 8, device=DEVICE),
                                       torch.randn(N, 8, device=DEVICE), seqlen_offsets=_i32([3, -1])),
        r"seqlen_offsets must be non-negative, got \[3, -1\]"),
}


@pytest.mark.parametrize("case", list(VALUE_ERRORS))
def test_value_errors_under_check_inputs(fa, monkeypatch, case):
    call, message = VALUE_ERRORS[case]
    monkeypatch.setenv(CHECK_INPUTS, "1")
    with pytest.raises(ValueError, match=message):
        call(fa)


def test_valid_metadata_passes_check_inputs(fa, monkeypatch):
    """The debug switch refuses nothing that is right, at the edges included (a full cache, a
    left pad up to the keys' end)."""
    monkeypatch.setenv(CHECK_INPUTS, "1")
    assert torch.isfinite(fa.flash_attn_varlen_func(*_qkv(N), _i32([0, 5, N]), _i32([0, 0, N]), 11, 16)).all()
    assert torch.isfinite(_kvcache(fa, cache_seqlens=_i32([29, 0]), cache_leftpad=_i32([32, 3]))).all()
    assert torch.isfinite(_paged_kvcache(fa, cache_seqlens=_i32([29, 0]))).all()


# -- item 4: a paged prefill with gradients -------------------------------------------------------------

def test_paged_prefill_runs_forward_with_grad(fa):
    """flash-attn runs the forward of a paged prefill whose q/k/v require grad (its own
    test_flash_attn_varlen_causal does); the result matches the call without grad, and a backward
    through it raises naming block_table."""
    q = torch.randn(8, 2, 32, device=DEVICE)
    cache = torch.randn(4, 16, 2, 32, device=DEVICE)
    with torch.no_grad():
        want = _paged(fa, q=q, k=cache, v=cache)
    q_grad, cache_grad = q.clone().requires_grad_(), cache.clone().requires_grad_()
    out = _paged(fa, q=q_grad, k=cache_grad, v=cache_grad)
    assert out.requires_grad and torch.equal(out.detach(), want)
    with pytest.raises(NotImplementedError, match=r"no backward through flash_attn_varlen_func with block_table"):
        out.sum().backward()
    out = _paged(fa, q=q_grad)  # only q requires grad
    with pytest.raises(NotImplementedError, match=r"block_table"):
        torch.autograd.grad(out.sum(), q_grad)
