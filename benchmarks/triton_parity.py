"""This package's kernels under the running Triton, to compare Triton releases point by point.

Issue 42 asks every Triton from 3.7 to 3.9 to run within 3 % of 3.6 at every point of the
16k-token grid. A release other than the image's is packed by ../shared/tools/device-triton and
put first on PYTHONPATH; run this script once under it and once under the image's Triton in the
same device call (one machine: rates differ by a few percent between machines), then compare.

Each run times the launchers the Hub package calls (flash_attention_kernel.attention_forward and
attention_backward: the default route, Gluon or tl, without the autograd and op layers, so the
rows measure kernels, not host time) on 16k tokens, hidden 2048 (16 heads of 128 or 32 of 64),
(batch, seqlen, heads, head_dim), at each N of --seqlens, causal and not, forward and backward;
with --tl also the tl kernels alone (configs.set_override "tl": what odd head dims, varlen and
short calls run). Each rate is the better of two triton.testing.do_bench medians, TFLOP/s as
bench_flash_attention.py counts them (causal halves the pairs, backward 2.5x the forward). One
JSON line per point goes to --out.

--compare BASE NEW prints NEW's rate over BASE's at every point the two share, their median, the
lowest, and the points below --bar (targets.BASELINE_SHARE, 0.97: within 3 %, the bar
targets.py --baseline applies to bench_flash_attention.py's summaries). BASE and NEW may each be several runs,
comma-separated, whose median rate per point is taken: alternate the releases within a call
(3.6, 3.9, 3.6, 3.9) so that neither always runs on the warmer GPU.

Usage: python benchmarks/triton_parity.py --out run.jsonl [--dtype bf16] [--seqlens 1024 ...] [--tl]
       python benchmarks/triton_parity.py --compare base.jsonl[,base2.jsonl] new.jsonl[,new2.jsonl] [--bar 0.97]
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_flash_attention import HIDDEN, TOKENS, attention_flops  # noqa: E402
from targets import BASELINE_SHARE  # noqa: E402

SEQLENS = [1024, 2048, 4096, 16384]
POINT = ("dtype", "head_dim", "causal", "seqlen", "direction", "kernels")  # the fields naming a point
TL_PASSES = ("fwd", "bwd_dq", "bwd_dkdv")  # (configs.PASSES with a Gluon kernel the tl one replaces)


def measure(args):
    """Time every point under the running Triton; write and return the rows."""
    import torch
    import triton
    from triton.testing import do_bench

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch-ext" / "flash_attention"))
    import flash_attention_kernel as kernels
    from flash_attention_kernel import configs

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    routes = ["default", "tl"] if args.tl else ["default"]
    rows = []
    with open(args.out, "w") as out_file:
        for head_dim in args.head_dims:
            heads = HIDDEN // head_dim
            for causal in (False, True):
                for seqlen in args.seqlens:
                    batch = TOKENS // seqlen
                    torch.manual_seed(0)
                    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype)
                               for _ in range(3))
                    options = kernels.AttentionOptions(softmax_scale=head_dim ** -0.5, causal=causal)
                    out, lse = kernels.attention_forward(q, k, v, options)
                    dout = torch.randn_like(out)
                    calls = {"fwd": lambda: kernels.attention_forward(q, k, v, options),
                             "bwd": lambda: kernels.attention_backward(dout, q, k, v, out, lse, options)}
                    for route in routes:
                        if route == "tl":
                            for kernel in TL_PASSES:
                                configs.set_override(kernel, implementation="tl")
                        try:
                            for direction, call in calls.items():
                                call()
                                ms = min(do_bench(call, warmup=25, rep=100, return_mode="median") for _ in range(2))
                                row = dict(dtype=args.dtype, head_dim=head_dim, causal=causal, seqlen=seqlen,
                                           direction=direction, kernels=route, triton=triton.__version__,
                                           tflops=attention_flops(batch, heads, seqlen, head_dim, causal,
                                                                  direction) / ms * 1e-9)
                                rows.append(row)
                                out_file.write(json.dumps(row) + "\n")
                                out_file.flush()
                        finally:
                            for kernel in TL_PASSES:
                                configs.set_override(kernel, None)
    print(f"wrote {len(rows)} points to {args.out} (Triton {triton.__version__}, {torch.cuda.get_device_name()})")
    return rows


def compare(base_rows, new_rows, bar=BASELINE_SHARE):
    """(lines of the table, median ratio, lowest ratio, points below ``bar``) of NEW over BASE at
    every point both have."""
    base = {tuple(row[key] for key in POINT): row for row in base_rows}
    ratios = []
    lines = ["| dtype | head dim | causal | N | direction | kernels | base | new | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in new_rows:
        point = tuple(row[key] for key in POINT)
        if point not in base:
            continue
        ratio = row["tflops"] / base[point]["tflops"]
        ratios.append((ratio, point))
        lines.append("| " + " | ".join(map(str, point)) + f" | {base[point]['tflops']:.1f} | {row['tflops']:.1f} |"
                     f" {ratio:.3f} |")
    if not ratios:
        raise ValueError("compare: the two runs share no point")
    below = [point for ratio, point in ratios if ratio < bar]
    return lines, statistics.median(r for r, _ in ratios), min(ratios), below


def read_runs(paths: str):
    """The rows of one or more runs (comma-separated paths), each point's rate the median over
    the runs that have it."""
    rates, rows = {}, {}
    for path in paths.split(","):
        for line in open(path):
            if line.strip():
                row = json.loads(line)
                point = tuple(row[key] for key in POINT)
                rates.setdefault(point, []).append(row["tflops"])
                rows.setdefault(point, row)
    return [dict(rows[point], tflops=statistics.median(values)) for point, values in rates.items()]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="where to write this run's points (JSON lines)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=SEQLENS)
    parser.add_argument("--tl", action="store_true", help="also the tl kernels alone")
    parser.add_argument("--compare", nargs=2, metavar=("BASE", "NEW"), help="runs (comma-separated) to compare")
    parser.add_argument("--bar", type=float, default=BASELINE_SHARE,
                        help="the ratio a point must reach (targets.py's for a baseline run)")
    args = parser.parse_args(argv)
    if args.compare:
        (base_path, new_path) = args.compare
        base_rows, new_rows = read_runs(base_path), read_runs(new_path)
        lines, median, (lowest, at), below = compare(base_rows, new_rows, args.bar)
        print(f"Triton {new_rows[0]['triton']} over {base_rows[0]['triton']}, TFLOP/s")
        print("\n".join(lines))
        print(f"\nmedian {median:.3f}, lowest {lowest:.3f} at {dict(zip(POINT, at))}; "
              f"{len(below)} of {len(lines) - 2} points below {args.bar}")
        return
    if args.out is None:
        parser.error("--out is needed to measure (or --compare BASE NEW)")
    measure(args)


if __name__ == "__main__":
    main()
