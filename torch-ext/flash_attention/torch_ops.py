"""Torch custom ops over the Triton launchers, with autograd.

``fwd`` and ``bwd`` are ``torch.library.triton_op``s: their bodies are plain PyTorch code plus Triton
launches through ``torch.library.wrap_triton``, so torch.compile traces into them (no graph break,
fake implementations derived from the body). The op namespace comes from the build-generated
``_ops`` module, which is unique per build and backend; it is never written out by hand.

Under Triton's CPU interpreter (TRITON_INTERPRET=1) ``wrap_triton`` hands kernels back unwrapped,
so a triton_op could be neither faked nor traced. There the same bodies are registered as opaque
``custom_op``s, with a fake implementation that runs the body without launching any kernel.

Layout: (batch, seqlen, heads, head_dim). Inputs are validated by the public functions in
``interface.py`` before they reach these ops.
"""

import inspect
from typing import Optional

import torch

from ._ops import add_op_namespace_prefix, ops
from .flash_attention_kernel import attention_backward, attention_forward, interpreter_active


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


def _fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool, wrap_kernel
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, softmax_lse): out like q, softmax_lse (batch, heads, seqlen_q) fp32, natural log."""
    return attention_forward(q, k, v, softmax_scale, causal, wrap_kernel=wrap_kernel)


def _bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dlse: Optional[torch.Tensor],
    softmax_scale: float,
    causal: bool,
    wrap_kernel,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv). ``dlse`` is the gradient of softmax_lse, None when it is unused."""
    return attention_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal, dlse, wrap_kernel=wrap_kernel)


_register(add_op_namespace_prefix("fwd"), _fwd)
_register(add_op_namespace_prefix("bwd"), _bwd)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal = inputs
    out, softmax_lse = output
    ctx.save_for_backward(q, k, v, out, softmax_lse)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    # Unused outputs (typically softmax_lse) then get None instead of a zero tensor to read.
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, softmax_lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = ops.bwd(dout, q, k, v, out, softmax_lse, dlse, ctx.softmax_scale, ctx.causal)
    return dq, dk, dv, None, None


torch.library.register_autograd(add_op_namespace_prefix("fwd"), _backward, setup_context=_setup_context)
