"""Does torch.compile's analysis of a user Triton kernel see through a tuple argument?

Issue 40 asked for kernel entry points under ~25 parameters. Grouping arguments into Triton
tuples does it with byte-identical PTX (docs/design.md#tuple-arguments-for-the-tl-kernels-signatures),
but torch.compile drives the kernels through ``torch.library.wrap_triton``, whose functionalization
asks ``identify_accessed_tensors`` (torch/_higher_order_ops/triton_kernel_wrap.py) which tensors a
kernel writes. That analysis generates the kernel's TTIR with its own binding of the arguments;
where it fails it logs a warning and answers "every tensor is read and written", and every
compiled graph then clones each input before the kernel runs.

This script asks the analysis which tensors two copies of one kernel write (the kernel copies X
into Y), one with the two strides flat and one with them as a tuple, and prints what it found. Run it with the Triton
and torch in question (no GPU needed: the target is set to sm_90 for TTIR generation only), e.g.
``PYTHONPATH=.tritons/3.9.0 python scripts/wrap_triton_tuple_probe.py``. The answer this project
waits for is "tuple: writes ['Y']"; until then the kernels keep flat signatures.
Exit status 0 when both copies are analysed exactly, 1 when the tuple copy is not.
"""

import sys

import torch
import triton
import triton.language as tl
from torch._higher_order_ops import triton_kernel_wrap
from triton.backends.compiler import GPUTarget


@triton.jit
def copy_flat(X, Y, stride_x, stride_y, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(Y + i * stride_y, tl.load(X + i * stride_x, mask=i < n), mask=i < n)


@triton.jit
def copy_tuple(X, Y, strides, n, BLOCK: tl.constexpr):
    stride_x, stride_y = strides
    i = tl.arange(0, BLOCK)
    tl.store(Y + i * stride_y, tl.load(X + i * stride_x, mask=i < n), mask=i < n)


class _Hopper:
    """A driver stand-in that names an sm_90 target, enough for TTIR generation on any machine."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def written(kernel, strides: dict) -> list:
    """The names of the tensors ``kernel`` writes, as torch's analysis finds them
    (``identify_mutated_tensors`` up to torch 2.11, ``identify_accessed_tensors`` after)."""
    x, y = torch.randn(16), torch.empty(16)
    kwargs = dict(X=x, Y=y, n=16, BLOCK=16, **strides)
    if hasattr(triton_kernel_wrap, "identify_accessed_tensors"):
        found = triton_kernel_wrap.identify_accessed_tensors(kernel, kwargs, {})
        return sorted(dep.name for dep in found.read_writes.writes)
    return sorted(triton_kernel_wrap.identify_mutated_tensors(kernel, kwargs, {}))


def main() -> int:
    triton.runtime.driver.set_active(_Hopper())
    flat = written(copy_flat, dict(stride_x=1, stride_y=1))
    grouped = written(copy_tuple, dict(strides=(1, 1)))
    print(f"torch {torch.__version__}, Triton {triton.__version__}")
    for name, writes in (("flat", flat), ("tuple", grouped)):
        print(f"  {name:5}: writes {writes}")
    return 0 if flat == grouped == ["Y"] else 1


if __name__ == "__main__":
    sys.exit(main())
