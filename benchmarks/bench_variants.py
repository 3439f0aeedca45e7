"""Cost of flash_attn_func's options: sliding window, softcap, ALiBi, attention sinks, dropout.

This kernel with each option against the same call without it, and against the PyTorch peers
that have the option.

Rows: bf16, head dim 128, 16 heads (hidden 2048), batch x seqlen = 16k tokens, seqlen 1k, 4k and
16k (--seqlens), forward and backward timed separately as bench_flash_attention.time_tflops does
(triton.testing.do_bench medians; the backward alone, its forward graph kept), in --rounds rounds
(default 3) that each visit every row, each row's median reported:

  plain              no option, causal and not: the baseline ("the same call without the option")
  window(4096,0)     window_size=(4096, 0), causal=True (at 16k: the issue's sliding-window row)
  window(4096,4096)  window_size=(4096, 4096), not causal
  softcap            softcap=50.0, causal and not
  alibi              alibi_slopes = 2^(-8 i / heads), i = 1..heads (flash-attn's standard slopes)
  sinks              s_aux ~ N(0, 1), fp32 (heads,), requires_grad: the backward computes its gradient
  dropout            dropout_p=0.1, causal and not

Peers, timed where PyTorch has the option, in layout (batch, heads, seqlen, head_dim) (ours:
flash_attn_func's (batch, seqlen, heads, head_dim)):

  flex        FlexAttention under torch.compile(dynamic=False), Dynamo's recompile limits raised:
              the mask as a block mask with the same window (plain causal, both windows), softcap
              and ALiBi as score_mods, sinks as out * sigmoid(lse - sink[h]) on flex_attention's
              lse (= out * e^lse / (e^lse + e^sink), compiled together with the attention; the
              backward runs through it). Rows: plain, window, softcap, alibi, sinks.
  sdpa-flash  scaled_dot_product_attention with the FLASH backend. Rows: plain, dropout.

FLOPs are counted on the (query, key) pairs the mask leaves visible, counted exactly row by row:
forward 4 * batch * heads * pairs * head_dim, backward 2.5x forward. A causal mask has
N (N + 1) / 2 pairs, so plain causal rates here sit (N + 1) / N above bench_flash_attention's
N^2 / 2 convention. Options other than the window keep the count, so for them "x plain" (ours
over ours plain with the same causal flag) is the inverse of the time ratio.

Targets of the issue, checked on ours (worst point over the N measured):
  window(4096,0) at N = 16k: TFLOP/s >= 0.9x plain causal, forward and backward separately
  softcap, alibi, sinks: time <= 1.10x plain with the same causal flag, forward and backward
  dropout: forward + backward time <= 1.30x plain with the same causal flag

Ours and the peers can run in separate processes (ours may be run with another Triton first on
PYTHONPATH), then be merged. Every run writes one CSV row per variant, causal flag, N, direction
and provider (FLOPs, TFLOP/s, ms, and the device, torch and Triton it ran on) and prints the table
and the targets. A provider that fails to build, compile or run prints one line and gets NaN.

Usage (after scripts/build_variants.py, on a GPU):
  python benchmarks/bench_variants.py [--seqlens 1024 4096 16384] [--variants window softcap ...]
      ours and peers in one process -> benchmarks/results/variants.csv
  python benchmarks/bench_variants.py --providers ours     -> benchmarks/results/variants-ours.csv
  python benchmarks/bench_variants.py --providers peers    -> benchmarks/results/variants-peers.csv
  python benchmarks/bench_variants.py --merge benchmarks/results/variants-ours.csv \\
      benchmarks/results/variants-peers.csv             -> benchmarks/results/variants.csv
"""

import argparse
import csv
import math
import statistics
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_flash_attention import HIDDEN, TOKENS, load_kernel, time_tflops, write_csv

REPO_ROOT = Path(__file__).resolve().parent.parent
DEVICE, DTYPE, HEAD_DIM = "cuda", torch.bfloat16, 128
HEADS = HIDDEN // HEAD_DIM
SEQLENS = [1024, 4096, 16384]
DIRECTIONS = ("fwd", "bwd")
SOFTCAP, DROPOUT = 50.0, 0.1
PEERS = ("flex", "sdpa-flash")
KINDS = ("plain", "window", "softcap", "alibi", "sinks", "dropout")


@dataclass(frozen=True)
class Variant:
    kind: str  # one of KINDS
    causal: bool
    window: tuple[int, int] = (-1, -1)  # flash_attn_func's window_size
    peers: tuple[str, ...] = ("flex",)

    @property
    def name(self):
        return f"window({self.window[0]},{self.window[1]})" if self.kind == "window" else self.kind

    @property
    def visible(self):
        """(left, right): query i sees keys i - left <= j <= i + right (-1: unbounded)."""
        return self.window[0], 0 if self.causal else self.window[1]


VARIANTS = [
    Variant("plain", True, peers=PEERS),
    Variant("plain", False, peers=PEERS),
    Variant("window", True, window=(4096, 0)),
    Variant("window", False, window=(4096, 4096)),
    *(Variant(kind, causal) for kind in ("softcap", "alibi", "sinks") for causal in (True, False)),
    *(Variant("dropout", causal, peers=("sdpa-flash",)) for causal in (True, False)),
]


def visible_pairs(seqlen, left, right):
    """(query, key) pairs with key j visible to query i (i - left <= j <= i + right, -1 unbounded)
    when seqlen_q == seqlen_k, summed over the query rows."""
    rows = torch.arange(seqlen, dtype=torch.int64)
    first = (rows - left).clamp(min=0) if left >= 0 else torch.zeros_like(rows)
    last = (rows + right).clamp(max=seqlen - 1) if right >= 0 else torch.full_like(rows, seqlen - 1)
    return int((last - first + 1).clamp(min=0).sum())


def attention_flops(variant, seqlen, direction):
    flops = 4 * (TOKENS // seqlen) * HEADS * visible_pairs(seqlen, *variant.visible) * HEAD_DIM
    return flops * (2.5 if direction == "bwd" else 1.0)


def alibi_slopes():
    """flash-attn's standard ALiBi slopes for a power-of-two head count, fp32 (heads,)."""
    return torch.tensor([2.0 ** (-8.0 * i / HEADS) for i in range(1, HEADS + 1)], device=DEVICE)


def random_inputs(*shape):
    return [torch.randn(shape, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(3)]


def ours_call(fa, variant, seqlen):
    """(forward, leaves): flash_attn_func with the variant's option."""
    q, k, v = leaves = random_inputs(TOKENS // seqlen, seqlen, HEADS, HEAD_DIM)
    options = dict(causal=variant.causal, window_size=variant.window)
    if variant.kind == "softcap":
        options["softcap"] = SOFTCAP
    elif variant.kind == "alibi":
        options["alibi_slopes"] = alibi_slopes()
    elif variant.kind == "sinks":
        options["s_aux"] = torch.randn(HEADS, device=DEVICE, requires_grad=True)
        leaves.append(options["s_aux"])
    elif variant.kind == "dropout":
        options["dropout_p"] = DROPOUT
    return lambda: fa.flash_attn_func(q, k, v, **options), leaves


class Peers:
    """FlexAttention and SDPA FLASH calls. flex_attention is imported here, not at the top: a
    process that times only ours may run another Triton than the one torch.compile expects."""

    def __init__(self):
        from torch.nn.attention import flex_attention as flex

        torch._dynamo.config.recompile_limit = 10_000
        torch._dynamo.config.accumulated_recompile_limit = 10_000
        self.flex_attention, self.create_block_mask = flex.flex_attention, flex.create_block_mask
        try:  # newer torch returns the lse through return_aux=AuxRequest(lse=True)
            self.aux_request = flex.AuxRequest
        except AttributeError:  # older torch through return_lse=True
            self.aux_request = None
        self.attention = torch.compile(self.flex_attention, dynamic=False)
        self.attention_with_sink = torch.compile(self.sink_attention, dynamic=False)

    def sink_attention(self, q, k, v, block_mask, sink):
        """Attention with one extra logit sink[h] in each softmax denominator:
        out * e^lse / (e^lse + e^sink) = out * sigmoid(lse - sink)."""
        if self.aux_request is None:
            out, lse = self.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
        else:
            out, aux = self.flex_attention(q, k, v, block_mask=block_mask, return_aux=self.aux_request(lse=True))
            lse = aux.lse
        return (out * torch.sigmoid(lse - sink[:, None]).unsqueeze(-1)).to(out.dtype)

    def call(self, provider, variant, seqlen):
        """(forward, leaves) of the peer for the variant."""
        q, k, v = leaves = random_inputs(TOKENS // seqlen, HEADS, seqlen, HEAD_DIM)
        if provider == "sdpa-flash":
            dropout_p = DROPOUT if variant.kind == "dropout" else 0.0

            def sdpa():
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, dropout_p=dropout_p, is_causal=variant.causal)

            return sdpa, leaves
        mask_mod = flex_mask_mod(*variant.visible)
        block_mask = None if mask_mod is None else self.create_block_mask(
            mask_mod, None, None, seqlen, seqlen, device=DEVICE)
        if variant.kind == "sinks":
            sink = torch.randn(HEADS, device=DEVICE, requires_grad=True)
            return lambda: self.attention_with_sink(q, k, v, block_mask, sink), [*leaves, sink]
        score_mod = flex_score_mod(variant.kind)
        return lambda: self.attention(q, k, v, score_mod=score_mod, block_mask=block_mask), leaves


def flex_mask_mod(left, right):
    """FlexAttention mask_mod of the window (left, right) (-1: unbounded); None when it hides nothing."""
    if (left, right) == (-1, -1):
        return None

    def mask_mod(b, h, q_idx, kv_idx):
        seen = kv_idx <= q_idx + right if right >= 0 else kv_idx >= 0
        return seen & (kv_idx >= q_idx - left) if left >= 0 else seen

    return mask_mod


def flex_score_mod(kind):
    """FlexAttention score_mod of the option (on scaled scores, as flash-attn applies them); None
    for the options that need none."""
    if kind == "softcap":
        return lambda score, b, h, q_idx, kv_idx: SOFTCAP * torch.tanh(score / SOFTCAP)
    if kind == "alibi":
        slopes = alibi_slopes()
        return lambda score, b, h, q_idx, kv_idx: score - slopes[h] * (q_idx - kv_idx).abs()
    return None


def mask_label(causal):
    return "causal" if causal else "nc"


def time_provider(provider, make_call, variant, seqlen):
    """{direction: TFLOP/s}; NaN, with one printed line, from the direction that failed on."""
    rates = {}
    try:
        forward, leaves = make_call(variant, seqlen)
        for direction in DIRECTIONS:
            # (this script's calls close over their leaves, so they take none: eager timing only)
            rates[direction] = time_tflops(lambda *_: forward(), leaves, attention_flops(variant, seqlen, direction),
                                           direction)
    except Exception as error:  # an option not built, a peer that fails to compile or run, out of memory
        lines = str(error).strip().splitlines()
        print(f"  {provider} {variant.name} {mask_label(variant.causal)} N={seqlen} {DIRECTIONS[len(rates)]}:"
              f" failed ({type(error).__name__}: {lines[0][:200] if lines else ''})")
    return {direction: rates.get(direction, math.nan) for direction in DIRECTIONS}


def measure(variants, seqlens, providers, out, rounds):
    """Times every (variant, N, provider) ``rounds`` times, a round visiting every row before the
    next begins, and keeps each row's median rate: the GPU's clock falls as it heats, so rows timed
    one after another would put the options, timed after their plain baseline, on a slower chip.
    Rewrites ``out`` after each round so that a run cut short keeps what it measured; returns the
    CSV rows."""
    fa = load_kernel() if "ours" in providers else None
    peers = Peers() if "peers" in providers else None
    setup = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
    measured = {}  # (variant, seqlen, provider) -> [{direction: TFLOP/s} per round]
    rows = []
    for round_index in range(rounds):
        for variant in variants:
            for seqlen in seqlens:
                calls = {"ours": partial(ours_call, fa)} if fa is not None else {}
                if peers is not None:
                    calls.update({peer: partial(peers.call, peer) for peer in variant.peers})
                for provider, make_call in calls.items():
                    rates = time_provider(provider, make_call, variant, seqlen)
                    measured.setdefault((variant, seqlen, provider), []).append(rates)
                    print(f"{provider:>10} {variant.name:>17} {mask_label(variant.causal):>6} N={seqlen:<5}"
                          + "".join(f"  {direction} {rate:6.1f}" for direction, rate in rates.items())
                          + f" TFLOP/s  (round {round_index + 1}/{rounds})")
        rows = []
        for (variant, seqlen, provider), per_round in measured.items():
            for direction in DIRECTIONS:
                rate = statistics.median(rates[direction] for rates in per_round)
                flops = attention_flops(variant, seqlen, direction)
                rows.append(dict(variant=variant.name, causal=variant.causal, seqlen=seqlen, direction=direction,
                                 provider=provider, flops=flops, tflops=rate, ms=flops / rate * 1e-9, setup=setup))
        write_csv(out, rows)
    return rows


def read_rows(paths):
    """Rows of the CSVs; a later file's row replaces an earlier one for the same measurement."""
    rows = {}
    for path in paths:
        with open(path, newline="") as handle:
            for row in csv.DictReader(handle):
                row.update(causal=row["causal"] == "True", seqlen=int(row["seqlen"]), flops=float(row["flops"]),
                           tflops=float(row["tflops"]), ms=float(row["ms"]))
                rows[row["variant"], row["causal"], row["seqlen"], row["direction"], row["provider"]] = row
    return list(rows.values())


def lookup(rows, field):
    """{(variant, causal, seqlen, direction, provider): row[field]}."""
    return {(r["variant"], r["causal"], r["seqlen"], r["direction"], r["provider"]): r[field] for r in rows}


def ratio(a, b):
    return None if a is None or b is None else a / b


def cell(value, digits):
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(rows):
    tflops = lookup(rows, "tflops")
    print("\nTFLOP/s on visible (query, key) pairs; x PEER = ours / PEER;"
          " x plain = ours / ours plain with the same causal flag (< 1: the option costs)")
    for provider, setup in {r["provider"]: r["setup"] for r in rows}.items():
        print(f"  {provider}: {setup}")
    header = (f"{'variant':>17} {'causal':>6} {'N':>6} {'dir':>4} {'ours':>7}" + "".join(f" {p:>10}" for p in PEERS)
              + "".join(f" {'x ' + p:>12}" for p in PEERS) + f" {'x plain':>8}")
    print(header)
    for variant in VARIANTS:
        seqlens = sorted({r["seqlen"] for r in rows if (r["variant"], r["causal"]) == (variant.name, variant.causal)})
        for direction in DIRECTIONS:
            for seqlen in seqlens:
                ours = tflops.get((variant.name, variant.causal, seqlen, direction, "ours"))
                peers = [tflops.get((variant.name, variant.causal, seqlen, direction, p)) for p in PEERS]
                plain = tflops.get(("plain", variant.causal, seqlen, direction, "ours"))
                print(f"{variant.name:>17} {str(variant.causal):>6} {seqlen:>6} {direction:>4} {cell(ours, 1):>7}"
                      + "".join(f" {cell(p, 1):>10}" for p in peers)
                      + "".join(f" {cell(ratio(ours, p), 2):>12}" for p in peers)
                      + f" {cell(ratio(ours, plain), 2):>8}")


def target_checks(rows):
    """(label, bound, larger_is_better, {where: value}) per target of the issue, on ours."""
    ours = [r for r in rows if r["provider"] == "ours"]
    tflops, ms = lookup(ours, "tflops"), lookup(ours, "ms")

    def value(table, variant, causal, seqlen, direction):
        return table.get((variant, causal, seqlen, direction, "ours"), math.nan)

    def points(variant):
        return sorted({(r["causal"], r["seqlen"]) for r in ours if r["variant"] == variant})

    def where(causal, seqlen):
        return f"{mask_label(causal)} N={seqlen}"

    checks = [
        (f"window(4096,0) {direction} at N=16k: TFLOP/s >= 0.9x plain causal", 0.9, True,
         {where(True, 16384): value(tflops, "window(4096,0)", True, 16384, direction)
          / value(tflops, "plain", True, 16384, direction)})
        for direction in DIRECTIONS
    ]
    checks += [
        (f"{option} {direction}: time <= 1.10x plain", 1.10, False,
         {where(causal, seqlen): value(ms, option, causal, seqlen, direction)
          / value(ms, "plain", causal, seqlen, direction) for causal, seqlen in points(option)})
        for option in ("softcap", "alibi", "sinks") for direction in DIRECTIONS
    ]
    checks.append(
        ("dropout fwd+bwd: time <= 1.30x plain", 1.30, False,
         {where(causal, seqlen): sum(value(ms, "dropout", causal, seqlen, d) for d in DIRECTIONS)
          / sum(value(ms, "plain", causal, seqlen, d) for d in DIRECTIONS)
          for causal, seqlen in points("dropout")}))
    return checks


def print_targets(rows):
    print("\ntargets (ours; worst point over the rows measured)")
    for label, bound, larger_is_better, values in target_checks(rows):
        measured = {where: v for where, v in values.items() if not math.isnan(v)}
        missing = sorted(set(values) - set(measured))
        if not measured:
            print(f"  {label:<58} not measured")
            continue
        where, worst = (min if larger_is_better else max)(measured.items(), key=lambda item: item[1])
        holds = worst >= bound if larger_is_better else worst <= bound
        print(f"  {label:<58} worst {worst:.2f}x ({where})  {'holds' if holds else 'FAILS'}"
              + (f"  (not measured: {', '.join(missing)})" if missing else ""))


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--providers", choices=["ours", "peers", "both"], default="both",
                        help="time this kernel, the PyTorch peers, or both (default)")
    parser.add_argument("--seqlens", type=int, nargs="+", default=SEQLENS, help="divisors of 16384")
    parser.add_argument("--variants", nargs="+", choices=KINDS, default=list(KINDS),
                        help="options to time (default all); plain, their baseline, is always timed")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over every row; each row reports its median (default 3)")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="CSV",
                        help="time nothing: merge these CSVs (a later one wins on the same row) into --out,"
                             " print the table and the targets")
    parser.add_argument("--out", type=Path,
                        help="CSV to write (default benchmarks/results/variants.csv; variants-ours.csv /"
                             " variants-peers.csv with --providers ours / peers)")
    args = parser.parse_args(argv)
    if any(seqlen <= 0 or TOKENS % seqlen for seqlen in args.seqlens):
        parser.error(f"--seqlens must divide {TOKENS}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    single = args.providers if args.providers != "both" and not args.merge else None
    out = args.out or REPO_ROOT / "benchmarks" / "results" / (f"variants-{single}.csv" if single else "variants.csv")
    out.parent.mkdir(parents=True, exist_ok=True)

    if args.merge:
        rows = read_rows(args.merge)
        write_csv(out, rows)
    else:
        providers = {"ours", "peers"} if args.providers == "both" else {args.providers}
        variants = [v for v in VARIANTS if v.kind == "plain" or v.kind in args.variants]
        rows = measure(variants, args.seqlens, providers, out, args.rounds)
    print_table(rows)
    print_targets(rows)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
