"""Host cost: every public call timed as users call it (eager) and as the GPU runs it (graph).

Each call is timed two ways in one process, on the same inputs:

* eager: 100 back-to-back calls after a warm-up, one synchronisation after the last, the wall
  time per call (median of 3 such runs). This is what a training step or ``generate()`` sees:
  while the host issues calls faster than the GPU runs them, eager equals the GPU time; where it
  is slower, eager is the host's time per call and no kernel work shows.
* graph: 20 calls captured in one CUDA graph and replayed (median of 5 replays), per call:
  the GPU time alone, with the L2 as warm as in the eager runs.

"e/g" is eager over graph (1.00: the host is hidden). "x flash" is SDPA FLASH's eager time over
ours (> 1: ours is faster as users call it); a peer that cannot run the shape prints n/a.

Sections (--sections):

  host     batch 1, N = 128 (the GPU work is negligible: the eager time is the host cost):
           flash_attn_func forward and forward + backward, flash_attn_varlen_func (one sequence)
           forward and forward + backward, flash_attn_with_kvcache decode steps (one query
           token over a 1k cache: contiguous, paged with pages of 256, with num_splits 4 (the
           merge kernel), and appending the step's key/value with rotary), apply_rotary_emb.
           Peers: SDPA FLASH and CUDNN on the same dense shapes (the varlen rows compare with the
           dense call on the same tokens; the decode rows with SDPA FLASH over the same cache,
           (1, heads, 1, d) against (1, heads_k, 1k, d) with enable_gqa); the rotary row with
           the rotate-half formula in eager torch ops (transformers' apply_rotary_pos_emb).
  scaling  16k tokens (batch = 16384 / N), 16 heads, N = 512 ... 4096, causal and not, head
           dim 64 and 128, bf16 and fp16 (--dtypes): forward and forward + backward, against
           SDPA FLASH and CUDNN. Issue 41's goal: e/g at most 1.10 (forward) and 1.15
           (forward + backward) from N = 1k; rows past it print "!".
  options  N = 1024, 16k tokens, bf16, d128: each option of the variants (window, softcap,
           ALiBi, sinks, dropout) and the varlen path (16 sequences of 1k), forward and
           forward + backward, with the same e/g goal.
  profile  cProfile of 20 steady-state calls of the N = 1024 forward + backward (bf16, d128,
           causal): Python function calls per call and the 25 functions of most own time.

The kernel is loaded as users load it: the built Hub variant through ``kernels``
(scripts/build_variants.py first), as bench_flash_attention does.

Usage: python benchmarks/bench_host.py [--sections host scaling options profile] [--quick]
           [--out benchmarks/results/host.md]
"""

import argparse
import cProfile
import io
import pstats
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_decode import gpu_busy_us, issue_and_wall_us
from bench_flash_attention import load_kernel

SECTIONS = ["host", "scaling", "options", "profile"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PEERS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
TOKENS = 16384
HEADS = 16
EAGER_CALLS = 100
GOAL = {"fwd": 1.10, "fwd+bwd": 1.15}  # issue 41: eager within 10% / 15% of graph time from N = 1k


def eager_us(fn, calls=EAGER_CALLS, runs=3):
    """Median over ``runs`` of the wall time per call of ``calls`` back-to-back calls, one
    synchronisation after the last (bench_decode.issue_and_wall_us; the first run warms up)."""
    return statistics.median(issue_and_wall_us(fn, calls, warmup=10 if run == 0 else 0)[1] for run in range(runs))


def graph_us(fn, calls=20, runs=5):
    """GPU time per call: ``calls`` calls captured in one CUDA graph (after warm-up on a side
    stream, as torch.cuda.graphs documents), the median over ``runs`` replays, per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def timed(fn):
    """(eager us, GPU us), or None where ``fn`` raises (a peer without the shape). The GPU time is
    graph_us's, or where the call cannot be captured the summed kernel times of a profiler trace
    (bench_decode.gpu_busy_us; a line printed above the row says so)."""
    try:
        fn()
        eager = eager_us(fn)
    except (RuntimeError, ValueError, NotImplementedError) as error:
        print(f"  (n/a: {str(error).splitlines()[0][:120]})")
        torch.cuda.empty_cache()
        return None
    try:
        return eager, graph_us(fn)
    except RuntimeError as error:
        print(f"  (not capturable, kernel time from the profiler instead: {error})")
        torch.cuda.synchronize()
        return eager, gpu_busy_us(fn)


def with_backward(forward, leaves):
    """``forward()`` and the gradients of ``leaves`` by a fixed random output gradient."""
    out = forward()
    # (drawn on the CPU: the CUDA generator may not be used between a failed capture and the next)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out)
    return lambda: torch.autograd.grad(forward(), leaves, dout)


def sdpa(backend, q, k, v, causal=False, **kwargs):
    """SDPA restricted to ``backend`` on (batch, seqlen, heads, d) tensors (transposed views)."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def call():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **kwargs)

    return call


class Table:
    def __init__(self, title, peers):
        self.title, self.peers, self.rows, self.misses = title, peers, [], 0
        columns = ["call", "shape", "ours eager", "ours graph", "e/g"]
        for peer in peers:
            columns += [f"{peer} eager", f"{peer} graph", f"x {peer}"]
        self.header = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)

    def row(self, call, shape, ours, peers, goal=None):
        cells = [call, shape]
        if ours is None:
            cells += ["n/a", "n/a", "n/a"]
        else:
            ratio = ours[0] / ours[1]
            miss = goal is not None and ratio > goal
            self.misses += miss
            cells += [f"{ours[0]:.0f}", f"{ours[1]:.0f}", f"{ratio:.2f}" + (" !" if miss else "")]
        for peer in self.peers:
            theirs = peers.get(peer)
            if theirs is None:
                cells += ["n/a", "n/a", "n/a"]
            else:
                cells += [f"{theirs[0]:.0f}", f"{theirs[1]:.0f}",
                          f"{theirs[0] / ours[0]:.2f}" if ours is not None else "n/a"]
        line = "| " + " | ".join(cells) + " |"
        self.rows.append(line)
        print(line, flush=True)

    def markdown(self):
        text = f"\n### {self.title}\n\nMicroseconds per call.\n\n{self.header}\n" + "\n".join(self.rows) + "\n"
        if self.misses:
            text += f"\n{self.misses} row(s) above issue 41's eager/graph goal (marked !).\n"
        return text


_INPUTS = torch.Generator().manual_seed(0)


def randn(*shape, dtype=torch.bfloat16, grad=False):
    """Random inputs, drawn on the CPU (see with_backward)."""
    return torch.randn(*shape, generator=_INPUTS).to("cuda", dtype).requires_grad_(grad)


def host_section(fa, report):
    table = Table("host: batch 1, N = 128, 16 heads, d128, bf16", list(PEERS))
    print(table.header)
    n, d = 128, 128
    q, k, v = (randn(1, n, HEADS, d, grad=True) for _ in range(3))
    dense_peers = {name: timed(sdpa(backend, q, k, v, causal=True)) for name, backend in PEERS.items()}
    table.row("flash_attn_func fwd", "causal", timed(lambda: fa.flash_attn_func(q, k, v, causal=True)), dense_peers)
    peers = {name: timed(with_backward(sdpa(backend, q, k, v, causal=True), (q, k, v)))
             for name, backend in PEERS.items()}
    table.row("flash_attn_func fwd+bwd", "causal",
              timed(with_backward(lambda: fa.flash_attn_func(q, k, v, causal=True), (q, k, v))), peers)
    qp, kp, vp = (x.detach().view(n, HEADS, d).requires_grad_() for x in (q, k, v))
    cu = torch.tensor([0, n], device="cuda", dtype=torch.int32)

    def varlen():
        return fa.flash_attn_varlen_func(qp, kp, vp, cu, cu, n, n, causal=True)

    table.row("flash_attn_varlen_func fwd", "1 sequence, causal", timed(varlen), dense_peers)
    table.row("flash_attn_varlen_func fwd+bwd", "1 sequence, causal",
              timed(with_backward(varlen, (qp, kp, vp))), peers)

    heads_k, cache = 4, 1024
    qd = randn(1, 1, HEADS, d)
    k_cache, v_cache = randn(1, cache, heads_k, d), randn(1, cache, heads_k, d)
    seqlens = torch.full((1,), cache, device="cuda", dtype=torch.int32)
    page = 256
    k_paged, v_paged = (x.view(cache // page, page, heads_k, d).clone() for x in (k_cache, v_cache))
    table_pages = torch.arange(cache // page, device="cuda", dtype=torch.int32).view(1, -1)
    decode_peer = {"flash": timed(_sdpa_decode(SDPBackend.FLASH_ATTENTION, qd, k_cache, v_cache)),
                   "cudnn": timed(_sdpa_decode(SDPBackend.CUDNN_ATTENTION, qd, k_cache, v_cache))}
    table.row("flash_attn_with_kvcache", "decode, 1k cache",
              timed(lambda: fa.flash_attn_with_kvcache(qd, k_cache, v_cache, cache_seqlens=seqlens, causal=True)),
              decode_peer)
    table.row("flash_attn_with_kvcache", "decode, paged 256",
              timed(lambda: fa.flash_attn_with_kvcache(qd, k_paged, v_paged, cache_seqlens=seqlens,
                                                       block_table=table_pages, causal=True)), decode_peer)
    table.row("flash_attn_with_kvcache", "decode, num_splits 4 (merge)",
              timed(lambda: fa.flash_attn_with_kvcache(qd, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                       num_splits=4)), decode_peer)
    k_new, v_new = randn(1, 1, heads_k, d), randn(1, 1, heads_k, d)
    cos, sin = randn(2 * cache, d // 2), randn(2 * cache, d // 2)
    short = torch.full((1,), cache - 1, device="cuda", dtype=torch.int32)
    table.row("flash_attn_with_kvcache", "append k/v + rotary",
              timed(lambda: fa.flash_attn_with_kvcache(qd, k_cache, v_cache, k_new, v_new, rotary_cos=cos,
                                                       rotary_sin=sin, cache_seqlens=short, causal=True)),
              decode_peer)
    x = randn(1, n, HEADS, d)
    cos_n, sin_n = cos[:n], sin[:n]
    table.row("apply_rotary_emb", "N = 128", timed(lambda: fa.apply_rotary_emb(x, cos_n, sin_n)),
              {"flash": timed(lambda: _rotate_half_rotary(x, cos_n, sin_n)), "cudnn": None})
    report.append(table.markdown() + "\nPeers of the decode rows: SDPA over the same contiguous cache; of "
                  "apply_rotary_emb: the rotate-half formula in eager torch ops (in the flash column).\n")


def _sdpa_decode(backend, q, k_cache, v_cache):
    qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)

    def call():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    return call


def _rotate_half_rotary(x, cos, sin):
    """transformers' apply_rotary_pos_emb on (batch, seqlen, heads, d) with half-dim cos / sin."""
    cos_full = torch.cat((cos, cos), dim=-1)[None, :, None, :]
    sin_full = torch.cat((sin, sin), dim=-1)[None, :, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos_full + rotated * sin_full


def _dense_rows(fa, table, n, d, dtype, causal, goal_from=1024, options=None, label=None):
    batch = TOKENS // n
    q, k, v = (randn(batch, n, HEADS, d, dtype=dtype, grad=True) for _ in range(3))
    options = options or {}

    def ours():
        return fa.flash_attn_func(q, k, v, causal=causal, **options)

    shape = label or f"N={n} d{d} {'bf16' if dtype == torch.bfloat16 else 'fp16'} {'causal' if causal else 'full'}"
    peers = {} if options else {name: timed(sdpa(backend, q, k, v, causal)) for name, backend in PEERS.items()}
    table.row("fwd", shape, timed(ours), peers, GOAL["fwd"] if n >= goal_from else None)
    peers = {} if options else {name: timed(with_backward(sdpa(backend, q, k, v, causal), (q, k, v)))
                                for name, backend in PEERS.items()}
    table.row("fwd+bwd", shape, timed(with_backward(ours, (q, k, v))), peers,
              GOAL["fwd+bwd"] if n >= goal_from else None)


def scaling_section(fa, report, args):
    table = Table(f"scaling: {TOKENS} tokens, {HEADS} heads", list(PEERS))
    print(table.header)
    for dtype_name in args.dtypes:
        for d in args.head_dims:
            for causal in (True, False):
                for n in args.seqlens:
                    _dense_rows(fa, table, n, d, DTYPES[dtype_name], causal)
    report.append(table.markdown())


def options_section(fa, report):
    table = Table(f"options: N = 1024, {TOKENS} tokens, {HEADS} heads, d128, bf16", [])
    print(table.header)
    n, d = 1024, 128
    slopes = randn(HEADS, dtype=torch.float32).abs() * 0.1
    sinks = randn(HEADS, dtype=torch.float32, grad=True)
    for label, options in [("causal", dict()), ("window (256, 0)", dict(window_size=(256, 0))),
                           ("softcap 50", dict(softcap=50.0)), ("alibi", dict(alibi_slopes=slopes)),
                           ("sinks", dict(s_aux=sinks)), ("dropout 0.1", dict(dropout_p=0.1))]:
        _dense_rows(fa, table, n, d, torch.bfloat16, True, options=options, label=f"causal, {label}")
    batch = TOKENS // n
    q, k, v = (randn(TOKENS, HEADS, d, grad=True) for _ in range(3))
    cu = torch.arange(0, TOKENS + 1, n, device="cuda", dtype=torch.int32)

    def varlen():
        return fa.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True)

    table.row("varlen fwd", f"{batch} x 1k, causal", timed(varlen), {}, GOAL["fwd"])
    table.row("varlen fwd+bwd", f"{batch} x 1k, causal", timed(with_backward(varlen, (q, k, v))), {}, GOAL["fwd+bwd"])
    report.append(table.markdown())


def profile_section(fa, report, calls=20):
    n, d = 1024, 128
    q, k, v = (randn(TOKENS // n, n, HEADS, d, grad=True) for _ in range(3))
    step = with_backward(lambda: fa.flash_attn_func(q, k, v, causal=True), (q, k, v))
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
    summary = (f"\n### profile: {calls} forward + backward calls, N = 1024, d128, bf16, causal\n\n"
               f"{stats.total_calls / calls:.0f} Python function calls per forward + backward.\n\n```\n"
               + text.getvalue().strip() + "\n```\n")
    print(summary)
    report.append(summary)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=SECTIONS)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--seqlens", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    parser.add_argument("--quick", action="store_true", help="bf16, d128, N = 512 and 1024 in the scaling section")
    parser.add_argument("--out", help="also write the tables here (markdown)")
    parser.add_argument("--build", help="load the Hub variant built under this folder (default: the repository's "
                                        "build/; another tree's, to compare two in one run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.dtypes, args.head_dims, args.seqlens = ["bf16"], [128], [512, 1024]
    if args.build:
        import kernels

        fa = kernels.get_local_kernel(Path(args.build).resolve())
    else:
        fa = load_kernel()
    device = torch.cuda.get_device_name()
    report = [f"# Host cost per call\n\n{device}, torch {torch.__version__}, Triton {triton.__version__}, "
              f"{Path(args.build or 'build').as_posix()}\n"]
    print(report[0])
    for section in args.sections:
        if section == "host":
            host_section(fa, report)
        elif section == "scaling":
            scaling_section(fa, report, args)
        elif section == "options":
            options_section(fa, report)
        elif section == "profile":
            profile_section(fa, report)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write("\n".join(report))


if __name__ == "__main__":
    main(sys.argv[1:])
