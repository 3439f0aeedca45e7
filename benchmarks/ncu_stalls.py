"""Where a kernel's warps wait, from Nsight Compute's per-instruction samples (Hopper or any GPU).

Two steps. ``run`` makes one call of the package (the backward alone, or the forward) between
cudaProfilerStart and Stop after a warm-up, for ncu to profile just that call's kernels::

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --section SourceCounters -f -o /tmp/bwd \\
        python benchmarks/ncu_stalls.py run --head-dim 128 --causal --fused 1
    ncu -i /tmp/bwd.ncu-rep --page details            # per kernel: duration, pipes, stall reasons
    ncu -i /tmp/bwd.ncu-rep --page source --csv --print-source sass > /tmp/bwd.csv

``report`` then reads the source page: the kernel's samples by stall reason, the instructions with
the most shared-memory bank conflicts (``L1 Wavefronts Shared Excessive``) and the instructions
the warps wait at most::

    python benchmarks/ncu_stalls.py report /tmp/bwd.csv --kernel dkdv

``--clock-control none`` leaves the H200's clocks alone (the device notes' METHOD.md). A kernel
launched with idle warps (the Gluon kernels' 384 threads hold 9 working warps) shows them at one
NOP waiting on a barrier: a quarter of the samples, none of them lost time. Stop 63 found
the fused backward's dQ staging this way (docs/design.md#fused-dq-in-the-gluon-dkdv-kernel).
"""

import argparse
import csv
import os
import pathlib
import sys
from collections import defaultdict

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
# the source page's columns read by name besides the stall_* ones
SAMPLES, EXCESSIVE = "Warp Stall Sampling (All Samples)", "L1 Wavefronts Shared Excessive"


def run(args) -> None:
    """One call (bf16, hidden 2048) of the package's attention or an SDPA backend's under the
    profiler, after a warm-up. With EMULATE_GPU set (and ../shared/tools on PYTHONPATH) the GPU
    poses as that class, as in bench_fused_backward.py."""
    if os.environ.get("EMULATE_GPU"):
        import emulate_gpu  # noqa: F401  (before torch sees the GPU)
    import torch
    heads = 2048 // args.head_dim
    leaves = [torch.randn(args.batch, args.seqlen, heads, args.head_dim, device="cuda", dtype=torch.bfloat16,
                          requires_grad=True) for _ in range(3)]
    if args.provider == "package":
        import kernels
        fa = kernels.get_local_kernel(pathlib.Path(args.build))
        if args.fused is not None:
            os.environ["FLASH_ATTENTION_FUSED_DQ"] = args.fused
        attention = lambda: fa.flash_attn_func(*leaves, causal=args.causal)  # noqa: E731
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[args.provider]
        leaves = [x.detach().transpose(1, 2).requires_grad_() for x in leaves]  # (SDPA's batch, heads, seq, dim)

        def attention():
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=args.causal)
    out = attention()
    dout = torch.randn_like(out)

    def call():
        if args.direction == "fwd":
            return attention()
        return torch.autograd.grad(out, leaves, dout, retain_graph=True)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def _kernels(path):
    """{kernel name: (header, rows)} of an ``ncu --page source --csv`` file (one block a kernel)."""
    found, name, header = {}, None, None
    with open(path, newline="") as handle:
        for row in csv.reader(handle):
            if row and row[0] == "Kernel Name":
                name, header = row[1], None
            elif row and row[0] == "Address":
                header = {h: i for i, h in enumerate(row)}
                found[name] = (header, [])
            elif row and header is not None:
                found[name][1].append(row)
    return found


def summarise(path, kernel: str = "", top: int = 20) -> list:
    """Per kernel whose name holds ``kernel``: its samples, shared-memory wavefronts (all and
    excessive), samples by stall reason (shares, largest first), and the ``top`` instructions by
    excessive wavefronts (those with any) and by samples, as (address, SASS, value, ...) tuples."""
    summaries = []
    for name, (header, rows) in _kernels(path).items():
        if kernel not in name:
            continue

        def value(row, column):
            try:
                return float(row[header[column]] or 0)
            except (KeyError, IndexError, ValueError):
                return 0.0
        samples = sum(value(r, SAMPLES) for r in rows) or 1.0
        reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
        stalls = {r.removeprefix("stall_"): sum(value(row, r) for row in rows) / samples for r in reasons}
        conflicted = sorted((r for r in rows if value(r, EXCESSIVE)), key=lambda r: -value(r, EXCESSIVE))[:top]
        waited = sorted(rows, key=lambda r: -value(r, SAMPLES))[:top]
        summaries.append(dict(
            name=name, instructions=len(rows), samples=samples,
            shared=sum(value(r, "L1 Wavefronts Shared") for r in rows),
            excessive=sum(value(r, EXCESSIVE) for r in rows),
            stalls=dict(sorted(((k, v) for k, v in stalls.items() if v), key=lambda x: -x[1])),
            conflicts=[(r[0], r[1].strip(), value(r, EXCESSIVE), r[header["L1 Conflicts Shared N-Way"]],
                        value(r, "Instructions Executed")) for r in conflicted],
            waits=[(r[0], r[1].strip(), value(r, SAMPLES) / samples,
                    sorted(((value(r, x), x.removeprefix("stall_")) for x in reasons), reverse=True)[:2])
                   for r in waited]))
    return summaries


def report(args) -> None:
    for k in summarise(args.csv, args.kernel, args.top):
        print(f"{k['name'][:100]}: {k['instructions']} instructions, {k['samples']:.0f} samples, shared wavefronts "
              f"{k['shared']:.3g} of which excessive {k['excessive']:.3g} ({k['excessive'] / (k['shared'] or 1):.0%})")
        print("  stalls: " + ", ".join(f"{reason} {share:.1%}" for reason, share in k["stalls"].items()))
        print("  most bank conflicts (excessive wavefronts, n-way, executions):")
        for address, sass, excessive, ways, executed in k["conflicts"]:
            print(f"    {address[-6:]} {sass[:60]:60} {excessive:.3g} {ways}-way {executed:.3g}")
        print("  most waited at (share of samples, top two reasons):")
        for address, sass, share, top in k["waits"]:
            print(f"    {address[-6:]} {share:6.2%} {sass[:60]:60} " + ", ".join(f"{r} {v:.0f}" for v, r in top if v))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    call = commands.add_parser("run", help="one call between profiler start and stop (for ncu)")
    call.add_argument("--provider", choices=["package", "cudnn", "flash"], default="package",
                      help="this package (build/) or SDPA's CUDNN or FLASH backend")
    call.add_argument("--build", default=str(REPO_ROOT / "build"))
    call.add_argument("--direction", choices=["fwd", "bwd"], default="bwd")
    call.add_argument("--head-dim", type=int, default=128)
    call.add_argument("--seqlen", type=int, default=16384)
    call.add_argument("--batch", type=int, default=1)
    call.add_argument("--causal", action="store_true")
    call.add_argument("--fused", choices=["0", "1"], default=None, help="FLASH_ATTENTION_FUSED_DQ (default: the rule)")
    summary = commands.add_parser("report", help="summarise an ncu source-page CSV")
    summary.add_argument("csv")
    summary.add_argument("--kernel", default="", help="a part of the kernel's name")
    summary.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    if args.command == "run":
        run(args)
    else:
        report(args)


if __name__ == "__main__":
    sys.exit(main())
