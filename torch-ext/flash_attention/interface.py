"""Public functions: flash-attn 2's interface and the kernels-community ``flash_attention_forward``.

Each function checks its tensors (``checks.py``) and hands them, with its options, to ``_run``:
it validates the options into one ``AttentionOptions`` (drawing dropout's RNG state from PyTorch's
generator), calls one of the forward ops (``fwd``, ``fwd_kvpacked``, ``fwd_qkvpacked``) through
``torch_ops.run_attention``, whose autograd formula calls the matching backward op, and with
``return_attn_probs=True`` and dropout also the ``probs`` op. Dense inputs are
(batch, seqlen, heads, headdim); the ``varlen`` functions take sequences packed along the first
dim, (total_tokens, heads, headdim), with int32 ``cu_seqlens`` (batch + 1,) marking where each
sequence starts.

Semantics (flash-attn 2.8's): softmax_scale defaults to 1/sqrt(headdim); nheads a multiple of
nheads_k (GQA/MQA); causal masks and windows are aligned to the bottom-right corner of each
sequence (query i sees keys j with i + sk - sq - left <= j <= i + sk - sq + right, causal meaning
right = 0; -1 = unbounded); softcap > 0 caps the scaled scores as softcap * tanh(s / softcap);
alibi_slopes (fp32, (nheads,) or (batch, nheads)) add -slope * |i + sk - sq - j|; s_aux (the
attention sinks of gpt-oss, (nheads,)) adds one logit per head to every row's softmax denominator
and gets a gradient; dropout_p drops probabilities with a Philox mask that the backward
regenerates. A query row that sees no key outputs 0 and has softmax_lse = +inf (with sinks: the
sink's logit). softmax_lse is fp32, natural log, includes the sink, and is shaped
(batch, nheads, seqlen_q) for dense inputs and (nheads, total_q) for varlen inputs. With
return_attn_probs=True the functions return (out, softmax_lse, S_dmask): S_dmask is None without
dropout, else the probabilities (batch, nheads, seqlen_q, seqlen_k) with dropped entries negated.
Every output and gradient is bitwise repeatable with ``deterministic=True``; with False (the
default, as in flash-attn) the backward may add dQ by atomics where that is faster (the A100 class
at head dims 64 and 128: docs/api.md#semantics), and is repeatable everywhere else.
"""

from typing import Optional

import torch

from .checks import check_packed, check_paged_kv, check_qkv, check_varlen, checked_attention_options
from .torch_ops import run_attention, run_op

DENSE = "(batch, seqlen, nheads, headdim)"
VARLEN = "(total_tokens, nheads, headdim)"
NO_LAYOUT = (None, None, 0, 0, None)  # dense inputs: no cu_seqlens, max_seqlens unused, no block_table


def _run(op: str, inputs: tuple, q, k, layout: tuple, batch: int, dropout_p, softmax_scale, causal, window_size,
         softcap, alibi_slopes, s_aux, return_attn_probs, deterministic=False):
    """Forward op ``op`` on ``inputs`` (q, k: the query and key tensors among them) with the
    sequence ``layout`` (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) and the options."""
    options = checked_attention_options(q, batch, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                        s_aux, deterministic=deterministic)
    out, softmax_lse = run_attention(op, inputs, layout, options)
    if not return_attn_probs:
        return out
    probs = None
    if options.dropout_p > 0:
        probs = run_op("probs", q.detach(), k.detach(), softmax_lse.detach(), *layout, *options.flatten())
    return out, softmax_lse, probs


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
    s_aux: Optional[torch.Tensor] = None,
):
    """q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
    Returns out like q, or (out, softmax_lse, S_dmask)."""
    check_qkv(q, k, v, DENSE, heads_axis=2, dense=True)
    return _run("fwd", (q, k, v), q, k, NO_LAYOUT, q.shape[0], dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, s_aux, return_attn_probs, deterministic)


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
    s_aux: Optional[torch.Tensor] = None,
):
    """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim)."""
    check_packed("kv", kv, "(batch, seqlen, 2, nheads, headdim)", 2)
    k, v = kv.unbind(dim=2)
    check_qkv(q, k, v, DENSE, heads_axis=2, dense=True)
    return _run("fwd_kvpacked", (q, kv), q, k, NO_LAYOUT, q.shape[0], dropout_p, softmax_scale, causal, window_size,
                softcap, alibi_slopes, s_aux, return_attn_probs, deterministic)


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
    s_aux: Optional[torch.Tensor] = None,
):
    """qkv: (batch, seqlen, 3, nheads, headdim)."""
    check_packed("qkv", qkv, "(batch, seqlen, 3, nheads, headdim)", 3)
    q, k, v = qkv.unbind(dim=2)
    check_qkv(q, k, v, DENSE, heads_axis=2, dense=True)
    return _run("fwd_qkvpacked", (qkv,), q, k, NO_LAYOUT, q.shape[0], dropout_p, softmax_scale, causal, window_size,
                softcap, alibi_slopes, s_aux, return_attn_probs, deterministic)


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
    s_aux: Optional[torch.Tensor] = None,
):
    """q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); cu_seqlens_q/k int32
    (batch + 1,); max_seqlen_q/k: the longest sequence (an int; a 0-d tensor is accepted).
    block_table (int32 (batch, max_num_blocks_per_seq)): k and v are paged caches
    (num_blocks, page_size, nheads_k, headdim), page_size a multiple of 16, sequence b's key j at
    k[block_table[b, j // page_size], j % page_size], cu_seqlens_k counting keys (no dropout; the
    forward runs on tensors that require grad, but a backward through it raises, as flash-attn
    has no paged backward)."""
    if block_table is not None:
        max_seqlens = check_paged_kv(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     dropout_p)
    else:
        check_qkv(q, k, v, VARLEN, heads_axis=1, dense=False)
        max_seqlens = check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
    layout = (cu_seqlens_q, cu_seqlens_k, *max_seqlens, block_table)
    return _run("fwd", (q, k, v), q, k, layout, cu_seqlens_q.numel() - 1, dropout_p, softmax_scale, causal,
                window_size, softcap, alibi_slopes, s_aux, return_attn_probs, deterministic)


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
    s_aux: Optional[torch.Tensor] = None,
):
    """q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim)."""
    check_packed("kv", kv, "(total_tokens, 2, nheads, headdim)", 2)
    k, v = kv.unbind(dim=1)
    check_qkv(q, k, v, VARLEN, heads_axis=1, dense=False)
    layout = (cu_seqlens_q, cu_seqlens_k, *check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k),
              None)
    return _run("fwd_kvpacked", (q, kv), q, k, layout, cu_seqlens_q.numel() - 1, dropout_p, softmax_scale, causal,
                window_size, softcap, alibi_slopes, s_aux, return_attn_probs, deterministic)


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
    s_aux: Optional[torch.Tensor] = None,
):
    """qkv: (total_tokens, 3, nheads, headdim); cu_seqlens int32 (batch + 1,)."""
    check_packed("qkv", qkv, "(total_tokens, 3, nheads, headdim)", 3)
    q, k, v = qkv.unbind(dim=1)
    check_qkv(q, k, v, VARLEN, heads_axis=1, dense=False)
    max_seqlen, _ = check_varlen(cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, q, k)
    return _run("fwd_qkvpacked", (qkv,), q, k, (cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, None),
                cu_seqlens.numel() - 1, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, s_aux,
                return_attn_probs, deterministic)


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
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    return _run("fwd", (q, k, v), q, k, NO_LAYOUT, q.shape[0], 0.0, softmax_scale, causal, (-1, -1), 0.0, None, None,
                False).transpose(1, 2)
