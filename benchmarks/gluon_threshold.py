"""Where the Gluon kernels start to beat the tl ones: the data behind hopper_route.long_enough.

For each head dim (64, 128), causal and not, and each shape, the GPU time of the forward and of
the backward (forward + backward less forward) with the Gluon kernels forced on
(FLASH_ATTENTION_GLUON=1: every call they fit, short ones too) and off (=0), from the summed
kernel times of a profiler trace (bench_decode.gpu_busy_us: no host time), the better of two
rounds, and their ratio (below 1: Gluon is faster). Shapes: 16k tokens at N = 256 ... 16k, and
short calls at batch 1 and 16 (N = 128, 256, 512). bf16, 16 heads of 128 or 32 of 64. The rule's
thresholds and the H100 run behind them: docs/design.md#hopper-gluon-kernels ("Short calls").

Usage: python benchmarks/gluon_threshold.py [--quick]     (after scripts/build_variants.py, on Hopper)
"""

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import gpu_busy_us  # noqa: E402
from bench_flash_attention import load_kernel  # noqa: E402

TOKENS = 16384


def shapes(quick: bool):
    lengths = (256, 512, 1024, 2048, 4096) if quick else (256, 512, 1024, 2048, 4096, 8192, 16384)
    return [(TOKENS // n, n) for n in lengths] + [(1, 128), (1, 256), (1, 512), (16, 128), (16, 256)]


def gpu_times(fa, batch, seqlen, head_dim, causal, generator):
    """(forward us, backward us) with the Gluon kernels on and off: {"1": (...), "0": (...)}."""
    heads = 16 if head_dim == 128 else 32
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, generator=generator).to("cuda", torch.bfloat16)
               .requires_grad_() for _ in range(3))
    dout = torch.randn(batch, seqlen, heads, head_dim, generator=generator).to("cuda", torch.bfloat16)

    def forward():
        return fa.flash_attn_func(q, k, v, causal=causal)

    def step():
        return torch.autograd.grad(forward(), (q, k, v), dout)

    times = {}
    for setting in ("1", "0", "1", "0"):
        os.environ["FLASH_ATTENTION_GLUON"] = setting
        fwd, both = gpu_busy_us(forward, calls=10), gpu_busy_us(step, calls=10)
        best = times.get(setting, (float("inf"), float("inf")))
        times[setting] = (min(best[0], fwd), min(best[1], both - fwd))
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16k tokens up to N = 4096 only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("gluon_threshold: needs a Hopper GPU")
    fa = load_kernel()
    generator = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {__import__('triton').__version__}")
    print("| head dim | causal | batch x N | fwd Gluon / tl us | ratio | bwd Gluon / tl us | ratio |")
    print("|---|---|---|---|---|---|---|")
    try:
        for head_dim, causal in itertools.product((64, 128), (True, False)):
            for batch, seqlen in shapes(args.quick):
                times = gpu_times(fa, batch, seqlen, head_dim, causal, generator)
                (gluon_fwd, gluon_bwd), (tl_fwd, tl_bwd) = times["1"], times["0"]
                print(f"| {head_dim} | {causal} | {batch} x {seqlen} | {gluon_fwd:.1f} / {tl_fwd:.1f} | "
                      f"{gluon_fwd / tl_fwd:.2f} | {gluon_bwd:.1f} / {tl_bwd:.1f} | {gluon_bwd / tl_bwd:.2f} |",
                      flush=True)
    finally:
        os.environ.pop("FLASH_ATTENTION_GLUON", None)


if __name__ == "__main__":
    main()
