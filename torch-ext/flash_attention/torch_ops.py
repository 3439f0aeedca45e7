"""Torch custom ops over the Triton launchers, with autograd.

The ops (``fwd``/``bwd`` and the packed ``fwd_kvpacked``/``bwd_kvpacked``,
``fwd_qkvpacked``/``bwd_qkvpacked``) are ``torch.library.triton_op``s: their bodies are plain PyTorch code plus Triton
launches through ``torch.library.wrap_triton``, so torch.compile traces into them (no graph break,
fake implementations derived from the body). The op namespace comes from the build-generated
``_ops`` module, which is unique per build and backend; it is never written out by hand.

Under Triton's CPU interpreter (TRITON_INTERPRET=1) ``wrap_triton`` hands kernels back unwrapped,
so a triton_op could be neither faked nor traced. There the same bodies are registered as opaque
``custom_op``s, with a fake implementation that runs the body without launching any kernel.

Eager calls skip the dispatcher. Going through torch.library costs about 100 us of host time per
forward and more per backward (the custom-op autograd wrapper, redispatch, argument defaults,
triton_op's dynamo guard), more than the whole kernel at short sequences. ``attention`` therefore
runs the same op bodies directly, under a ``torch.autograd.Function`` with the op's autograd
formula, whenever nothing could need the op itself: plain tensors, no torch.compile / export /
jit tracing, no functorch transform, no torch function or dispatch mode (FakeTensorMode,
FlopCounterMode, ``with torch.device(...)``...). Otherwise it calls the registered op, which is what
those systems see and trace. Both paths launch the same kernels with the same arguments.

Layouts: dense (batch, seqlen, heads, head_dim), or varlen (total_tokens, heads, head_dim) with
cu_seqlens. Inputs are validated by the public functions in ``interface.py`` before they reach
these ops.
"""

import functools
import inspect
from typing import Optional

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from ._ops import add_op_namespace_prefix, ops
from .flash_attention_kernel import attention_backward, attention_forward, interpreter_active
from .flash_attention_kernel.launch import identity_wrap


class _SkipLaunch:
    """``wrap_kernel`` for fake implementations: ``kernel[grid](...)`` does nothing."""

    def __init__(self, kernel):
        pass

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _register(name: str, body):
    """Register ``body(*args, wrap_kernel)`` as the op ``name`` (see the module docstring)."""

    def impl(*args):
        return body(*args, wrap_kernel=torch.library.wrap_triton)

    parameters = [p for p in inspect.signature(body).parameters.values() if p.name != "wrap_kernel"]
    impl.__signature__ = inspect.signature(body).replace(parameters=parameters)
    if not interpreter_active():
        return torch.library.triton_op(name, impl, mutates_args=())
    op = torch.library.custom_op(name, impl, mutates_args=())
    op.register_fake(lambda *args: body(*args, wrap_kernel=_SkipLaunch))
    return op


# Every forward op takes (*tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
# softmax_scale, causal) and returns (out, softmax_lse); cu_seqlens None means dense (batch,
# seqlen, heads, dim) inputs, and then max_seqlen_* are unused. The packed variants take q, k, v
# as slices along dim -3 of one tensor and their backward writes the gradient of that tensor
# directly (the kernels store into its slices), instead of stacking three separate gradients.
# Every backward op takes (dout, *tensors, out, softmax_lse, dlse, <the same trailing options>)
# and returns the gradients of *tensors; dlse is the gradient of softmax_lse, None when unused.

Tensor = torch.Tensor
OptionalTensor = Optional[torch.Tensor]


def _packed_grad(packed: Tensor) -> Tensor:
    """Gradient buffer for a packed tensor: contiguous, so each slice has a unit last stride."""
    return torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)


def _fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: OptionalTensor, cu_seqlens_k: OptionalTensor,
         max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, wrap_kernel) -> tuple[Tensor, Tensor]:
    return attention_forward(q, k, v, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             wrap_kernel=wrap_kernel)


def _fwd_kvpacked(q: Tensor, kv: Tensor, cu_seqlens_q: OptionalTensor, cu_seqlens_k: OptionalTensor,
                  max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
                  wrap_kernel) -> tuple[Tensor, Tensor]:
    k, v = kv.unbind(dim=-3)
    return attention_forward(q, k, v, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             wrap_kernel=wrap_kernel)


def _fwd_qkvpacked(qkv: Tensor, cu_seqlens_q: OptionalTensor, cu_seqlens_k: OptionalTensor, max_seqlen_q: int,
                   max_seqlen_k: int, softmax_scale: float, causal: bool, wrap_kernel) -> tuple[Tensor, Tensor]:
    q, k, v = qkv.unbind(dim=-3)
    return attention_forward(q, k, v, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             wrap_kernel=wrap_kernel)


def _bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor, dlse: OptionalTensor,
         cu_seqlens_q: OptionalTensor, cu_seqlens_k: OptionalTensor, max_seqlen_q: int, max_seqlen_k: int,
         softmax_scale: float, causal: bool, wrap_kernel) -> tuple[Tensor, Tensor, Tensor]:
    return attention_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal, dlse, cu_seqlens_q,
                              cu_seqlens_k, max_seqlen_q, max_seqlen_k, wrap_kernel=wrap_kernel)


def _bwd_kvpacked(dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, softmax_lse: Tensor, dlse: OptionalTensor,
                  cu_seqlens_q: OptionalTensor, cu_seqlens_k: OptionalTensor, max_seqlen_q: int, max_seqlen_k: int,
                  softmax_scale: float, causal: bool, wrap_kernel) -> tuple[Tensor, Tensor]:
    dkv = _packed_grad(kv)
    dk, dv = dkv.unbind(dim=-3)
    dq, _, _ = attention_backward(dout, q, *kv.unbind(dim=-3), out, softmax_lse, softmax_scale, causal, dlse,
                                  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  grads=(torch.empty_like(q), dk, dv), wrap_kernel=wrap_kernel)
    return dq, dkv


def _bwd_qkvpacked(dout: Tensor, qkv: Tensor, out: Tensor, softmax_lse: Tensor, dlse: OptionalTensor,
                   cu_seqlens_q: OptionalTensor, cu_seqlens_k: OptionalTensor, max_seqlen_q: int, max_seqlen_k: int,
                   softmax_scale: float, causal: bool, wrap_kernel) -> Tensor:
    dqkv = _packed_grad(qkv)
    attention_backward(dout, *qkv.unbind(dim=-3), out, softmax_lse, softmax_scale, causal, dlse, cu_seqlens_q,
                       cu_seqlens_k, max_seqlen_q, max_seqlen_k, grads=dqkv.unbind(dim=-3), wrap_kernel=wrap_kernel)
    return dqkv


NUM_OPTIONS = 6  # cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal


def _setup_context(ctx, inputs, output):
    tensors, (cu_seqlens_q, cu_seqlens_k, *options) = inputs[:-NUM_OPTIONS], inputs[-NUM_OPTIONS:]
    ctx.save_for_backward(*tensors, *output, cu_seqlens_q, cu_seqlens_k)
    ctx.options = options
    # Unused outputs (typically softmax_lse) then get None instead of a zero tensor to read.
    ctx.set_materialize_grads(False)


def _autograd_formula(backward_op):
    """The backward of a forward op, as register_autograd and _EagerAttention take it."""

    def backward(ctx, dout, dlse):
        *tensors, out, softmax_lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        grads = backward_op(dout, *tensors, out, softmax_lse, dlse, cu_seqlens_q, cu_seqlens_k, *ctx.options)
        grads = grads if isinstance(grads, (tuple, list)) else (grads,)
        return (*grads, *([None] * NUM_OPTIONS))

    return backward


_FORWARD_TO_BACKWARD = {"fwd": "bwd", "fwd_kvpacked": "bwd_kvpacked", "fwd_qkvpacked": "bwd_qkvpacked"}
_BODIES = {"fwd": _fwd, "bwd": _bwd, "fwd_kvpacked": _fwd_kvpacked, "bwd_kvpacked": _bwd_kvpacked,
           "fwd_qkvpacked": _fwd_qkvpacked, "bwd_qkvpacked": _bwd_qkvpacked}

for _name, _body in _BODIES.items():
    _register(add_op_namespace_prefix(_name), _body)
for _forward, _backward in _FORWARD_TO_BACKWARD.items():
    torch.library.register_autograd(add_op_namespace_prefix(_forward), _autograd_formula(getattr(ops, _backward)),
                                    setup_context=_setup_context)


# The op bodies launching their kernels as they are, and the autograd formulas over them.
_DIRECT = {name: functools.partial(body, wrap_kernel=identity_wrap) for name, body in _BODIES.items()}
_DIRECT_BACKWARD = {name: _autograd_formula(_DIRECT[backward]) for name, backward in _FORWARD_TO_BACKWARD.items()}


class _EagerAttention(torch.autograd.Function):
    """Forward op ``name`` without the dispatcher, with the op's autograd formula (eager only)."""

    @staticmethod
    def forward(ctx, name, *args):
        output = _DIRECT[name](*args)
        _setup_context(ctx, args, output)
        ctx.name = name
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return None, *_DIRECT_BACKWARD[ctx.name](ctx, dout, dlse)


def _needs_dispatcher(tensors) -> bool:
    """Whether a call must go through the registered op (see the module docstring)."""
    return (
        torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or torch._C._is_torch_function_mode_enabled()
        or is_in_torch_dispatch_mode()
        or torch._C._functorch.peek_interpreter_stack() is not None
        or any(type(x) not in (torch.Tensor, torch.nn.Parameter) for x in tensors if x is not None)
    )


def attention(name: str, *args) -> tuple[Tensor, Tensor]:
    """Forward op ``name`` ("fwd", "fwd_kvpacked" or "fwd_qkvpacked") on the op's arguments,
    differentiable; eager calls skip the dispatcher (see the module docstring)."""
    tensors = args[:-NUM_OPTIONS + 2]  # the inputs and cu_seqlens_q/k
    if _needs_dispatcher(tensors):
        return getattr(ops, name)(*args)
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensors if x is not None):
        return _EagerAttention.apply(name, *args)
    return _DIRECT[name](*args)
