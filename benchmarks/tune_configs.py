"""Offline tuning of the launch-config table in flash_attention_kernel/configs.py.

Run on the target GPU. It tunes the tl kernels, so every pass runs its tl kernel (configs.set_override
with implementation "tl", the planner's hook: on Hopper the Gluon kernels would take the d64/d128
calls it times). For each kernel (fwd, bwd_dkdv, bwd_dq), head
dim and mask (causal or not) it times a short list of candidate configs, each with and without tensor descriptors (TMA;
before Hopper without, and each forward tile also with Q read per key tile, TileConfig.q_per_tile),
on the benchmark's shape (16k tokens, hidden 2048, N = --seqlen, 4096 by default, bf16; stored
(batch, heads, seqlen, dim) as the benchmark passes them, or --layout bshd), checks that each
candidate computes what the current table entry computes, and reports the fastest next to the
current entry. The forward is timed alone; each backward kernel is timed through the whole
backward with the other kernel at its current config (computing delta is common to all
candidates). Run it with --seqlen 1024 / 2048 for the short-sequence entries (configs.SEQLEN_BUCKETS).

With --warp-specialized it tunes the warp-specialised entries instead (the warp_specialized entries of configs.TABLES:
forward and dQ kernel, non-causal, tiles through descriptors); it stops if the launch would not
take that path here (launch.warp_specialize: a Hopper GPU and a checked Triton, or
FLASH_ATTENTION_WS=1). Its candidates are those seen to compile on Triton 3.6
(docs/design.md#warp-specialised-tl-loops): a candidate that crashes the compiler aborts the sweep.
Without it, the kernel being tuned runs its plain loop at every length.

Compilation dominates a sweep, so a first phase compiles every candidate in --jobs worker
processes (filling Triton's on-disk cache) and the timing phase then runs on one process.
Configs that do not fit (shared memory, registers) are reported and skipped. Copy the winners
into configs.py by hand, and record the run (date, device, command) with the change (docs/design.md#config-rules).

Usage: python benchmarks/tune_configs.py [--head-dims 64 128 256] [--kernels fwd bwd_dkdv bwd_dq]
       [--seqlen 4096] [--layout bhsd] [--warp-specialized] [--jobs 8] [--out tune.json]
"""

import argparse
from dataclasses import astuple
import json
import multiprocessing
import sys
from pathlib import Path

import torch
import triton
import triton.testing

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "torch-ext" / "flash_attention"))

from flash_attention_kernel import AttentionOptions, attention_backward, attention_forward  # noqa: E402
from flash_attention_kernel import configs  # noqa: E402
from flash_attention_kernel import launch as launch_module  # noqa: E402
from flash_attention_kernel import planner  # noqa: E402

TOKENS, HIDDEN = 16384, 2048
# (BLOCK_M, BLOCK_N, num_warps, num_stages); each is tried with and without tensor descriptors (TMA)
_TILES = {
    "fwd": [(64, 32, 4, 3), (64, 32, 4, 4), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 8, 3),
            (64, 128, 4, 2), (64, 128, 4, 3), (64, 128, 8, 3), (128, 16, 4, 3), (128, 16, 4, 4), (128, 32, 4, 2),
            (128, 32, 4, 3), (128, 32, 4, 4), (128, 32, 8, 3), (128, 64, 4, 3),
            (128, 64, 4, 4), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 4, 2), (128, 128, 8, 2),
            (128, 128, 8, 3), (256, 32, 8, 3), (256, 64, 8, 2), (256, 64, 8, 3)],
    "bwd_dkdv": [(16, 64, 4, 2), (16, 128, 8, 2), (32, 32, 4, 2), (32, 64, 4, 2), (32, 64, 4, 3), (32, 64, 8, 2),
                 (32, 128, 4, 2), (32, 128, 8, 2), (32, 128, 8, 3), (64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3),
                 (64, 64, 8, 2), (64, 64, 8, 3), (64, 128, 8, 1), (64, 128, 8, 2), (64, 128, 8, 3), (64, 128, 8, 4),
                 (64, 128, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2)],
    "bwd_dq": [(64, 32, 4, 2), (64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 3), (64, 128, 8, 2),
               (128, 32, 4, 2), (128, 32, 4, 3), (128, 32, 8, 2), (128, 32, 8, 3), (128, 32, 8, 4),
               (128, 32, 4, 4), (128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2)],
}
# (BLOCK_M, BLOCK_N, warps, stages, tma, q_per_tile), configs.TileConfig's fields
CANDIDATES = {kernel: [tile + (tma, False) for tile in tiles for tma in (False, True)] for kernel, tiles in _TILES.items()}
# Warp-specialised loops read every tile through descriptors (tma=True); the dQ kernel only
# compiles with 8 warps (docs/design.md#warp-specialised-tl-loops), the dK/dV kernel not at all.
WARP_SPECIALIZED_CANDIDATES = {
    "fwd": [(128, 64, 4, 2, True, False), (128, 64, 4, 3, True, False), (128, 128, 4, 2, True, False),
            (128, 128, 8, 2, True, False), (128, 64, 8, 2, True, False)],
    "bwd_dq": [(128, 64, 8, 2, True, False), (128, 128, 8, 2, True, False), (128, 64, 8, 3, True, False),
               (64, 128, 8, 2, True, False)],
}


def _candidates(specialized):
    """The candidate configs per kernel; without tensor descriptors where this GPU has none
    (before Hopper, or a GPU emulating one: there the tma flag would time the same kernel twice),
    and there each forward tile also with Q read per key tile (q_per_tile: mma.sync holds a
    loop-invariant Q in registers, wgmma reads it from shared memory anyway)."""
    if specialized:
        return WARP_SPECIALIZED_CANDIDATES
    if torch.cuda.get_device_capability()[0] >= 9:
        return CANDIDATES
    plain = {kernel: [config for config in configs if not config[4]] for kernel, configs in CANDIDATES.items()}
    plain["fwd"] += [config[:5] + (True,) for config in plain["fwd"]]
    return plain


def _inputs(head_dim, seqlen, layout, dtype=torch.bfloat16):
    """q, k, v, dout as (batch, seqlen, heads, dim) tensors, stored that way ("bshd") or as
    (batch, heads, seqlen, dim) ("bhsd", what bench_flash_attention.py passes)."""
    batch, heads = TOKENS // seqlen, HIDDEN // head_dim
    if layout == "bhsd":
        return [torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=dtype).transpose(1, 2)
                for _ in range(4)]
    return [torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype) for _ in range(4)]


def _with_config(kernel, config, specialized):
    """Make the launchers use ``config`` for ``kernel`` (configs.set_override), as its
    warp-specialised entry if ``specialized`` else as its plain one with warp specialisation off,
    and the table for the other kernels; every pass on its tl kernel (the table tunes those)."""
    _tl_kernels_only()
    configs.set_override(kernel, config, specialized)


def _tl_kernels_only():
    """Every pass of the forward and backward on its tl kernel, with the table's configs."""
    configs.OVERRIDES.clear()
    for kernel in CANDIDATES:
        configs.set_override(kernel, implementation="tl")


def _options(head_dim, causal):
    return AttentionOptions(head_dim ** -0.5, causal)


def _current(kernel, head_dim, causal, seqlen, specialized):
    """The table's entry for the tuned kernel, as a tuple (None where it has no such entry)."""
    _tl_kernels_only()
    mask = _options(head_dim, causal).mask_kind
    gpu = launch_module.device_gpu_class(torch.device("cuda", torch.cuda.current_device())).name
    if specialized:
        config = configs.warp_specialized_config(kernel, head_dim, torch.bfloat16, False, mask, seqlen, gpu)
    else:
        config = configs.tile_config(kernel, head_dim, torch.bfloat16, False, mask, seqlen, gpu=gpu)
    return astuple(config) if config is not None else None


def _takes_warp_specialization(kernel, head_dim, causal, tensors):
    """Whether the launch of ``kernel`` on ``tensors`` runs its warp-specialised loop (as the planner plans it)."""
    q, k, v, dout = tensors
    layout = launch_module.SequenceLayout.of(q, k)
    options = _options(head_dim, causal)
    if kernel == "fwd":
        return planner.plan_forward(options, layout, False, q, k, v).tl.specialized
    return getattr(planner.plan_backward(options, layout, False, q, k, v, dout), kernel[4:]).tl.specialized


def _run(kernel, head_dim, causal, tensors):
    q, k, v, dout = tensors
    options = _options(head_dim, causal)
    if kernel == "fwd":
        return lambda: attention_forward(q, k, v, options)
    out, lse = attention_forward(q, k, v, options)
    return lambda: attention_backward(dout, q, k, v, out, lse, options)[:3]


def _compile_worker(jobs):
    """Launch each (kernel, head_dim, seqlen, config) once so that Triton caches the binaries."""
    for kernel, head_dim, seqlen, layout, config, specialized, masks in jobs:
        _with_config(kernel, configs.TileConfig(*config), specialized)
        tensors = _inputs(head_dim, seqlen, layout)
        for causal in masks:
            try:
                _run(kernel, head_dim, causal, tensors)()
            except Exception:  # reported in the timing phase
                pass
    torch.cuda.synchronize()


def _max_difference(result, reference):
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(result, reference))


def time_config(kernel, head_dim, config, causal, tensors, reference, specialized):
    """Milliseconds of ``kernel`` with ``config``, and the largest difference of its results
    from ``reference`` (the current table entry's)."""
    _with_config(kernel, configs.TileConfig(*config), specialized)
    fn = _run(kernel, head_dim, causal, tensors)
    difference = _max_difference(fn(), reference)
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"), difference


def tune(kernel, head_dim, causal, seqlen, layout, specialized):
    """Time every candidate for one (kernel, head dim, mask); returns the result record."""
    tensors = _inputs(head_dim, seqlen, layout)
    mask = "causal" if causal else "non-causal"
    candidates = _candidates(specialized)[kernel]
    current = _current(kernel, head_dim, causal, seqlen, specialized)
    first = current or candidates[0]
    _with_config(kernel, configs.TileConfig(*first), specialized)
    if specialized and not _takes_warp_specialization(kernel, head_dim, causal, tensors):
        sys.exit(f"{kernel} d{head_dim} {mask} N={seqlen}: the launch would not warp-specialise here "
                 "(launch.warp_specialize); nothing tuned")
    reference = _run(kernel, head_dim, causal, tensors)()
    timings = {}
    for config in dict.fromkeys([first, *candidates]):
        try:
            timings[config], difference = time_config(kernel, head_dim, config, causal, tensors, reference,
                                                      specialized)
        except Exception as error:  # out of shared memory / registers
            print(f"  {kernel} d{head_dim} {mask} {config}: skipped ({type(error).__name__}: {str(error)[:200]})")
            continue
        print(f"  {kernel} d{head_dim} {mask} {config}: {timings[config]:.3f} ms, "
              f"max difference from current {difference:.2e}", flush=True)
        if not difference < 0.05:  # a wrong kernel, not rounding: never pick it
            print(f"  {kernel} d{head_dim} {mask} {config}: WRONG RESULTS, dropped")
            del timings[config]
    best = min(timings, key=timings.get)
    if current in timings:
        print(f"{kernel} d{head_dim} {mask} N={seqlen}: current {current} {timings[current]:.3f} ms -> best {best} "
              f"{timings[best]:.3f} ms ({timings[current] / timings[best]:.2f}x)", flush=True)
    else:
        print(f"{kernel} d{head_dim} {mask} N={seqlen}: no current entry -> best {best} {timings[best]:.3f} ms",
              flush=True)
    return dict(kernel=kernel, head_dim=head_dim, causal=causal, seqlen=seqlen, current=current, best=best,
                timings_ms={"x".join(map(str, c)): t for c, t in timings.items()})


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--kernels", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    parser.add_argument("--seqlen", type=int, default=4096, help="N; batch = 16k tokens / N")
    parser.add_argument("--layout", choices=["bhsd", "bshd"], default="bhsd",
                        help="memory layout of q, k, v (bhsd: the benchmark's)")
    parser.add_argument("--warp-specialized", action="store_true",
                        help="tune the warp-specialised entries (fwd, bwd_dq; non-causal)")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    specialized = args.warp_specialized
    if specialized and not set(args.kernels) <= set(WARP_SPECIALIZED_CANDIDATES):
        parser.error(f"--warp-specialized tunes only {', '.join(WARP_SPECIALIZED_CANDIDATES)}")
    masks = (False,) if specialized else (False, True)
    candidates = _candidates(specialized)

    jobs = [(kernel, head_dim, args.seqlen, args.layout, config, specialized, masks) for kernel in args.kernels
            for head_dim in args.head_dims for config in candidates[kernel]]
    if args.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            pool.map(_compile_worker, [jobs[i::args.jobs] for i in range(args.jobs)])

    results = [tune(kernel, head_dim, causal, args.seqlen, args.layout, specialized)
               for kernel in args.kernels for head_dim in args.head_dims for causal in masks]
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
