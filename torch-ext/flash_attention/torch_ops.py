"""Torch custom ops over the Triton launchers, with autograd.

``fwd`` and ``bwd`` are ``torch.library.triton_op``s: their bodies are plain PyTorch code plus Triton
launches through ``torch.library.wrap_triton``, so torch.compile traces into them (no graph break,
fake implementations derived from the body). The op namespace comes from the build-generated
``_ops`` module, which is unique per build and backend; it is never written out by hand.

Layout: (batch, seqlen, heads, head_dim). Inputs are validated by the public functions in
``interface.py`` before they reach these ops.
"""

from typing import Optional

import torch

from ._ops import add_op_namespace_prefix, ops
from .flash_attention_kernel import attention_backward, attention_forward


@torch.library.triton_op(add_op_namespace_prefix("fwd"), mutates_args=())
def _fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, softmax_lse): out like q, softmax_lse (batch, heads, seqlen_q) fp32, natural log."""
    return attention_forward(q, k, v, softmax_scale, causal, wrap_kernel=torch.library.wrap_triton)


@torch.library.triton_op(add_op_namespace_prefix("bwd"), mutates_args=())
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv). ``dlse`` is the gradient of softmax_lse, None when it is unused."""
    return attention_backward(
        dout, q, k, v, out, softmax_lse, softmax_scale, causal, dlse, wrap_kernel=torch.library.wrap_triton
    )


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
