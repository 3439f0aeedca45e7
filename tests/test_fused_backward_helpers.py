"""The fused backward's two tl helper kernels (flash_attention_kernel/backward.py): the preprocess
that makes delta and, with ZERO_DQ, zeroes the fp32 dQ accumulator the fused kernel adds into, and
the conversion of that accumulator to dQ. Both hold a tile as the head dim's chunks (64 + 16 at
head dim 80, 64 + 32 at 96: configs.head_dim_chunks).

The fused route runs only on a GPU (Hopper's Gluon kernel, the Ampere class's), so the rest of the
CPU suite never launches these with ZERO_DQ; stop 75 found on an H100 that a zero tile of the first
chunk's width did not compile into the second chunk. Here, without a GPU: each compiles for sm_90
and sm_80 at every head dim a fused route takes (Triton's compiler in a subprocess, no
interpreter), and in the interpreter (or on the GPU) zeroes a poisoned accumulator, makes delta and
converts the accumulator, at a ragged number of rows.
"""

import os
import subprocess
import sys

import pytest
import torch
import triton

from conftest import PACKAGE_SOURCE
from sizes import DEVICE, ON_GPU

FUSED_HEAD_DIMS = (64, 80, 96, 128)  # (hopper_route's fused rule; the Ampere class's FUSED_BACKWARD: 64, 128)

_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, sys.argv[1])
from flash_attention_kernel import backward, configs

head_dim, arch = int(sys.argv[2]), int(sys.argv[3])
dim_a, dim_b = configs.head_dim_chunks(head_dim)
shapes = dict(HEAD_DIM=head_dim, DIM_A=dim_a, DIM_B=dim_b, BLOCK_M=64)
pointers = dict(Out="*bf16", DO="*bf16", DLse="*fp32", Delta="*fp32", DqAcc="*fp32", DQ="*bf16")
kernels = [(backward._attn_bwd_preprocess_kernel, dict(HAS_DLSE=True, IS_VARLEN=False, ZERO_DQ=True,
                                                       CuSeqlensQ=None)),
           (backward._dq_from_accumulator_kernel, dict(PRECISION="tf32"))]
for kernel, flags in kernels:
    constexprs = {name: value for name, value in {**shapes, **flags}.items() if name in kernel.arg_names}
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32") for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4))
    assert compiled.asm["cubin"], kernel.__name__
"""


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("head_dim", FUSED_HEAD_DIMS)
def test_helpers_compile(head_dim, arch):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _COMPILE, str(PACKAGE_SOURCE), str(head_dim), str(arch)],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize("head_dim", FUSED_HEAD_DIMS)
def test_helpers_zero_make_delta_and_convert(fa, head_dim):
    kernels = fa.flash_attention_kernel
    backward = kernels.backward
    dim_a, dim_b = kernels.configs.head_dim_chunks(head_dim)
    batch, seqlen, heads, block = 2, 113, 3, 64 if ON_GPU else 32
    out, dout = (torch.randn(batch, seqlen, heads, head_dim, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    dlse = torch.randn(batch, heads, seqlen, device=DEVICE)
    delta = torch.full_like(dlse, float("nan"))
    accumulator = torch.full((batch, seqlen, heads, head_dim), float("nan"), device=DEVICE)
    grid = (triton.cdiv(seqlen, block), heads, batch)
    layout = kernels.launch.SequenceLayout.of(out, out)  # (the strides as the launcher passes them)
    backward._attn_bwd_preprocess_kernel[grid](
        out, dout, dlse, delta, accumulator, None, 0, *layout.strides(out), *layout.strides(dout),
        *layout.strides(accumulator), *layout.stat_strides(dlse), seqlen, HEAD_DIM=head_dim, DIM_A=dim_a, DIM_B=dim_b,
        BLOCK_M=block, HAS_DLSE=True, IS_VARLEN=False, ZERO_DQ=True)
    assert torch.equal(accumulator, torch.zeros_like(accumulator))
    expected = (out.float() * dout.float()).sum(-1).transpose(1, 2) - dlse
    torch.testing.assert_close(delta, expected, rtol=1e-5, atol=1e-4)

    accumulator.normal_()
    dq = torch.full_like(out, float("nan"))
    backward._dq_from_accumulator_kernel[grid](
        accumulator, dq, *layout.strides(accumulator), *layout.strides(dq), seqlen, BLOCK_M=block, HEAD_DIM=head_dim,
        DIM_A=dim_a, DIM_B=dim_b, PRECISION=kernels.launch.precision_mode(torch.bfloat16, not ON_GPU))
    assert torch.equal(dq, accumulator.to(torch.bfloat16))
