"""Public functions: flash-attn 2's interface and the kernels-community ``flash_attention_forward``.

Each function checks its arguments (raising an exception that names the argument and what is
allowed), normalises the layout to (batch, seqlen, heads, head_dim) with views only, and calls the
``fwd`` op, whose autograd formula calls ``bwd``. Features flash-attn has but this package does not
build yet raise NotImplementedError naming the parameter, never a silently different result.
"""

import math
from typing import Optional

import torch

from .flash_attention_kernel import interpreter_active
from ._ops import ops
from . import torch_ops  # noqa: F401  (registers the ops)

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_tensor(name: str, x, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must have 4 dims {layout}, got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}; supported dtypes are float16, bfloat16 and float32")


def _check_device(q: torch.Tensor) -> None:
    if q.device.type == "cuda":
        return
    if q.device.type == "cpu":
        if interpreter_active():
            return
        raise RuntimeError(
            "q, k, v are CPU tensors, but these Triton kernels run on a CUDA GPU: move the tensors to "
            "a GPU (q.cuda()), or set TRITON_INTERPRET=1 in the environment before triton is imported "
            "to run them through Triton's CPU interpreter (slow; meant for testing)."
        )
    raise RuntimeError(f"q, k, v are on device {q.device}; supported devices are CUDA GPUs (and CPU under TRITON_INTERPRET=1)")


def _check_qkv(q, k, v, layout: str, heads_axis: int) -> None:
    """Checks q, k, v of rank 4 whose dim ``heads_axis`` holds the heads."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x, layout)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must have the same dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on the same device, got q {q.device}, k {k.device}, v {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    dim = q.shape[-1]
    if k.shape[-1] != dim:
        raise ValueError(f"q and k must have the same head dim, got {dim} and {k.shape[-1]}")
    if not 1 <= dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be between 1 and {MAX_HEAD_DIM}, got {dim}")
    heads_q, heads_kv = q.shape[heads_axis], k.shape[heads_axis]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(
            f"the number of query heads ({heads_q}) must be a multiple of the number of key/value heads ({heads_kv})"
        )
    _check_device(q)


def _softmax_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite number or None, got {softmax_scale!r}")
    return float(softmax_scale)


def _check_unbuilt_features(dropout_p, window_size, softcap, alibi_slopes) -> None:
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if dropout_p != 0.0:
        raise NotImplementedError("dropout_p > 0 is not supported yet; pass dropout_p=0.0")
    if len(tuple(window_size)) != 2 or any(not isinstance(w, int) or w < -1 for w in window_size):
        raise ValueError(f"window_size must be a pair of ints >= -1 (-1 = unbounded), got {window_size!r}")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError("window_size (sliding-window attention) is not supported yet; pass window_size=(-1, -1)")
    if not isinstance(softcap, (int, float)) or softcap < 0:
        raise ValueError(f"softcap must be a number >= 0 (0 = off), got {softcap!r}")
    if softcap != 0.0:
        raise NotImplementedError("softcap is not supported yet; pass softcap=0.0")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes is not supported yet; pass alibi_slopes=None")


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
    """flash-attn 2's ``flash_attn_func``.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim) with nheads a
    multiple of nheads_k (GQA/MQA). softmax_scale defaults to 1/sqrt(headdim). causal masks are
    aligned to the bottom-right corner when seqlen_q != seqlen_k; a query row that sees no key
    outputs 0. The backward never uses atomics, so it is deterministic whatever ``deterministic``
    says. Returns out (batch, seqlen_q, nheads, headdim), or with return_attn_probs=True
    (out, softmax_lse, None) with softmax_lse (batch, nheads, seqlen_q) fp32 (natural log; +inf for
    rows that see no key); the attention-probability tensor is not built.
    """
    _check_qkv(q, k, v, "(batch, seqlen, nheads, headdim)", heads_axis=2)
    _check_unbuilt_features(dropout_p, window_size, softcap, alibi_slopes)
    out, softmax_lse = ops.fwd(q, k, v, _softmax_scale(softmax_scale, q.shape[-1]), bool(causal))
    return (out, softmax_lse, None) if return_attn_probs else out


def flash_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
) -> torch.Tensor:
    """Attention on (batch, heads, seqlen, headdim) tensors, differentiable; returns the output in
    the same layout. Same semantics as ``flash_attn_func`` (GQA, bottom-right causal)."""
    _check_qkv(query, key, value, "(batch, nheads, seqlen, headdim)", heads_axis=1)
    scale = _softmax_scale(softmax_scale, query.shape[-1])
    out, _ = ops.fwd(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale, bool(causal))
    return out.transpose(1, 2)
