"""flash-attention: pure-Triton FlashAttention for the Kernel Hub.

Load with ``kernels.get_kernel("<org>/flash-attention", version=1)``. The public API follows
flash-attn 2 (``flash_attn_func``, ``flash_attn_varlen_func``, the packed variants and
``bert_padding``) and the kernels-community ``flash_attention_forward``; all functions are
differentiable and work under torch.compile(fullgraph=True). ``ops`` is this build's torch.ops
namespace, holding the forward and backward ops.

Layers of the package:
* ``interface.py``: public functions (dense, varlen, packed); ``checks.py``: their argument checks.
* ``kvcache.py``: ``flash_attn_with_kvcache``, attention over a (paged) KV cache for inference.
* ``bert_padding.py``: ``unpad_input`` / ``pad_input`` for the varlen functions.
* ``rotary.py``: rotary embeddings (``apply_rotary_emb``, ``RotaryEmbedding``), flash-attn's
  ``flash_attn.layers.rotary``.
* ``layers.py``: stateless attention layers for ``kernels.kernelize`` (``FlashSelfAttention``,
  ``FlashCrossAttention``, ``FlashAttention``), reading their options from the module they serve.
* ``modules.py``: flash-attn's ``flash_attn.modules.mha`` modules with their constructors
  (``FlashSelfAttention``, ``FlashCrossAttention``, ``MHA``), the (batch, heads, seqlen, headdim)
  ``FlashAttention`` module, and ``InferenceParams`` for MHA's generation with a KV cache.
* ``torch_ops.py``: the torch ops (torch.library.triton_op), their autograd formula, and the
  eager path that runs the same op bodies without the dispatcher's host overhead.
* ``flash_attention_kernel/``: the Triton kernels and launchers (copied from the repository's
  top-level ``flash_attention_kernel/`` at build time).
"""

from . import bert_padding, layers, modules, rotary
from ._ops import ops
from .interface import (
    flash_attention_forward,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .kvcache import flash_attn_with_kvcache
from .modules import MHA, FlashAttention, FlashCrossAttention, FlashSelfAttention, InferenceParams
from .rotary import RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_kv_, apply_rotary_emb_qkv_

__all__ = [
    "MHA",
    "FlashAttention",
    "FlashCrossAttention",
    "FlashSelfAttention",
    "InferenceParams",
    "RotaryEmbedding",
    "apply_rotary_emb",
    "apply_rotary_emb_kv_",
    "apply_rotary_emb_qkv_",
    "bert_padding",
    "flash_attention_forward",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "layers",
    "modules",
    "ops",
    "rotary",
]
