"""Tile loads through tensor descriptors (TMA) against plain loads.

FLASH_ATTENTION_TMA=1 makes every kernel read its tiles through tensor descriptors wherever they
can work: on a Hopper GPU through the copy engine, under the CPU interpreter through Triton's
emulation of it; "0" turns them off; unset, the config table chooses. At the same tile sizes
both paths compute the same numbers, so their results must be bitwise equal, and the descriptor
path must meet the float64 reference bar on ragged shapes (zero fill past the sequence end and
past the head dim). Inputs whose strides are not 16-byte aligned must fall back to plain loads.
"""

import math

import pytest
import torch

from conftest import ON_GPU
from inputs import cu_seqlens, op_options, random_qkv
from reference import BWD_FACTOR, FWD_FACTOR, assert_within_bar, run_ref
from sizes import BF16

# (name, q shape, k/v shape, dtype, causal); batch, seqlen, heads, head dim
DENSE_CASES = [
    ("gqa-causal-q<k-d64", (2, 113, 4, 64), (2, 203, 2, 64), torch.float16, True),
    ("causal-q>k-d80", (1, 203, 2, 80), (1, 113, 2, 80), BF16, True),
    ("full-d96", (1, 17, 3, 96), (1, 203, 1, 96), BF16, False),
    ("full-d128", (1, 113, 2, 128), (1, 113, 2, 128), torch.float16, False),
]


def _fwd_bwd(fa, monkeypatch, setting, run, leaves, dout):
    monkeypatch.setenv("FLASH_ATTENTION_TMA", setting)
    leaves = [t.detach().requires_grad_() for t in leaves]
    out, lse, _ = run(*leaves)
    return (out, lse, *torch.autograd.grad(out, leaves, dout))


def _tma_possible():
    return not ON_GPU or torch.cuda.get_device_capability()[0] >= 9


def test_descriptors_used_only_where_they_work(fa, monkeypatch):
    """The switch and the alignment rule; without this the comparisons below could compare
    plain loads with plain loads."""
    launch = fa.flash_attention_kernel.launch
    interpreted = not ON_GPU
    aligned = random_qkv((1, 17, 2, 64), (1, 17, 2, 64))
    unaligned = random_qkv((1, 17, 2, 59), (1, 17, 2, 59))  # row stride 118 bytes
    monkeypatch.setenv("FLASH_ATTENTION_TMA", "1")
    assert launch.use_tma([False, True], interpreted, *aligned) == [_tma_possible()] * 2
    assert launch.use_tma([True], interpreted, *unaligned) == [False]
    monkeypatch.setenv("FLASH_ATTENTION_TMA", "0")
    assert launch.use_tma([True], interpreted, *aligned) == [False]


@pytest.mark.parametrize("name, q_shape, kv_shape, dtype, causal", DENSE_CASES, ids=[c[0] for c in DENSE_CASES])
def test_dense_descriptors_match_plain_loads(fa, monkeypatch, name, q_shape, kv_shape, dtype, causal):
    q, k, v = random_qkv(q_shape, kv_shape, dtype)
    dout = torch.randn_like(q)

    def run(q, k, v):
        return fa.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)

    plain = _fwd_bwd(fa, monkeypatch, "0", run, (q, k, v), dout)
    described = _fwd_bwd(fa, monkeypatch, "1", run, (q, k, v), dout)
    for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), plain, described):
        assert torch.equal(a, b), f"{label} differs between plain and descriptor loads"

    scale = 1.0 / math.sqrt(q_shape[-1])
    truth_out, truth_grads = run_ref(q, k, v, dout, causal, scale, torch.float64)
    pt_out, pt_grads = run_ref(q, k, v, dout, causal, scale, dtype)
    assert_within_bar("out", described[0], pt_out, truth_out, FWD_FACTOR)
    for label, ours, pt, truth in zip(("dq", "dk", "dv"), described[2:], pt_grads, truth_grads):
        assert_within_bar(label, ours, pt, truth, BWD_FACTOR)


def test_descriptors_under_opcheck(fa, monkeypatch):
    """torch.compile and opcheck trace the ops with fake tensors, which have no data pointer:
    the descriptor decision must not read one."""
    monkeypatch.setenv("FLASH_ATTENTION_TMA", "1")
    q, k, v = random_qkv((2, 113, 4, 64), (2, 203, 2, 64), torch.float16, requires_grad=True)
    torch.library.opcheck(fa.ops.fwd.default, (q, k, v, None, None, 0, 0, None, *op_options(fa, False)))
    out, lse = fa.ops.fwd(q, k, v, None, None, 0, 0, None, *op_options(fa, False))
    dout = torch.randn_like(out)
    torch.library.opcheck(fa.ops.bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), None,
                           None, None, 0, 0, None, *op_options(fa, False)))


def test_varlen_descriptors_match_plain_loads(fa, monkeypatch):
    """Per-sequence descriptors: a tile past a sequence's end reads zeros, not the next sequence."""
    lens_q, lens_k = [17, 113, 1, 40], [113, 17, 40, 1]
    q, k, v = random_qkv((sum(lens_q), 4, 64), (sum(lens_k), 2, 64), BF16)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    dout = torch.randn_like(q)

    def run(q, k, v):
        return fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                         return_attn_probs=True)

    plain = _fwd_bwd(fa, monkeypatch, "0", run, (q, k, v), dout)
    described = _fwd_bwd(fa, monkeypatch, "1", run, (q, k, v), dout)
    for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), plain, described):
        assert torch.equal(a, b), f"{label} differs between plain and descriptor loads"
