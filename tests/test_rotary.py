"""Rotary embeddings (apply_rotary_emb, the in-place qkv/kv helpers, RotaryEmbedding) against a
float64 rotation built here: each row's features rotated by its position's angle, GPT-NeoX
(halves) or GPT-J (interleaved) pairing, the tail past rotary_dim unchanged. The kernel's error
may be at most twice that of the same formula evaluated by PyTorch in the input dtype (plus a
rounding of the output)."""

import pytest
import torch

from inputs import cu_seqlens
from sizes import DEVICE, DTYPES


def _tables(positions, half, dtype, base=10000.0):
    freqs = torch.outer(torch.arange(positions, dtype=torch.float64),
                        base ** -(torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half)))
    return freqs.cos().to(DEVICE, dtype), freqs.sin().to(DEVICE, dtype)


def _pairs(rotary_dim, interleaved):
    half = rotary_dim // 2
    if interleaved:
        return torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)
    return torch.arange(half), torch.arange(half, rotary_dim)


def rotate(x, cos, sin, positions, interleaved, compute_dtype=torch.float64):
    """x (..., seqlen, heads, dim) rotated at ``positions`` (..., seqlen) in ``compute_dtype``;
    positions past the tables rotate by 0."""
    x = x.to(compute_dtype)
    inside = positions < cos.shape[0]
    index = positions.clamp(max=cos.shape[0] - 1)
    c = torch.where(inside[..., None], cos.to(compute_dtype)[index], 1.0)[..., None, :]
    s = torch.where(inside[..., None], sin.to(compute_dtype)[index], 0.0)[..., None, :]
    first, second = _pairs(2 * cos.shape[1], interleaved)
    out = x.clone()
    x1, x2 = x[..., first], x[..., second]
    out[..., first] = x1 * c - x2 * s
    out[..., second] = x1 * s + x2 * c
    return out


def _positions(batch, seqlen, offsets):
    start = offsets.to("cpu")[:, None] if isinstance(offsets, torch.Tensor) else offsets
    return (torch.arange(seqlen)[None, :] + start).expand(batch, seqlen).to(DEVICE)


def _check(got, x, cos, sin, positions, interleaved):
    want = rotate(x, cos, sin, positions, interleaved)
    same_dtype = rotate(x, cos, sin, positions, interleaved, compute_dtype=x.dtype)
    bar = 2 * (same_dtype.double() - want).abs().max().item() + 2 * torch.finfo(x.dtype).eps * want.abs().max().item()
    error = (got.double() - want).abs().max().item()
    assert error <= bar, f"error {error:.3g} above the bar {bar:.3g}"


CASES = [  # batch, seqlen, heads, head_dim, rotary_dim, offsets
    (2, 17, 3, 64, 64, 0),
    (2, 17, 3, 59, 40, 5),
    (1, 113, 2, 128, 64, 0),
    (3, 9, 4, 80, 80, "tensor"),
    (2, 1, 5, 256, 128, "tensor"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}s{}h{}d{}r{}-{}".format(*c))
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_apply_rotary_emb(fa, case, interleaved, inplace):
    batch, seqlen, heads, head_dim, rotary_dim, offsets = case
    dtype = DTYPES[(head_dim + rotary_dim) % len(DTYPES)]
    if offsets == "tensor":
        offsets = torch.tensor([0, 7, 30][:batch], dtype=torch.int32, device=DEVICE)
    cos, sin = _tables(40 + seqlen, rotary_dim // 2, dtype)
    x = torch.randn(batch, seqlen, heads, head_dim, device=DEVICE, dtype=dtype)
    original = x.clone()
    got = fa.apply_rotary_emb(x, cos, sin, interleaved=interleaved, inplace=inplace, seqlen_offsets=offsets)
    assert (got is x) == inplace and got.shape == x.shape and got.dtype == dtype
    if not inplace:
        assert torch.equal(x, original)
    _check(got, original, cos, sin, _positions(batch, seqlen, offsets), interleaved)
    assert torch.equal(got[..., rotary_dim:], original[..., rotary_dim:])


def test_strided_input(fa):
    """Any strides: a last dim with stride 2 is copied first (out of place), sequence and head
    strides are read as they are."""
    cos, sin = _tables(12, 8, torch.float32)
    wide = torch.randn(2, 3, 10, 64, device=DEVICE)
    x = wide.transpose(1, 2)[..., ::2]  # (2, 10, 3, 32), strides (1920, 64, 640, 2)
    _check(fa.apply_rotary_emb(x, cos, sin), x, cos, sin, _positions(2, 10, 0), False)
    y = wide.transpose(1, 2)[..., :32]  # unit last stride, permuted heads and rows
    _check(fa.apply_rotary_emb(y.clone(), cos, sin), y, cos, sin, _positions(2, 10, 0), False)
    rotated = fa.apply_rotary_emb(y, cos, sin, inplace=True)
    assert rotated is y and rotated.data_ptr() == wide.data_ptr()


def test_positions_past_the_tables_rotate_by_zero(fa):
    """With per-sequence offsets (not checked on the host) rows past the tables keep their values,
    as in flash-attn."""
    cos, sin = _tables(12, 16, torch.float32)
    x = torch.randn(2, 10, 2, 32, device=DEVICE)
    offsets = torch.tensor([0, 6], dtype=torch.int64, device=DEVICE)
    got = fa.apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets)
    _check(got, x, cos, sin, _positions(2, 10, offsets), False)
    assert torch.equal(got[1, 6:], x[1, 6:])


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_varlen(fa, interleaved):
    lengths = [5, 0, 1, 17]
    cu = cu_seqlens(lengths)
    total, heads, head_dim, rotary_dim = sum(lengths), 3, 48, 32
    cos, sin = _tables(30, rotary_dim // 2, torch.float16)
    x = torch.randn(total, heads, head_dim, device=DEVICE, dtype=torch.float16)
    offsets = torch.tensor([2, 9, 0, 4], dtype=torch.int32, device=DEVICE)
    got = fa.apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets, cu_seqlens=cu,
                              max_seqlen=max(lengths))
    positions = torch.cat([torch.arange(n) + int(offsets[i]) for i, n in enumerate(lengths)]).to(DEVICE)
    _check(got, x, cos, sin, positions, interleaved)


@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_gradient_rotates_back(fa, inplace):
    """The gradient of a rotation is the opposite rotation of the output gradient."""
    cos, sin = _tables(20, 24, torch.float32)
    leaf = torch.randn(2, 13, 3, 64, device=DEVICE, requires_grad=True)
    x = leaf * 1.0 if inplace else leaf  # (an in-place op needs a non-leaf)
    out = fa.apply_rotary_emb(x, cos, sin, interleaved=True, inplace=inplace, seqlen_offsets=3)
    dout = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, leaf, dout)
    want = rotate(dout, cos, -sin, _positions(2, 13, 3), True)
    assert (grad.double() - want).abs().max().item() < 1e-5


def test_qkv_and_kv_helpers(fa):
    batch, seqlen, heads, head_dim = 2, 11, 4, 64
    cos, sin = _tables(seqlen + 3, 16, torch.float32)
    positions = _positions(batch, seqlen, 3)
    qkv = torch.randn(batch, seqlen, 3, heads, head_dim, device=DEVICE)
    original = qkv.clone()
    assert fa.apply_rotary_emb_qkv_(qkv, cos, sin, seqlen_offsets=3) is qkv
    for i in (0, 1):
        _check(qkv[:, :, i], original[:, :, i], cos, sin, positions, False)
    assert torch.equal(qkv[:, :, 2], original[:, :, 2])

    gqa = torch.randn(batch, seqlen, 4 + 2 * 2, head_dim, device=DEVICE)  # 4 query heads, 2 KV heads
    original = gqa.clone()
    fa.apply_rotary_emb_qkv_(gqa, cos, sin, cos_k=cos * 0.5, sin_k=sin * 0.5, seqlen_offsets=3, num_heads_q=4)
    _check(gqa[:, :, :4], original[:, :, :4], cos, sin, positions, False)
    _check(gqa[:, :, 4:6], original[:, :, 4:6], cos * 0.5, sin * 0.5, positions, False)
    assert torch.equal(gqa[:, :, 6:], original[:, :, 6:])

    kv = torch.randn(batch, seqlen, 2, 2, head_dim, device=DEVICE)
    original = kv.clone()
    assert fa.apply_rotary_emb_kv_(kv, cos, sin, seqlen_offsets=3) is kv
    _check(kv[:, :, 0], original[:, :, 0], cos, sin, positions, False)
    assert torch.equal(kv[:, :, 1], original[:, :, 1])


@pytest.mark.parametrize("scale_base", [None, 512.0], ids=["rope", "xpos"])
def test_rotary_embedding_module(fa, scale_base):
    """The module's tables are RoFormer's (XPos: q scaled by scale^((t - n/2) / scale_base), k by
    its inverse), grown as positions grow; q and k rotated in place, v untouched."""
    dim, head_dim, seqlen = 32, 64, 9
    module = fa.RotaryEmbedding(dim, interleaved=False, scale_base=scale_base, device=DEVICE)
    qkv = torch.randn(2, seqlen, 3, 2, head_dim, device=DEVICE)
    original = qkv.clone()
    assert module(qkv, seqlen_offset=4) is qkv
    n = seqlen + 4
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    scale = torch.ones(n, dim // 2, dtype=torch.float64)
    if scale_base is not None:
        scale = ((torch.arange(0, dim, 2, dtype=torch.float64) + 0.4 * dim) / (1.4 * dim)) ** (
            (torch.arange(n, dtype=torch.float64) - n // 2) / scale_base)[:, None]
    positions = _positions(2, seqlen, 4)
    for i, factor in ((0, scale), (1, 1.0 / scale)):
        want = rotate(original[:, :, i], (cos * factor).to(DEVICE), (sin * factor).to(DEVICE), positions, False)
        assert (qkv[:, :, i].double() - want).abs().max().item() < 1e-5
    assert torch.equal(qkv[:, :, 2], original[:, :, 2])
    assert module._cos_cached.shape == (n, dim // 2)

    q, kv = torch.randn(1, 3, 2, head_dim, device=DEVICE), torch.randn(1, 3, 2, 1, head_dim, device=DEVICE)
    q_rotated, kv_rotated = module(q, kv=kv, seqlen_offset=20)  # grows the tables to 23 positions
    assert q_rotated is q and kv_rotated is kv and module._cos_cached.shape[0] == 23


def test_torch_compile(fa):
    cos, sin = _tables(16, 16, torch.float16)
    x = torch.randn(2, 9, 2, 40, device=DEVICE, dtype=torch.float16, requires_grad=True)
    fn = lambda x: fa.apply_rotary_emb(x, cos, sin, interleaved=True, seqlen_offsets=2) * 2.0  # noqa: E731
    eager, compiled = fn(x), torch.compile(fn, fullgraph=True)(x)
    dout = torch.randn_like(eager)
    assert torch.equal(compiled, eager)
    assert torch.equal(torch.autograd.grad(compiled, x, dout)[0], torch.autograd.grad(eager, x, dout)[0])


def test_errors(fa):
    x = torch.randn(2, 8, 2, 32, device=DEVICE)
    cos, sin = _tables(8, 8, torch.float32)
    with pytest.raises(TypeError, match="cos must have x's dtype"):
        fa.apply_rotary_emb(x, cos.half(), sin)
    with pytest.raises(ValueError, match="rotary_dim"):
        fa.apply_rotary_emb(x, *_tables(8, 17, torch.float32))
    with pytest.raises(ValueError, match="need 11"):
        fa.apply_rotary_emb(x, cos, sin, seqlen_offsets=3)
    with pytest.raises(ValueError, match=r"shape \(batch,\) = \(2,\)"):
        fa.apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.zeros(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="non-negative int"):
        fa.apply_rotary_emb(x, cos, sin, seqlen_offsets=-1)
    with pytest.raises(ValueError, match="max_seqlen is required"):
        fa.apply_rotary_emb(x[0], cos, sin, cu_seqlens=cu_seqlens([3, 5]))
    with pytest.raises(ValueError, match="contiguous last dim"):
        fa.apply_rotary_emb(torch.randn(2, 8, 2, 64, device=DEVICE)[..., ::2], cos, sin, inplace=True)
    with pytest.raises(ValueError, match="4 dims"):
        fa.apply_rotary_emb(x[0], cos, sin)
    with pytest.raises(ValueError, match="num_heads_q is required"):
        fa.apply_rotary_emb_qkv_(torch.randn(2, 8, 6, 32, device=DEVICE), cos, sin)
    with pytest.raises(ValueError, match="positive even int"):
        fa.RotaryEmbedding(7)
