"""Argument checks for the public functions, and the validated AttentionOptions of a call.

Each check raises an exception that names the argument and what is allowed. They run on host
metadata only (shapes, dtypes, devices), so they cost no device synchronisation: every
inconsistency visible there raises at once (a cu_seqlens of one entry beside tokens, a
block_table without columns, an index tensor of the wrong dtype, rank or device...).

The values inside the metadata tensors can only be read with a device-to-host copy, which would
stall every call. They are checked only when the environment variable
FLASH_ATTENTION_CHECK_INPUTS=1 is set (a debug switch, read on every call): cu_seqlens starting at
0, non-decreasing and ending at the token count, max_seqlen at least each length, cache_seqlens
(+ the new keys) within the cache, cache_batch_idx, cache_leftpad and block_table entries inside
what they index, rotary seqlen_offsets non-negative; each failure names the argument.

Without the switch, wrong values are contained, never an access outside a tensor: the kernels
clamp every index they read from metadata into the tensor it addresses (a few integer min/max per
program, flash_attention_kernel/tiles.py). What such a call returns is then unspecified but
bounded:

* a sequence's rows [cu_seqlens[b], cu_seqlens[b + 1]) are clamped into [0, total tokens] (end
  >= start), and rows no program covers (outside every clamped sequence, or past max_seqlen) are
  left as allocated: their output, lse and gradients hold whatever the fresh buffers held;
* cache_seqlens is clamped into [0, cache capacity] and new keys past the capacity are dropped
  (never written); cache_batch_idx, cache_leftpad and block_table entries are clamped into the
  cache (wrong rows or pages are read, not memory outside the cache); a paged sequence's key
  count is capped at max_seqlen_k;
* rotary positions outside the cos/sin tables (negative offsets included) rotate by 0.
"""

import functools
import math
import os
from dataclasses import replace
from typing import Optional

import torch

from .flash_attention_kernel import AttentionOptions, draw_rng_state, interpreter_active

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SINK_DTYPES = SUPPORTED_DTYPES
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


def _check_device(q: torch.Tensor, names: str = "q, k, v") -> None:
    if q.device.type == "cuda":
        return
    if q.device.type == "cpu":
        if interpreter_active():
            return
        raise RuntimeError(
            f"{names} are CPU tensors, but these Triton kernels run on a CUDA GPU: move the tensors to "
            "a GPU (.cuda()), or set TRITON_INTERPRET=1 in the environment before triton is imported "
            "to run them through Triton's CPU interpreter (slow; meant for testing)."
        )
    raise RuntimeError(f"{names} are on device {q.device}; supported devices are CUDA GPUs (and CPU under "
                       "TRITON_INTERPRET=1)")


def check_qkv(q, k, v, layout: str, heads_axis: int, dense: bool, kv_layout: Optional[str] = None,
              kv_names: tuple[str, str] = ("k", "v")) -> None:
    """q, k, v with ``layout``; ``heads_axis`` holds the heads; ``dense`` inputs share dim 0 (batch).
    ``kv_layout``: k and v's own layout where it differs from q's (a cache), heads on dim -2;
    ``kv_names``: what the caller calls k and v (error messages name them)."""
    k_name, v_name = kv_names
    for name, x, x_layout in (("q", q, layout), (k_name, k, kv_layout or layout), (v_name, v, kv_layout or layout)):
        check_tensor(name, x, x_layout)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, {k_name}, {v_name} must have the same dtype, got q {q.dtype}, {k_name} {k.dtype}, "
                        f"{v_name} {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, {k_name}, {v_name} must be on the same device, got q {q.device}, {k_name} {k.device}, "
                         f"{v_name} {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"{k_name} and {v_name} must have the same shape, got {k_name} {tuple(k.shape)} and "
                         f"{v_name} {tuple(v.shape)}")
    if dense and q.shape[0] != k.shape[0]:
        raise ValueError(f"q and {k_name} must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    dim = q.shape[-1]
    if k.shape[-1] != dim:
        raise ValueError(f"q and {k_name} must have the same head dim, got {dim} and {k.shape[-1]}")
    if not 1 <= dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be between 1 and {MAX_HEAD_DIM}, got {dim}")
    heads_q, heads_kv = q.shape[heads_axis], k.shape[-2 if kv_layout else heads_axis]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(
            f"the number of query heads ({heads_q}) must be a multiple of the number of key/value heads ({heads_kv})"
        )
    _check_device(q, f"q, {k_name}, {v_name}")


def _max_seqlen(name: str, value) -> int:
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
        value = int(value)  # transformers passes a 0-d tensor on its packed-sequence path
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def _check_cu_seqlens(name: str, cu, x_name: str, x: torch.Tensor, tokens: Optional[int]) -> None:
    """An int32 (batch + 1,) tensor of sequence starts on the device of ``x``, with at least one
    sequence where ``x_name`` holds ``tokens`` > 0 tokens (None: tokens not counted in rows)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be one-dimensional with batch + 1 entries, got shape {tuple(cu.shape)}")
    if cu.device != x.device:
        raise ValueError(f"{name} must be on the same device as {x_name} ({x.device}), got {cu.device}")
    if cu.numel() == 1 and tokens:
        raise ValueError(f"{name} has a single entry (a batch of 0 sequences), but {x_name} has {tokens} tokens: it "
                         f"must have batch + 1 entries, from 0 to the token count")


def check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k, paged: bool = False) -> tuple[int, int]:
    """cu_seqlens_q/k and max_seqlen_q/k for q (total_q, ...), k (total_k, ...), or a paged k
    (whose cu_seqlens_k gives key counts, not rows of k); returns the max_seqlens."""
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, "q", q, q.shape[0])
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, "k", q, None if paged else k.shape[0])
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must both have batch + 1 entries, got {cu_seqlens_q.numel()} "
            f"and {cu_seqlens_k.numel()}"
        )
    max_seqlen_q = _max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _max_seqlen("max_seqlen_k", max_seqlen_k)
    if os.environ.get(DEBUG_CHECKS_ENV, "0") == "1":
        for name, cu, total, max_name, longest in (
                ("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q),
                ("cu_seqlens_k", cu_seqlens_k, None if paged else k.shape[0], "max_seqlen_k", max_seqlen_k)):
            _check_cu_seqlens_values(name, cu.tolist(), total, max_name, longest)
    return max_seqlen_q, max_seqlen_k


def _check_cu_seqlens_values(name, values, total, max_name, longest) -> None:
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    if total is not None and values[-1] != total:
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


def _number(name: str, value, allowed: str, valid) -> float:
    # (finite as a comparison, not math.isfinite: torch.compile(dynamic=True) passes a SymFloat,
    # which it can compare, guarding on the result, but not hand to math)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) < math.inf or not valid(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return float(value)


def _window(window_size) -> tuple[int, int]:
    """flash-attn's window_size: a tuple or list of two ints, or a 2-element integer tensor (its
    tests pass torch.randint(0, seqlen, (2,)); reading it costs a device-to-host copy)."""
    allowed = "a tuple or list of two ints >= -1 (-1 = unbounded) or a 2-element integer tensor"
    if isinstance(window_size, torch.Tensor):
        if window_size.shape != (2,) or window_size.is_floating_point() or window_size.is_complex():
            raise ValueError(f"window_size must be {allowed}, got a tensor of shape {tuple(window_size.shape)} "
                             f"and dtype {window_size.dtype}")
        window_size = window_size.tolist()
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, int) or w < -1 for w in window_size)):
        raise ValueError(f"window_size must be {allowed}, got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _per_head_tensor(name: str, x, q: torch.Tensor, shapes: dict, dtypes, dtype_text: str) -> torch.Tensor:
    """A tensor option of one of ``shapes`` (text -> shape) and one of ``dtypes`` on q's device."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {dtype_text}, got {x.dtype}")
    if tuple(x.shape) not in shapes.values():
        raise ValueError(f"{name} must have shape {' or '.join(shapes)}, got {tuple(x.shape)}")
    if x.device != q.device:
        raise ValueError(f"{name} must be on the same device as q ({q.device}), got {x.device}")
    return x.contiguous()


def checked_attention_options(q: torch.Tensor, batch: int, dropout_p, softmax_scale, causal, window_size, softcap,
                              alibi_slopes, s_aux, rng_state: Optional[torch.Tensor] = None,
                              deterministic=False) -> AttentionOptions:
    """The validated options of a call on ``q`` (heads on dim -2) with ``batch`` sequences, with
    dropout's RNG state drawn from PyTorch's generator when dropout_p > 0, unless ``rng_state``
    (int64 (2,), a forward's: a backward regenerating its mask) is given."""
    heads, head_dim = q.shape[-2:]
    if isinstance(window_size, (list, torch.Tensor)):  # (a tensor would be cached by its id)
        window_size = _window(window_size)
    try:
        if torch.compiler.is_compiling():  # (dynamo traces the function, not its cache)
            raise TypeError
        options = scalar_options(head_dim, dropout_p, softmax_scale, causal, window_size, softcap, deterministic)
    except TypeError:  # an unhashable argument: the checks' own error
        options = scalar_options.__wrapped__(head_dim, dropout_p, softmax_scale, causal, window_size, softcap,
                                             deterministic)
    if alibi_slopes is None and s_aux is None and options.dropout_p == 0:
        return options
    if alibi_slopes is not None:
        alibi_slopes = _per_head_tensor("alibi_slopes", alibi_slopes, q,
                                        {f"(nheads,) = ({heads},)": (heads,),
                                         f"(batch, nheads) = ({batch}, {heads})": (batch, heads)},
                                        (torch.float32,), "torch.float32")
    if s_aux is not None:
        s_aux = _per_head_tensor("s_aux", s_aux, q, {f"(nheads,) = ({heads},)": (heads,)}, SINK_DTYPES,
                                 "float16, bfloat16 or float32")
    if options.dropout_p == 0:
        rng_state = None
    elif rng_state is None:
        rng_state = draw_rng_state(q.device)
    else:
        rng_state = _per_head_tensor("rng_state", rng_state, q, {"(2,)": (2,)}, (torch.int64,), "torch.int64")
    return replace(options, alibi_slopes=alibi_slopes, sinks=s_aux, rng_state=rng_state)


@functools.lru_cache(maxsize=256, typed=True)
def scalar_options(head_dim: int, dropout_p, softmax_scale, causal, window_size, softcap,
                   deterministic=False) -> AttentionOptions:
    """The validated scalar options, as one AttentionOptions without tensors. Cached: a model calls
    with the same few sets of options again and again, and a call's host time counts in decoding
    (a cached object also keeps the values it derives, options.AttentionOptions.variant...)."""
    dropout_p = _number("dropout_p", dropout_p, "a number in [0, 1)", lambda p: 0.0 <= p < 1.0)
    window_left, window_right = _window(window_size)
    softcap = _number("softcap", softcap, "a number >= 0 (0 = off)", lambda c: c >= 0)
    return AttentionOptions(
        softmax_scale=softmax_scale_or_default(softmax_scale, head_dim), causal=bool(causal),
        window_left=window_left, window_right=window_right, softcap=softcap, dropout_p=dropout_p,
        deterministic=bool(deterministic),
    )


PAGED = "(num_blocks, page_size, nheads_k, headdim)"


def check_paged_kv(q, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p) -> tuple[int, int]:
    """A varlen call whose k and v are paged caches listed by block_table (batch, max_blocks):
    the caches against q, the table against the caches and the batch, and what paging leaves out
    (dropout; gradients are refused at backward time, torch_ops.py); returns the max_seqlens. The
    table's entries are read (a device-to-host copy) only with FLASH_ATTENTION_CHECK_INPUTS=1; the
    kernel clamps them into the cache."""
    check_qkv(q, k_cache, v_cache, "(total_tokens, nheads, headdim)", heads_axis=1, dense=False, kv_layout=PAGED)
    max_seqlen_q, max_seqlen_k = check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k_cache,
                                              paged=True)
    page_size = check_block_table(block_table, k_cache, cu_seqlens_q.numel() - 1, q, "k and v")
    if max_seqlen_k > block_table.shape[1] * page_size:
        raise ValueError(f"max_seqlen_k ({max_seqlen_k}) is longer than block_table's {block_table.shape[1]} pages of "
                         f"{page_size} keys hold")
    if dropout_p != 0:
        raise ValueError("block_table (a paged KV cache) serves inference: dropout_p must be 0")
    if os.environ.get(DEBUG_CHECKS_ENV, "0") == "1":
        check_table_entries(block_table, (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist(), k_cache)
    return max_seqlen_q, max_seqlen_k


def check_block_table(block_table, k_cache, batch: int, q, cache_names: str) -> int:
    """Paged caches ``k_cache``-like (num_blocks, page_size, ...) listed by ``block_table``: a page
    size that is a positive multiple of 16, an int32 table (batch, max_num_blocks_per_seq) with a
    contiguous last dim on q's device; returns the page size."""
    num_blocks, page_size = k_cache.shape[:2]
    if page_size == 0 or page_size % 16 != 0 or num_blocks == 0:
        raise ValueError(f"{cache_names} must be paged caches {PAGED} with a page size that is a positive multiple of "
                         f"16, got shape {tuple(k_cache.shape)}")
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError("block_table must be an int32 tensor of shape (batch, max_num_blocks_per_seq)")
    if block_table.device != q.device:
        raise ValueError(f"block_table must be on q's device ({q.device}), got {block_table.device}")
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table must have one row per sequence ({batch}), got shape {tuple(block_table.shape)}")
    if block_table.shape[1] == 0:
        raise ValueError(f"block_table must have at least one column (page) per sequence, got shape "
                         f"{tuple(block_table.shape)}")
    if block_table.stride(-1) != 1:
        raise ValueError("block_table must have a contiguous last dim")
    return page_size


def check_table_entries(block_table, lengths, k_cache) -> None:
    """FLASH_ATTENTION_CHECK_INPUTS=1: the pages each sequence of ``lengths`` keys uses lie in the
    cache (a device-to-host copy; without it the kernels clamp entries into the cache)."""
    num_blocks, page_size = k_cache.shape[:2]
    for b, (row, length) in enumerate(zip(block_table.tolist(), lengths)):
        used = row[:-(-length // page_size)]
        if any(not 0 <= page < num_blocks for page in used):
            raise ValueError(f"block_table row {b} lists pages outside the cache's {num_blocks}: {used}")


def check_rotary(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, inplace: bool):
    """The arguments of apply_rotary_emb; returns seqlen_offsets (an int, or an integer tensor (batch,)) and max_seqlen (an int; unused when
    dense)."""
    varlen = cu_seqlens is not None
    check_tensor("x", x, "(total_seqlen, nheads, headdim)" if varlen else "(batch, seqlen, nheads, headdim)")
    for name, table in (("cos", cos), ("sin", sin)):
        if not isinstance(table, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(table).__name__}")
        if table.dim() != 2:
            raise ValueError(f"{name} must have 2 dims (seqlen_rotary, rotary_dim / 2), got shape {tuple(table.shape)}")
        if table.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype ({x.dtype}), got {table.dtype}")
        if table.device != x.device:
            raise ValueError(f"{name} must be on x's device ({x.device}), got {table.device}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    rotary_dim, head_dim = 2 * cos.shape[1], x.shape[-1]
    if not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim = 2 * cos.shape[1] = {rotary_dim} must be between 2 and the head dim ({head_dim})")
    if inplace and x.stride(-1) != 1:
        raise ValueError("x must have a contiguous last dim (stride 1) to be rotated in place")
    if varlen:
        _check_cu_seqlens("cu_seqlens", cu_seqlens, "x", x, x.shape[0])
        if max_seqlen is None:
            raise ValueError("max_seqlen is required with cu_seqlens")
        seqlen, batch = _max_seqlen("max_seqlen", max_seqlen), cu_seqlens.numel() - 1
        if os.environ.get(DEBUG_CHECKS_ENV, "0") == "1":
            _check_cu_seqlens_values("cu_seqlens", cu_seqlens.tolist(), x.shape[0], "max_seqlen", seqlen)
    else:
        seqlen, batch = x.shape[1], x.shape[0]
    seqlen_ro = cos.shape[0]
    if isinstance(seqlen_offsets, torch.Tensor):
        if seqlen_offsets.dtype not in (torch.int32, torch.int64) or tuple(seqlen_offsets.shape) != (batch,):
            raise ValueError(f"seqlen_offsets must be an int or an int32/int64 tensor of shape (batch,) = ({batch},), "
                             f"got dtype {seqlen_offsets.dtype} and shape {tuple(seqlen_offsets.shape)}")
        if seqlen_offsets.device != x.device:
            raise ValueError(f"seqlen_offsets must be on x's device ({x.device}), got {seqlen_offsets.device}")
        if os.environ.get(DEBUG_CHECKS_ENV, "0") == "1" and batch and seqlen_offsets.min().item() < 0:
            raise ValueError(f"seqlen_offsets must be non-negative, got {seqlen_offsets.tolist()}")
        if seqlen > seqlen_ro:
            raise ValueError(f"cos/sin have {seqlen_ro} positions, fewer than the sequence length {seqlen}")
    else:
        if isinstance(seqlen_offsets, bool) or not isinstance(seqlen_offsets, int) or seqlen_offsets < 0:
            raise ValueError(f"seqlen_offsets must be a non-negative int or an integer tensor (batch,), got "
                             f"{seqlen_offsets!r}")
        if seqlen + seqlen_offsets > seqlen_ro:
            raise ValueError(f"cos/sin have {seqlen_ro} positions; sequences of {seqlen} rows from offset "
                             f"{seqlen_offsets} need {seqlen + seqlen_offsets}")
    _check_device(x, "x, cos, sin")
    return seqlen_offsets, seqlen if varlen else 0
