"""Two builds of this kernel, interleaved in one process: the A/B of a kernel change (or of "this
change costs nothing when its option is off").

Loads ``build`` (this tree, after scripts/build_variants.py) and ``OTHER`` (another checkout's
build folder, e.g. of the last landed commit: ``git worktree add /tmp/base <rev>`` then
``python /tmp/base/scripts/build_variants.py --out ...``) through kernels.get_local_kernel, and
times flash_attn_func forward and backward (bf16, 16k tokens, hidden 2048, (B, N, H, d) layout):
by default at head dims 64/128, N 1k/4k/16k, causal and not; ``--points`` picks others. Each point
runs ``--rounds`` interleaved rounds, alternately in one order and the other (medians of
triton.testing.do_bench medians; in one round the build timed first ran up to 7 % faster than
the same build timed second, H200); ``--cudnn`` adds SDPA's cuDNN backend in the same rounds as a
column. FLOPs are bench_flash_attention.attention_flops'.

Before timing, each point checks that the builds agree: ``max|new-other|``, the largest difference
of the outputs (forward) or of dq, dk, dv (backward), over the largest magnitude of the other
build's. Two builds whose kernels sum in another order differ by a few bf16 ulps (~1e-2); a wrong
tile shows as order 1. (The float64 bar is the GPU suite's: tests/test_hopper_*.py.)

Usage: python benchmarks/compare_builds.py OTHER_BUILD_DIR [--points d:causal:N,...]
       [--directions fwd bwd] [--rounds 3] [--cudnn]
"""

import argparse
import pathlib
import statistics

import kernels
import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_flash_attention import attention_flops  # (the FLOP count every benchmark here uses)

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_POINTS = ",".join(f"{d}:{c}:{n}" for d in (64, 128) for n in (1024, 4096, 16384) for c in (0, 1))


def step(attention, q, k, v, direction):
    """The timed call: the forward, or the gradients of q, k, v from one retained forward."""
    if direction == "fwd":
        return lambda: attention(q, k, v)
    out = attention(q, k, v)
    generator = torch.Generator(out.device).manual_seed(0)  # (the same dout for every build)
    dout = torch.randn(out.shape, generator=generator, device=out.device, dtype=out.dtype)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def tflops(fn, q, causal, direction):
    fn()
    batch, seqlen, heads, head_dim = q.shape
    flops = attention_flops(batch, heads, seqlen, head_dim, causal, direction)
    return flops / triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-9


def difference(new, other):
    """max |new - other| over the results (one tensor or a tuple), relative to other's largest."""
    new, other = (x if isinstance(x, tuple) else (x,) for x in (new, other))
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(new, other))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("other", type=pathlib.Path)
    parser.add_argument("--points", default=DEFAULT_POINTS, help="head_dim:causal(0/1):seqlen, comma-separated")
    parser.add_argument("--directions", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cudnn", action="store_true", help="time SDPA's cuDNN backend in the same rounds")
    args = parser.parse_args()
    builds = {"new": kernels.get_local_kernel(REPO_ROOT / "build"), "other": kernels.get_local_kernel(args.other)}
    if builds["new"].__name__ == builds["other"].__name__:  # (the loader imports a build under its id: the
        # commit it was built at, "_dirty" for a changed tree; a second build of that id runs the first's modules)
        parser.error(f"{args.other} has the id of this tree's build ({builds['new'].__name__}), so both would "
                     "run this build's kernels: build OTHER at another commit, or give it another id "
                     "(its metadata.json and _ops.py)")
    print(f"{'d':>4} {'N':>6} {'causal':>6} {'dir':>4} {'new':>7} {'other':>7} {'new/other':>9}"
          + (f" {'cudnn':>7} {'new/cudnn':>9}" if args.cudnn else "") + f" {'max|new-other|':>14}")
    for point in args.points.split(","):
        head_dim, causal, seqlen = (int(x) for x in point.split(":"))
        causal = bool(causal)
        batch, heads = 16384 // seqlen, 2048 // head_dim
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        calls = {name: (lambda q, k, v, m=module: m.flash_attn_func(q, k, v, causal=causal))
                 for name, module in builds.items()}
        if args.cudnn:
            calls["cudnn"] = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
        for direction in args.directions:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):  # (SDPA's calls only; the builds call no SDPA)
                fns = {name: step(call, q, k, v, direction) for name, call in calls.items()}
                agree = difference(fns["new"](), fns["other"]())
                runs = {name: [] for name in fns}
                for round_ in range(args.rounds):  # (each round in the other order: the first timed can gain)
                    for name in list(fns)[::-1 if round_ % 2 else 1]:
                        runs[name].append(tflops(fns[name], q, causal, direction))
            rate = {name: statistics.median(values) for name, values in runs.items()}
            line = (f"{head_dim:>4} {seqlen:>6} {str(causal):>6} {direction:>4} "
                    f"{rate['new']:7.1f} {rate['other']:7.1f} {rate['new'] / rate['other']:9.3f}")
            if args.cudnn:
                line += f" {rate['cudnn']:7.1f} {rate['new'] / rate['cudnn']:9.3f}"
            print(line + f" {agree:14.2e}", flush=True)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")


if __name__ == "__main__":
    main()
