"""Attention modules with flash-attn 2.8's names and constructors (``flash_attn.modules.mha``).

* ``FlashSelfAttention``, ``FlashCrossAttention``: flash-attn's inner attention modules. They add
  only a constructor to the stateless layers of ``layers.py`` (one forward serves both the
  modules and ``kernels.kernelize``).
* ``FlashAttention``: the same over separate (batch, heads, seqlen, headdim) q, k, v, with every
  option of ``flash_attn_func`` but sinks; a differentiable module for any optimizer.
* ``MHA``: multi-head self- or cross-attention with projections (``Wqkv``, or ``Wq`` + ``Wkv`` for
  cross-attention, and ``out_proj``, flash-attn's parameter names), GQA/MQA through
  ``num_heads_kv``, rotary embeddings (``RotaryEmbedding``, XPos with ``rotary_emb_scale_base``),
  causal masks, sliding windows, ALiBi (``get_alibi_slopes``), attention dropout, padded batches
  through ``key_padding_mask`` (unpadded to varlen attention and padded back, padded positions
  give out_proj(0)), packed batches through ``cu_seqlens``, activation checkpointing of the
  attention, and generation with a KV cache through ``InferenceParams`` (flash-attn's
  ``flash_attn.utils.generation.InferenceParams``).

MHA's generation follows flash-attn: each layer's cache is key_value_memory_dict[layer_idx],
(max_batch_size, max_seqlen, 2, num_heads_kv, head_dim) from ``allocate_inference_cache`` (made on
first use if absent). The prompt (seqlen_offset 0) is rotated, written into the cache and attended
like a training batch; later calls (decoding, chunked prefill) go through ``flash_attn_with_kvcache``,
which appends the new keys and values to the cache in place at ``lengths_per_sample`` (else
``seqlen_offset``) and rotates them and q inside the kernel. The caller advances seqlen_offset.
Generation is inference: call it under torch.no_grad() (or inference_mode) and in eval mode.

flash-attn options that MHA cannot honour raise NotImplementedError: ``dwconv=True``,
``fused_bias_fc=True`` (flash-attn's fused CUDA linear; ``fused_bias_fc=False`` computes the same
with nn.Linear). ``use_flash_attn`` is accepted and ignored: attention is always this package's.
"""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.utils.checkpoint
from torch import nn

from . import layers
from .bert_padding import pad_input, unpad_input
from .kvcache import flash_attn_with_kvcache
from .rotary import RotaryEmbedding


def get_alibi_slopes(nheads: int) -> list[float]:
    """ALiBi's slope per head (Press et al.): 2^(-8i/n), i = 1..n, for n = nheads a power of two;
    otherwise those of the power of two p just below nheads, then every other slope of 2p."""
    def powers_of_two_slopes(n):
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]

    below = 2 ** math.floor(math.log2(nheads))
    return powers_of_two_slopes(below) + powers_of_two_slopes(2 * below)[0::2][:nheads - below]


@dataclass
class InferenceParams:
    """State of a generation shared by every layer (flash-attn's): the cache capacity, how many
    tokens are cached (seqlen_offset, or lengths_per_sample int32 (batch,) per sequence), the
    first cache row of this batch (batch_size_offset), and each layer's cache by layer_idx."""

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: Optional[torch.Tensor] = None

    def reset(self, max_seqlen: int, max_batch_size: int) -> None:
        """Start a new generation with these sizes (the caches are kept and overwritten)."""
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.seqlen_offset = 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()


def _hold_options(module: nn.Module, causal: bool, softmax_scale: Optional[float], dropout: float,
                  window_size: tuple, softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool):
    """Set the attributes the layers of ``layers.py`` read, under flash-attn's names (the slopes as a
    non-persistent buffer, so that they follow the module's device)."""
    module.causal = causal
    module.softmax_scale = softmax_scale
    module.drop = nn.Dropout(dropout)
    module.window_size = window_size
    module.softcap = softcap
    module.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
    module.deterministic = deterministic


class FlashSelfAttention(layers.FlashSelfAttention):
    """forward(qkv, causal=None, cu_seqlens=None, max_seqlen=None): see layers.FlashSelfAttention."""

    def __init__(self, causal: bool = False, softmax_scale: Optional[float] = None, attention_dropout: float = 0.0,
                 window_size: tuple = (-1, -1), alibi_slopes: Optional[torch.Tensor] = None,
                 deterministic: bool = False):
        super().__init__()
        _hold_options(self, causal, softmax_scale, attention_dropout, window_size, 0.0, alibi_slopes, deterministic)


class FlashCrossAttention(layers.FlashCrossAttention):
    """forward(q, kv, causal=None, cu_seqlens=None, max_seqlen=None, cu_seqlens_k=None,
    max_seqlen_k=None): see layers.FlashCrossAttention."""

    def __init__(self, causal: bool = False, softmax_scale: Optional[float] = None, attention_dropout: float = 0.0,
                 alibi_slopes: Optional[torch.Tensor] = None, window_size: tuple = (-1, -1),
                 deterministic: bool = False):
        super().__init__()
        _hold_options(self, causal, softmax_scale, attention_dropout, window_size, 0.0, alibi_slopes, deterministic)


class FlashAttention(layers.FlashAttention):
    """forward(q, k, v) on (batch, heads, seqlen, headdim) tensors (k, v may have fewer heads);
    returns (batch, heads, seqlen, headdim). ``dropout`` applies in training mode only."""

    def __init__(self, causal: bool = False, softmax_scale: Optional[float] = None, dropout: float = 0.0,
                 window_size: tuple = (-1, -1), softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                 deterministic: bool = False):
        super().__init__()
        _hold_options(self, causal, softmax_scale, dropout, window_size, softcap, alibi_slopes, deterministic)


class MHA(nn.Module):
    """Multi-head self-attention (or cross-attention with ``cross_attn``), flash-attn's MHA; see the
    module docstring. forward(x, x_kv=None, key_padding_mask=None, cu_seqlens=None, max_seqlen=None,
    mixer_subset=None, inference_params=None, **kwargs) takes x (batch, seqlen, embed_dim), or
    (total, embed_dim) with cu_seqlens/max_seqlen, and returns out like x (with
    ``return_residual``, (out, x)). key_padding_mask (batch, seqlen_k) bool, True = keep; x_kv the
    cross-attention keys' input (default x); mixer_subset indexes x's sequences for the queries
    (cross-attention only); kwargs go to the inner attention's forward (e.g. causal=, or
    cu_seqlens_k= and max_seqlen_k= for packed cross-attention)."""

    def __init__(self, embed_dim: int, num_heads: int, num_heads_kv: Optional[int] = None, cross_attn: bool = False,
                 qkv_proj_bias: bool = True, out_proj_bias: bool = True, dropout: float = 0.0,
                 softmax_scale: Optional[float] = None, causal: bool = False, layer_idx: Optional[int] = None,
                 dwconv: bool = False, rotary_emb_dim: int = 0, rotary_emb_base: float = 10000.0,
                 rotary_emb_scale_base: Optional[float] = None, rotary_emb_interleaved: bool = False,
                 use_alibi: bool = False, window_size: tuple = (-1, -1), fused_bias_fc: bool = False,
                 use_flash_attn: bool = False, return_residual: bool = False, checkpointing: bool = False,
                 device=None, dtype=None) -> None:
        if dwconv:
            raise NotImplementedError("MHA(dwconv=True): depthwise convolutions over q, k, v are not supported by "
                                      "this package")
        if fused_bias_fc:
            raise NotImplementedError("MHA(fused_bias_fc=True): flash-attn's fused CUDA linear layers are not part of "
                                      "this package; fused_bias_fc=False computes the same with nn.Linear")
        super().__init__()
        num_heads_kv = num_heads if num_heads_kv is None else num_heads_kv
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if num_heads % num_heads_kv:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_heads_kv ({num_heads_kv})")
        head_dim = embed_dim // num_heads
        if rotary_emb_dim and cross_attn:
            raise ValueError("rotary_emb_dim > 0 is not supported with cross_attn=True (as in flash-attn)")
        if not 0 <= rotary_emb_dim <= head_dim:
            raise ValueError(f"rotary_emb_dim ({rotary_emb_dim}) must be between 0 and the head dim ({head_dim})")
        self.embed_dim, self.num_heads, self.num_heads_kv, self.head_dim = embed_dim, num_heads, num_heads_kv, head_dim
        self.cross_attn = cross_attn
        self.causal = causal
        self.layer_idx = layer_idx
        self.rotary_emb_dim = rotary_emb_dim
        self.return_residual = return_residual
        self.checkpointing = checkpointing
        if rotary_emb_dim > 0:
            self.rotary_emb = RotaryEmbedding(rotary_emb_dim, base=rotary_emb_base, interleaved=rotary_emb_interleaved,
                                              scale_base=rotary_emb_scale_base, device=device)
        factory = {"device": device, "dtype": dtype}
        kv_dim = 2 * num_heads_kv * head_dim
        if cross_attn:
            self.Wq = nn.Linear(embed_dim, embed_dim, bias=qkv_proj_bias, **factory)
            self.Wkv = nn.Linear(embed_dim, kv_dim, bias=qkv_proj_bias, **factory)
        else:
            self.Wqkv = nn.Linear(embed_dim, embed_dim + kv_dim, bias=qkv_proj_bias, **factory)
        alibi_slopes = torch.tensor(get_alibi_slopes(num_heads), device=device) if use_alibi else None
        options = dict(causal=causal, softmax_scale=softmax_scale, attention_dropout=dropout,
                       window_size=window_size, alibi_slopes=alibi_slopes)
        self.inner_attn = FlashSelfAttention(**options)
        self.inner_cross_attn = FlashCrossAttention(**options)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=out_proj_bias, **factory)

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None) -> torch.Tensor:
        """An empty KV cache (batch_size, max_seqlen, 2, num_heads_kv, head_dim), in out_proj's dtype
        by default, on its device."""
        weight = self.out_proj.weight
        return torch.empty(batch_size, max_seqlen, 2, self.num_heads_kv, self.head_dim,
                           dtype=weight.dtype if dtype is None else dtype, device=weight.device)

    def forward(self, x, x_kv=None, key_padding_mask=None, cu_seqlens=None, max_seqlen=None, mixer_subset=None,
                inference_params=None, **kwargs):
        self._check_forward(x_kv, key_padding_mask, cu_seqlens, max_seqlen, mixer_subset, inference_params, kwargs)
        qkv, q, kv = self._project(x, x_kv, mixer_subset)
        if inference_params is not None:
            context = self._attend_cached(q, kv, inference_params)
        else:
            if self.rotary_emb_dim > 0 and qkv is not None:  # in place, on views of the projection
                self.rotary_emb(qkv)
            elif self.rotary_emb_dim > 0:
                self.rotary_emb(q, kv)
            if key_padding_mask is not None:
                context = self._attend_unpadded(qkv, q, kv, key_padding_mask, **kwargs)
            else:
                if qkv is None and not self.cross_attn:  # GQA self-attention: keys packed like the queries
                    kwargs.update(cu_seqlens_k=cu_seqlens, max_seqlen_k=max_seqlen)
                context = self._attend(qkv, q, kv, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **kwargs)
        out = self.out_proj(context.flatten(-2))
        return (out, x) if self.return_residual else out

    def _check_forward(self, x_kv, key_padding_mask, cu_seqlens, max_seqlen, mixer_subset, inference_params,
                       kwargs) -> None:
        if not self.cross_attn:
            for name, value in (("x_kv", x_kv), ("mixer_subset", mixer_subset)):
                if value is not None:
                    raise ValueError(f"{name} is for cross-attention: construct MHA with cross_attn=True")
        if cu_seqlens is not None and key_padding_mask is not None:
            raise ValueError("pass either cu_seqlens (packed sequences) or key_padding_mask (padded ones), not both")
        if cu_seqlens is not None and self.rotary_emb_dim > 0:
            raise ValueError("cu_seqlens is not supported with rotary embeddings (as in flash-attn): pass the padded "
                             "batch with key_padding_mask instead")
        if inference_params is not None:
            given = [name for name, value in (("key_padding_mask", key_padding_mask), ("cu_seqlens", cu_seqlens),
                                              ("max_seqlen", max_seqlen), *kwargs.items()) if value is not None]
            if given:
                raise ValueError(f"inference_params cannot be combined with {', '.join(given)}")
            if self.layer_idx is None:
                raise ValueError("generation with inference_params needs MHA(layer_idx=...), the key of this layer's "
                                 "cache in inference_params.key_value_memory_dict")
            if self.training and self.inner_attn.drop.p > 0:
                raise ValueError("generation with inference_params has no attention dropout: call model.eval() first")

    def _project(self, x, x_kv, mixer_subset):
        """(qkv, q, kv): qkv (..., 3, heads, head_dim) for self-attention with as many key/value
        heads as query heads, else None; q (..., heads, head_dim) and kv (..., 2, heads_kv,
        head_dim), views of qkv when there is one."""
        if self.cross_attn:
            q = self.Wq(x if mixer_subset is None else x[:, mixer_subset])
            kv = self.Wkv(x if x_kv is None else x_kv)
        else:
            projected = self.Wqkv(x)
            if self.num_heads_kv == self.num_heads:
                qkv = projected.unflatten(-1, (3, self.num_heads, self.head_dim))
                return qkv, qkv[..., 0, :, :], qkv[..., 1:, :, :]
            q, kv = projected[..., :self.embed_dim], projected[..., self.embed_dim:]
        return None, q.unflatten(-1, (self.num_heads, self.head_dim)), kv.unflatten(-1, (2, self.num_heads_kv,
                                                                                         self.head_dim))

    def _attend(self, qkv, q, kv, **kwargs):
        """The inner attention on qkv (inner_attn) or on q and kv (inner_cross_attn), recomputed in
        the backward with ``checkpointing``."""
        attention, args = (self.inner_attn, (qkv,)) if qkv is not None else (self.inner_cross_attn, (q, kv))
        if self.checkpointing:
            return torch.utils.checkpoint.checkpoint(attention, *args, use_reentrant=False, **kwargs)
        return attention(*args, **kwargs)

    def _attend_unpadded(self, qkv, q, kv, key_padding_mask, **kwargs):
        """Attention of a padded batch as varlen attention: the tokens key_padding_mask drops are
        removed (the queries too, in self-attention), and the output is padded back with zeros."""
        batch, seqlen = q.shape[:2]
        if tuple(key_padding_mask.shape) != tuple(kv.shape[:2]):
            raise ValueError(f"key_padding_mask must be (batch, seqlen_k) = {tuple(kv.shape[:2])}, got shape "
                             f"{tuple(key_padding_mask.shape)}")
        if qkv is not None:
            qkv, indices, cu_seqlens, max_seqlen, _ = unpad_input(qkv, key_padding_mask)
            context = self._attend(qkv, None, None, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **kwargs)
        else:
            query_mask = key_padding_mask
            if self.cross_attn:  # the mask covers the keys only: every query stays
                query_mask = torch.ones(batch, seqlen, dtype=torch.bool, device=q.device)
            q, indices, cu_seqlens, max_seqlen, _ = unpad_input(q, query_mask)
            kv, _, cu_seqlens_k, max_seqlen_k, _ = unpad_input(kv, key_padding_mask)
            context = self._attend(None, q, kv, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, cu_seqlens_k=cu_seqlens_k,
                                   max_seqlen_k=max_seqlen_k, **kwargs)
        return pad_input(context, indices, batch, seqlen)

    def _attend_cached(self, q, kv, inference_params: InferenceParams):
        """Attention with this layer's KV cache (module docstring): q (batch, seqlen, heads,
        head_dim) and kv (batch, seqlen, 2, heads_kv, head_dim) of the new tokens."""
        batch, seqlen = q.shape[:2]
        caches = inference_params.key_value_memory_dict
        if self.layer_idx not in caches:
            caches[self.layer_idx] = self.allocate_inference_cache(inference_params.max_batch_size,
                                                                   inference_params.max_seqlen, dtype=kv.dtype)
        first = inference_params.batch_size_offset
        cache = caches[self.layer_idx][first:first + batch]
        lengths = inference_params.lengths_per_sample
        cache_seqlens = inference_params.seqlen_offset if lengths is None else lengths[first:first + batch]
        if inference_params.seqlen_offset == 0 and seqlen > cache.shape[1]:
            raise ValueError(f"the prompt's {seqlen} tokens do not fit the cache's {cache.shape[1]} positions "
                             f"(inference_params.max_seqlen)")
        attention = self.inner_cross_attn
        # The kernel rotates q's rows at cache_seqlens + i only with a causal mask (or a window; else
        # all at cache_seqlens, as flash-attn's) and knows no XPos: other cases rotate here.
        rotate_in_kernel = (self.rotary_emb_dim > 0 and self.rotary_emb.scale is None
                            and inference_params.seqlen_offset > 0 and (seqlen == 1 or attention.causal))
        if self.rotary_emb_dim > 0 and not rotate_in_kernel:
            q, kv = self.rotary_emb(q, kv, seqlen_offset=cache_seqlens, max_seqlen=cache.shape[1])
        if inference_params.seqlen_offset == 0:
            cache[:, :seqlen] = kv
            return attention(q, kv)
        rotary = {}
        if rotate_in_kernel:
            self.rotary_emb._update_cos_sin_cache(cache.shape[1], device=q.device, dtype=q.dtype)
            rotary = dict(rotary_cos=self.rotary_emb._cos_cached, rotary_sin=self.rotary_emb._sin_cached,
                          rotary_interleaved=self.rotary_emb.interleaved)
        return flash_attn_with_kvcache(q, cache[:, :, 0], cache[:, :, 1], kv[:, :, 0], kv[:, :, 1],
                                       cache_seqlens=cache_seqlens, **layers.host_attention_kwargs(attention), **rotary)
