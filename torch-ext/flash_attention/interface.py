"""Public functions: flash-attn 2's interface and the kernels-community ``flash_attention_forward``.

Each function checks its arguments (``checks.py``), passes views of its inputs to one of the
forward ops (``fwd``, ``fwd_kvpacked``, ``fwd_qkvpacked``) through ``torch_ops.attention``, whose
autograd formula calls the matching backward op. Dense inputs are (batch, seqlen, heads, headdim); the
``varlen`` functions take sequences packed along the first dim, (total_tokens, heads, headdim),
with int32 ``cu_seqlens`` (batch + 1,) marking where each sequence starts. Features flash-attn has
but this package does not build yet raise NotImplementedError naming the parameter.

Semantics shared by all functions: softmax_scale defaults to 1/sqrt(headdim); nheads a multiple of
nheads_k (GQA/MQA); causal masks are aligned to the bottom-right corner of each sequence
(query i sees keys j <= i + seqlen_k - seqlen_q); a query row that sees no key outputs 0 and has
softmax_lse = +inf. The backward uses no atomics, so it is deterministic whatever
``deterministic`` says. With return_attn_probs=True they return (out, softmax_lse, None): the
attention-probability tensor is not built. softmax_lse is fp32, natural log, shaped
(batch, nheads, seqlen_q) for dense inputs and (nheads, total_q) for varlen inputs.
"""

from typing import Optional

import torch

from .checks import (
    check_packed, check_qkv, check_unbuilt_features, check_varlen, softmax_scale_or_default,
)
from .torch_ops import attention

DENSE = "(batch, seqlen, nheads, headdim)"
VARLEN = "(total_tokens, nheads, headdim)"


def _result(out, softmax_lse, return_attn_probs: bool):
    return (out, softmax_lse, None) if return_attn_probs else out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
    Returns out like q, or (out, softmax_lse, None)."""
    check_qkv(q, k, v, DENSE, heads_axis=2, dense=True)
    check_unbuilt_features(dropout_p, window_size, softcap, alibi_slopes)
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    out, softmax_lse = attention("fwd", q, k, v, None, None, 0, 0, scale, bool(causal))
    return _result(out, softmax_lse, return_attn_probs)


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim)."""
    check_packed("kv", kv, "(batch, seqlen, 2, nheads, headdim)", 2)
    check_qkv(q, *kv.unbind(dim=2), DENSE, heads_axis=2, dense=True)
    check_unbuilt_features(dropout_p, window_size, softcap, alibi_slopes)
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    out, softmax_lse = attention("fwd_kvpacked", q, kv, None, None, 0, 0, scale, bool(causal))
    return _result(out, softmax_lse, return_attn_probs)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """qkv: (batch, seqlen, 3, nheads, headdim)."""
    check_packed("qkv", qkv, "(batch, seqlen, 3, nheads, headdim)", 3)
    check_qkv(*qkv.unbind(dim=2), DENSE, heads_axis=2, dense=True)
    check_unbuilt_features(dropout_p, window_size, softcap, alibi_slopes)
    scale = softmax_scale_or_default(softmax_scale, qkv.shape[-1])
    out, softmax_lse = attention("fwd_qkvpacked", qkv, None, None, 0, 0, scale, bool(causal))
    return _result(out, softmax_lse, return_attn_probs)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
):
    """q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); cu_seqlens_q/k int32
    (batch + 1,); max_seqlen_q/k: the longest sequence (an int; a 0-d tensor is accepted)."""
    check_qkv(q, k, v, VARLEN, heads_axis=1, dense=False)
    max_seqlen_q, max_seqlen_k = check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
    check_unbuilt_features(dropout_p, window_size, softcap, alibi_slopes, block_table)
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    out, softmax_lse = attention("fwd", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                                 bool(causal))
    return _result(out, softmax_lse, return_attn_probs)


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim)."""
    check_packed("kv", kv, "(total_tokens, 2, nheads, headdim)", 2)
    k, v = kv.unbind(dim=1)
    check_qkv(q, k, v, VARLEN, heads_axis=1, dense=False)
    max_seqlen_q, max_seqlen_k = check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
    check_unbuilt_features(dropout_p, window_size, softcap, alibi_slopes)
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    out, softmax_lse = attention("fwd_kvpacked", q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 scale, bool(causal))
    return _result(out, softmax_lse, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """qkv: (total_tokens, 3, nheads, headdim); cu_seqlens int32 (batch + 1,)."""
    check_packed("qkv", qkv, "(total_tokens, 3, nheads, headdim)", 3)
    q, k, v = qkv.unbind(dim=1)
    check_qkv(q, k, v, VARLEN, heads_axis=1, dense=False)
    max_seqlen, _ = check_varlen(cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, q, k)
    check_unbuilt_features(dropout_p, window_size, softcap, alibi_slopes)
    scale = softmax_scale_or_default(softmax_scale, qkv.shape[-1])
    out, softmax_lse = attention("fwd_qkvpacked", qkv, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale,
                                 bool(causal))
    return _result(out, softmax_lse, return_attn_probs)


def flash_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
) -> torch.Tensor:
    """Attention on (batch, heads, seqlen, headdim) tensors, differentiable; returns the output in
    the same layout. Same semantics as ``flash_attn_func``."""
    check_qkv(query, key, value, "(batch, nheads, seqlen, headdim)", heads_axis=1, dense=True)
    scale = softmax_scale_or_default(softmax_scale, query.shape[-1])
    out, _ = attention("fwd", query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, None, 0, 0,
                       scale, bool(causal))
    return out.transpose(1, 2)
