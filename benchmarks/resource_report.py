"""Registers, spills and shared memory of the kernels for each GPU architecture, without a GPU.

Cross-compiles a kernel for an architecture (sm_90a by default) with Triton's own compiler (and
the ptxas in Triton's wheel), then prints the binary's registers per thread and stack frame
(local memory: spills; from cuobjdump -res-usage), its shared memory (Triton's allocation, what
its launch checks against the GPU's limit) and the count of wgmma, tcgen05 and mma.sync
instructions in the PTX. Pointer and integer arguments are marked divisible by 16, as real
launches specialise them (without that, every load compiles to scalar loads and the report says
nothing about the real kernel); sequence lengths are not specialised, as in the kernels.

With --table it checks the config tables instead: every distinct entry of every GPU class
(configs.GPU_CLASSES; or of the classes named) is compiled for each architecture of the class and
its shared memory compared with the class's limit (exit status 1 if any entry exceeds it). An
entry is compiled once, at the widest head-dim width that takes it (shared memory grows with the
width), with every option of the kernel compiled in (window masks, softcap, ALiBi, sinks,
dropout; the warp-specialised loops take what they support), as a launch on that architecture
would build it: tensor descriptors only from sm_90, warp specialisation only on sm_90
(launch.warp_specialize), 2-byte inputs as fp16 on sm_75 (bf16 needs sm_80).

Usage: python benchmarks/resource_report.py [--arch 90] [--variant causal,softcap,...] [--ptx DIR]
           fwd bf16 128 128x64x8x3 [64x64x4x2xtma ...]
       (kernel in fwd, dkdv, dq, decode; dtype in bf16, fp16, fp32; head dim; BM x BN x warps x stages,
       with "xtma" to read tiles through tensor descriptors, "xq" (fwd) to read Q per key tile
       (TileConfig.q_per_tile), "xws" (fwd, dq) for the warp-specialised
       loop, which reads through descriptors too; --arch: compute capability as one number (75, 80,
       86, 89, 90, 100, 120); --variant: the options compiled in, any of causal, window, softcap,
       alibi, sinks, dropout, tanh_approx, wide_products; --ptx: also write each kernel's PTX, without its debug
       sections and line records, to DIR, so that two trees' kernels can be compared with diff:
       identical files mean identical plain kernels)
       python benchmarks/resource_report.py --table [sm90 sm80 sm86 sm75] [--jobs 2] [--as-run]
       (--as-run: only the entries the installed Triton runs: the warp-specialised loops only under
       a Triton in launch.WARP_SPECIALIZATION_CHECKED; scripts/triton_matrix.py compiles so)
"""

import contextlib
import itertools
import multiprocessing
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch-ext" / "flash_attention"))

from flash_attention_kernel import backward, configs, decode, forward, launch, options  # noqa: E402

KERNELS = {"fwd": forward._attn_fwd_kernel, "dkdv": backward._attn_bwd_dkdv_kernel, "dq": backward._attn_bwd_dq_kernel,
           "decode": decode._decode_kernel}
INT32_POINTERS = ("CacheSeqlens", "CacheBatchIdx", "CacheLeftpad", "BlockTable")
STATS = ("Lse", "Delta", "RowScale", "DLse", "AlibiSlopes", "Sinks")
SCALAR_OPTIONS = ("window_left", "window_right", "dropout_threshold", "stride_alibi_b", "cache_seqlen", "capacity",
                  "num_splits", "cache_entries", "total_q", "total_k")  # (no divisibility hint)
FLOAT_ARGS = ("softmax_scale", "score_scale", "softcap_log2", "dropout_scale")
VARIANT_BITS = {"window": options.MASK_LEFT | options.MASK_RIGHT, "causal": options.MASK_RIGHT,
                "softcap": options.SOFTCAP, "alibi": options.ALIBI, "sinks": options.SINKS, "dropout": options.DROPOUT,
                "tanh_approx": options.TANH_APPROX, "fixed_pivot": options.FIXED_PIVOT,
                "wide_products": options.WIDE_PRODUCTS}


def _signature(kernel, dtype, constexprs):
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.startswith("CuSeqlens") or name in INT32_POINTERS:
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


def _cuobjdump():
    try:
        from triton import knobs
        return knobs.nvidia.cuobjdump.path
    except (ImportError, AttributeError):
        return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def report(kernel_name, dtype, head_dim, block_m, block_n, num_warps, num_stages, tma=False, variant=0,
           specialized=False, ptx_path=None, arch=90, q_per_tile=False):
    kernel = KERNELS[kernel_name]
    if dtype == "fp32":  # (as launch.kernel_variant sets it for fp32 inputs)
        variant |= options.FP32_EXACT
    dim_a, dim_b = configs.head_dim_chunks(head_dim)
    constexprs = dict(HEAD_DIM=head_dim, DIM_A=dim_a, DIM_B=dim_b, GROUP_SIZE=1,
                      BLOCK_M=block_m, BLOCK_N=block_n, VARIANT=variant, IS_VARLEN=False,
                      PRECISION="ieee" if dtype == "fp32" else "tf32", USE_TMA=tma or specialized,
                      WARP_SPECIALIZE=specialized, CuSeqlensQ=None, CuSeqlensK=None, BlockTable=None, PAGE_SIZE=0,
                      COMPUTE_DELTA=not specialized, HAS_DLSE=False,  # (as dense launches set them)
                      # the KV-cache kernel with every option: per-sequence lengths, leftpad, new rows
                      # rotated, split; HEAD_DIM rows of GROUP_SIZE 4 (as decode.attention_with_kvcache)
                      HEAD_DIM_PADDED=triton.next_power_of_2(head_dim), SEQLENS_PER_BATCH=True,
                      HAS_BATCH_IDX=True, HAS_LEFTPAD=True, HAS_NEW=True, ROTARY_DIM=head_dim - head_dim % 2,
                      INTERLEAVED=False, ROTATE_BY_ROW=True, SPLIT=True, Q_PER_TILE=q_per_tile)
    constexprs = {k: v for k, v in constexprs.items() if k in kernel.arg_names}
    signature = _signature(kernel, dtype, constexprs)
    divisible = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
                 if signature[name] not in ("constexpr", "fp32") and not name.startswith("seqlen")
                 and name not in SCALAR_OPTIONS}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=divisible),
                              target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = compiled.asm["ptx"]
    if ptx_path is not None:
        Path(ptx_path).write_text(_code_only(ptx))
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.cubin").write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(_cuobjdump()), "-res-usage", f"{tmp}/k.cubin"], capture_output=True, text=True,
                               check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"unexpected cuobjdump report: {usage[:500]}")
    registers, stack = map(int, found.groups())
    return dict(registers=registers, stack_bytes=stack, shared_bytes=compiled.metadata.shared,
                wgmma=ptx.count("wgmma.mma_async"), mma_sync=ptx.count("mma.sync"), tcgen05=ptx.count("tcgen05.mma"))


TABLE_KERNELS = {"fwd": "fwd", "bwd_dkdv": "dkdv", "bwd_dq": "dq"}
# every head-dim width the kernels compute (one or two power-of-two chunks), for head dims 1-256
WIDTHS = sorted({sum(configs.head_dim_chunks(head_dim)) for head_dim in range(1, 257)})
_OPTIONS = options.SOFTCAP | options.ALIBI | options.SINKS
FULL_VARIANT = options.MASK_LEFT | options.MASK_RIGHT | _OPTIONS | options.DROPOUT


@dataclass(frozen=True)
class TableEntry:
    """One compilation the table check makes: a config of ``gpu``'s table, for ``arch``."""

    gpu: str
    arch: int
    kernel: str  # fwd, dkdv, dq
    dtype: str
    head_dim: int
    config: configs.TileConfig
    specialized: bool

    @property
    def variant(self) -> int:
        tanh = options.TANH_APPROX if self.dtype != "fp32" else 0
        if self.kernel == "decode":  # (no dropout in inference)
            return FULL_VARIANT & ~options.DROPOUT | tanh
        variant = (_OPTIONS if self.specialized else FULL_VARIANT) | tanh
        if self.kernel == "fwd" and variant & options.DROPOUT:  # (as launch.kernel_variant sets it)
            variant |= options.WIDE_PRODUCTS
        return variant

    def compile(self) -> dict:
        c = self.config
        return report(self.kernel, self.dtype, self.head_dim, c.block_m, c.block_n, c.num_warps, c.num_stages,
                      c.tma and self.arch >= 90, self.variant, self.specialized, arch=self.arch,
                      q_per_tile=c.q_per_tile)

    def __str__(self) -> str:
        c = self.config
        return (f"{self.gpu} sm_{self.arch} {self.kernel} {self.dtype} d{self.head_dim} "
                f"{c.block_m}x{c.block_n}x{c.num_warps}x{c.num_stages}{'xtma' if c.tma and self.arch >= 90 else ''}"
                f"{'xws' if self.specialized else ''}{'xq' if c.q_per_tile else ''}")


def table_entries(gpu: configs.GpuClass, as_run: bool = False) -> list:
    """The distinct compilations of ``gpu``'s table: each (architecture, kernel, dtype, config,
    warp-specialised?) once, at the widest width that takes it; with the KV-cache kernel's configs
    (configs.decode_config, for blocks of 1 to 64 rows). ``as_run``: the warp-specialised entries
    only where the installed Triton runs them (launch.WARP_SPECIALIZATION_CHECKED)."""
    specializes = not as_run or triton.__version__.startswith(launch.WARP_SPECIALIZATION_CHECKED)
    widest = {}
    two_byte = "bf16" if min(gpu.capabilities) >= (8, 0) else "fp16"
    dtypes = ((two_byte, torch.float16), ("fp32", torch.float32))
    calls = itertools.product(gpu.capabilities, TABLE_KERNELS.items(), dtypes, WIDTHS, ("none", "causal", "window"),
                              (*configs.SEQLEN_BUCKETS, 1 << 20))
    for (major, minor), (kernel, short_name), (dtype, torch_dtype), width, mask, seqlen in calls:
        arch = 10 * major + minor
        found = []
        for dropout in (False, True):
            try:
                found.append((configs.tile_config(kernel, width, torch_dtype, False, mask, seqlen, dropout, gpu.name),
                              False))
            except ValueError:  # a call the class refuses (no tile fits): nothing to compile
                pass
        specialized = configs.warp_specialized_config(kernel, width, torch_dtype, False, mask, seqlen, gpu.name)
        if specialized is not None and major == 9 and specializes:
            found.append((specialized, True))
        for config, is_specialized in found:
            key = (arch, short_name, dtype, config, is_specialized)
            widest[key] = max(widest.get(key, 0), width)
    entries = [TableEntry(gpu.name, arch, kernel, dtype, width, config, specialized)
               for (arch, kernel, dtype, config, specialized), width in widest.items()]
    return entries + decode_entries(gpu, dtypes)


def decode_entries(gpu: configs.GpuClass, dtypes) -> list:
    """The KV-cache kernel's configs (configs.decode_config, a formula of the class's limit rather
    than a table): for each dtype and number of rows, the width whose config the
    formula expects to come closest to the limit, compiled for the class's first architecture
    (blocks of 16, 64 and 128 rows: decode, speculative decoding, chunked prefill)."""
    major, minor = min(gpu.capabilities)
    closest = {}
    for (dtype, torch_dtype), width, rows in itertools.product(dtypes, WIDTHS, (16, 64, 2048)):
        config = configs.decode_config(rows, width, torch_dtype, False, gpu)
        element = 4 if dtype == "fp32" else 2
        expected = ((config.block_m + 2 * config.block_n * config.num_stages) * width
                    + config.block_m * config.block_n) * element
        rows = config.block_m  # (one entry per block shape)
        if expected > closest.get((dtype, rows), (0,))[0]:
            closest[(dtype, rows)] = (expected, width, config)
    return [TableEntry(gpu.name, 10 * major + minor, "decode", dtype, width, config, False)
            for (dtype, rows), (_, width, config) in closest.items()]


def _check(entry):
    try:
        return entry, entry.compile(), None
    except Exception as error:  # reported as a failed entry
        return entry, None, f"{type(error).__name__}: {str(error)[:300]}"


def check_tables(class_names, jobs=1, as_run=False) -> bool:
    """Compile every table entry of the named classes (``as_run``: as ``table_entries``) and print
    each against its class's limit; True when every entry compiles and fits."""
    classes = [gpu for gpu in configs.GPU_CLASSES if not class_names or gpu.name in class_names]
    entries = [entry for gpu in classes for entry in table_entries(gpu, as_run)]
    limits = {gpu.name: gpu.shared_memory for gpu in classes}
    ok = True
    with multiprocessing.Pool(jobs) if jobs > 1 else contextlib.nullcontext() as pool:
        results = pool.imap(_check, entries) if pool else map(_check, entries)
        for entry, result, error in results:
            if error is not None:
                ok = False
                print(f"{entry}: failed ({error})", flush=True)
                continue
            fits = result["shared_bytes"] <= limits[entry.gpu]
            ok = ok and fits
            print(f"{entry}: shared {result['shared_bytes']} / {limits[entry.gpu]} {'ok' if fits else 'EXCEEDS'}, "
                  f"registers {result['registers']}, stack {result['stack_bytes']}", flush=True)
    return ok


def main(argv):
    if "--table" in argv:
        jobs = 1
        if "--jobs" in argv:
            at = argv.index("--jobs")
            jobs = int(argv[at + 1])
            argv = argv[:at] + argv[at + 2:]
        names = [name for name in argv if name not in ("--table", "--as-run")]
        sys.exit(0 if check_tables(names, jobs, "--as-run" in argv) else 1)
    if len(argv) < 4:
        sys.exit(__doc__)
    arch = 90
    if "--arch" in argv:
        at = argv.index("--arch")
        arch = int(argv[at + 1])
        argv = argv[:at] + argv[at + 2:]
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
                            variant, "ws" in fields[4:], ptx_path, arch, "q" in fields[4:])
        except Exception as error:
            print(f"{kernel_name} {dtype} d{head_dim} {config}: failed ({type(error).__name__}: {str(error)[:200]})")
            continue
        print(f"{kernel_name} {dtype} d{head_dim} {config}: " + ", ".join(f"{k} {v}" for k, v in result.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
