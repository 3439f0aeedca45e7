"""Kernel Hub layers: attention modules whose forward ``kernels.kernelize`` swaps into a model.

``kernelize`` replaces the forward of a module class decorated with
``kernels.use_kernel_forward_from_hub("<name>")`` by the forward of the layer ``<name>`` here,
bound to the model's own module (the host). A layer is therefore stateless, as kernels checks: no
``__init__``, no members besides ``forward``, ``has_backward`` and ``can_torch_compile``; its
forward has the parameters of the forward it replaces and reads the host's state through the
attributes annotated on the class, with flash-attn's names (``flash_attn.modules.mha``):

* ``causal``, ``softmax_scale``, ``window_size``, ``softcap``, ``alibi_slopes`` (cast to fp32),
  ``deterministic``: the options of the public functions;
* ``drop``: an ``nn.Dropout`` whose ``p`` is the attention dropout, applied in training mode only.

An attribute the host lacks takes flash-attn's default (not causal, 1/sqrt(headdim), no window,
softcap, ALiBi or dropout). ``modules.py`` subclasses these layers with flash-attn's constructors.

* ``FlashSelfAttention.forward(qkv, causal=None, cu_seqlens=None, max_seqlen=None)``: qkv
  (batch, seqlen, 3, heads, headdim), or (total, 3, heads, headdim) with cu_seqlens/max_seqlen.
* ``FlashCrossAttention.forward(q, kv, causal=None, cu_seqlens=None, max_seqlen=None,
  cu_seqlens_k=None, max_seqlen_k=None)``: q (batch, seqlen_q, heads, headdim), kv (batch,
  seqlen_k, 2, heads_k, headdim), or packed sequences with all four varlen arguments.
* ``FlashAttention.forward(q, k, v)``: (batch, heads, seqlen, headdim) tensors, GQA allowed.

``causal`` passed to forward overrides the host's. Outputs are (batch, seqlen, heads, headdim)
(varlen: (total, heads, headdim)), except FlashAttention's, which keeps its inputs' layout.
"""

from typing import Optional

import torch
from torch import nn

from .interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)


def host_attention_kwargs(module: nn.Module, causal: Optional[bool] = None) -> dict:
    """The options a host module holds, as keyword arguments of the public functions and of
    flash_attn_with_kvcache (no dropout or deterministic); ``causal`` overrides the host's."""
    slopes = getattr(module, "alibi_slopes", None)
    return dict(
        softmax_scale=getattr(module, "softmax_scale", None),
        causal=getattr(module, "causal", False) if causal is None else causal,
        window_size=getattr(module, "window_size", (-1, -1)),
        softcap=getattr(module, "softcap", 0.0),
        alibi_slopes=None if slopes is None else slopes.float(),  # fp32 even after model.half()
    )


def _host_training_kwargs(module: nn.Module, causal: Optional[bool]) -> dict:
    """host_attention_kwargs plus dropout (the host's drop.p in training mode, else 0) and deterministic."""
    drop = getattr(module, "drop", None)
    dropout_p = drop.p if module.training and drop is not None else 0.0
    return dict(host_attention_kwargs(module, causal), dropout_p=dropout_p,
                deterministic=getattr(module, "deterministic", False))


def _check_varlen(pairs: dict) -> bool:
    """Whether the call is varlen: the varlen arguments (name -> value) are all given, or none."""
    given = [name for name, value in pairs.items() if value is not None]
    if given and len(given) != len(pairs):
        missing = [name for name in pairs if name not in given]
        raise ValueError(f"varlen attention needs {', '.join(pairs)} together; got {', '.join(given)} "
                         f"without {', '.join(missing)}")
    return bool(given)


class FlashSelfAttention(nn.Module):
    """Self-attention over packed qkv, dense or varlen (flash-attn's FlashSelfAttention)."""

    has_backward = True
    can_torch_compile = True

    causal: bool
    softmax_scale: Optional[float]
    drop: nn.Dropout
    window_size: tuple
    alibi_slopes: Optional[torch.Tensor]
    deterministic: bool

    def forward(self, qkv: torch.Tensor, causal: Optional[bool] = None, cu_seqlens: Optional[torch.Tensor] = None,
                max_seqlen: Optional[int] = None) -> torch.Tensor:
        options = _host_training_kwargs(self, causal)
        if _check_varlen({"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}):
            return flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, **options)
        return flash_attn_qkvpacked_func(qkv, **options)


class FlashCrossAttention(nn.Module):
    """Attention of q over packed kv, dense or varlen, GQA/MQA allowed (flash-attn's
    FlashCrossAttention)."""

    has_backward = True
    can_torch_compile = True

    causal: bool
    softmax_scale: Optional[float]
    drop: nn.Dropout
    window_size: tuple
    alibi_slopes: Optional[torch.Tensor]
    deterministic: bool

    def forward(self, q: torch.Tensor, kv: torch.Tensor, causal: Optional[bool] = None,
                cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_k: Optional[int] = None) -> torch.Tensor:
        options = _host_training_kwargs(self, causal)
        if _check_varlen({"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, "cu_seqlens_k": cu_seqlens_k,
                          "max_seqlen_k": max_seqlen_k}):
            return flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k,
                                                   **options)
        return flash_attn_kvpacked_func(q, kv, **options)


class FlashAttention(nn.Module):
    """Attention on separate (batch, heads, seqlen, headdim) q, k, v; returns that layout."""

    has_backward = True
    can_torch_compile = True

    causal: bool
    softmax_scale: Optional[float]
    drop: nn.Dropout
    window_size: tuple
    softcap: float
    alibi_slopes: Optional[torch.Tensor]
    deterministic: bool

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              **_host_training_kwargs(self, None))
        return out.transpose(1, 2)
