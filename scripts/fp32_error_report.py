"""Error of every result against float64, over PyTorch's own error in the same dtype (issue 39).

For each case of a grid (options x head dims x GQA ratios, fp32 and, for comparison, bf16) this
runs the package's public API forward and backward on random inputs and reports, per tensor,

    ratio = max|ours - float64 truth| / max|PyTorch attention in the same dtype - float64 truth|

for out, lse, dq, dk, dv and the sinks' gradient (dsink, whose PyTorch error is taken as the
larger of PyTorch's and that of reading back the output in the inputs' dtype, as the tests' bar
does). The project's bar is 2 for out and lse, 3 for the gradients (tests/reference.py). The
truth and the PyTorch attention are tests/reference.py's.

Options: plain, causal, window, softcap (q scaled by the softcap so that most scores saturate, as
flash-attn's tests do), ALiBi, sinks, ALiBi + sinks, dropout (the reference rebuilt from the keep
mask returned in S_dmask), a ragged varlen batch with a softcap, and flash_attn_with_kvcache
(forward only) with rotary + cache_batch_idx + causal, and paged + rotary. Each option runs at
(head dim, GQA ratio) (64, 1), (128, 8), (256, 8), (256, 1) and (59, 8) by default; --head-dims
and --ratios run their full product instead.

Prints one row per case and then, per dtype and tensor, the median, p99 and max ratio (and the
worst case), and writes the same text to $OUT/fp32_report.txt (--report-name) when $OUT is set
(rewritten after every case, so a run cut short leaves what it measured).

Usage, on a GPU, from the repository root (the package is built from the source tree, or from
--repo DIR, another checkout, into a temporary folder and loaded with kernels.get_local_kernel, as
the tests do):
  python3 scripts/fp32_error_report.py [--dtypes fp32 bf16] [--options softcap alibi_sinks ...]
      [--head-dims 64 128 256 59 --ratios 1 8] [--seqlens 1023 1024] [--seed 0] [--repo DIR]
"""

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))
sys.path.insert(0, str(REPO_ROOT / "tests"))
import build_variants  # noqa: E402
from reference import attention_ref, run_ref, run_varlen_ref, sink_grad_rounded_out  # noqa: E402

DEVICE = "cuda"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TENSORS = ("out", "lse", "dq", "dk", "dv", "dsink")
DENSE_OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(256, 128)),
    "softcap": dict(softcap=30.0),
    "softcap_causal": dict(softcap=50.0, causal=True),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "alibi_sinks": dict(alibi=True, sinks=True),
    "dropout": dict(dropout_p=0.17),
}
OTHER_OPTIONS = ("varlen_softcap", "varlen_alibi_sinks", "kv_rotary_batch_idx", "kv_paged_rotary")
ALL_OPTIONS = tuple(DENSE_OPTIONS) + OTHER_OPTIONS
DEFAULT_SHAPES = ((64, 1), (128, 8), (256, 8), (256, 1), (59, 8))  # (head dim, GQA ratio)
HEADS_Q = 8
VARLEN_LENS = ([1023, 2049, 1, 511, 700], [1024, 2049, 5, 300, 700])
KV = dict(seqlens=[1500, 2040, 3, 700], capacity=2112, batch_idx=[3, 0, 5, 1], batch_cache=6, seqlen_q=3,
          rotary_dim=None, page_size=64)


def max_err(x, ref):
    return (x.double() - ref.double()).abs().max().item() if x.numel() else 0.0


def ratio(ours, pytorch, truth, floor=None):
    """max error of ours over PyTorch's (or ``floor``'s, if larger) against the truth, on the
    entries where the truth is finite (rows that see no key have lse -inf there)."""
    finite = torch.isfinite(truth)
    ours, pytorch, truth = ours[finite], pytorch[finite], truth[finite]
    bar = max_err(pytorch, truth)
    if floor is not None:
        bar = max(bar, max_err(floor[finite] if floor.shape == finite.shape else floor, truth))
    err = max_err(ours, truth)
    if bar == 0.0:
        return 0.0 if err == 0.0 else math.inf
    return err / bar


def _slopes(batch):
    return torch.rand(batch, HEADS_Q, device=DEVICE, dtype=torch.float32) * 0.3


def _sinks(lse_truth):
    """Per head: the mean finite float64 lse (heads on axis -2) plus N(0, 1), fp32, so that the
    sink takes a real share of every row."""
    lse = lse_truth.masked_fill(torch.isinf(lse_truth), float("nan"))
    mean = lse.transpose(0, -2).reshape(HEADS_Q, -1).nanmean(dim=1).nan_to_num(0.0)
    return (mean + torch.randn_like(mean)).float()


def dense_case(fa, dtype, option, head_dim, ratio_gqa, seqlens):
    opts = dict(DENSE_OPTIONS[option])
    batch = 2 if ratio_gqa == 1 else 1
    heads_kv = HEADS_Q // ratio_gqa
    seqlen_q, seqlen_k = seqlens
    q = torch.randn(batch, seqlen_q, HEADS_Q, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    causal = opts.pop("causal", False)
    kwargs = dict(window_size=opts.pop("window_size", (-1, -1)), softcap=opts.pop("softcap", 0.0),
                  dropout_p=opts.pop("dropout_p", 0.0))
    if kwargs["softcap"]:
        q = (q.float() * kwargs["softcap"]).to(dtype)
    if opts.pop("alibi", False):
        kwargs["alibi_slopes"] = _slopes(batch)
    scale = 1.0 / math.sqrt(head_dim)
    ref = dict(window=kwargs["window_size"], softcap=kwargs["softcap"], alibi_slopes=kwargs.get("alibi_slopes"))
    sinks = None
    if opts.pop("sinks", False):
        sinks = _sinks(attention_ref(q, k, v, causal, scale, torch.float64, **ref)[1])
    inputs = [t.detach().requires_grad_() for t in (q, k, v)] + ([sinks.requires_grad_()] if sinks is not None else [])
    out, lse, S_dmask = fa.flash_attn_func(*inputs[:3], causal=causal, return_attn_probs=True,
                                           s_aux=inputs[3] if sinks is not None else None, **kwargs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dout)
    keep = ~torch.signbit(S_dmask) if kwargs["dropout_p"] > 0 else None
    ref.update(keep=keep, dropout_p=kwargs["dropout_p"] if keep is not None else 0.0)
    truth_out, truth_grads, truth_lse = run_ref(q, k, v, dout, causal, scale, torch.float64, sinks=sinks,
                                                return_lse=True, **ref)
    pt_out, pt_grads, pt_lse = run_ref(q, k, v, dout, causal, scale, dtype, sinks=sinks, return_lse=True, **ref)
    return _ratios(out, lse, grads, pt_out, pt_lse, pt_grads, truth_out, truth_lse, truth_grads, sinks, dout, dtype)


def varlen_case(fa, dtype, option, head_dim, ratio_gqa):
    lens_q, lens_k = VARLEN_LENS
    heads_kv = HEADS_Q // ratio_gqa
    q = torch.randn(sum(lens_q), HEADS_Q, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(sum(lens_k), heads_kv, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    kwargs, sinks = {}, None
    if option == "varlen_softcap":
        kwargs["softcap"] = 30.0
        q = (q.float() * 30.0).to(dtype)
    else:
        kwargs["alibi_slopes"] = _slopes(len(lens_q))
    scale = 1.0 / math.sqrt(head_dim)
    ref = dict(softcap=kwargs.get("softcap", 0.0), alibi_slopes=kwargs.get("alibi_slopes"))
    causal = False
    if option == "varlen_alibi_sinks":
        zeros = torch.zeros(sum(lens_q), HEADS_Q, head_dim, device=DEVICE, dtype=torch.float64)
        _, _, lse0 = run_varlen_ref(q, k, v, zeros, cu_q, cu_k, causal, scale, torch.float64, **ref)
        sinks = _sinks(lse0)
    inputs = [t.detach().requires_grad_() for t in (q, k, v)] + ([sinks.requires_grad_()] if sinks is not None else [])
    out, lse, _ = fa.flash_attn_varlen_func(*inputs[:3], cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                            return_attn_probs=True, s_aux=inputs[3] if sinks is not None else None,
                                            **kwargs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dout)
    truth_out, truth_grads, truth_lse = run_varlen_ref(q, k, v, dout, cu_q, cu_k, causal, scale, torch.float64,
                                                       sinks=sinks, **ref)
    pt_out, pt_grads, pt_lse = run_varlen_ref(q, k, v, dout, cu_q, cu_k, causal, scale, dtype, sinks=sinks, **ref)
    return _ratios(out, lse, grads, pt_out, pt_lse, pt_grads, truth_out, truth_lse, truth_grads, sinks, dout, dtype)


def _ratios(out, lse, grads, pt_out, pt_lse, pt_grads, truth_out, truth_lse, truth_grads, sinks, dout, dtype):
    row = {"out": ratio(out, pt_out, truth_out), "lse": ratio(lse, pt_lse, truth_lse)}
    for name, ours, pt, truth in zip(("dq", "dk", "dv"), grads[:3], pt_grads[:3], truth_grads[:3]):
        row[name] = ratio(ours, pt, truth)
    if sinks is not None:
        floor = sink_grad_rounded_out(truth_out, truth_lse, sinks, dout, dtype).to(sinks.dtype)
        row["dsink"] = ratio(grads[3], pt_grads[3], truth_grads[3], floor=floor)
    return row


def _rotate(x, cos, sin, positions, compute_dtype):
    """GPT-NeoX rotation of the first 2 * cos.shape[1] features of x (batch, seqlen, heads, d) at
    ``positions`` (batch, seqlen), in ``compute_dtype``."""
    half = cos.shape[1]
    x = x.to(compute_dtype)
    c = cos.to(compute_dtype)[positions][:, :, None, :]
    s = sin.to(compute_dtype)[positions][:, :, None, :]
    out = x.clone()
    x1, x2 = x[..., :half], x[..., half:2 * half]
    out[..., :half] = x1 * c - x2 * s
    out[..., half:2 * half] = x1 * s + x2 * c
    return out


def kvcache_case(fa, dtype, option, head_dim, ratio_gqa):
    """flash_attn_with_kvcache, causal, rotary (rotary_dim = head_dim rounded down to even, at most
    64) with seqlen_q new keys per entry: cache_batch_idx into a larger contiguous cache, or a
    paged cache with shuffled pages. Forward only: out and lse."""
    heads_kv = HEADS_Q // ratio_gqa
    seqlens, capacity, seqlen_q = KV["seqlens"], KV["capacity"], KV["seqlen_q"]
    batch = len(seqlens)
    rotary_dim = min(64, head_dim - head_dim % 2)
    freqs = torch.outer(torch.arange(capacity, dtype=torch.float64),
                        10000.0 ** -(torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    cos, sin = freqs.cos().to(DEVICE, dtype), freqs.sin().to(DEVICE, dtype)
    paged = option == "kv_paged_rotary"
    rows = KV["batch_cache"] if not paged else batch
    k_full = torch.randn(rows, capacity, heads_kv, head_dim, device=DEVICE, dtype=dtype)
    v_full = torch.randn_like(k_full)
    q = torch.randn(batch, seqlen_q, HEADS_Q, head_dim, device=DEVICE, dtype=dtype)
    k_new = torch.randn(batch, seqlen_q, heads_kv, head_dim, device=DEVICE, dtype=dtype)
    v_new = torch.randn_like(k_new)
    batch_idx = KV["batch_idx"] if not paged else list(range(batch))
    call = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False, causal=True, return_softmax_lse=True,
                cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=DEVICE))
    if paged:
        page = KV["page_size"]
        pages_per_seq = capacity // page
        order = torch.randperm(batch * pages_per_seq, device=DEVICE)
        table = order.view(batch, pages_per_seq).to(torch.int32)
        k_cache = torch.empty(batch * pages_per_seq, page, heads_kv, head_dim, device=DEVICE, dtype=dtype)
        v_cache = torch.empty_like(k_cache)
        k_cache[order] = k_full.view(batch * pages_per_seq, page, heads_kv, head_dim)
        v_cache[order] = v_full.view(batch * pages_per_seq, page, heads_kv, head_dim)
        call["block_table"] = table
    else:
        k_cache, v_cache = k_full.clone(), v_full.clone()
        call["cache_batch_idx"] = torch.tensor(batch_idx, dtype=torch.int32, device=DEVICE)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **call)
    positions = (torch.tensor(seqlens)[:, None] + torch.arange(seqlen_q)[None, :]).to(DEVICE)

    def reference(compute_dtype):
        q_rot = _rotate(q, cos, sin, positions, compute_dtype)
        k_rot = _rotate(k_new, cos, sin, positions, compute_dtype)
        outs, lses = [], []
        for b, row in enumerate(batch_idx):
            n = seqlens[b]
            keys = torch.cat([k_full[row, :n].to(compute_dtype), k_rot[b]])[None]
            values = torch.cat([v_full[row, :n].to(compute_dtype), v_new[b].to(compute_dtype)])[None]
            o, l_ = attention_ref(q_rot[b:b + 1], keys, values, True, None, compute_dtype)
            outs.append(o)
            lses.append(l_)
        return torch.cat(outs), torch.cat(lses)

    truth_out, truth_lse = reference(torch.float64)
    pt_out, pt_lse = reference(dtype)
    return {"out": ratio(out, pt_out, truth_out), "lse": ratio(lse, pt_lse, truth_lse)}


def run_case(fa, dtype, option, head_dim, ratio_gqa, seqlens):
    if option in DENSE_OPTIONS:
        return dense_case(fa, dtype, option, head_dim, ratio_gqa, seqlens)
    if option.startswith("varlen"):
        return varlen_case(fa, dtype, option, head_dim, ratio_gqa)
    return kvcache_case(fa, dtype, option, head_dim, ratio_gqa)


def _fmt(x):
    return "      -" if x is None else (f"{x:7.2f}" if math.isfinite(x) else "    inf")


def _percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def report(rows, header):
    lines = [header, f"{'dtype':5} {'case':22} {'d':>4} {'gqa':>4} " + " ".join(f"{t:>7}" for t in TENSORS)]
    for (dtype_name, option, head_dim, ratio_gqa), row in rows:
        if isinstance(row, str):
            lines.append(f"{dtype_name:5} {option:22} {head_dim:4} {ratio_gqa:4}  FAILED: {row}")
            continue
        lines.append(f"{dtype_name:5} {option:22} {head_dim:4} {ratio_gqa:4} "
                     + " ".join(_fmt(row.get(t)) for t in TENSORS))
    lines.append("")
    lines.append("Summary: ratio = max error / PyTorch's max error in the same dtype (bar: 2 out/lse, 3 gradients)")
    lines.append(f"{'dtype':5} {'tensor':6} {'n':>4} {'median':>7} {'p99':>7} {'max':>7}  worst case")
    for dtype_name in DTYPES:
        for tensor in TENSORS:
            values = [(row[tensor], key) for key, row in rows
                      if key[0] == dtype_name and not isinstance(row, str) and tensor in row]
            if not values:
                continue
            ratios = [v for v, _ in values]
            worst = max(values, key=lambda item: item[0])[1]
            lines.append(f"{dtype_name:5} {tensor:6} {len(ratios):4} {_fmt(statistics.median(ratios))} "
                         f"{_fmt(_percentile(ratios, 0.99))} {_fmt(max(ratios))}  {worst[1]} d{worst[2]} gqa{worst[3]}")
    return "\n".join(lines)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--options", nargs="+", default=list(ALL_OPTIONS), choices=list(ALL_OPTIONS))
    parser.add_argument("--head-dims", nargs="+", type=int, help="with --ratios: their full product")
    parser.add_argument("--ratios", nargs="+", type=int, help="GQA ratios (dividing 8)")
    parser.add_argument("--seqlens", nargs=2, type=int, default=[1023, 1024], help="dense seqlen_q seqlen_k")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repo", type=Path, default=REPO_ROOT, help="the checkout whose package is measured")
    parser.add_argument("--report-name", default="fp32_report.txt", help="the file written under $OUT")
    args = parser.parse_args(argv)
    shapes = DEFAULT_SHAPES
    if args.head_dims or args.ratios:
        shapes = [(d, r) for d in args.head_dims or [64, 128, 256, 59] for r in args.ratios or [1, 8]]
    if not torch.cuda.is_available():
        raise SystemExit("fp32_error_report.py needs a CUDA GPU")
    import kernels

    build_dir = build_variants.build(repo_root=args.repo.resolve(), out_dir=Path(tempfile.mkdtemp(prefix="fa-build-")))
    fa = kernels.get_local_kernel(build_dir)
    import triton

    header = (f"fp32 error report: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
              f"{triton.__version__}, seqlens {tuple(args.seqlens)}, seed {args.seed}, package from {args.repo.resolve()}")
    print(header, flush=True)
    out_dir = os.environ.get("OUT")
    rows = []
    for dtype_name in args.dtypes:
        for option in args.options:
            for head_dim, ratio_gqa in shapes:
                torch.manual_seed(args.seed)
                key = (dtype_name, option, head_dim, ratio_gqa)
                start = time.time()
                try:
                    row = run_case(fa, DTYPES[dtype_name], option, head_dim, ratio_gqa, tuple(args.seqlens))
                except Exception as error:  # one failing case must not hide the others
                    row = f"{type(error).__name__}: {str(error).splitlines()[0][:150] if str(error) else ''}"
                rows.append((key, row))
                cells = row if isinstance(row, str) else " ".join(f"{t}={_fmt(row[t]).strip()}" for t in row)
                print(f"{dtype_name} {option} d{head_dim} gqa{ratio_gqa}: {cells}  ({time.time() - start:.1f} s)",
                      flush=True)
                if out_dir:
                    Path(out_dir, args.report_name).write_text(report(rows, header) + "\n")
    text = report(rows, header)
    print()
    print(text)
    if out_dir:
        Path(out_dir, args.report_name).write_text(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
