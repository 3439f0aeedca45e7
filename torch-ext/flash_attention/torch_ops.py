"""Torch custom ops over the Triton launchers, with autograd.

The ops (``fwd``/``bwd`` and the packed ``fwd_kvpacked``/``bwd_kvpacked``,
``fwd_qkvpacked``/``bwd_qkvpacked``, and ``probs`` for return_attn_probs) are
``torch.library.triton_op``s: their bodies are plain PyTorch code plus Triton launches through
``torch.library.wrap_triton``, so torch.compile traces into them (no graph break, fake
implementations derived from the body). The op namespace comes from the build-generated
``_ops`` module, which is unique per build and backend; it is never written out by hand.

Under Triton's CPU interpreter (TRITON_INTERPRET=1) ``wrap_triton`` hands kernels back unwrapped,
so a triton_op could be neither faked nor traced. There the same bodies are registered as opaque
``custom_op``s, with a fake implementation that runs the body without launching any kernel.

Eager calls skip the dispatcher. Going through torch.library costs about 100 us of host time per
forward and more per backward (the custom-op autograd wrapper, redispatch, argument defaults,
triton_op's dynamo guard), more than the whole kernel at short sequences. ``run_attention`` (and
``run_op``, ``run_rotary``, ``run_kvcache``) therefore run the same op bodies directly, the
attention ones under a ``torch.autograd.Function`` with the op's autograd formula whose only
inputs are what can need a gradient (docs/design.md#host-cost-per-call), whenever nothing could
need the op itself: plain tensors, no torch.compile / export /
jit tracing, no functorch transform, no torch function or dispatch mode (FakeTensorMode,
FlopCounterMode, ``with torch.device(...)``...). Otherwise it calls the registered op, which is what
those systems see and trace. Both paths launch the same kernels with the same arguments.

Layouts: dense (batch, seqlen, heads, head_dim), or varlen (total_tokens, heads, head_dim) with
cu_seqlens. Inputs are validated by the public functions in ``interface.py`` before they reach
these ops.
"""

import inspect
from typing import Optional

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from ._ops import add_op_namespace_prefix, ops
from .flash_attention_kernel import (
    AttentionOptions, apply_rotary, attention_backward, attention_forward, attention_probabilities,
    attention_with_kvcache, interpreter_active,
)
from .flash_attention_kernel.launch import PLAIN_TENSORS, identity_wrap

Tensor = torch.Tensor
OptionalTensor = Optional[torch.Tensor]

# Every op takes its tensors, then the same trailing parameters: the sequence layout
# (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table; cu_seqlens None means
# dense (batch, seqlen, heads, dim) inputs, and then max_seqlen_* are unused; block_table: k and v
# are paged caches, varlen forward only), then the attention
# options as AttentionOptions flattens them (tensor options, then scalars).
#   fwd(q, k, v, ...), fwd_kvpacked(q, kv, ...), fwd_qkvpacked(qkv, ...) -> (out, softmax_lse)
#   bwd(dout, q, k, v, out, softmax_lse, dlse, ...) -> (dq, dk, dv, dsinks)
#   bwd_kvpacked(dout, q, kv, out, softmax_lse, dlse, ...) -> (dq, dkv, dsinks)
#   bwd_qkvpacked(dout, qkv, out, softmax_lse, dlse, ...) -> (dqkv, dsinks)
#   probs(q, k, softmax_lse, ...) -> S_dmask (probabilities with the dropout mask in their sign)
# dlse is the gradient of softmax_lse, None when unused; dsinks is an empty tensor without sinks.
# The packed variants take q, k, v as slices along dim -3 of one tensor and their backward writes
# the gradient of that tensor directly (the kernels store into its slices), instead of stacking
# three separate gradients.
_LAYOUT = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation)
           for name, annotation in (("cu_seqlens_q", OptionalTensor), ("cu_seqlens_k", OptionalTensor),
                                    ("max_seqlen_q", int), ("max_seqlen_k", int), ("block_table", OptionalTensor))]
TRAILING = _LAYOUT + AttentionOptions.schema()
NUM_TRAILING = len(TRAILING)


def _split(trailing):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table), AttentionOptions."""
    return tuple(trailing[:len(_LAYOUT)]), AttentionOptions.unflatten(trailing[len(_LAYOUT):])


class _SkipLaunch:
    """``wrap_kernel`` for fake implementations: ``kernel[grid](...)`` does nothing."""

    def __init__(self, kernel):
        pass

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _register(name: str, body, leading: str, returns):
    """Register ``body(*tensors, layout, options, wrap_kernel=...)`` as the op ``name`` whose
    parameters are the tensors named in ``leading`` (Optional where they end in "?") and TRAILING
    (see the module docstring), which the op splits into the sequence layout and the options."""

    def run(args, wrap_kernel):
        layout, options = _split(args[-NUM_TRAILING:])
        return body(*args[:-NUM_TRAILING], layout, options, wrap_kernel=wrap_kernel)

    def impl(*args):
        return run(args, torch.library.wrap_triton)

    parameters = [inspect.Parameter(arg.rstrip("?"), inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                    annotation=OptionalTensor if arg.endswith("?") else Tensor)
                  for arg in leading.split()]
    impl.__signature__ = inspect.Signature(parameters + TRAILING, return_annotation=returns)
    if not interpreter_active():
        return torch.library.triton_op(name, impl, mutates_args=())
    op = torch.library.custom_op(name, impl, mutates_args=())
    op.register_fake(lambda *args: run(args, _SkipLaunch))
    return op


def _packed_grad(packed: Tensor) -> Tensor:
    """Gradient buffer for a packed tensor: contiguous, so each slice has a unit last stride."""
    return torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)


def _sink_grad_or_empty(dsinks, q):
    return dsinks if dsinks is not None else q.new_empty(0)


# The op bodies: the op's tensors, then its sequence layout (cu_seqlens_q, cu_seqlens_k,
# max_seqlen_q, max_seqlen_k, block_table) and its AttentionOptions
def _fwd(q, k, v, layout, options, *, wrap_kernel):
    return attention_forward(q, k, v, options, *layout, wrap_kernel=wrap_kernel)


def _fwd_kvpacked(q, kv, layout, options, *, wrap_kernel):
    return _fwd(q, *kv.unbind(dim=-3), layout, options, wrap_kernel=wrap_kernel)


def _fwd_qkvpacked(qkv, layout, options, *, wrap_kernel):
    return _fwd(*qkv.unbind(dim=-3), layout, options, wrap_kernel=wrap_kernel)


def _bwd(dout, q, k, v, out, softmax_lse, dlse, layout, options, *, wrap_kernel, grads=None, delta_out=None):
    dq, dk, dv, dsinks = attention_backward(dout, q, k, v, out, softmax_lse, options, dlse, *layout, grads=grads,
                                            delta_out=delta_out, wrap_kernel=wrap_kernel)
    return dq, dk, dv, _sink_grad_or_empty(dsinks, q)


def _bwd_kvpacked(dout, q, kv, out, softmax_lse, dlse, layout, options, *, wrap_kernel):
    dkv = _packed_grad(kv)
    dq, _, _, dsinks = _bwd(dout, q, *kv.unbind(dim=-3), out, softmax_lse, dlse, layout, options,
                            wrap_kernel=wrap_kernel, grads=(torch.empty_like(q), *dkv.unbind(dim=-3)))
    return dq, dkv, dsinks


def _bwd_qkvpacked(dout, qkv, out, softmax_lse, dlse, layout, options, *, wrap_kernel):
    dqkv = _packed_grad(qkv)
    *_, dsinks = _bwd(dout, *qkv.unbind(dim=-3), out, softmax_lse, dlse, layout, options, wrap_kernel=wrap_kernel,
                      grads=dqkv.unbind(dim=-3))
    return dqkv, dsinks


def _probs(q, k, softmax_lse, layout, options, *, wrap_kernel):
    return attention_probabilities(q, k, softmax_lse, options, *layout, wrap_kernel=wrap_kernel)


# name -> (body, its tensor parameters, return annotation)
_OPS = {
    "fwd": (_fwd, "q k v", tuple[Tensor, Tensor]),
    "fwd_kvpacked": (_fwd_kvpacked, "q kv", tuple[Tensor, Tensor]),
    "fwd_qkvpacked": (_fwd_qkvpacked, "qkv", tuple[Tensor, Tensor]),
    "bwd": (_bwd, "dout q k v out softmax_lse dlse?", tuple[Tensor, Tensor, Tensor, Tensor]),
    "bwd_kvpacked": (_bwd_kvpacked, "dout q kv out softmax_lse dlse?", tuple[Tensor, Tensor, Tensor]),
    "bwd_qkvpacked": (_bwd_qkvpacked, "dout qkv out softmax_lse dlse?", tuple[Tensor, Tensor]),
    "probs": (_probs, "q k softmax_lse", Tensor),
}
_FORWARD_TO_BACKWARD = {"fwd": "bwd", "fwd_kvpacked": "bwd_kvpacked", "fwd_qkvpacked": "bwd_qkvpacked"}
_SAVED_AFTER_INPUTS = 2 + 2 + len(AttentionOptions.TENSORS)  # out, lse, cu_seqlens_q/k, tensor options


def _setup_context(ctx, inputs, output):
    tensors, trailing = inputs[:-NUM_TRAILING], inputs[-NUM_TRAILING:]
    (cu_seqlens_q, cu_seqlens_k, *max_seqlens, block_table), options = _split(trailing)
    ctx.paged = block_table is not None  # forward only: the backward refuses (_autograd_formula), so nothing is saved
    if not ctx.paged:
        ctx.save_for_backward(*tensors, *output, cu_seqlens_q, cu_seqlens_k, *options.tensors())
    ctx.max_seqlens = max_seqlens
    ctx.options = options.with_tensors([None] * len(AttentionOptions.TENSORS))  # (the tensors are saved above)
    # Unused outputs (typically softmax_lse) then get None instead of a zero tensor to read.
    ctx.set_materialize_grads(False)


def _refuse_paged_backward():
    raise NotImplementedError(
        "flash_attention: no backward through flash_attn_varlen_func with block_table (a paged KV cache), "
        "as in flash-attn 2.8: its forward runs on tensors that require grad, but a gradient of q, k or v "
        "through it cannot be computed; use contiguous k and v (no block_table) to train")


def _autograd_formula(backward_op):
    """The backward of a forward op, as register_autograd takes it."""

    def backward(ctx, dout, dlse):
        if ctx.paged:
            _refuse_paged_backward()
        saved = ctx.saved_tensors
        tensors, (out, softmax_lse, cu_seqlens_q, cu_seqlens_k, *option_tensors) = (
            saved[:-_SAVED_AFTER_INPUTS], saved[-_SAVED_AFTER_INPUTS:])
        options = ctx.options.with_tensors(option_tensors)
        if dout is None:
            dout = torch.zeros_like(out)
        *grads, dsinks = backward_op(dout, *tensors, out, softmax_lse, dlse, cu_seqlens_q, cu_seqlens_k,
                                     *ctx.max_seqlens, None, *options.flatten())
        option_grads = [dsinks if name == "sinks" and options.sinks is not None else None
                        for name in AttentionOptions.TENSORS]
        return (*grads, *([None] * len(_LAYOUT)), *option_grads, *([None] * len(AttentionOptions.SCALARS)))

    return backward


for _name, (_body, _leading, _returns) in _OPS.items():
    _register(add_op_namespace_prefix(_name), _body, _leading, _returns)
for _forward, _backward in _FORWARD_TO_BACKWARD.items():
    torch.library.register_autograd(add_op_namespace_prefix(_forward), _autograd_formula(getattr(ops, _backward)),
                                    setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """Forward op ``call.name`` without the dispatcher, with the op's autograd formula (eager
    only). It takes only what can need a gradient as inputs (the op's tensors, then the sinks or
    None) and carries the layout and options in ``call``: every argument of an autograd Function
    costs host time on each call."""

    @staticmethod
    def forward(ctx, call, *inputs):
        *tensors, _ = inputs
        output = _OPS[call.name][0](*tensors, call.layout, call.options, wrap_kernel=identity_wrap)
        ctx.paged = call.layout[4] is not None  # (forward only: the backward refuses, so nothing is saved)
        if not ctx.paged:
            ctx.save_for_backward(*tensors, *output)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        if ctx.paged:
            _refuse_paged_backward()
        call = ctx.call
        *tensors, out, softmax_lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        backward_body = _OPS[_FORWARD_TO_BACKWARD[call.name]][0]
        *grads, dsinks = backward_body(dout, *tensors, out, softmax_lse, dlse, call.layout, call.options,
                                       wrap_kernel=identity_wrap)
        return None, *grads, dsinks if call.options.sinks is not None else None


class _EagerCall:
    """What an eager attention call carries besides its differentiable inputs."""

    __slots__ = ("name", "layout", "options")

    def __init__(self, name: str, layout: tuple, options: AttentionOptions):
        self.name, self.layout, self.options = name, layout, options


def _needs_dispatcher(args) -> bool:
    """Whether a call on ``args`` must go through the registered op (see the module docstring):
    a tracing or transforming context, or a tensor of another type among them."""
    return (
        torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or torch._C._is_torch_function_mode_enabled()
        or is_in_torch_dispatch_mode()
        or torch._C._functorch.peek_interpreter_stack() is not None
        or any(type(x) not in PLAIN_TENSORS for x in args if isinstance(x, torch.Tensor))
    )


# Rotary embeddings (rotary.py): rotary(x, cos, sin, seqlen_offsets?, cu_seqlens?, offset,
# max_seqlen, interleaved, conjugate) returns the rotated copy of x, rotary_(...) rotates x in
# place. seqlen_offsets (batch,) or, when None, the int offset of every sequence; cu_seqlens for
# varlen x (then max_seqlen bounds its sequences). Their autograd is rotary.py's.
def _rotary_body(x: Tensor, cos: Tensor, sin: Tensor, seqlen_offsets: OptionalTensor, cu_seqlens: OptionalTensor,
                 offset: int, max_seqlen: int, interleaved: bool, conjugate: bool, *, wrap_kernel,
                 inplace: bool = False) -> Tensor:
    offsets = seqlen_offsets if seqlen_offsets is not None else offset
    return apply_rotary(x, cos, sin, offsets, cu_seqlens, max_seqlen, interleaved, inplace, conjugate,
                        wrap_kernel=wrap_kernel)


def _rotary(x: Tensor, cos: Tensor, sin: Tensor, seqlen_offsets: OptionalTensor, cu_seqlens: OptionalTensor,
            offset: int, max_seqlen: int, interleaved: bool, conjugate: bool) -> Tensor:
    return _rotary_body(x, cos, sin, seqlen_offsets, cu_seqlens, offset, max_seqlen, interleaved, conjugate,
                        wrap_kernel=torch.library.wrap_triton)


def _rotary_(x: Tensor, cos: Tensor, sin: Tensor, seqlen_offsets: OptionalTensor, cu_seqlens: OptionalTensor,
             offset: int, max_seqlen: int, interleaved: bool, conjugate: bool) -> None:
    _rotary_body(x, cos, sin, seqlen_offsets, cu_seqlens, offset, max_seqlen, interleaved, conjugate,
                 wrap_kernel=torch.library.wrap_triton, inplace=True)


if not interpreter_active():
    torch.library.triton_op(add_op_namespace_prefix("rotary"), _rotary, mutates_args=())
    torch.library.triton_op(add_op_namespace_prefix("rotary_"), _rotary_, mutates_args={"x"})
else:
    torch.library.custom_op(add_op_namespace_prefix("rotary"), _rotary, mutates_args=()).register_fake(
        lambda x, *args: torch.empty_like(x))
    torch.library.custom_op(add_op_namespace_prefix("rotary_"), _rotary_, mutates_args={"x"}).register_fake(
        lambda x, *args: None)


def run_rotary(inplace: bool, *args) -> Tensor:
    """The rotary op (``rotary_`` with ``inplace``, then returning x) on its arguments; eager
    calls skip the dispatcher, as run_op's do."""
    if _needs_dispatcher(args):
        if inplace:
            ops.rotary_(*args)
            return args[0]
        return ops.rotary(*args)
    return _rotary_body(*args, wrap_kernel=identity_wrap, inplace=inplace)


# Attention over a KV cache (kvcache.py): kvcache(q, k_cache, v_cache, k?, v?, rotary_cos?,
# rotary_sin?, cache_seqlens?, cache_batch_idx?, cache_leftpad?, block_table?, cache_seqlen,
# rotary_interleaved, num_splits, *options) -> (out, softmax_lse), writing k and v into the caches
# in place. cache_seqlen: every sequence's cached length when cache_seqlens is None. No autograd.
def _kvcache_body(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: OptionalTensor, v: OptionalTensor,
                  rotary_cos: OptionalTensor, rotary_sin: OptionalTensor, cache_seqlens: OptionalTensor,
                  cache_batch_idx: OptionalTensor, cache_leftpad: OptionalTensor, block_table: OptionalTensor,
                  cache_seqlen: int, rotary_interleaved: bool, num_splits: int, *options, wrap_kernel):
    return attention_with_kvcache(q, k_cache, v_cache, AttentionOptions.unflatten(options), k, v, rotary_cos,
                                  rotary_sin, cache_seqlens, cache_seqlen, cache_batch_idx, cache_leftpad, block_table,
                                  rotary_interleaved, num_splits, wrap_kernel=wrap_kernel)


def _kvcache(*args):
    return _kvcache_body(*args, wrap_kernel=torch.library.wrap_triton)


_KVCACHE_PARAMETERS = (
    [(name, Tensor) for name in ("q", "k_cache", "v_cache")]
    + [(name, OptionalTensor) for name in ("k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
                                           "cache_leftpad", "block_table")]
    + [("cache_seqlen", int), ("rotary_interleaved", bool), ("num_splits", int)])
_kvcache.__signature__ = inspect.Signature(
    [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation)
     for name, annotation in _KVCACHE_PARAMETERS] + AttentionOptions.schema(),
    return_annotation=tuple[Tensor, Tensor])
if not interpreter_active():
    torch.library.triton_op(add_op_namespace_prefix("kvcache"), _kvcache, mutates_args={"k_cache", "v_cache"})
else:
    torch.library.custom_op(add_op_namespace_prefix("kvcache"), _kvcache,
                            mutates_args={"k_cache", "v_cache"}).register_fake(
        lambda *args: _kvcache_body(*args, wrap_kernel=_SkipLaunch))


def run_kvcache(options: AttentionOptions, *args):
    """The kvcache op on ``args`` (its parameters before the options) with ``options``; eager calls
    skip the dispatcher, as run_op's do, and hand the options object through as it is."""
    if _needs_dispatcher(args):
        return ops.kvcache(*args, *options.flatten())
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, \
        cache_seqlen, rotary_interleaved, num_splits = args
    return attention_with_kvcache(q, k_cache, v_cache, options, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                  cache_seqlen, cache_batch_idx, cache_leftpad, block_table, rotary_interleaved,
                                  num_splits)


def run_op(name: str, *args):
    """Op ``name`` on the op's arguments (the ``probs`` op; the attention ops go through
    ``run_attention``); eager calls skip the dispatcher (see the module docstring)."""
    if _needs_dispatcher([x for x in args if isinstance(x, torch.Tensor)]):
        return getattr(ops, name)(*args)
    tensors, trailing = args[:-NUM_TRAILING], args[-NUM_TRAILING:]
    layout, options = _split(trailing)
    return _OPS[name][0](*tensors, layout, options, wrap_kernel=identity_wrap)


def run_backward_into(grads: tuple, dout, q, k, v, out, softmax_lse, layout: tuple, options: AttentionOptions):
    """The bwd op's gradients of q, k and v written into ``grads`` (dq, dk, dv: each None, to
    drop that gradient, or a tensor shaped and typed like its input with a unit last stride), for
    flash-attn's private backward (compat/entry_points.py), whose callers own the buffers; returns
    delta = rowsum(dout * out), fp32, shaped like softmax_lse. Eager calls run the op body straight
    into the buffers and take delta from the kernels; a traced call runs the op, copies its
    results, and computes delta with torch."""
    tensors = [dout, q, k, v, out, softmax_lse, *(x for x in (*layout[:2], *options.tensors(), *grads) if x is not None)]
    if _needs_dispatcher(tensors):
        results = ops.bwd(dout, q, k, v, out, softmax_lse, None, *layout, *options.flatten())
        for buffer, result in zip(grads, results):
            if buffer is not None:
                buffer.copy_(result)
        delta = torch.einsum("...hd,...hd->...h", dout.float(), out.float())  # (batch, seqlen, heads) or (total, heads)
        return delta.transpose(-1, -2)
    buffers = tuple(x if x is not None else torch.empty_like(like) for x, like in zip(grads, (q, k, v)))
    delta = torch.empty(softmax_lse.shape, dtype=torch.float32, device=q.device)
    _bwd(dout, q, k, v, out, softmax_lse, None, layout, options, wrap_kernel=identity_wrap, grads=buffers,
         delta_out=delta)
    return delta


def run_attention(name: str, inputs: tuple, layout: tuple, options: AttentionOptions):
    """Forward op ``name`` (fwd, fwd_kvpacked, fwd_qkvpacked) on its tensors ``inputs`` with the
    sequence ``layout`` (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table) and
    ``options``: (out, softmax_lse), differentiable. Eager calls skip the dispatcher (module
    docstring) and hand the options object through as it is."""
    tensors = [*inputs, *(x for x in (layout[0], layout[1], layout[4], *options.tensors()) if x is not None)]
    if _needs_dispatcher(tensors):
        return getattr(ops, name)(*inputs, *layout, *options.flatten())
    sinks = options.sinks
    if torch.is_grad_enabled() and (any(x.requires_grad for x in inputs) or (sinks is not None and sinks.requires_grad)):
        return _EagerAttention.apply(_EagerCall(name, layout, options), *inputs, sinks)
    return _OPS[name][0](*inputs, layout, options, wrap_kernel=identity_wrap)
