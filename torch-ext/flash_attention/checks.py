"""Argument checks for the public functions.

Each check raises an exception that names the argument and what is allowed. They run on host
metadata only (shapes, dtypes, devices), so they cost no device synchronisation, with one
exception: the values inside cu_seqlens (starting at 0, non-decreasing, ending at the token
count, no sequence longer than max_seqlen) can only be read with a device-to-host copy. Those are
checked only when the environment variable FLASH_ATTENTION_CHECK_INPUTS=1 is set (a debug switch,
read on every call); without it, a wrong cu_seqlens or a too small max_seqlen gives wrong results,
as in flash-attn.
"""

import math
import os

import torch

from .flash_attention_kernel import interpreter_active

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEBUG_CHECKS_ENV = "FLASH_ATTENTION_CHECK_INPUTS"


def check_tensor(name: str, x, layout: str) -> None:
    """``x`` is a float16/bfloat16/float32 tensor whose rank matches ``layout``, e.g. "(b, s, h, d)"."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    rank = layout.count(",") + 1
    if x.dim() != rank:
        raise ValueError(f"{name} must have {rank} dims {layout}, got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}; supported dtypes are float16, bfloat16 and float32")


def check_packed(name: str, packed, layout: str, count: int) -> None:
    """A packed tensor (qkv or kv) with ``count`` slices along dim -3."""
    check_tensor(name, packed, layout)
    if packed.shape[-3] != count:
        raise ValueError(f"{name} must have size {count} in dim -3 {layout}, got shape {tuple(packed.shape)}")


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


def check_qkv(q, k, v, layout: str, heads_axis: int, dense: bool) -> None:
    """q, k, v with ``layout``; ``heads_axis`` holds the heads; ``dense`` inputs share dim 0 (batch)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, layout)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must have the same dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on the same device, got q {q.device}, k {k.device}, v {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if dense and q.shape[0] != k.shape[0]:
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


def _max_seqlen(name: str, value) -> int:
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
        value = int(value)  # transformers passes a 0-d tensor on its packed-sequence path
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k) -> tuple[int, int]:
    """cu_seqlens_q/k and max_seqlen_q/k for q (total_q, ...), k (total_k, ...); returns the max_seqlens."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{name} must be one-dimensional with batch + 1 entries, got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {cu.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must both have batch + 1 entries, got {cu_seqlens_q.numel()} "
            f"and {cu_seqlens_k.numel()}"
        )
    max_seqlen_q = _max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _max_seqlen("max_seqlen_k", max_seqlen_k)
    if os.environ.get(DEBUG_CHECKS_ENV, "0") == "1":
        for name, cu, x, max_name, longest in (("cu_seqlens_q", cu_seqlens_q, q, "max_seqlen_q", max_seqlen_q),
                                               ("cu_seqlens_k", cu_seqlens_k, k, "max_seqlen_k", max_seqlen_k)):
            _check_cu_seqlens_values(name, cu.tolist(), x.shape[0], max_name, longest)
    return max_seqlen_q, max_seqlen_k


def _check_cu_seqlens_values(name, values, total, max_name, longest) -> None:
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    if values[-1] != total:
        raise ValueError(f"{name} must end at the number of tokens ({total}), got {values[-1]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    if any(length < 0 for length in lengths):
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    if lengths and max(lengths) > longest:
        raise ValueError(f"{max_name} ({longest}) is smaller than the longest sequence in {name} ({max(lengths)})")


def softmax_scale_or_default(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite number or None, got {softmax_scale!r}")
    return float(softmax_scale)


def check_unbuilt_features(dropout_p, window_size, softcap, alibi_slopes, block_table=None) -> None:
    """Parameters of flash-attn whose feature is not built yet: valid defaults pass, the rest raise."""
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
    if block_table is not None:
        raise NotImplementedError("block_table (paged KV cache) is not supported yet; pass block_table=None")
