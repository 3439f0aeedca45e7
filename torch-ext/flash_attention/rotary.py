"""Rotary position embeddings with flash-attn's interface (``flash_attn.layers.rotary``).

``apply_rotary_emb`` rotates the first rotary_dim = 2 * cos.shape[-1] features of every head of x
by the angle of each row's position, through the Triton kernel of
``flash_attention_kernel/rotary.py`` (which documents the arithmetic); features past rotary_dim
are unchanged. Position = the row's index in its sequence + ``seqlen_offsets`` (an int, or an
integer tensor (batch,) in inference with a KV cache). GPT-NeoX style rotates features
(i, i + rotary_dim / 2), ``interleaved`` (GPT-J style) features (2i, 2i + 1). Positions at or past
the tables' length rotate by 0, as in flash-attn; with an int offset such a call is refused
instead (its rows could only be wrong).

All functions are differentiable (the gradient rotates by the opposite angle) and work under
torch.compile; the in-place ones (``inplace=True``, ``apply_rotary_emb_qkv_``,
``apply_rotary_emb_kv_``) modify their input, as flash-attn's do. ``RotaryEmbedding`` is
flash-attn's module: it keeps cos/sin tables in the inputs' dtype, grown to the longest position
seen, and rotates q and k in place; ``scale_base`` turns it into XPos (q scaled by
scale^(t - n/2) / scale_base, k by its inverse).

For code written against flash-attn's lower layers: ``apply_rotary`` is
``flash_attn.ops.triton.rotary.apply_rotary`` (the kernel call alone, no autograd, ``conjugate``
rotating by the opposite angle), and ``rotate_half`` / ``apply_rotary_emb_torch`` are
flash-attn's PyTorch reference of the same rotation.
"""

from typing import Optional, Union

import torch

from .checks import check_rotary
from .torch_ops import run_rotary


class _ApplyRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, seqlen_offsets, cu_seqlens, offset, max_seqlen, interleaved, inplace):
        out = run_rotary(inplace, x, cos, sin, seqlen_offsets, cu_seqlens, offset, max_seqlen, interleaved, False)
        if inplace:
            ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin, seqlen_offsets, cu_seqlens)
        ctx.scalars = (offset, max_seqlen, interleaved)
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin, seqlen_offsets, cu_seqlens = ctx.saved_tensors
        offset, max_seqlen, interleaved = ctx.scalars
        dx = run_rotary(False, grad, cos, sin, seqlen_offsets, cu_seqlens, offset, max_seqlen, interleaved, True)
        return dx, None, None, None, None, None, None, None, None


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     inplace: bool = False, seqlen_offsets: Union[int, torch.Tensor] = 0,
                     cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None) -> torch.Tensor:
    """x: (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with cu_seqlens
    (int32 (batch + 1,)) and max_seqlen; cos, sin: (seqlen_rotary, rotary_dim / 2) in x's dtype,
    rotary_dim <= headdim; seqlen_offsets: int or integer tensor (batch,). Returns x rotated (x
    itself with ``inplace``)."""
    seqlen_offsets, max_seqlen = check_rotary(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, inplace)
    if isinstance(seqlen_offsets, torch.Tensor):
        offsets_tensor, offset = seqlen_offsets, 0
    else:
        offsets_tensor, offset = None, seqlen_offsets
    args = (x, cos, sin, offsets_tensor, cu_seqlens, offset, max_seqlen, bool(interleaved))
    if torch.is_grad_enabled() and x.requires_grad:
        return _ApplyRotary.apply(*args, bool(inplace))
    return run_rotary(bool(inplace), *args, False)


apply_rotary_emb_func = apply_rotary_emb  # flash-attn's older name


def _qk_heads(qkv: torch.Tensor, num_heads_q: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of q and k inside qkv: (batch, seqlen, 3, nheads, headdim), or
    (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim) with num_heads_q."""
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv must have size 3 in dim 2 (batch, seqlen, 3, nheads, headdim), got shape "
                             f"{tuple(qkv.shape)}")
        return qkv[:, :, 0], qkv[:, :, 1]
    if qkv.dim() != 4:
        raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim) or (batch, seqlen, num_heads_q + 2 * "
                         f"num_heads_k, headdim), got shape {tuple(qkv.shape)}")
    if num_heads_q is None:
        raise ValueError("num_heads_q is required when qkv is (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim)")
    num_heads_k = (qkv.shape[2] - num_heads_q) // 2
    if num_heads_q <= 0 or num_heads_k <= 0 or num_heads_q + 2 * num_heads_k != qkv.shape[2]:
        raise ValueError(f"qkv's dim 2 ({qkv.shape[2]}) must be num_heads_q ({num_heads_q}) + 2 * num_heads_k")
    return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + num_heads_k]


def apply_rotary_emb_qkv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          cos_k: Optional[torch.Tensor] = None, sin_k: Optional[torch.Tensor] = None,
                          interleaved: bool = False, seqlen_offsets: Union[int, torch.Tensor] = 0,
                          num_heads_q: Optional[int] = None) -> torch.Tensor:
    """Rotate q and k inside qkv in place (k by cos_k / sin_k where given); returns qkv."""
    q, k = _qk_heads(qkv, num_heads_q)
    apply_rotary_emb(q, cos, sin, interleaved, True, seqlen_offsets)
    apply_rotary_emb(k, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k, interleaved, True,
                     seqlen_offsets)
    return qkv


def apply_rotary_emb_kv_(kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                         seqlen_offsets: Union[int, torch.Tensor] = 0) -> torch.Tensor:
    """Rotate k inside kv (batch, seqlen, 2, nheads, headdim) in place; returns kv."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        shape = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise ValueError(f"kv must be (batch, seqlen, 2, nheads, headdim), got {shape}")
    apply_rotary_emb(kv[:, :, 0], cos, sin, interleaved, True, seqlen_offsets)
    return kv


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlen_offsets: Union[int, torch.Tensor] = 0,
                 cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                 interleaved: bool = False, inplace: bool = False, conjugate: bool = False) -> torch.Tensor:
    """``apply_rotary_emb``'s rotation without autograd, rotating by minus the angle with
    ``conjugate`` (flash-attn's ops.triton.rotary.apply_rotary, same arguments)."""
    seqlen_offsets, max_seqlen = check_rotary(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, inplace)
    offsets_tensor, offset = (seqlen_offsets, 0) if isinstance(seqlen_offsets, torch.Tensor) else (None, seqlen_offsets)
    with torch.no_grad():
        return run_rotary(bool(inplace), x, cos, sin, offsets_tensor, cu_seqlens, offset, max_seqlen, bool(interleaved),
                          bool(conjugate))


def rotate_half(x: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """(-x2, x1) of the halves (x1, x2) of the last dim, or of its even and odd features when
    ``interleaved``: the rotation by 90 degrees of the reference below."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_emb_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           interleaved: bool = False) -> torch.Tensor:
    """The rotation in PyTorch ops (flash-attn's reference): x (batch, seqlen, nheads, headdim),
    cos/sin (seqlen, rotary_dim / 2) or (batch, seqlen, rotary_dim / 2)."""
    rotary_dim = cos.shape[-1] * 2
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"cos/sin cover rotary_dim = {rotary_dim} features, more than x's head dim {x.shape[-1]}")

    def per_feature(table):  # (..., rotary_dim / 2) -> (..., 1, rotary_dim), in the rotation's feature order
        table = table.repeat_interleave(2, dim=-1) if interleaved else torch.cat((table, table), dim=-1)
        return table.unsqueeze(-2)

    rotated = x[..., :rotary_dim] * per_feature(cos) + rotate_half(x[..., :rotary_dim], interleaved) * per_feature(sin)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


class RotaryEmbedding(torch.nn.Module):
    """Rotary embeddings (RoFormer) of ``dim`` features, or XPos with ``scale_base``, as
    flash-attn's module: ``forward(qkv, kv=None, seqlen_offset=0, max_seqlen=None,
    num_heads_q=None)`` rotates q and k in place and returns qkv, or (q, kv) when kv is given."""

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False, scale_base: Optional[float] = None,
                 device=None):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 2:
            raise ValueError(f"dim must be a positive even int, got {dim!r}")
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        self.scale_base = scale_base
        self.register_buffer("inv_freq", self._inv_freq(device), persistent=False)
        self.register_buffer("scale", self._xpos_scale(device) if scale_base is not None else None, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = self._cos_k_cached = self._sin_k_cached = None

    def _inv_freq(self, device=None) -> torch.Tensor:
        return 1.0 / self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim)

    def _xpos_scale(self, device=None) -> torch.Tensor:
        return (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) + 0.4 * self.dim) / (1.4 * self.dim)

    def _update_cos_sin_cache(self, seqlen: int, device=None, dtype=None) -> None:
        """Tables for positions [0, seqlen), rebuilt when longer ones are needed, on a new device or
        dtype, or when training after inference mode (whose tensors autograd cannot save)."""
        cached = self._cos_cached
        if (seqlen <= self._seq_len_cached and cached is not None and cached.device == device
                and cached.dtype == dtype and not (self.training and cached.is_inference())):
            return
        self._seq_len_cached = seqlen
        # fp32 throughout: positions times frequencies lose most of their digits in bf16
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._inv_freq(device)
        freqs = torch.outer(torch.arange(seqlen, device=device, dtype=torch.float32), inv_freq.to(device))
        if self.scale is None:
            self._cos_cached, self._sin_cached = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
            return
        scale = self.scale if self.scale.dtype == torch.float32 else self._xpos_scale(self.scale.device)
        power = (torch.arange(seqlen, dtype=torch.float32, device=device) - seqlen // 2) / self.scale_base
        scale = scale.to(device) ** power[:, None]
        self._cos_cached, self._sin_cached = (torch.cos(freqs) * scale).to(dtype), (torch.sin(freqs) * scale).to(dtype)
        self._cos_k_cached = (torch.cos(freqs) / scale).to(dtype)
        self._sin_k_cached = (torch.sin(freqs) / scale).to(dtype)

    def forward(self, qkv: torch.Tensor, kv: Optional[torch.Tensor] = None,
                seqlen_offset: Union[int, torch.Tensor] = 0, max_seqlen: Optional[int] = None,
                num_heads_q: Optional[int] = None):
        """qkv: (batch, seqlen, 3, nheads, headdim) or (batch, seqlen, num_heads_q + 2 * num_heads_k,
        headdim), or q (batch, seqlen, nheads, headdim) when kv (batch, seqlen, 2, nheads_k,
        headdim) is given. seqlen_offset: int or (batch,) tensor; with a tensor, pass max_seqlen
        (the longest position + 1) so that the tables cover it."""
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        elif self._cos_cached is None:
            raise ValueError("seqlen_offset is a tensor: pass max_seqlen so that the cos/sin tables cover every position")
        xpos = self.scale is not None
        cos_k = self._cos_k_cached if xpos else self._cos_cached
        sin_k = self._sin_k_cached if xpos else self._sin_cached
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached, cos_k, sin_k, self.interleaved,
                                         seqlen_offset, num_heads_q)
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached, self.interleaved, True, seqlen_offset)
        return q, apply_rotary_emb_kv_(kv, cos_k, sin_k, self.interleaved, seqlen_offset)
