"""Interleaved A/B of kernel sources: several copies of flash_attention_kernel in one process.

Each copy is imported under its own name from a folder of copies (e.g. the last landed commit's
`git archive <rev> torch-ext/flash_attention/flash_attention_kernel` renamed fa_base, and the
working tree's copy renamed fa_new; revisions before the kernels moved into torch-ext/ hold them
at the top-level flash_attention_kernel/), so the rows of every copy are timed in the same rounds
on the same warm GPU: a row's copies are timed one after another, three rounds, medians of
triton.testing.do_bench medians.
The launchers are called directly (attention_forward / attention_backward, no autograd), bf16,
head dim 128, 16 heads, 16k tokens, (batch, seqlen, heads, dim); FLOPs on the visible pairs as
bench_variants.py counts them.

A spec file lists rows, one per line: ``kind causal seqlen copies``, kind in plain, window
((4096, 0) causal, (4096, 4096) not), softcap (50), alibi, sinks, dropout (0.1); copies a
comma-separated list of names (fa_<name> in the folder), each optionally with table overrides
``name@kernel=BMxBNxWARPSxSTAGES[xtma]`` (configs.set_override: that pass then runs its tl kernel
with this config, also where the Gluon kernels would take it). Each row is timed forward and
backward, then every option row is printed as a rate ratio to the plain row of the same copy.

Usage: python benchmarks/ab_sources.py COPIES_DIR SPEC_FILE [fwd|bwd]  (one direction only)
"""

import importlib
import statistics
import sys

import torch
import triton

from bench_flash_attention import TOKENS
from bench_variants import DEVICE, DROPOUT, DTYPE, HEAD_DIM, HEADS, SOFTCAP, alibi_slopes, visible_pairs

ROUNDS = 3


def options(package, kind, causal):
    window = (4096, 0 if causal else 4096) if kind == "window" else (-1, -1)
    extra = {
        "window": dict(window_left=window[0], window_right=window[1]),
        "softcap": dict(softcap=SOFTCAP),
        "alibi": dict(alibi_slopes=alibi_slopes()),
        "sinks": dict(sinks=torch.randn(HEADS, device=DEVICE)),
        "dropout": dict(dropout_p=DROPOUT, rng_state=package.draw_rng_state(torch.device(DEVICE))),
    }.get(kind, {})
    return package.AttentionOptions(softmax_scale=HEAD_DIM ** -0.5, causal=causal, **extra), window


def rate_timer(package, overrides, kind, causal, seqlen, direction):
    """A function timing one row of one copy, returning TFLOP/s."""
    batch = TOKENS // seqlen
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, seqlen, HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE) for _ in range(3))
    opts, (left, right) = options(package, kind, causal)
    right = 0 if causal else right

    def with_overrides(fn):
        def run():
            for kernel, config in overrides.items():
                package.configs.set_override(kernel, config)
            try:
                return fn()
            finally:
                for kernel in overrides:
                    package.configs.set_override(kernel, None)
        return run

    if direction == "fwd":
        fn = with_overrides(lambda: package.attention_forward(q, k, v, opts))
    else:
        out, lse = with_overrides(lambda: package.attention_forward(q, k, v, opts))()
        dout = torch.randn_like(out)
        fn = with_overrides(lambda: package.attention_backward(dout, q, k, v, out, lse, opts))
    fn()
    flops = 4 * batch * HEADS * visible_pairs(seqlen, left, right) * HEAD_DIM * (2.5 if direction == "bwd" else 1.0)
    return lambda: flops / triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-9


def parse_copy(entry):
    name, *overrides = entry.split("@")
    package = importlib.import_module("fa_" + name)
    configs = {}
    for override in overrides:
        kernel, config = override.split("=")
        fields = config.split("x")
        configs[kernel] = package.configs.TileConfig(*map(int, fields[:4]), tma="tma" in fields[4:],
                                                       q_per_tile="q" in fields[4:])
    return name, package, configs


def main(argv):
    if len(argv) not in (2, 3) or argv[2:] not in ([], ["fwd"], ["bwd"]):
        sys.exit(__doc__)
    directions = argv[2:] or ("fwd", "bwd")
    sys.path.insert(0, argv[0])
    rows = [line.split() for line in open(argv[1]) if line.strip() and not line.startswith("#")]
    results = {}
    for kind, causal, seqlen, copies in rows:
        causal, seqlen = bool(int(causal)), int(seqlen)
        for direction in directions:
            timers = {}
            for entry in copies.split(","):
                _, package, overrides = parse_copy(entry)
                timers[entry] = rate_timer(package, overrides, kind, causal, seqlen, direction)
            rates = {entry: [] for entry in timers}
            for _ in range(ROUNDS):
                for entry, timer in timers.items():
                    rates[entry].append(timer())
            row = {entry: statistics.median(values) for entry, values in rates.items()}
            results[(kind, causal, seqlen, direction)] = row
            print(f"{kind:8} causal={int(causal)} N={seqlen:6} {direction}: "
                  + "  ".join(f"{entry}={rate:6.1f}" for entry, rate in row.items()), flush=True)
    print("\nrate over the same copy's plain rate (same causal flag, N, direction)")
    for (kind, causal, seqlen, direction), row in results.items():
        plain = results.get(("plain", causal, seqlen, direction))
        if kind == "plain" or plain is None:
            continue
        ratios = {entry: rate / plain[entry.split("@")[0]] for entry, rate in row.items()
                  if entry.split("@")[0] in plain}
        print(f"{kind:8} causal={int(causal)} N={seqlen:6} {direction}: "
              + "  ".join(f"{entry}={ratio:.3f}" for entry, ratio in ratios.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
