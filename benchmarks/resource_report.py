"""Registers, spills and shared memory of the kernels for Hopper, without a GPU.

Cross-compiles a kernel for sm_90a with Triton's own compiler and assembles it with the ptxas
that ships in Triton's wheel, then prints what ``ptxas -v`` reports plus the count of wgmma and
mma.sync instructions in the PTX. Pointer and integer arguments are marked divisible by 16, as
real launches specialise them (without that, every load compiles to scalar loads and the report
says nothing about the real kernel); sequence lengths are not specialised, as in the kernels.

Usage: python benchmarks/resource_report.py [--variant causal,softcap,...] [--ptx DIR]
           fwd bf16 128 128x64x8x3 [64x64x4x2xtma ...]
       (kernel in fwd, dkdv, dq; dtype in bf16, fp16, fp32; head dim; BM x BN x warps x stages,
       with "xtma" to read tiles through tensor descriptors, "xws" (fwd, dq) for the warp-specialised
       loop, which reads through descriptors too; --variant: the options compiled in, any of
       causal, window, softcap, alibi, sinks, dropout, tanh_approx; --ptx: also write each kernel's PTX,
       without its debug sections and line records, to DIR, so that two trees' kernels can be
       compared with diff: identical files mean identical plain kernels)
"""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_attention_kernel import backward, configs, forward, options  # noqa: E402

KERNELS = {"fwd": forward._attn_fwd_kernel, "dkdv": backward._attn_bwd_dkdv_kernel, "dq": backward._attn_bwd_dq_kernel}
STATS = ("Lse", "Delta", "DLse", "AlibiSlopes", "Sinks")
SCALAR_OPTIONS = ("window_left", "window_right", "dropout_threshold", "stride_alibi_b")  # (no divisibility hint)
FLOAT_ARGS = ("softmax_scale", "score_scale", "softcap_log2", "dropout_scale")
VARIANT_BITS = {"window": options.MASK_LEFT | options.MASK_RIGHT, "causal": options.MASK_RIGHT,
                "softcap": options.SOFTCAP, "alibi": options.ALIBI, "sinks": options.SINKS, "dropout": options.DROPOUT,
                "tanh_approx": options.TANH_APPROX}


def _signature(kernel, dtype, constexprs):
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.startswith("CuSeqlens"):
            signature[name] = "*i32"
        elif name == "RngState":
            signature[name] = "*i64"
        elif name[0].isupper():
            signature[name] = "*fp32" if name in STATS else f"*{dtype}"
        elif name in FLOAT_ARGS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    return signature


def _code_only(ptx):
    """PTX without debug sections, line records, comments and the debug scopes' $L__tmp labels (all
    of which move with source lines and inlined calls)."""
    code = ptx.split(".section\t.debug")[0].split(".section .debug")[0]
    return "\n".join(line for line in code.splitlines()
                     if not line.strip().startswith((".loc", ".file", "//"))
                     and not re.fullmatch(r"\$L__tmp\d+:", line.strip()))


def report(kernel_name, dtype, head_dim, block_m, block_n, num_warps, num_stages, tma=False, variant=0,
           specialized=False, ptx_path=None):
    kernel = KERNELS[kernel_name]
    dim_a, dim_b = configs.head_dim_chunks(head_dim)
    constexprs = dict(HEAD_DIM=head_dim, DIM_A=dim_a, DIM_B=dim_b, GROUP_SIZE=1,
                      BLOCK_M=block_m, BLOCK_N=block_n, VARIANT=variant, IS_VARLEN=False,
                      PRECISION="ieee" if dtype == "fp32" else "tf32", USE_TMA=tma or specialized,
                      WARP_SPECIALIZE=specialized, CuSeqlensQ=None, CuSeqlensK=None,
                      COMPUTE_DELTA=not specialized, HAS_DLSE=False)  # (as dense launches set them)
    constexprs = {k: v for k, v in constexprs.items() if k in kernel.arg_names}
    signature = _signature(kernel, dtype, constexprs)
    divisible = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
                 if signature[name] not in ("constexpr", "fp32") and not name.startswith("seqlen")
                 and name not in SCALAR_OPTIONS}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=divisible),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = compiled.asm["ptx"]
    if ptx_path is not None:
        Path(ptx_path).write_text(_code_only(ptx))
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(ptx)
        log = subprocess.run([str(ptxas), "--gpu-name", "sm_90a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                             capture_output=True, text=True, check=True).stderr
    registers, spills = (re.search(pattern, log) for pattern in (r"Used (\d+) registers", r"(\d+) bytes spill stores"))
    if registers is None or spills is None:
        raise RuntimeError(f"unexpected ptxas report: {log[:500]}")
    registers, spills = int(registers.group(1)), int(spills.group(1))
    return dict(registers=registers, spill_bytes=spills, shared_bytes=compiled.metadata.shared,
                wgmma=ptx.count("wgmma.mma_async"), mma_sync=ptx.count("mma.sync"))


def main(argv):
    if len(argv) < 4:
        sys.exit(__doc__)
    variant = 0
    if "--variant" in argv:
        at = argv.index("--variant")
        for name in argv[at + 1].split(","):
            variant |= VARIANT_BITS[name]
        argv = argv[:at] + argv[at + 2:]
    ptx_dir = None
    if "--ptx" in argv:
        at = argv.index("--ptx")
        ptx_dir = Path(argv[at + 1])
        ptx_dir.mkdir(parents=True, exist_ok=True)
        argv = argv[:at] + argv[at + 2:]
    kernel_name, dtype, head_dim = argv[0], argv[1], int(argv[2])
    for config in argv[3:]:
        fields = config.split("x")
        block_m, block_n, num_warps, num_stages = map(int, fields[:4])
        try:
            ptx_path = ptx_dir / f"{kernel_name}-{dtype}-d{head_dim}-v{variant}-{config}.ptx" if ptx_dir else None
            result = report(kernel_name, dtype, head_dim, block_m, block_n, num_warps, num_stages, "tma" in fields[4:],
                            variant, "ws" in fields[4:], ptx_path)
        except Exception as error:
            print(f"{kernel_name} {dtype} d{head_dim} {config}: failed ({type(error).__name__}: {str(error)[:200]})")
            continue
        print(f"{kernel_name} {dtype} d{head_dim} {config}: " + ", ".join(f"{k} {v}" for k, v in result.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
