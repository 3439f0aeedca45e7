"""Host-side helpers shared by the kernel launchers."""

import math

import torch

LOG2E = math.log2(math.e)


def identity_wrap(kernel):
    """Default ``wrap_kernel``: launch the Triton kernel as it is."""
    return kernel


def is_interpreted(kernel) -> bool:
    """True when Triton runs ``kernel`` through its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels need a unit stride on the last dim; any other strides are passed through."""
    return x if x.stride(-1) == 1 else x.contiguous()


def precision_mode(dtype: torch.dtype, interpreted: bool) -> str:
    """PRECISION for ``tiles.mma`` / ``tiles.round_to``: fp32 inputs are multiplied in full fp32
    ("ieee"), never silently in TF32; bf16 under the interpreter takes its emulation."""
    if dtype == torch.float32:
        return "ieee"
    if dtype == torch.bfloat16 and interpreted:
        return "bf16_emulated"
    return "tf32"


def bhs_strides(x: torch.Tensor) -> tuple:
    """(batch, head, seq) strides of a (batch, seq, head, dim) tensor, in kernel argument order."""
    return x.stride(0), x.stride(2), x.stride(1)
