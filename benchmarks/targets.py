"""Issue 4's performance targets, checked against a summary.csv from bench_flash_attention.py.

Prints the benchmark as a markdown table (TFLOP/s and the ratio to every peer measured in the
same run) and, per target, the worst ratio over the grid points it covers and whether it holds:

* forward  >= 1.25x SDPA FLASH at seqlen >= 1k; >= 0.9x CUDNN at head dim 128, seqlen >= 2k
* backward >= 1.1x SDPA FLASH at seqlen >= 1k;  >= 0.8x CUDNN at head dim 128, seqlen >= 2k
* ahead of FlexAttention (> 1.0x) everywhere, forward and backward

Usage: python benchmarks/targets.py benchmarks/results/summary.csv
"""

import csv
import sys

PEERS = ["sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex"]

# (label, direction, peer, minimum ratio, which rows)
TARGETS = [
    ("fwd >= 1.25x SDPA FLASH, N >= 1k", "fwd", "sdpa-flash", 1.25, lambda r: r["seqlen"] >= 1024),
    ("fwd >= 0.9x CUDNN, d128, N >= 2k", "fwd", "sdpa-cudnn", 0.9, lambda r: r["head_dim"] == 128 and r["seqlen"] >= 2048),
    ("bwd >= 1.1x SDPA FLASH, N >= 1k", "bwd", "sdpa-flash", 1.1, lambda r: r["seqlen"] >= 1024),
    ("bwd >= 0.8x CUDNN, d128, N >= 2k", "bwd", "sdpa-cudnn", 0.8, lambda r: r["head_dim"] == 128 and r["seqlen"] >= 2048),
    ("fwd ahead of Flex, everywhere", "fwd", "flex", 1.0, lambda r: True),
    ("bwd ahead of Flex, everywhere", "bwd", "flex", 1.0, lambda r: True),
]


def read(path):
    rows = []
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            row["head_dim"], row["seqlen"] = int(row["head_dim"]), int(row["seqlen"])
            row["causal"] = row["causal"] == "True"
            for key in ["triton-fa", *PEERS]:
                row[key] = float(row[key])
            rows.append(row)
    return rows


def ratio(row, peer):
    return row["triton-fa"] / row[peer]


def main(path):
    rows = read(path)
    print("| dir | dtype | d | mask | N | ours | " + " | ".join(PEERS) + " | " + " | ".join(f"x {p}" for p in PEERS) + " |")
    print("|" + "---|" * (6 + 2 * len(PEERS)))
    for row in rows:
        print(f"| {row['direction']} | {row['dtype']} | {row['head_dim']} | {'causal' if row['causal'] else 'nc'} "
              f"| {row['seqlen']} | {row['triton-fa']:.0f} | " + " | ".join(f"{row[p]:.0f}" for p in PEERS) + " | "
              + " | ".join(f"{ratio(row, p):.2f}" for p in PEERS) + " |")
    print("\n| target | worst ratio (at) | points met | holds |\n|---|---|---|---|")
    for label, direction, peer, minimum, covers in TARGETS:
        covered = [r for r in rows if r["direction"] == direction and covers(r)]
        worst = min(covered, key=lambda r: ratio(r, peer))
        met = sum(ratio(r, peer) >= minimum if minimum != 1.0 else ratio(r, peer) > 1.0 for r in covered)
        where = f"{worst['dtype']} d{worst['head_dim']} {'causal' if worst['causal'] else 'nc'} N={worst['seqlen']}"
        print(f"| {label} | {ratio(worst, peer):.2f} ({where}) | {met}/{len(covered)} | {'yes' if met == len(covered) else 'no'} |")


if __name__ == "__main__":
    main(sys.argv[1])
