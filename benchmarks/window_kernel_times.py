"""Per-kernel GPU times of a sliding window against plain causal: which kernel lags.

bf16, head dim 128, 16 heads, 16k tokens; the launchers are called directly (no autograd), ten
forward + backward calls under torch.profiler (warm L2, unlike do_bench, which clears it before
each call). Prints, per row, the visible (query, key) pairs and each kernel's ms per call; the
time per pair of a window row over plain causal's is its rate ratio (docs/benchmarks.md#method).

Usage (on a GPU): python benchmarks/window_kernel_times.py [--window 4096] [--rounds 2]
"""

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch-ext" / "flash_attention"))
import flash_attention_kernel as fk  # noqa: E402

HEADS, HEAD_DIM, TOKENS, CALLS = 16, 128, 16384, 10


def kernel_times(seqlen, window_left):
    """(visible pairs, {kernel name: ms per call}) of causal attention with the window's left bound."""
    batch = TOKENS // seqlen
    q, k, v = (torch.randn(batch, seqlen, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    options = fk.AttentionOptions(softmax_scale=HEAD_DIM ** -0.5, causal=True, window_left=window_left)
    out, lse = fk.attention_forward(q, k, v, options)
    dout = torch.randn_like(out)

    def step():
        fk.attention_forward(q, k, v, options)
        fk.attention_backward(dout, q, k, v, out, lse, options)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            step()
        torch.cuda.synchronize()
    times = {event.key: event.self_device_time_total / CALLS / 1000 for event in prof.key_averages()
             if event.self_device_time_total > 0 and "cuda" not in event.key.lower()}
    seen = window_left if window_left >= 0 else seqlen
    pairs = sum(min(i, seen) + 1 for i in range(seqlen)) * batch * HEADS
    return pairs, times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for _ in range(args.rounds):
        for label, left in (("causal", -1), (f"window ({args.window}, 0)", args.window)):
            pairs, times = kernel_times(args.seqlen, left)
            row = "  ".join(f"{name[:32]}={ms:.3f}" for name, ms in sorted(times.items(), key=lambda t: -t[1]))
            print(f"{label} N={args.seqlen}: pairs {pairs / 1e9:.3f}e9  {row}", flush=True)


if __name__ == "__main__":
    main()
