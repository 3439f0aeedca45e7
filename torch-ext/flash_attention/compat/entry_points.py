"""flash-attn 2.8.3's private entry points, on this package's ops.

Ring- and context-parallel engines (ring-flash-attn, yunchang, diffusers' context parallelism)
drive flash-attn's kernels through ``flash_attn.flash_attn_interface``'s private functions rather
than its autograd functions, because they run the forward once per block of keys and merge the
blocks themselves. These are those functions, with flash-attn 2.8.3's names, parameters, defaults
and results (callers read the parameter names with inspect and pass every argument by name):

* ``_flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
  window_size_right, softcap, alibi_slopes, return_softmax) -> (out, softmax_lse, S_dmask,
  rng_state)`` on dense (batch, seqlen, heads, headdim) tensors; ``_flash_attn_varlen_forward``
  on packed (total, heads, headdim) ones with cu_seqlens (and flash-attn's block_table for a
  paged k/v). softmax_lse is fp32 in natural log, (batch, heads, seqlen_q) dense and
  (heads, total_q) varlen. S_dmask is the probabilities with dropped entries negated where
  return_softmax and dropout_p > 0 (flash-attn pads its last two dims to multiples of 128; these
  are exact), else an empty tensor. rng_state is dropout's int64 (seed, offset) pair, to hand to
  the backward (uninitialised without dropout, as flash-attn's).
* ``_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
  causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
  rng_state=None) -> softmax_d`` writes the gradients into the caller's dq, dk, dv (None drops
  one; views with a unit last stride are fine) and returns flash-attn's softmax_d, rowsum(dout *
  out) times the keep probability 1 - dropout_p in fp32 (the backward's own delta, no extra pass),
  laid out as flash-attn's: dense (batch, heads, seqlen_q rounded up to 128), varlen
  (heads, total_q + 128 * batch) with sequence b's rows from cu_seqlens_q[b] + 128 b;
  ``_flash_attn_varlen_backward`` likewise. softmax_lse may also come with its last two dims
  swapped, as diffusers passes it.

The backward takes ``out`` and ``softmax_lse`` as given: where a ring passes the merged output and
logsumexp of all its key blocks, the gradients are this block's share of the whole attention's
(delta = rowsum(dout * out) over the merged out; P = exp(scores - merged lse)), which is what the
engines sum. So the entry points refuse fp32, as flash-attn does: its fp32 path derives delta from
this call's own probabilities (docs/design.md), which a merged out would contradict. Dropout
needs the forward's rng_state in the backward (the engines that do not carry it get a ValueError
instead of a different mask), and a backward given it draws nothing from PyTorch's generator.
A window or ALiBi needs each query's distance to each key, which a call on one block pair of a ring
cannot see: its queries and keys start at positions of the whole sequence that it is not told, so
flash-attn applies them in the blocks' own coordinates, silently wrong. The forward raises a
ValueError naming the option instead when a ring engine's block loop calls it
(``RING_ENGINE_MODULES``, over a process group of more than one rank); ring-flash-attn's llama3
scheme gathers all the keys up to its queries, bottom-right aligned, so distances stay right there
and it is not refused. ``deterministic`` means what it means in flash-attn: True keeps the
backward bitwise repeatable (it is everywhere but on the A100 class at head dims 64 and 128,
where False adds dQ by atomics, ``flash_attention_kernel.ampere_route``). ``zero_tensors`` (varlen) zeroes
what flash-attn's zeroes: the output rows of q past the last sequence (their lse -inf) and, in
the backward, dq, dk, dv before the kernels write the sequences' rows. ``leftpad_k`` and
``seqused_k`` are not supported (NotImplementedError). Where flash-attn differs on purpose:
``return_softmax`` without dropout returns an empty S_dmask instead of raising, and S_dmask holds
the normalised probabilities (flash-attn's own are unnormalised and padded).

``_wrapped_flash_attn_*`` are the names flash-attn 2.8 gives its torch.library custom ops; here
they are the same functions, which trace under torch.compile through this package's own ops.
"""

import sys
from typing import Optional

import torch

from ..checks import check_paged_kv, check_qkv, check_varlen, checked_attention_options
from ..flash_attention_kernel.launch import cdiv
from ..interface import DENSE, NO_LAYOUT, VARLEN
from ..torch_ops import run_attention, run_backward_into, run_op

FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)
# The modules whose block loops call the private forward on one (query block, key block) pair of a
# sequence split across ranks (module docstring): ring-flash-attn's ring, zigzag and stripe schemes
# (dense and varlen) and yunchang's copies of them
RING_ENGINE_MODULES = ("ring_flash_attn.ring_flash_attn", "ring_flash_attn.zigzag_ring_flash_attn",
                       "ring_flash_attn.stripe_flash_attn", "yunchang.ring.")
_CALLERS_LOOKED_AT = 8  # (frames up from the entry point: yunchang reaches it through its kernel wrappers)


def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash-attn 2.8.3's dense forward: (out, softmax_lse, S_dmask, rng_state), module docstring."""
    check_qkv(q, k, v, DENSE, heads_axis=2, dense=True)
    _check_dtype(q)
    return _forward(q, k, v, NO_LAYOUT, q.shape[0], dropout_p, softmax_scale, causal, window_size_left,
                    window_size_right, softcap, alibi_slopes, return_softmax)


def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    return_softmax: bool = False,
    block_table: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash-attn 2.8.3's varlen forward: (out, softmax_lse, S_dmask, rng_state), module docstring."""
    _refuse_unsupported(leftpad_k=leftpad_k, seqused_k=seqused_k)
    if block_table is not None:
        max_seqlens = check_paged_kv(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     dropout_p)
    else:
        check_qkv(q, k, v, VARLEN, heads_axis=1, dense=False)
        max_seqlens = check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
    _check_dtype(q)
    layout = (cu_seqlens_q, cu_seqlens_k, *max_seqlens, block_table)
    out, softmax_lse, s_dmask, rng_state = _forward(q, k, v, layout, cu_seqlens_q.numel() - 1, dropout_p, softmax_scale,
                                                    causal, window_size_left, window_size_right, softcap, alibi_slopes,
                                                    return_softmax)
    if zero_tensors:  # rows of q past the last sequence: out 0 and lse -inf, as flash-attn's (no host sync)
        in_sequences = torch.arange(q.shape[0], device=q.device) < cu_seqlens_q[-1]
        out = torch.where(in_sequences[:, None, None], out, 0.0)
        softmax_lse = torch.where(in_sequences[None, :], softmax_lse, float("-inf"))
    return out, softmax_lse, s_dmask, rng_state


def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """flash-attn 2.8.3's dense backward into dq, dk, dv; returns softmax_d (module docstring)."""
    check_qkv(q, k, v, DENSE, heads_axis=2, dense=True)
    _check_dtype(q)
    batch, seqlen_q, heads, _ = q.shape
    softmax_lse = _check_backward_tensors(dout, out, softmax_lse, (batch, heads, seqlen_q), q, (dq, dk, dv), (q, k, v))
    delta = _backward(dout, q, k, v, out, softmax_lse, (dq, dk, dv), NO_LAYOUT, batch, dropout_p, softmax_scale,
                      causal, window_size_left, window_size_right, softcap, alibi_slopes, rng_state, deterministic)
    softmax_d = q.new_zeros((batch, heads, cdiv(seqlen_q, 128) * 128), dtype=torch.float32)
    softmax_d[:, :, :seqlen_q] = delta
    return softmax_d


def _flash_attn_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> torch.Tensor:
    """flash-attn 2.8.3's varlen backward into dq, dk, dv; returns softmax_d (module docstring)."""
    check_qkv(q, k, v, VARLEN, heads_axis=1, dense=False)
    max_seqlens = check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
    _check_dtype(q)
    total_q, heads, _ = q.shape
    batch = cu_seqlens_q.numel() - 1
    softmax_lse = _check_backward_tensors(dout, out, softmax_lse, (heads, total_q), q, (dq, dk, dv), (q, k, v))
    if zero_tensors:  # (rows outside every sequence keep zeros; the kernels write only the sequences' rows)
        for grad in (dq, dk, dv):
            if grad is not None:
                grad.zero_()
    delta = _backward(dout, q, k, v, out, softmax_lse, (dq, dk, dv), (cu_seqlens_q, cu_seqlens_k, *max_seqlens, None),
                      batch, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                      alibi_slopes, rng_state, deterministic)
    # sequence b's rows start at cu_seqlens_q[b] + 128 b in flash-attn's softmax_d
    rows = torch.arange(total_q, device=q.device, dtype=cu_seqlens_q.dtype)
    sequence = torch.searchsorted(cu_seqlens_q, rows, right=True) - 1
    softmax_d = q.new_zeros((heads, total_q + 128 * batch), dtype=torch.float32)
    softmax_d[:, rows + 128 * sequence] = delta
    return softmax_d


_wrapped_flash_attn_forward = _flash_attn_forward
_wrapped_flash_attn_varlen_forward = _flash_attn_varlen_forward
_wrapped_flash_attn_backward = _flash_attn_backward
_wrapped_flash_attn_varlen_backward = _flash_attn_varlen_backward


def _forward(q, k, v, layout, batch, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
             alibi_slopes, return_softmax):
    if alibi_slopes is not None or window_size_left >= 0 or window_size_right >= 0:
        _refuse_positions_in_a_ring(window_size_left, window_size_right, alibi_slopes)
    options = checked_attention_options(q, batch, dropout_p, softmax_scale, causal,
                                        (window_size_left, window_size_right), _softcap(softcap), alibi_slopes, None)
    with torch.no_grad():
        out, softmax_lse = run_attention("fwd", (q, k, v), layout, options)
        if return_softmax and options.dropout_p > 0:
            s_dmask = run_op("probs", q, k, softmax_lse, *layout, *options.flatten())
        else:
            s_dmask = q.new_empty((0,))
    rng_state = options.rng_state if options.rng_state is not None else q.new_empty((2,), dtype=torch.int64)
    return out, softmax_lse, s_dmask, rng_state


def _backward(dout, q, k, v, out, softmax_lse, grads, layout, batch, dropout_p, softmax_scale, causal,
              window_size_left, window_size_right, softcap, alibi_slopes, rng_state, deterministic) -> torch.Tensor:
    """The gradients into ``grads``; returns flash-attn's softmax_d values, rowsum(dout * out)
    times the keep probability 1 - dropout_p, shaped like softmax_lse."""
    if rng_state is None and isinstance(dropout_p, (int, float)) and dropout_p > 0:  # (else the options draw one)
        raise ValueError("rng_state: a backward with dropout_p > 0 needs the rng_state its forward returned "
                         "(the 4th result of _flash_attn_forward), to regenerate the same dropout mask")
    options = checked_attention_options(q, batch, dropout_p, softmax_scale, causal,
                                        (window_size_left, window_size_right), _softcap(softcap), alibi_slopes, None,
                                        rng_state=rng_state, deterministic=deterministic)
    with torch.no_grad():
        delta = run_backward_into(grads, dout, q, k, v, out, softmax_lse, layout, options)
    return delta * (1.0 - options.dropout_p) if options.dropout_p > 0 else delta


def _refuse_positions_in_a_ring(window_size_left, window_size_right, alibi_slopes) -> None:
    """ValueError where a ring engine's block loop (``RING_ENGINE_MODULES``) called the forward
    with a window or ALiBi over more than one rank (module docstring). The ring runs over the
    ``process_group`` its function was given: that of the engine's innermost frame holding one
    (zigzag's per-block helper, the direct caller, holds none), else the default group."""
    engine_frames, frame = [], sys._getframe(2)
    for _ in range(_CALLERS_LOOKED_AT):
        if frame is None:
            break
        if frame.f_globals.get("__name__", "").startswith(RING_ENGINE_MODULES):
            engine_frames.append(frame)
        elif engine_frames:
            break
        frame = frame.f_back
    if not engine_frames or not torch.distributed.is_initialized():
        return
    group = next((f.f_locals["process_group"] for f in engine_frames if "process_group" in f.f_locals), None)
    if torch.distributed.get_world_size(group) > 1:
        option = "alibi_slopes" if alibi_slopes is not None else f"window_size ({window_size_left}, {window_size_right})"
        raise ValueError(
            f"{option}: {engine_frames[0].f_globals['__name__']} runs flash-attn's forward on one pair of sequence "
            "blocks at a time, whose queries and keys start at positions of the whole sequence that the call is not "
            "told, so a window or ALiBi would be measured from each block's own start (flash-attn gives that wrong "
            "result silently). Run the ring without it, or use ring_flash_attn's llama3_flash_attn_varlen_func, "
            "which gathers each query block's keys so that distances stay right")


def _check_dtype(q: torch.Tensor) -> None:
    if q.dtype not in FLASH_ATTN_DTYPES:
        raise TypeError(f"q, k, v must be float16 or bfloat16 in flash-attn's private entry points, got {q.dtype} "
                        f"(fp32 runs through flash_attn_func and flash_attn_varlen_func)")


def _check_backward_tensors(dout, out, softmax_lse, lse_shape, q, grads, inputs) -> torch.Tensor:
    """Checks the backward's tensors; returns softmax_lse in flash-attn's layout ``lse_shape``."""
    for name, x in (("dout", dout), ("out", out)):
        if not isinstance(x, torch.Tensor) or x.shape != q.shape or x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"{name} must be a tensor shaped and typed like q ({tuple(q.shape)}, {q.dtype}, "
                             f"{q.device}), got {_describe(x)}")
    softmax_lse = _lse_in_layout(softmax_lse, lse_shape, q)
    for name, grad, x in zip(("dq", "dk", "dv"), grads, inputs):
        if grad is None:
            continue
        if (not isinstance(grad, torch.Tensor) or grad.shape != x.shape or grad.dtype != x.dtype
                or grad.device != x.device or grad.stride(-1) != 1):
            raise ValueError(f"{name} must be None or a tensor shaped and typed like its input "
                             f"({tuple(x.shape)}, {x.dtype}, {x.device}) with a unit last stride, got {_describe(grad)}")
    return softmax_lse


def _lse_in_layout(softmax_lse, lse_shape: tuple, q) -> torch.Tensor:
    """softmax_lse as flash-attn lays it out, (batch, heads, seqlen_q) or (heads, total_q); also
    taken with its last two dims swapped, as diffusers passes it (a permuted view of the forward's
    lse, or that made contiguous), which flash-attn's kernel would misread."""
    swapped = (*lse_shape[:-2], lse_shape[-1], lse_shape[-2])
    if isinstance(softmax_lse, torch.Tensor) and softmax_lse.dtype == torch.float32 and softmax_lse.device == q.device:
        shape = tuple(softmax_lse.shape)
        # (a swapped view of flash-attn's layout is told apart by its strides where heads == seqlen
        # gives both layouts one shape)
        swapped_view = softmax_lse.stride(-2) == 1 and lse_shape[-1] > 1
        if shape == swapped and (shape != lse_shape or swapped_view):
            return softmax_lse.transpose(-1, -2)
        if shape == lse_shape:
            return softmax_lse
    raise ValueError(f"softmax_lse must be a float32 tensor of shape {lse_shape} (or {swapped}) on {q.device}, "
                     f"got {_describe(softmax_lse)}")


def _describe(x) -> str:
    if not isinstance(x, torch.Tensor):
        return type(x).__name__
    return f"{tuple(x.shape)}, {x.dtype}, {x.device}, strides {x.stride()}"


def _refuse_unsupported(**tensors) -> None:
    for name, x in tensors.items():
        if x is not None:
            raise NotImplementedError(f"{name} is not supported by this kernel's _flash_attn_varlen_forward (flash-attn "
                                      f"2.8.3's varlen forward takes it); pass None")


def _softcap(softcap) -> float:
    return 0.0 if softcap is None else softcap  # (yunchang passes None for "off")
