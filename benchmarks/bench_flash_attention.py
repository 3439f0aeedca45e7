"""Forward and backward TFLOP/s of this kernel against PyTorch's attention backends, in one run.

Peers, timed in the same process on the same inputs: SDPA with the FLASH (FlashAttention-2),
CUDNN and EFFICIENT backends, and FlexAttention compiled by torch.compile (Dynamo's recompile
limit is raised so every shape really compiles instead of silently falling back to eager).

Grid (flash-attn's benchmark): batch x seqlen = 16k tokens, hidden 2048 (heads = 2048 / head_dim),
head dim 64 and 128, seqlen 512 to 16k, causal and not, bf16 and fp16. Layout (batch, heads,
seqlen, head_dim) for everyone. Times are triton.testing.do_bench medians; backward is timed
alone (the forward graph is kept). With ``--timing graph`` every call is captured in a CUDA graph
and replayed (``triton.testing.do_bench_cudagraph``; the backward as forward + backward less the
forward, see time_tflops): GPU time without the host's launch cost, where the default times calls
as users make them, back to back. FLOPs: forward 4 * B * H * N^2 * d, halved when causal;
backward 2.5x forward (5 matmuls; this kernel's atomic-free backward really does 7).

Varlen rows: one batch of mixed lengths (drawn between 128 and 4k, 16k tokens in all, head dim
128, bf16), forward and backward, causal and not. TFLOP/s are counted on real tokens for every
entry: this kernel's flash_attn_varlen_func on the packed batch, this kernel and SDPA FLASH on the
same batch padded to the longest sequence, and, for scale, this kernel's dense rate on a uniform
batch with the same token count and the mean length.

Writes one CSV and PNG per (direction, dtype, head dim, mask) to --out, and prints a table of
TFLOP/s with this kernel's ratio to each peer. The kernel is loaded as users load it: the built
Hub variant through ``kernels`` (run scripts/build_variants.py first).

Usage: python benchmarks/bench_flash_attention.py [--quick] [--timing eager|graph] [--out benchmarks/results]
"""

import argparse
import csv
import math
import sys
from pathlib import Path

import torch
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKENS, HIDDEN = 16384, 2048
SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
PEERS = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
         "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}
PROVIDERS = ["triton-fa", *PEERS, "flex"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def load_kernel():
    import kernels

    return kernels.get_local_kernel(REPO_ROOT / "build")


def attention_flops(batch, heads, seqlen, head_dim, causal, direction):
    flops = 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    return flops * (2.5 if direction == "bwd" else 1.0)


class Attention:
    """Builds the callable each provider runs for one shape."""

    def __init__(self, fa):
        self.fa = fa
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        torch._dynamo.config.recompile_limit = 10_000
        torch._dynamo.config.accumulated_recompile_limit = 10_000
        self.flex = torch.compile(flex_attention, dynamic=False)
        self.create_block_mask = create_block_mask

    def forward_fn(self, provider, causal, seqlen):
        """provider's attention as a function of (q, k, v)."""
        if provider == "triton-fa":
            return lambda q, k, v: self.fa.flash_attention_forward(q, k, v, causal=causal)
        if provider == "flex":
            mask = self.create_block_mask(lambda b, h, i, j: i >= j, None, None, seqlen, seqlen) if causal else None
            return lambda q, k, v: self.flex(q, k, v, block_mask=mask)
        backend = PEERS[provider]

        def sdpa(q, k, v):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return sdpa


def bench_one(attention, provider, direction, dtype, head_dim, causal, seqlen, timing="eager"):
    batch, heads = TOKENS // seqlen, HIDDEN // head_dim
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    flops = attention_flops(batch, heads, seqlen, head_dim, causal, direction)
    try:
        return time_tflops(attention.forward_fn(provider, causal, seqlen), (q, k, v), flops, direction, timing)
    except RuntimeError as error:  # a backend without a kernel for this shape/dtype
        print(f"  {provider} {direction} {dtype} d{head_dim} N{seqlen}: unavailable ({str(error).splitlines()[0]})")
        return float("nan")


def mixed_lengths(total=TOKENS, low=128, high=4096, seed=0):
    """Sequence lengths drawn uniformly in [low, high] until they add up to ``total``."""
    generator = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(low, high + 1, (1,), generator=generator)))
    lengths[-1] -= sum(lengths) - total
    if lengths[-1] < low:  # fold a short remainder into the previous sequence
        lengths[-2] += lengths.pop()
    return lengths


def time_tflops(forward, leaves, flops, direction, timing="eager"):
    """TFLOP/s of ``forward(*leaves)`` ("fwd"), or of the backward alone into ``leaves`` ("bwd"),
    from the median of do_bench ("eager": the forward graph is built once and kept, the backward
    timed alone) or of do_bench_cudagraph ("graph": GPU time of the replayed calls). A graph cannot
    replay a backward alone (autograd runs each backward kernel on the stream its forward ran on,
    which is not the capturing one), so "graph" times forward + backward into fresh leaves made in
    the captured call, and subtracts the forward."""
    dout = torch.randn_like(forward(*leaves))
    if timing == "graph":
        def graph_ms(fn):
            torch.cuda.synchronize()
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")

        def forward_backward():
            fresh = [x.detach().requires_grad_() for x in leaves]
            torch.autograd.grad(forward(*fresh), fresh, dout)

        milliseconds = graph_ms(lambda: forward(*leaves))
        if direction == "bwd":
            milliseconds = graph_ms(forward_backward) - milliseconds
        return flops / milliseconds * 1e-9
    fn = lambda: forward(*leaves)  # noqa: E731
    if direction == "bwd":
        out = forward(*leaves)
        fn = lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)  # noqa: E731
    fn()
    return flops / triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-9


def bench_varlen(fa, head_dim=128, dtype=torch.bfloat16):
    """Rows of the varlen table (see the module docstring)."""
    lengths = mixed_lengths()
    heads, longest, batch = HIDDEN // head_dim, max(lengths), len(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    print(f"\nvarlen batch: {batch} sequences, lengths {sorted(lengths)}, {sum(lengths)} tokens")
    rows = []
    for direction in ("fwd", "bwd"):
        for causal in (False, True):
            real_flops = sum(attention_flops(1, heads, n, head_dim, causal, direction) for n in lengths)
            packed = [torch.randn(sum(lengths), heads, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                      for _ in range(3)]
            padded = [torch.randn(batch, heads, longest, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                      for _ in range(3)]
            mean = TOKENS // batch
            uniform = [torch.randn(batch, heads, mean, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                       for _ in range(3)]

            def sdpa_padded(*tensors):
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return torch.nn.functional.scaled_dot_product_attention(*tensors, is_causal=causal)

            row = dict(direction=direction, causal=causal, tokens=sum(lengths), sequences=batch, longest=longest)
            row["varlen"] = time_tflops(
                lambda *tensors: fa.flash_attn_varlen_func(*tensors, cu, cu, longest, longest, causal=causal),
                packed, real_flops, direction)
            row["padded"] = time_tflops(
                lambda *tensors: fa.flash_attention_forward(*tensors, causal=causal), padded, real_flops, direction)
            row["sdpa-flash-padded"] = time_tflops(sdpa_padded, padded, real_flops, direction)
            row["dense-uniform"] = time_tflops(
                lambda *tensors: fa.flash_attention_forward(*tensors, causal=causal), uniform,
                attention_flops(batch, heads, mean, head_dim, causal, direction), direction)
            rows.append(row)
    print("direction  mask    varlen  padded  sdpa-flash-padded  dense-uniform   x sdpa-flash-padded  x dense-uniform")
    for row in rows:
        print(f"{row['direction']:>9} {'causal' if row['causal'] else 'nc':>5} {row['varlen']:>9.1f} {row['padded']:>7.1f}"
              f" {row['sdpa-flash-padded']:>18.1f} {row['dense-uniform']:>14.1f}"
              f" {row['varlen'] / row['sdpa-flash-padded']:>20.2f} {row['varlen'] / row['dense-uniform']:>16.2f}")
    return rows


def make_benchmarks(args):
    return [
        triton.testing.Benchmark(
            x_names=["seqlen"], x_vals=args.seqlens, line_arg="provider", line_vals=args.providers,
            line_names=args.providers,
            ylabel="TFLOP/s", x_log=True, plot_name=f"{direction}-{dtype}-d{head_dim}-{'causal' if causal else 'full'}",
            args=dict(direction=direction, dtype=dtype, head_dim=head_dim, causal=causal),
        )
        for direction in args.directions for dtype in args.dtypes for head_dim in args.head_dims
        for causal in (False, True)
    ]


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--seqlens", type=int, nargs="+", default=SEQLENS)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--directions", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    parser.add_argument("--quick", action="store_true", help="bf16, head dim 128, seqlens 1k/4k/16k only")
    parser.add_argument("--varlen-only", action="store_true", help="only the mixed-length varlen table")
    parser.add_argument("--no-varlen", action="store_true", help="no mixed-length varlen table")
    parser.add_argument("--providers", nargs="+", default=PROVIDERS, choices=PROVIDERS,
                        help="triton-fa (this kernel) and the peers to time")
    parser.add_argument("--timing", choices=["eager", "graph"], default="eager",
                        help="calls back to back as users make them, or replayed from a CUDA graph (GPU time)")
    args = parser.parse_args(argv)
    if args.quick:
        args.seqlens, args.head_dims, args.dtypes = [1024, 4096, 16384], [128], ["bf16"]
    args.out.mkdir(parents=True, exist_ok=True)

    fa = load_kernel()
    if not args.no_varlen:
        write_csv(args.out / "varlen.csv", bench_varlen(fa))
    if args.varlen_only:
        return
    attention = Attention(fa)
    rows = []
    for benchmark in make_benchmarks(args):
        settings = benchmark.args

        @triton.testing.perf_report(benchmark)
        def report(seqlen, provider, direction, dtype, head_dim, causal):
            return bench_one(attention, provider, direction, DTYPES[dtype], head_dim, causal, seqlen, args.timing)

        frames = report.run(save_path=str(args.out), print_data=False, return_df=True)
        frame = frames[0] if isinstance(frames, list) else frames
        for record in frame.to_dict("records"):
            tflops = {p: float(record[f"{p} (TFLOP/s)"]) for p in args.providers}
            rows.append({**settings, "seqlen": int(record["seqlen"]), **tflops})
        print_rows([r for r in rows if all(r[key] == value for key, value in settings.items())], args.providers)

    write_csv(args.out / "summary.csv", rows)
    print(f"\nwrote summary.csv, varlen.csv and one CSV/PNG per table to {args.out}")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"timing {args.timing}")


def write_csv(path, rows):
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def print_rows(rows, providers):
    first = rows[0]
    print(f"\n{first['direction']} {first['dtype']} d={first['head_dim']} {'causal' if first['causal'] else 'non-causal'}"
          " (TFLOP/s; ratio = triton-fa / peer)")
    peers = [p for p in providers if p != "triton-fa"]
    print(f"{'seqlen':>6} " + " ".join(f"{p:>14}" for p in providers) + " " + " ".join(f"{'x' + p:>16}" for p in peers))
    for row in rows:
        ratios = [row["triton-fa"] / row[p] if row[p] and not math.isnan(row[p]) else float("nan") for p in peers]
        print(f"{row['seqlen']:>6} " + " ".join(f"{row[p]:>14.1f}" for p in providers) + " "
              + " ".join(f"{r:>16.2f}" for r in ratios))


if __name__ == "__main__":
    main(sys.argv[1:])
