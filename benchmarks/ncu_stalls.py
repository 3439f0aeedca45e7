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


def run(args) -> None:
    """One call of the package's attention (bf16, hidden 2048) under the profiler, after a warm-up."""
    import kernels
    import torch
    fa = kernels.get_local_kernel(pathlib.Path(args.build))
    if args.fused is not None:
        os.environ["FLASH_ATTENTION_FUSED_DQ"] = args.fused
    heads = 2048 // args.head_dim
    leaves = [torch.randn(args.batch, args.seqlen, heads, args.head_dim, device="cuda", dtype=torch.bfloat16,
                          requires_grad=True) for _ in range(3)]
    out = fa.flash_attn_func(*leaves, causal=args.causal)
    dout = torch.randn_like(out)

    def call():
        if args.direction == "fwd":
            return fa.flash_attn_func(*leaves, causal=args.causal)
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
    for row in csv.reader(open(path)):
        if row and row[0] == "Kernel Name":
            name, header = row[1], None
        elif row and row[0] == "Address":
            header = {h: i for i, h in enumerate(row)}
            found[name] = (header, [])
        elif row and header is not None:
            found[name][1].append(row)
    return found


def report(args) -> None:
    for name, (header, rows) in _kernels(args.csv).items():
        if args.kernel not in name:
            continue

        def value(row, column):
            try:
                return float(row[header[column]] or 0)
            except (KeyError, ValueError):
                return 0.0
        samples = sum(value(r, "Warp Stall Sampling (All Samples)") for r in rows) or 1.0
        excessive = sum(value(r, "L1 Wavefronts Shared Excessive") for r in rows)
        shared = sum(value(r, "L1 Wavefronts Shared") for r in rows) or 1.0
        print(f"{name[:100]}: {len(rows)} instructions, {samples:.0f} samples, shared wavefronts "
              f"{shared:.3g} of which excessive {excessive:.3g} ({excessive / shared:.0%})")
        reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
        totals = defaultdict(float)
        for row in rows:
            for reason in reasons:
                totals[reason] += value(row, reason)
        print("  stalls: " + ", ".join(f"{r.removeprefix('stall_')} {v / samples:.1%}"
                                       for r, v in sorted(totals.items(), key=lambda x: -x[1]) if v))
        print("  most bank conflicts (excessive wavefronts, n-way, executions):")
        for row in sorted(rows, key=lambda r: -value(r, "L1 Wavefronts Shared Excessive"))[:args.top]:
            if value(row, "L1 Wavefronts Shared Excessive"):
                print(f"    {row[0][-6:]} {row[1].strip()[:60]:60} {value(row, 'L1 Wavefronts Shared Excessive'):.3g}"
                      f" {row[header['L1 Conflicts Shared N-Way']]}-way {value(row, 'Instructions Executed'):.3g}")
        print("  most waited at (share of samples, top two reasons):")
        for row in sorted(rows, key=lambda r: -value(r, "Warp Stall Sampling (All Samples)"))[:args.top]:
            top = sorted(((value(row, r), r.removeprefix("stall_")) for r in reasons), reverse=True)[:2]
            print(f"    {row[0][-6:]} {value(row, 'Warp Stall Sampling (All Samples)') / samples:6.2%} "
                  f"{row[1].strip()[:60]:60} " + ", ".join(f"{r} {v:.0f}" for v, r in top if v))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    call = commands.add_parser("run", help="one call between profiler start and stop (for ncu)")
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
