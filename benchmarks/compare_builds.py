"""Plain rows of two builds of this kernel, interleaved in one process: the A/B for "this change
costs nothing when its option is off".

Loads ``build`` (this tree, after scripts/build_variants.py) and ``OTHER`` (another checkout's
build folder, e.g. of the last landed commit: ``git worktree add /tmp/base <rev>`` then
``python /tmp/base/scripts/build_variants.py``) through kernels.get_local_kernel, and times
flash_attn_func forward and backward (bf16, 16k tokens, hidden 2048, (B, N, H, d) layout) at head
dims 64/128, N 1k/4k/16k, causal and not: three interleaved rounds per point, medians of
triton.testing.do_bench medians. FLOPs as bench_flash_attention.py counts them.

Usage: python benchmarks/compare_builds.py OTHER_BUILD_DIR
"""

import pathlib
import statistics
import sys

import kernels
import torch
import triton.testing

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def tflops(module, q, k, v, causal, direction):
    batch, seqlen, heads, head_dim = q.shape
    flops = 4 * batch * heads * seqlen ** 2 * head_dim / (2 if causal else 1) * (2.5 if direction == "bwd" else 1)
    if direction == "fwd":
        fn = lambda: module.flash_attn_func(q, k, v, causal=causal)  # noqa: E731
    else:
        out = module.flash_attn_func(q, k, v, causal=causal)
        dout = torch.randn_like(out)
        fn = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
    fn()
    return flops / triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-9


def main(argv):
    if len(argv) != 1:
        sys.exit(__doc__)
    builds = {"new": kernels.get_local_kernel(REPO_ROOT / "build"),
              "other": kernels.get_local_kernel(pathlib.Path(argv[0]))}
    print(f"{'d':>4} {'N':>6} {'causal':>6} {'dir':>4} {'new':>7} {'other':>7} {'new/other':>9}")
    for head_dim in (64, 128):
        for seqlen in (1024, 4096, 16384):
            for causal in (False, True):
                batch, heads = 16384 // seqlen, 2048 // head_dim
                q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))
                for direction in ("fwd", "bwd"):
                    runs = {name: [] for name in builds}
                    for _ in range(3):
                        for name, module in builds.items():
                            runs[name].append(tflops(module, q, k, v, causal, direction))
                    new, other = statistics.median(runs["new"]), statistics.median(runs["other"])
                    print(f"{head_dim:>4} {seqlen:>6} {str(causal):>6} {direction:>4} {new:7.1f} {other:7.1f} "
                          f"{new / other:9.3f}", flush=True)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")


if __name__ == "__main__":
    main(sys.argv[1:])
