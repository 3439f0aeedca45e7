"""flash_attn_with_kvcache: attention over a KV cache for inference, with flash-attn 2.8's interface.

q (batch, seqlen_q, nheads, headdim) attends to the keys and values of a cache, contiguous
(batch_cache, seqlen_cache, nheads_k, headdim) or paged (num_blocks, page_size, nheads_k, headdim)
through ``block_table`` (batch, max_blocks_per_seq) int32, any page size that is a multiple of 16.
With new keys and values ``k``, ``v`` (batch, seqlen_new, nheads_k, headdim) the call first writes
them into the cache in place, at rows cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of
batch entry b's cache row (``cache_batch_idx[b]``, or b), rotating k by ``rotary_cos/sin``
(seqlen_ro, rotary_dim / 2) when given; q is then rotated too, at cache_seqlens + i with a causal
mask or a window, else at cache_seqlens (GPT-J pairing with ``rotary_interleaved``, else GPT-NeoX).
Query row i of entry b then sees keys [cache_leftpad[b], cache_seqlens[b] + seqlen_new), with
causal masks, windows and ALiBi aligned to that end (as flash_attn_func aligns them to seqlen_k).
``cache_seqlens`` (an int, or int32 (batch,)) is not updated: the caller advances it.

``num_splits``: 0 chooses how many ranges the keys are split into (flash-decoding, so that few
sequences still fill the GPU; decode.num_splits_heuristic documents the rule), 1 forces one pass,
n > 1 splits into n. Each count is bitwise repeatable. Returns out like q, and with
``return_softmax_lse`` also lse (batch, nheads, seqlen_q) fp32. Inference only: no gradients.

The values of the index tensors (cache_seqlens, cache_batch_idx, cache_leftpad, block_table) are
read on the host only under FLASH_ATTENTION_CHECK_INPUTS=1, which refuses wrong ones naming the
argument. Without it the kernel keeps wrong values inside the cache (checks.py states the rule): a
tensor cache_seqlens is clamped into [0, capacity] and new rows past the capacity are dropped,
cache_batch_idx, cache_leftpad and block_table entries are clamped into what they index.
"""

import os
from typing import Optional, Union

import torch

from .checks import (
    DEBUG_CHECKS_ENV, PAGED, check_block_table, check_qkv, check_table_entries, check_tensor, checked_attention_options,
)
from .flash_attention_kernel.decode import MAX_SPLITS
from .torch_ops import run_kvcache

CACHE = "(batch_cache, seqlen_cache, nheads_k, headdim)"
NEW = "(batch, seqlen_new, nheads_k, headdim)"


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    s_aux: Optional[torch.Tensor] = None,
):
    """See the module docstring. Returns out, or (out, softmax_lse) with return_softmax_lse."""
    tensors = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table)
    cache_seqlens, cache_seqlen = checked_kvcache(tensors, cache_seqlens, num_splits)
    options = checked_attention_options(q, q.shape[0], 0.0, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                        s_aux)
    out, softmax_lse = run_kvcache(options, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                   cache_batch_idx, cache_leftpad, block_table, cache_seqlen, bool(rotary_interleaved),
                                   num_splits)
    return (out, softmax_lse) if return_softmax_lse else out


# Signatures (what check_kvcache reads of its arguments) of calls whose checks passed -> the cache
# capacity. A decode loop repeats one signature, and checking it again would cost more host time
# than its kernels take on the GPU.
_PASSED: dict = {}
MAX_SIGNATURES = 4096


def _signature(x):
    if isinstance(x, torch.Tensor):
        return type(x), x.shape, x.stride(), x.dtype, x.device, x.requires_grad
    return type(x) if isinstance(x, int) and not isinstance(x, bool) else x


def checked_kvcache(tensors: tuple, cache_seqlens, num_splits):
    """check_kvcache, skipped for a signature that passed before (the values of an int
    cache_seqlens, which the signature leaves out, are checked on every call); returns what
    check_kvcache returns."""
    if torch.compiler.is_compiling() or os.environ.get(DEBUG_CHECKS_ENV, "0") == "1":  # (traced: no cache)
        return check_kvcache(*tensors[:7], cache_seqlens, *tensors[7:], num_splits)
    signature = (torch.is_grad_enabled(), num_splits, _signature(cache_seqlens), *map(_signature, tensors))
    capacity = _PASSED.get(signature)
    if capacity is None:
        result = check_kvcache(*tensors[:7], cache_seqlens, *tensors[7:], num_splits)
        if len(_PASSED) >= MAX_SIGNATURES:
            _PASSED.clear()
        _PASSED[signature] = _capacity(tensors[1], tensors[-1])
        return result
    if isinstance(cache_seqlens, torch.Tensor):
        return cache_seqlens, 0
    if cache_seqlens is None:
        return None, capacity
    seqlen_new = 0 if tensors[3] is None else tensors[3].shape[1]
    if not 0 <= cache_seqlens <= capacity - seqlen_new:  # check_kvcache raises, naming the values
        return check_kvcache(*tensors[:7], cache_seqlens, *tensors[7:], num_splits)
    return None, cache_seqlens


def _capacity(k_cache, block_table) -> int:
    """Keys per sequence that the cache holds."""
    return k_cache.shape[1] * block_table.shape[1] if block_table is not None else k_cache.shape[1]


def _index_tensor(name: str, x, batch: int, q: torch.Tensor) -> None:
    """An int32 (batch,) tensor on q's device."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor of shape (batch,), got {type(x).__name__}")
    if x.dtype != torch.int32 or tuple(x.shape) != (batch,):
        raise ValueError(f"{name} must be an int32 tensor of shape (batch,) = ({batch},), got dtype {x.dtype} and "
                         f"shape {tuple(x.shape)}")
    if x.device != q.device:
        raise ValueError(f"{name} must be on q's device ({q.device}), got {x.device}")


def check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                  block_table, num_splits):
    """The arguments of flash_attn_with_kvcache; returns (cache_seqlens as an int32 tensor or None,
    the int cache length used when it is None)."""
    paged = block_table is not None
    check_qkv(q, k_cache, v_cache, "(batch, seqlen_q, nheads, headdim)", heads_axis=2, dense=False,
              kv_layout=PAGED if paged else CACHE, kv_names=("k_cache", "v_cache"))
    batch = q.shape[0]
    if paged:
        page_size = check_block_table(block_table, k_cache, batch, q, "k_cache and v_cache")
        for name, x in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
            if x is not None:
                raise ValueError(f"{name} is not supported with block_table (paged KV cache), as in flash-attn: "
                                 f"list each sequence's pages in block_table instead")
        capacity = block_table.shape[1] * page_size
    else:
        if cache_batch_idx is None and k_cache.shape[0] != batch:
            raise ValueError(f"k_cache must have q's batch size ({batch}) in dim 0, or pass cache_batch_idx; got "
                             f"{k_cache.shape[0]}")
        capacity = k_cache.shape[1]
    for name, x in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if x is not None:
            _index_tensor(name, x, batch, q)

    seqlen_new = 0
    if (k is None) != (v is None):
        raise ValueError("k and v (the new keys and values) must be given together")
    if k is not None:
        check_qkv(q, k, v, "(batch, seqlen_q, nheads, headdim)", heads_axis=2, dense=True, kv_layout=NEW)
        if k.shape[2] != k_cache.shape[2]:
            raise ValueError(f"k must have k_cache's number of heads ({k_cache.shape[2]}), got shape {tuple(k.shape)}")
        seqlen_new = k.shape[1]
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is needed with k and v: the new keys are written at cache_seqlens")

    if cache_seqlens is None:
        cache_seqlen = capacity
    elif isinstance(cache_seqlens, torch.Tensor):
        _index_tensor("cache_seqlens", cache_seqlens, batch, q)
        cache_seqlen = 0
    elif isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int) or cache_seqlens < 0:
        raise ValueError(f"cache_seqlens must be a non-negative int or an int32 tensor (batch,), got {cache_seqlens!r}")
    else:
        cache_seqlen, cache_seqlens = cache_seqlens, None
    if cache_seqlens is None and cache_seqlen + seqlen_new > capacity:
        raise ValueError(f"cache_seqlens ({cache_seqlen}) + the {seqlen_new} new keys would overflow the cache, "
                         f"which holds {capacity} keys per sequence")

    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos and rotary_sin rotate the new keys and q: they need k and v")
        for name, table in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            check_tensor(name, table, "(seqlen_ro, rotary_dim / 2)")
            if table.dtype != q.dtype or table.device != q.device:
                raise TypeError(f"{name} must have q's dtype and device ({q.dtype}, {q.device}), got {table.dtype}, "
                                f"{table.device}")
        if rotary_cos.shape != rotary_sin.shape:
            raise ValueError(f"rotary_cos and rotary_sin must have the same shape, got {tuple(rotary_cos.shape)} and "
                             f"{tuple(rotary_sin.shape)}")
        if not 0 < 2 * rotary_cos.shape[1] <= q.shape[-1]:
            raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[1] = {2 * rotary_cos.shape[1]} must be between 2 "
                             f"and the head dim ({q.shape[-1]})")
        if rotary_cos.shape[0] < capacity:
            raise ValueError(f"rotary_cos and rotary_sin have {rotary_cos.shape[0]} positions; they must cover the "
                             f"cache's {capacity}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int from 0 (automatic) to {MAX_SPLITS}, got {num_splits!r}")
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k_cache, v_cache, k, v)):
        raise ValueError("flash_attn_with_kvcache serves inference and has no backward: call it under "
                         "torch.no_grad(), or pass tensors that do not require grad")
    if os.environ.get(DEBUG_CHECKS_ENV, "0") == "1":
        _check_values(k_cache, cache_seqlens, cache_seqlen, cache_batch_idx, cache_leftpad, block_table, seqlen_new,
                      capacity)
    return cache_seqlens, cache_seqlen


def _check_values(k_cache, cache_seqlens, cache_seqlen: int, cache_batch_idx, cache_leftpad, block_table,
                  seqlen_new: int, capacity: int) -> None:
    """FLASH_ATTENTION_CHECK_INPUTS=1: the index tensors' values (device-to-host copies)."""
    entries = k_cache.shape[0]
    if cache_seqlens is not None:
        lengths = [length + seqlen_new for length in cache_seqlens.tolist()]
        if lengths and (min(lengths) < seqlen_new or max(lengths) > capacity):
            raise ValueError(f"cache_seqlens ({cache_seqlens.tolist()}) must be >= 0, and with the {seqlen_new} new "
                             f"keys stay within the cache's {capacity} keys per sequence")
    else:
        lengths = [min(cache_seqlen + seqlen_new, capacity)] * (block_table.shape[0] if block_table is not None else 0)
    if cache_batch_idx is not None and any(not 0 <= row < entries for row in cache_batch_idx.tolist()):
        raise ValueError(f"cache_batch_idx lists rows outside the cache's {entries}: {cache_batch_idx.tolist()}")
    if cache_leftpad is not None:
        pads = cache_leftpad.tolist()
        ends = lengths if cache_seqlens is not None else [cache_seqlen + seqlen_new] * len(pads)
        if any(not 0 <= pad <= end for pad, end in zip(pads, ends)):
            raise ValueError(f"cache_leftpad ({pads}) must lie in [0, cache_seqlens + the new keys] ({ends})")
    if block_table is not None:
        check_table_entries(block_table, lengths, k_cache)
