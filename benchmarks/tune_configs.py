"""Offline tuning of the launch-config table in flash_attention_kernel/configs.py.

Run on the target GPU. For each kernel (fwd, bwd_dkdv, bwd_dq) and head dim it times a short
list of candidate tile configs on the benchmark's shape (16k tokens, hidden 2048, N = --seqlen,
4096 by default, bf16, causal and non-causal; layout (batch, seqlen, heads, dim)) and reports the config with the
lowest summed time over both masks, next to the current table entry, and the best config for
each mask alone (what a causal-specific table entry would gain). The forward is timed
alone; each backward kernel is timed through the whole backward with the other kernel at its
current config (the preprocess pass is common to all candidates).

Compilation dominates a sweep, so a first phase compiles every candidate in --jobs worker
processes (filling Triton's on-disk cache) and the timing phase then runs on one process.
Configs that do not fit (shared memory, registers) are reported and skipped. Copy the winners
into configs.py by hand, with the date and device in the lab notebook (benchmarks/NOTES.md).

Usage: python benchmarks/tune_configs.py [--head-dims 64 128 256] [--kernels fwd bwd_dkdv bwd_dq]
       [--jobs 8] [--out tune.json]
"""

import argparse
import json
import multiprocessing
import sys
from pathlib import Path

import torch
import triton
import triton.testing

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from flash_attention_kernel import attention_backward, attention_forward  # noqa: E402
from flash_attention_kernel import backward as backward_module  # noqa: E402
from flash_attention_kernel import configs  # noqa: E402
from flash_attention_kernel import forward as forward_module  # noqa: E402

TOKENS, HIDDEN = 16384, 2048
# (BLOCK_M, BLOCK_N, num_warps, num_stages)
CANDIDATES = {
    "fwd": [(64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 2), (64, 128, 4, 3),
            (128, 32, 4, 3), (128, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4),
            (128, 128, 8, 2), (128, 128, 8, 3), (128, 128, 4, 2)],
    "bwd_dkdv": [(16, 64, 4, 2), (16, 128, 8, 2), (32, 32, 4, 2), (32, 64, 4, 2), (32, 64, 4, 3), (32, 64, 8, 2),
                 (32, 128, 4, 2), (32, 128, 8, 2), (32, 128, 8, 3), (64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3),
                 (64, 64, 8, 2), (64, 64, 8, 3), (64, 128, 8, 1), (64, 128, 8, 2), (128, 64, 8, 2)],
    "bwd_dq": [(64, 32, 4, 2), (64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 3), (64, 128, 8, 2),
               (128, 32, 4, 2), (128, 32, 4, 3), (128, 32, 8, 2), (128, 32, 8, 3), (128, 32, 8, 4),
               (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2)],
}


def _inputs(head_dim, seqlen, dtype=torch.bfloat16):
    batch, heads = TOKENS // seqlen, HIDDEN // head_dim
    return [torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype) for _ in range(4)]


def _with_config(kernel, config):
    """Make the launchers use ``config`` for ``kernel`` and the table for the others."""

    def choose(name, head_dim, dtype, interpreted):
        return config if name == kernel else configs.tile_config(name, head_dim, dtype, interpreted)

    forward_module.tile_config = choose
    backward_module.tile_config = choose


def _run(kernel, head_dim, causal, tensors):
    q, k, v, dout = tensors
    scale = head_dim ** -0.5
    if kernel == "fwd":
        return lambda: attention_forward(q, k, v, scale, causal)
    out, lse = attention_forward(q, k, v, scale, causal)
    return lambda: attention_backward(dout, q, k, v, out, lse, scale, causal)


def _compile_worker(jobs):
    """Launch each (kernel, head_dim, seqlen, config) once so that Triton caches the binaries."""
    for kernel, head_dim, seqlen, config in jobs:
        _with_config(kernel, configs.TileConfig(*config))
        tensors = _inputs(head_dim, seqlen)
        for causal in (False, True):
            try:
                _run(kernel, head_dim, causal, tensors)()
            except Exception:  # reported in the timing phase
                pass
    torch.cuda.synchronize()


def time_config(kernel, head_dim, config, tensors):
    """Milliseconds (non-causal, causal) of ``kernel`` with ``config``."""
    _with_config(kernel, configs.TileConfig(*config))
    times = []
    for causal in (False, True):
        fn = _run(kernel, head_dim, causal, tensors)
        fn()
        times.append(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    return tuple(times)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--kernels", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    parser.add_argument("--seqlen", type=int, default=4096, help="N; batch = 16k tokens / N")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)

    jobs = [(kernel, head_dim, args.seqlen, config) for kernel in args.kernels for head_dim in args.head_dims
            for config in CANDIDATES[kernel]]
    if args.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            pool.map(_compile_worker, [jobs[i::args.jobs] for i in range(args.jobs)])

    results = []
    for kernel in args.kernels:
        for head_dim in args.head_dims:
            tensors = _inputs(head_dim, args.seqlen)
            current = configs.tile_config(kernel, head_dim, torch.bfloat16, False)
            current_key = (current.block_m, current.block_n, current.num_warps, current.num_stages)
            timings = {}
            for config in dict.fromkeys([current_key, *CANDIDATES[kernel]]):
                try:
                    timings[config] = time_config(kernel, head_dim, config, tensors)
                except Exception as error:  # out of shared memory / registers
                    print(f"  {kernel} d{head_dim} {config}: skipped ({type(error).__name__})")
            best = min(timings, key=lambda c: sum(timings[c]))
            print(f"{kernel:>8} d{head_dim:<3} current {current_key} {sum(timings[current_key]):.3f} ms -> best {best} "
                  f"{sum(timings[best]):.3f} ms ({sum(timings[current_key]) / sum(timings[best]):.2f}x)", flush=True)
            for mask, index in (("non-causal", 0), ("causal", 1)):
                best_alone = min(timings, key=lambda c: timings[c][index])
                print(f"{'':>13} {mask} alone: best {best_alone} {timings[best_alone][index]:.3f} ms, "
                      f"{timings[best][index] / timings[best_alone][index]:.2f}x over the summed best")
            results.append(dict(kernel=kernel, head_dim=head_dim, current=current_key, best=best,
                                timings_ms={"x".join(map(str, c)): t for c, t in timings.items()}))
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
