"""KV-cache inference: flash_attn_with_kvcache against PyTorch's attention and our prefill path.

Every row is timed in one process on the same inputs (bf16, 32 query heads / 8 KV heads, head
dim 128 unless --dtype / --heads / --heads-k / --head-dim say otherwise); times are
triton.testing.do_bench medians (warmup 25 ms, rep 100 ms; do_bench clears the L2 before each
call, so even a small cache is read from HBM) of CUDA-graph replays of each call: the GPU's time,
which is what bandwidth means (--timing eager times the calls as issued instead, where a call's
host time shows once it exceeds the GPU's; the host section measures host time itself).

Bandwidth. A call is counted as reading K and V once: batch * seqlen_k * nheads_k * head_dim *
2 tensors * element size bytes (seqlen_k = keys attended: the whole cache), divided by the median
time, in TB/s. Queries, outputs, the block table and appended rows are not counted (they are
below 1% of the bytes in every decode row). A peer that needs K/V expanded to all query heads
(GQA refused) reads group-size times more bytes; its TB/s is still counted on the same nominal
bytes (so its ratio to ours is its time ratio) and a note under the row says so.

Copy ceiling ("x copy"): torch.empty_like(x).copy_(x) of a >= 1 GB buffer (--copy-gb), counted
as bench_rotary counts x.clone(): bytes read + bytes written per second (the read side alone is
half of it; both are printed). A decode step only reads, so x copy near 1 means K/V stream at
about the rate a copy moves bytes through HBM. Ratios "x PEER" = PEER time / our time (> 1: ours
is faster), i.e. our bandwidth over the peer's. A peer that raises prints "n/a (reason)".

Sections (--sections):

  decode   seqlen_q 1, batch 1 / 8 / 64, cache 1k ... 128k keys (rows whose K + V exceed
           --max-cache-gb, default 40, are skipped), causal=True, no new k/v, cache_seqlens =
           the full length. Our layouts: contiguous (batch, seqlen, nheads_k, d), paged with page
           16 and page 256 (pages shuffled over the cache, int32 block table). Peers, once per
           (batch, cache), on the contiguous cache: SDPA restricted to FLASH_ATTENTION and to
           CUDNN_ATTENTION (q (batch, heads, 1, d), k/v (batch, heads_k, seqlen, d) views of the
           same cache, enable_gqa=True; seqlen_q 1 sees every key, so no mask), and this
           package's prefill path fa.flash_attn_func(q, k, v, causal=True).
  spec     speculative decoding: seqlen_q 4 / 8 / 16 at cache 4k and 16k, batch 8, causal
           (bottom-right: query i sees keys j <= i + seqlen_k - seqlen_q). Time in us and
           bandwidth. "ours" attends over the full cache; "+append" is the same call writing the
           seqlen_q new keys/values into the cache first (cache_seqlens = seqlen_k - seqlen_q).
           SDPA's is_causal is top-left, so the peers get a bottom-right mask: sdpa-flash-lr is
           FLASH through torch.nn.attention.bias.causal_lower_right (FlashAttention's causal is
           bottom-right), sdpa-cudnn-mask and sdpa-eff-mask are CUDNN / EFFICIENT with an
           explicit boolean (seqlen_q, seqlen_k) mask; plus fa.flash_attn_func(causal=True).
  chunked  chunked prefill: seqlen_q 512 against a 32k cache, batch 1, causal; as spec, plus
           TFLOP/s on the visible (query, key) pairs (4 * batch * heads * pairs * d).
  splits   num_splits sweep on one decode row (batch 1, cache 16k, contiguous): 0 (auto), 1, 2,
           4, 8, 16, 32, 64; time, bandwidth, ratio to auto.
  host     host overhead. (a) A tiny model's decode loop: 4 layers, each one
           flash_attn_with_kvcache call appending the step's key/value (batch 1, 1 new token,
           starting at 1k keys) plus a tiny matmul (out @ (heads*d, 128)), cache_seqlens += 1
           per step; wall clock over --host-steps steps after warm-up, one synchronize at the
           end only, so launch overhead shows. Against the same loop with SDPA (default
           dispatch, enable_gqa) on a preallocated (batch, heads_k, capacity, d) cache, appending
           by index_copy_ at a position tensor (as transformers' StaticCache does) and attending
           over the valid prefix. Each loop's GPU time per step (the kernel durations of one step
           at a fixed length, summed from a torch.profiler trace) is printed beside it: wall >> GPU
           means the host is the bottleneck.
           (b) Per-call host time: N back-to-back calls without synchronize (batch 1, 1k cache),
           the time to issue them / N, the wall time until they finished / N, and the GPU (kernel)
           time of one call from torch.profiler, for ours (with and without an appended token),
           flash_attn_func, SDPA FLASH and one torch.add (the floor of a single launch).

The kernel is loaded as users load it: the built Hub variant through ``kernels``
(run scripts/build_variants.py first). --smoke instead builds the current source tree into a
temporary folder (without asking git for a build id), and on a machine without a GPU runs
through Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported): one tiny row
per section, heads 8/2, head dim 64, wall-clock medians; it exits 1 if our rows fail or disagree
with the reference. It is a check that the script and the API fit, not a measurement.

Usage: python benchmarks/bench_decode.py [--quick] [--sections decode spec chunked splits host]
           [--out benchmarks/results/decode.md]     (after scripts/build_variants.py, on a GPU)
       python benchmarks/bench_decode.py --smoke    (any machine; CPU through the interpreter)
"""

import argparse
import contextlib
import math
import os
import secrets
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():  # must precede the first import of triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from bench_flash_attention import load_kernel  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SECTIONS = ["decode", "spec", "chunked", "splits", "host"]
CACHE_LENS = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
SPLITS = [0, 1, 2, 4, 8, 16, 32, 64]
ERROR_LIMIT = 0.05  # --smoke fails above this max |ours - reference| (bf16 outputs of N(0, 1) inputs)


# ----------------------------------------------------------------------------------------------
# timing and formatting


def synchronize():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


TIMING = {"mode": "graph"}  # --timing


def replay_of(fn):
    """``fn`` captured in a CUDA graph (after a warm-up call on a side stream), as a callable that
    replays it: the GPU time of its kernels, without the host time of issuing them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def median_ms(fn):
    """do_bench median on a GPU, of CUDA-graph replays of ``fn`` with --timing graph (the default;
    a call that cannot be captured is timed as issued); on CPU (--smoke) the median of three
    wall-clock calls."""
    if DEVICE == "cuda":
        if TIMING["mode"] == "graph":
            try:
                fn = replay_of(fn)
            except Exception:  # noqa: BLE001 (not capturable: timed eagerly)
                torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def first_line(text):
    lines = str(text).strip().splitlines()
    return lines[0].strip() if lines else ""


def failure_reason(error, caught=()):
    """The error's first line, then the distinct warnings it raised (SDPA explains why a backend
    refused the inputs only in warnings)."""
    parts = [f"{type(error).__name__}: {first_line(error)}"]
    for warning in caught:
        text = first_line(warning.message)
        if text and text not in parts:
            parts.append(text)
    reason = " | ".join(parts)
    return reason if len(reason) <= 300 else reason[:297] + "..."


@dataclass
class Timed:
    """One provider on one row: the median time (NaN when it failed), the output of its first call
    (for the error check), and a note: why it failed, or a caveat on what it ran."""

    ms: float = math.nan
    out: torch.Tensor | None = None
    note: str = ""

    @property
    def ok(self):
        return not math.isnan(self.ms)


def free_memory():
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def time_call(fn):
    """Calls ``fn`` once (compiles it; keeps the output), then times it. Anything it raises (a
    refused input, an unsupported option, out of memory) becomes a failed Timed with the reason."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = fn()
            synchronize()
            ms = median_ms(fn)
        except Exception as error:  # noqa: BLE001 (any failure is a row's "n/a (reason)")
            free_memory()
            return Timed(note=failure_reason(error, caught))
    return Timed(ms, out)


def tbps(nbytes, ms):
    return nbytes / ms * 1e-9


def speedup(peer, ours):
    """PEER time / our time: > 1 when ours is faster (= our bandwidth over the peer's)."""
    return peer.ms / ours.ms if peer.ok and ours.ok else math.nan


def fmt(value, digits=2):
    return "n/a" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def size_label(n):
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def max_error(out, reference):
    """max |out - reference| over the outputs in (batch, seqlen_q, heads, d); NaN if either is missing."""
    if out is None or reference is None:
        return math.nan
    return (out.float() - reference.float()).abs().max().item()


class Table:
    """A printed table: its title, explanation and header when created, each row as it is measured,
    notes under the rows; ``markdown()`` renders it for --out."""

    def __init__(self, report, title, explain, columns):
        self.title, self.explain, self.columns = title, explain, columns
        self.widths = [max(len(column), 6) for column in columns]
        self.rows, self.notes = [], []
        report.tables.append(self)
        print(f"\n{title}")
        for line in explain:
            print(f"  {line}")
        print(" ".join(f"{column:>{width}}" for column, width in zip(columns, self.widths)), flush=True)

    def row(self, cells):
        cells = [str(cell) for cell in cells]
        assert len(cells) == len(self.columns), (cells, self.columns)
        self.rows.append(cells)
        print(" ".join(f"{cell:>{width}}" for cell, width in zip(cells, self.widths)), flush=True)

    def note(self, text):
        self.notes.append(text)
        print(f"    {text}", flush=True)

    def markdown(self):
        lines = [f"## {self.title}", "", *self.explain, "", "| " + " | ".join(self.columns) + " |",
                 "|" + "---|" * len(self.columns), *("| " + " | ".join(row) + " |" for row in self.rows)]
        if self.notes:
            lines += ["", *(f"- {note}" for note in self.notes)]
        return "\n".join(lines) + "\n"


class Report:
    """The header lines and tables of this run; rewritten to --out after every section, so that a
    run cut short keeps what it measured."""

    def __init__(self, out, header):
        self.out, self.header, self.tables = out, header, []

    def write(self):
        if self.out is None:
            return
        self.out.parent.mkdir(parents=True, exist_ok=True)
        text = "# flash_attn_with_kvcache benchmark\n\n" + "".join(f"{line}  \n" for line in self.header)
        self.out.write_text(text + "".join("\n" + table.markdown() for table in self.tables))


# ----------------------------------------------------------------------------------------------
# inputs


class Bench:
    """The loaded package, the shapes of the run and the copy ceiling; builds the inputs."""

    def __init__(self, fa, args, report):
        self.fa, self.args, self.report = fa, args, report
        self.dtype = DTYPES[args.dtype]
        self.heads, self.heads_k, self.head_dim = args.heads, args.heads_k, args.head_dim
        self.copy_ceiling = math.nan  # TB/s, read + written
        self.failures, self.worst_error = 0, 0.0  # over our calls, for --smoke's exit status

    def record(self, timings, reference):
        """Counts our failed calls and keeps the worst error against the reference."""
        for timed in timings:
            self.failures += not timed.ok
            error = max_error(timed.out, reference)
            if not math.isnan(error):
                self.worst_error = max(self.worst_error, error)

    def kv_bytes(self, batch, seqlen_k):
        """Bytes of K and V read by one call over seqlen_k keys."""
        return batch * seqlen_k * self.heads_k * self.head_dim * 2 * self.dtype.itemsize

    def randn(self, *shape):
        return torch.randn(*shape, device=DEVICE, dtype=self.dtype)

    def sequence_rows(self, sequence, which, length):
        """The ``length`` keys (which=0) or values (which=1) of one sequence, (length, heads_k, d):
        seeded per sequence, so the contiguous and paged caches of a row hold the same data while
        only one sequence exists twice in memory."""
        generator = torch.Generator(device=DEVICE).manual_seed(2 * sequence + which)
        return torch.randn(length, self.heads_k, self.head_dim, generator=generator, device=DEVICE, dtype=self.dtype)

    def contiguous_cache(self, batch, length):
        """k_cache, v_cache (batch, length, heads_k, d)."""
        caches = []
        for which in (0, 1):
            cache = torch.empty(batch, length, self.heads_k, self.head_dim, device=DEVICE, dtype=self.dtype)
            for sequence in range(batch):
                cache[sequence] = self.sequence_rows(sequence, which, length)
            caches.append(cache)
        return caches

    def paged_cache(self, batch, length, page_size):
        """k_cache, v_cache (batch * pages, page_size, heads_k, d) holding the rows of
        contiguous_cache(batch, length) on shuffled pages, and the int32 block table (batch, pages)."""
        pages = -(-length // page_size)
        order = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(0))
        table = order.view(batch, pages).to(device=DEVICE, dtype=torch.int32)
        caches = []
        for which in (0, 1):
            cache = torch.zeros(batch * pages, page_size, self.heads_k, self.head_dim, device=DEVICE, dtype=self.dtype)
            for sequence in range(batch):
                rows = F.pad(self.sequence_rows(sequence, which, length), (0, 0, 0, 0, 0, pages * page_size - length))
                cache[table[sequence].long()] = rows.view(pages, page_size, self.heads_k, self.head_dim)
            caches.append(cache)
        return caches[0], caches[1], table

    def fits(self, nbytes, factor=1.2):
        """Whether ``nbytes`` more fit in the free device memory (with a margin); always on CPU."""
        if DEVICE != "cuda":
            return True
        torch.cuda.empty_cache()
        return nbytes * factor < torch.cuda.mem_get_info()[0]

    # ------------------------------------------------------------------------------------------
    # providers

    def ours(self, q, k_cache, v_cache, **options):
        fa = self.fa
        return time_call(lambda: fa.flash_attn_with_kvcache(q, k_cache, v_cache, causal=True, **options))

    def prefill(self, q, k, v):
        fa = self.fa
        return time_call(lambda: fa.flash_attn_func(q, k, v, causal=True))

    def sdpa(self, backend, q, k, v, mask=None):
        """SDPA restricted to ``backend`` on q (batch, seqlen_q, heads, d) and a contiguous cache
        k, v (batch, seqlen_k, heads_k, d), as (batch, heads, seqlen, d) views with enable_gqa=True.
        If the backend refuses them: with (batch, heads, seqlen, d) contiguous copies, then with K/V
        expanded to every query head (group-size times the bytes), each where memory allows.
        The output comes back as (batch, seqlen_q, heads, d); the note names the fallback used."""
        group = self.heads // self.heads_k

        def run(q_, k_, v_, gqa):
            def call():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, enable_gqa=gqa)
            return time_call(call)

        q_t, k_t, v_t = (x.transpose(1, 2) for x in (q, k, v))
        timed = run(q_t, k_t, v_t, True)
        reasons = [timed.note]
        if not timed.ok:
            if self.fits(k.numel() * k.element_size() * 2):
                timed = run(q_t.contiguous(), k_t.contiguous(), v_t.contiguous(), True)
                timed.note = timed.note if not timed.ok else "on (batch, heads, seqlen, d) contiguous copies"
            else:
                timed = Timed(note="no memory for contiguous copies")
            reasons.append(timed.note)
        if not timed.ok and group > 1:
            if self.fits(k.numel() * k.element_size() * 2 * group):
                expanded = [x.repeat_interleave(group, dim=1) for x in (k_t, v_t)]
                timed = run(q_t.contiguous(), *expanded, False)
                del expanded
                if timed.ok:
                    timed.note = (f"GQA refused ({reasons[0]}); K/V expanded to {self.heads} heads: reads {group}x"
                                  " the bytes counted")
            else:
                timed = Timed(note=f"K/V expanded to {self.heads} heads would need "
                                   f"{2 * group * k.numel() * k.element_size() / 1e9:.1f} GB")
            reasons.append(timed.note)
        if not timed.ok:
            retries = [reason for reason in dict.fromkeys(reasons[1:]) if reason and reason != reasons[0]]
            same = " (the same with contiguous copies / expanded K/V)" if len(reasons) > 1 and not retries else ""
            timed.note = reasons[0] + same + "".join(f"; retried: {reason}" for reason in retries)
        if timed.out is not None:
            timed.out = timed.out.transpose(1, 2)
        free_memory()
        return timed


def peer_cells(peers, ours, where, rate=None):
    """Cells of the peers (TB/s when ``rate`` is given, else us), the ratios, and the notes to print
    under the row: "n/a (reason)" for a peer that failed, the caveat of one that needed a fallback."""
    values, ratios, notes = [], [], []
    for name, timed in peers.items():
        if rate is not None:
            values.append(fmt(rate(timed.ms)) if timed.ok else "n/a")
        else:
            values.append(fmt(timed.ms * 1e3, 1) if timed.ok else "n/a")
        ratios.append(fmt(speedup(timed, ours)))
        if timed.note:
            notes.append(f"{where} {name}: {timed.note if timed.ok else f'n/a ({timed.note})'}")
    return values, ratios, notes


def reference_of(peers):
    """The first peer output that exists: the reference our rows' max error is measured against."""
    for name, timed in peers.items():
        if timed.out is not None:
            return name, timed.out
    return None, None


# ----------------------------------------------------------------------------------------------
# sections


def decode_section(bench):
    args = bench.args
    peer_names = ["sdpa-flash", "sdpa-cudnn", "fa-prefill"]
    layouts = ["contiguous", *(f"paged {page}" for page in args.page_sizes)]
    table = Table(bench.report, "decode: seqlen_q 1, causal, no new k/v",
                  [f"{bench.args.dtype}, {bench.heads}/{bench.heads_k} heads, d {bench.head_dim};"
                   " TB/s = K+V bytes read / median time; x copy = ours TB/s / copy ceiling (read + written);",
                   "x PEER = PEER time / ours; peers run once per (batch, cache) on the contiguous cache;"
                   " err = max |ours - reference| (first peer that ran)"],
                  ["batch", "cache", "layout", "ours us", "ours TB/s", "x copy",
                   *(f"{p} TB/s" for p in peer_names), *(f"x {p}" for p in peer_names), "err"])
    for batch in args.batches:
        for length in args.cache_lens:
            nbytes = bench.kv_bytes(batch, length)
            where = f"b={batch} cache={size_label(length)}"
            if nbytes > args.max_cache_gb * 1e9:
                table.note(f"{where}: skipped (K+V {nbytes / 1e9:.1f} GB > --max-cache-gb {args.max_cache_gb:g})")
                continue
            q = bench.randn(batch, 1, bench.heads, bench.head_dim)
            seqlens = torch.full((batch,), length, dtype=torch.int32, device=DEVICE)
            results = {}
            try:
                k, v = bench.contiguous_cache(batch, length)
            except Exception as error:  # noqa: BLE001 (out of memory)
                free_memory()
                table.note(f"{where}: skipped ({failure_reason(error)})")
                continue
            peers = {"sdpa-flash": bench.sdpa(SDPBackend.FLASH_ATTENTION, q, k, v),
                     "sdpa-cudnn": bench.sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v),
                     "fa-prefill": bench.prefill(q, k, v)}
            results["contiguous"] = bench.ours(q, k, v, cache_seqlens=seqlens)
            del k, v
            free_memory()
            for page_size in args.page_sizes:
                try:
                    k_pages, v_pages, block_table = bench.paged_cache(batch, length, page_size)
                except Exception as error:  # noqa: BLE001 (out of memory)
                    results[f"paged {page_size}"] = Timed(note=failure_reason(error))
                    free_memory()
                    continue
                results[f"paged {page_size}"] = bench.ours(q, k_pages, v_pages, cache_seqlens=seqlens,
                                                           block_table=block_table)
                del k_pages, v_pages, block_table
                free_memory()
            reference_name, reference = reference_of(peers)
            for layout in layouts:
                ours = results[layout]
                rate = tbps(nbytes, ours.ms)
                values, ratios, notes = peer_cells(peers, ours, where, rate=lambda ms: tbps(nbytes, ms))
                table.row([batch, size_label(length), layout, fmt(ours.ms * 1e3, 1), fmt(rate),
                           fmt(rate / bench.copy_ceiling), *values, *ratios,
                           fmt(max_error(ours.out, reference), 4)])
            for layout in layouts:
                if not results[layout].ok:
                    table.note(f"{where} ours {layout}: n/a ({results[layout].note})")
            for note in notes:
                table.note(note)
            check_peers(table, where, peers, reference_name, reference)
            bench.record(results.values(), reference)
            del peers, results, q
            free_memory()


def check_peers(table, where, peers, reference_name, reference):
    """A note for a peer whose output disagrees with the reference (a wrong peer is no peer)."""
    for name, timed in peers.items():
        error = max_error(timed.out, reference)
        if name != reference_name and error > ERROR_LIMIT:
            table.note(f"{where} {name}: max |{name} - {reference_name}| = {error:.3g}")


def bottom_right_mask(seqlen_q, seqlen_k):
    """Boolean (seqlen_q, seqlen_k), True where query i sees key j <= i + seqlen_k - seqlen_q."""
    return torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=DEVICE).tril(seqlen_k - seqlen_q)


def masked_rows(bench, table, batch, seqlen_q, length, with_flops):
    """One spec / chunked row: causal seqlen_q queries over ``length`` keys."""
    from torch.nn.attention.bias import causal_lower_right

    where = f"q={seqlen_q} cache={size_label(length)}"
    nbytes = bench.kv_bytes(batch, length)
    q = bench.randn(batch, seqlen_q, bench.heads, bench.head_dim)
    k, v = bench.contiguous_cache(batch, length)
    mask = bottom_right_mask(seqlen_q, length)
    peers = {"sdpa-flash-lr": bench.sdpa(SDPBackend.FLASH_ATTENTION, q, k, v,
                                         mask=causal_lower_right(seqlen_q, length)),
             "sdpa-cudnn-mask": bench.sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, mask=mask),
             "sdpa-eff-mask": bench.sdpa(SDPBackend.EFFICIENT_ATTENTION, q, k, v, mask=mask),
             "fa-prefill": bench.prefill(q, k, v)}
    full = torch.full((batch,), length, dtype=torch.int32, device=DEVICE)
    ours = bench.ours(q, k, v, cache_seqlens=full)
    # the same call appending the last seqlen_q keys/values (rewritten with themselves each call)
    k_new, v_new = k[:, length - seqlen_q:].clone(), v[:, length - seqlen_q:].clone()
    before = torch.full((batch,), length - seqlen_q, dtype=torch.int32, device=DEVICE)
    append = bench.ours(q, k, v, k=k_new, v=v_new, cache_seqlens=before)
    reference_name, reference = reference_of(peers)
    rate = tbps(nbytes, ours.ms)
    values, ratios, notes = peer_cells(peers, ours, where)
    cells = [seqlen_q, size_label(length), batch, fmt(ours.ms * 1e3, 1), fmt(rate), fmt(rate / bench.copy_ceiling)]
    if with_flops:
        pairs = seqlen_q * (length - seqlen_q) + seqlen_q * (seqlen_q + 1) // 2
        flops = 4 * batch * bench.heads * pairs * bench.head_dim
        cells.append(fmt(flops / ours.ms * 1e-9, 1))
    table.row([*cells, fmt(append.ms * 1e3, 1), *values, *ratios, fmt(max_error(ours.out, reference), 4),
               fmt(max_error(append.out, reference), 4)])
    for name, timed in (("ours", ours), ("ours+append", append)):
        if not timed.ok:
            table.note(f"{where} {name}: n/a ({timed.note})")
    for note in notes:
        table.note(note)
    check_peers(table, where, peers, reference_name, reference)
    bench.record((ours, append), reference)
    del k, v, peers
    free_memory()


MASKED_PEERS = ["sdpa-flash-lr", "sdpa-cudnn-mask", "sdpa-eff-mask", "fa-prefill"]
MASKED_EXPLAIN = [
    "causal = bottom-right; +append: the same call writing the seqlen_q new k/v into the cache first;",
    "sdpa-flash-lr: FLASH via causal_lower_right; sdpa-*-mask: CUDNN / EFFICIENT with a boolean bottom-right"
    " mask; fa-prefill: fa.flash_attn_func(causal=True);",
    "x PEER = PEER time / ours; err = max |ours - reference| (first peer that ran)",
]


def spec_section(bench):
    args = bench.args
    table = Table(bench.report, "speculative decoding: seqlen_q > 1 over a cache, causal", MASKED_EXPLAIN,
                  ["q", "cache", "batch", "ours us", "ours TB/s", "x copy", "+append us",
                   *(f"{p} us" for p in MASKED_PEERS), *(f"x {p}" for p in MASKED_PEERS), "err", "err append"])
    for length in args.spec_cache_lens:
        for seqlen_q in args.spec_qlens:
            masked_rows(bench, table, args.spec_batch, seqlen_q, length, with_flops=False)


def chunked_section(bench):
    args = bench.args
    table = Table(bench.report, "chunked prefill: a chunk of queries against a long cache, causal",
                  [*MASKED_EXPLAIN, "TFLOP/s on visible (query, key) pairs: 4 * batch * heads * pairs * d"],
                  ["q", "cache", "batch", "ours us", "ours TB/s", "x copy", "TFLOP/s", "+append us",
                   *(f"{p} us" for p in MASKED_PEERS), *(f"x {p}" for p in MASKED_PEERS), "err", "err append"])
    masked_rows(bench, table, 1, args.chunk, args.chunk_cache, with_flops=True)


def splits_section(bench):
    args = bench.args
    length, batch = args.splits_cache, 1
    table = Table(bench.report, f"num_splits sweep: decode, batch {batch}, cache {size_label(length)}, contiguous",
                  ["0 = the package's own choice; x auto = auto time / this time; err = max |out - auto's out|"],
                  ["num_splits", "us", "TB/s", "x copy", "x auto", "err"])
    nbytes = bench.kv_bytes(batch, length)
    q = bench.randn(batch, 1, bench.heads, bench.head_dim)
    k, v = bench.contiguous_cache(batch, length)
    seqlens = torch.full((batch,), length, dtype=torch.int32, device=DEVICE)
    auto = None
    for splits in args.splits:
        timed = bench.ours(q, k, v, cache_seqlens=seqlens, num_splits=splits)
        auto = timed if splits == 0 else auto
        reference = auto.out if auto is not None else None
        rate = tbps(nbytes, timed.ms)
        table.row([splits, fmt(timed.ms * 1e3, 1), fmt(rate), fmt(rate / bench.copy_ceiling),
                   fmt(speedup(auto, timed)) if auto is not None else "n/a",
                   fmt(max_error(timed.out, reference), 4)])
        if not timed.ok:
            table.note(f"num_splits={splits}: n/a ({timed.note})")
        bench.record([timed], reference)
    del k, v
    free_memory()


def issue_and_wall_us(fn, calls, warmup):
    """(us to issue one call, us per call until all finished): ``calls`` back-to-back calls, one
    synchronize after the last."""
    for _ in range(warmup):
        fn()
    synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    synchronize()
    done = time.perf_counter()
    return (issued - start) / calls * 1e6, (done - start) / calls * 1e6


def gpu_busy_us(fn, calls=20):
    """GPU time per call: the summed durations of the kernels (and copies) that ``calls`` calls
    ran, from a torch.profiler trace; NaN without a GPU. Unlike a do_bench median of a host-bound
    call, it leaves out the time the GPU waits for the host."""
    if DEVICE != "cuda":
        return math.nan
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            for _ in range(calls):
                fn()
            synchronize()
    except RuntimeError:  # a profiler that cannot start (CUPTI busy or missing): no number
        return math.nan
    device_events = [event for event in trace.events()
                     if event.device_type == DeviceType.CUDA and not event.name.startswith("Activity Buffer")]
    if not device_events:  # a profiler that recorded no kernel: better no number than 0
        return math.nan
    return sum(event.time_range.elapsed_us() for event in device_events) / calls


def host_section(bench):
    host_loop_table(bench)
    free_memory()
    host_call_table(bench)
    free_memory()


def host_loop_table(bench):
    """The decode loop table: ours against SDPA, per step (see the module docstring)."""
    args = bench.args
    fa, batch, start, layers = bench.fa, 1, args.host_cache, args.host_layers
    steps, warmup = args.host_steps, args.host_warmup
    capacity = start + warmup + steps + 64  # (the profiled and graphed steps advance too)
    heads, heads_k, head_dim = bench.heads, bench.heads_k, bench.head_dim
    q = bench.randn(batch, 1, heads, head_dim)
    k_new, v_new = bench.randn(batch, 1, heads_k, head_dim), bench.randn(batch, 1, heads_k, head_dim)
    weight = bench.randn(heads * head_dim, 128) * 0.02

    table = Table(bench.report, f"host: a {layers}-layer decode loop (batch {batch}, 1 new token per step, "
                  f"from {size_label(start)} keys)",
                  [f"each layer: one attention call appending the token's k/v + out @ ({heads * head_dim}, 128);"
                   f" wall clock over {steps} steps after {warmup}, one synchronize at the end;",
                   "GPU us/step: kernel time of one step (torch.profiler, at a fixed length);"
                   " x ours = loop time / ours loop time"],
                  ["loop", "us/step", "us/layer", "GPU us/step", "wall / GPU", "x ours"])

    # ours: (batch, capacity, heads_k, d) caches, cache_seqlens advanced on the device
    caches = [(torch.zeros(batch, capacity, heads_k, head_dim, device=DEVICE, dtype=bench.dtype),
               torch.zeros(batch, capacity, heads_k, head_dim, device=DEVICE, dtype=bench.dtype))
              for _ in range(layers)]
    for k_cache, v_cache in caches:
        k_cache[:, :start].normal_()
        v_cache[:, :start].normal_()
    seqlens = torch.full((batch,), start, dtype=torch.int32, device=DEVICE)

    def ours_step(advance=True):
        hidden = None
        for k_cache, v_cache in caches:
            out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens, causal=True)
            hidden = out.view(batch, -1) @ weight
        if advance:
            seqlens.add_(1)
        return hidden

    # SDPA: (batch, heads_k, capacity, d) caches, index_copy_ at a position tensor, attention over the prefix
    caches_t = [(k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous())
                for k_cache, v_cache in caches]
    q_t, k_new_t, v_new_t = (x.transpose(1, 2) for x in (q, k_new, v_new))
    position = torch.tensor([start], dtype=torch.long, device=DEVICE)
    length = [start]  # the host knows how many keys are valid

    def sdpa_step(advance=True, backends=None):
        hidden = None
        for k_cache, v_cache in caches_t:
            k_cache.index_copy_(2, position, k_new_t)
            v_cache.index_copy_(2, position, v_new_t)
            valid = length[0] + 1
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q_t, k_cache[:, :, :valid], v_cache[:, :, :valid],
                                                     enable_gqa=True)
            hidden = out.transpose(1, 2).reshape(batch, -1) @ weight
        if advance:
            position.add_(1)
            length[0] += 1
        return hidden

    def sdpa_flash_step(advance=True):
        return sdpa_step(advance, [SDPBackend.FLASH_ATTENTION])

    # ours, the whole step captured in one CUDA graph (cache_seqlens lives on the device, so a replay
    # appends at the next position): what a serving loop that uses graphs pays per step
    graph_step = []

    def ours_graph_step(advance=True):
        if not graph_step:
            graph_step.append(replay_of(ours_step))
        graph_step[0]()

    def reset():  # every loop starts from the same cache length (and stays inside the caches)
        seqlens.fill_(start)
        position.fill_(start)
        length[0] = start

    loops = {}
    for name, step in (("flash_attn_with_kvcache", ours_step), ("flash_attn_with_kvcache, CUDA graph", ours_graph_step),
                       ("sdpa + index_copy_", sdpa_step), ("sdpa FLASH + index_copy_", sdpa_flash_step)):
        reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                gpu_us = gpu_busy_us(lambda: step(advance=False))
                _, wall_us = issue_and_wall_us(step, steps, warmup)
                loops[name] = (wall_us, gpu_us)
            except Exception as error:  # noqa: BLE001
                loops[name] = None
                bench.failures += step is ours_step
                table.note(f"{name}: n/a ({failure_reason(error, caught)})")
    ours_wall = loops["flash_attn_with_kvcache"][0] if loops["flash_attn_with_kvcache"] else math.nan
    for name, measured in loops.items():
        wall_us, gpu_us = measured if measured else (math.nan, math.nan)
        table.row([name, fmt(wall_us, 1), fmt(wall_us / layers, 1), fmt(gpu_us, 1), fmt(wall_us / gpu_us),
                   fmt(wall_us / ours_wall)])


def host_call_table(bench):
    """The per-call host time table (batch 1, args.host_cache keys, seqlen_q 1)."""
    args = bench.args
    fa, batch, start, calls = bench.fa, 1, args.host_cache, args.host_calls
    q = bench.randn(batch, 1, bench.heads, bench.head_dim)
    k_new, v_new = (bench.randn(batch, 1, bench.heads_k, bench.head_dim) for _ in range(2))
    table = Table(bench.report, f"host: time per call (batch {batch}, cache {size_label(start)}, seqlen_q 1)",
                  [f"{calls} back-to-back calls without synchronize: issue us = host time to launch one call,"
                   " wall us = time until all finished / calls;",
                   "GPU us = kernel time of one call (torch.profiler);"
                   " wall us >> GPU us: host-bound, and then wall us = issue us"],
                  ["call", "issue us", "wall us", "GPU us"])
    k_cache, v_cache = bench.contiguous_cache(batch, start + 1)
    full = torch.full((batch,), start, dtype=torch.int32, device=DEVICE)
    k_view, v_view = k_cache[:, :start], v_cache[:, :start]
    q_t, k_t, v_t = q.transpose(1, 2), k_view.transpose(1, 2), v_view.transpose(1, 2)

    def sdpa_flash():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q_t, k_t, v_t, enable_gqa=True)

    single = {
        "flash_attn_with_kvcache": lambda: fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=full,
                                                                      causal=True),
        "flash_attn_with_kvcache + append": lambda: fa.flash_attn_with_kvcache(
            q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=full, causal=True),
        "fa.flash_attn_func": lambda: fa.flash_attn_func(q, k_view, v_view, causal=True),
        "sdpa-flash": sdpa_flash,
        "torch.add (one launch)": lambda: torch.add(q, 1),
    }
    for name, fn in single.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                gpu_us = gpu_busy_us(fn)
                issue_us, wall_us = issue_and_wall_us(fn, calls, warmup=10)
                table.row([name, fmt(issue_us, 1), fmt(wall_us, 1), fmt(gpu_us, 1)])
            except Exception as error:  # noqa: BLE001
                table.row([name, "n/a", "n/a", "n/a"])
                bench.failures += name.startswith("flash_attn_with_kvcache")
                table.note(f"{name}: n/a ({failure_reason(error, caught)})")
                free_memory()


# ----------------------------------------------------------------------------------------------


def measure_copy_ceiling(nbytes):
    """TB/s of torch.empty_like(x).copy_(x) on an ``nbytes`` buffer, counted read + written (timed
    as issued: one long kernel, whose host time hides under the GPU's)."""
    x = torch.empty(nbytes // 2, device=DEVICE, dtype=torch.bfloat16).normal_()
    mode, TIMING["mode"] = TIMING["mode"], "eager"
    ms = median_ms(lambda: torch.empty_like(x).copy_(x))
    TIMING["mode"] = mode
    return 2 * nbytes / ms * 1e-9


def load_for_smoke():
    """The current source tree built into a temporary folder (as tests/conftest.py does), with a
    random build id instead of asking git for one."""
    import kernels

    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import build_variants

    build_variants._build_id = lambda repo_root: "smoke" + secrets.token_hex(4)
    global _SMOKE_BUILD  # kept alive (and removed at exit) while the module loaded from it is used
    _SMOKE_BUILD = tempfile.TemporaryDirectory(prefix="bench_decode_")
    return kernels.get_local_kernel(build_variants.build(out_dir=Path(_SMOKE_BUILD.name)))


def apply_presets(args):
    if args.smoke:  # one tiny row per section
        args.heads, args.heads_k, args.head_dim = 8, 2, 64
        args.batches, args.cache_lens, args.page_sizes = [2], [160], [16]
        args.spec_qlens, args.spec_cache_lens, args.spec_batch = [4], [96], 2
        args.chunk, args.chunk_cache = 24, 128
        args.splits, args.splits_cache = [0, 1, 3], 192
        args.host_layers, args.host_steps, args.host_warmup, args.host_calls, args.host_cache = 2, 3, 1, 3, 64
        args.copy_gb = 0.008
    elif args.quick:
        args.batches, args.cache_lens = [1, 64], [4096, 32768]
        args.spec_qlens, args.spec_cache_lens = [4, 16], [16384]
        args.splits = [0, 1, 8, 32]
        args.host_steps = 50


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=SECTIONS,
                        help="sections to run (default all)")
    parser.add_argument("--quick", action="store_true",
                        help="a few rows: decode batch 1/64 at 4k/32k, spec q 4/16 at 16k, splits 0/1/8/32,"
                             " 50 host steps")
    parser.add_argument("--smoke", action="store_true",
                        help="one tiny row per section from a fresh build of the source tree; CPU through"
                             " TRITON_INTERPRET=1 when there is no GPU; exit 1 if our rows fail")
    parser.add_argument("--out", type=Path, metavar="FILE",
                        help="markdown file for the tables (default benchmarks/results/decode.md; none with --smoke)")
    parser.add_argument("--timing", choices=["graph", "eager"], default="graph",
                        help="graph: time CUDA-graph replays of each call (the GPU's time); eager: time the calls "
                             "as issued (host time shows where it exceeds the GPU's)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--heads", type=int, default=32, help="query heads")
    parser.add_argument("--heads-k", type=int, default=8, help="KV heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64], help="decode batches")
    parser.add_argument("--cache-lens", type=int, nargs="+", default=CACHE_LENS, help="decode cache lengths (keys)")
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16, 256], help="paged layouts timed in decode")
    parser.add_argument("--max-cache-gb", type=float, default=40.0, help="skip decode rows whose K+V exceed this")
    parser.add_argument("--spec-qlens", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--spec-cache-lens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--spec-batch", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=512, help="chunked prefill: queries per chunk")
    parser.add_argument("--chunk-cache", type=int, default=32768, help="chunked prefill: keys in the cache")
    parser.add_argument("--splits", type=int, nargs="+", default=SPLITS, help="num_splits values of the sweep")
    parser.add_argument("--splits-cache", type=int, default=16384, help="cache length of the sweep (batch 1)")
    parser.add_argument("--host-layers", type=int, default=4)
    parser.add_argument("--host-steps", type=int, default=200)
    parser.add_argument("--host-warmup", type=int, default=20)
    parser.add_argument("--host-calls", type=int, default=1000, help="back-to-back calls of the per-call host time")
    parser.add_argument("--host-cache", type=int, default=1024, help="keys in the cache at the start of the host loop")
    parser.add_argument("--copy-gb", type=float, default=1.0, help="buffer of the copy ceiling, GB (>= 1 on a GPU)")
    args = parser.parse_args(argv)
    apply_presets(args)
    TIMING["mode"] = args.timing
    if args.heads % args.heads_k:
        parser.error("--heads must be a multiple of --heads-k")
    if args.out is None and not args.smoke:
        args.out = REPO_ROOT / "benchmarks" / "results" / "decode.md"
    torch.manual_seed(0)

    fa = load_for_smoke() if args.smoke else load_kernel()
    if not hasattr(fa, "flash_attn_with_kvcache"):
        sys.exit(f"the loaded package ({fa.__file__}) has no flash_attn_with_kvcache:"
                 " rebuild it with scripts/build_variants.py")
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU, Triton interpreter (TRITON_INTERPRET=1)"
    header = [f"device {device_name}, torch {torch.__version__}, triton {triton.__version__}",
              f"command: python {' '.join([Path(sys.argv[0]).name, *argv])}; package {Path(fa.__file__).parent}",
              f"{args.dtype}, {args.heads} query heads / {args.heads_k} KV heads, head dim {args.head_dim};"
              " times: triton.testing.do_bench medians" + (" (wall clock on CPU)" if DEVICE != "cuda" else
                                                            f" of {'CUDA-graph replays' if args.timing == 'graph' else 'eager calls'}"
                                                            " (the host section: wall clock)"),
              "TB/s = K and V bytes read (batch * seqlen_k * heads_k * d * 2 tensors * element size) / median time"]
    for line in header:
        print(line)
    report = Report(args.out, header)
    bench = Bench(fa, args, report)
    copy_bytes = int(args.copy_gb * 1e9)
    bench.copy_ceiling = measure_copy_ceiling(copy_bytes)
    line = (f"copy ceiling: torch.empty_like(x).copy_(x), {copy_bytes / 1e9:.2f} GB buffer:"
            f" {bench.copy_ceiling:.2f} TB/s"
            f" counted as bytes read + written (bench_rotary's x.clone() convention; read side alone"
            f" {bench.copy_ceiling / 2:.2f} TB/s); x copy = ours TB/s / {bench.copy_ceiling:.2f}")
    print(line)
    header.append(line)

    sections = {"decode": decode_section, "spec": spec_section, "chunked": chunked_section,
                "splits": splits_section, "host": host_section}
    for name in SECTIONS:
        if name in args.sections:
            sections[name](bench)
            report.write()
    if args.out is not None:
        print(f"\nwrote {args.out}")
    print(f"\nours: {bench.failures} failed call(s), worst max |ours - reference| {bench.worst_error:.3g}")
    if args.smoke and (bench.failures or bench.worst_error > ERROR_LIMIT):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
