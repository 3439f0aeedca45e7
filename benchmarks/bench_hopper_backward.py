"""The backward's Gluon kernels for Hopper (flash_attention_kernel/hopper_dkdv.py, hopper_dq.py)
against the tl ones (backward._attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel), same inputs, same process.

For each row (bf16, 16 heads, batch x seqlen = 16k tokens; causal or not; plain, softcap or dropout)
it checks that the Gluon and tl kernels' dQ, dK and dV agree to bf16 rounding, then prints, from
triton.testing.do_bench medians:

* each kernel alone, tl -> Gluon, in TFLOP/s over the visible pairs (dK/dV: its 4 products, dQ:
  its 3). A kernel alone is timed as the backward with the other kernel's launches replaced by
  nothing (so both sides carry the same launch overhead and the delta work that comes with them);
* the whole backward in ms: tl kernels only ("tl"), Gluon dK/dV with the tl dQ ("dkdv"), both
  Gluon kernels ("dkdv+dq"), as far as the Gluon kernels take the row.

Every time is the median of 3 rounds that interleave all the measurements of a row.

Hopper GPU only (docs/design.md#hopper-gluon-kernels).

    python3 benchmarks/bench_hopper_backward.py [--seqlens 4096 16384] [--head-dim 128] [--softcap 50]
        [--dropout 0.1]
"""

import argparse
import contextlib
import os
import statistics
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch-ext", "flash_attention"))
from flash_attention_kernel import AttentionOptions, attention_backward, attention_forward  # noqa: E402
from flash_attention_kernel import backward as tl_backward  # noqa: E402
from flash_attention_kernel import hopper_dkdv, hopper_dq, hopper_route, planner  # noqa: E402
from flash_attention_kernel.launch import SequenceLayout  # noqa: E402
from flash_attention_kernel.options import draw_rng_state  # noqa: E402

TOKENS = 16384
ROUNDS = 3
KERNELS = {"dkdv": (hopper_dkdv, "attention_dkdv", tl_backward._attn_bwd_dkdv_kernel),
           "dq": (hopper_dq, "attention_dq", tl_backward._attn_bwd_dq_kernel)}


class _NoLaunch:
    """A kernel stand-in whose launches do nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def _kernels(gluon, skip=None):
    """The backward with the Gluon kernels named in ``gluon`` running their passes and the tl
    kernels the others (the planner's override hook), and kernel ``skip`` (either kind) launching
    nothing."""
    skipped = KERNELS[skip][2] if skip else None
    with contextlib.ExitStack() as stack:
        for name in KERNELS:
            stack.enter_context(planner.override(f"bwd_{name}", implementation="gluon" if name in gluon else "tl"))
        if skip:
            module, launcher, _ = KERNELS[skip]
            stack.callback(setattr, module, launcher, getattr(module, launcher))
            setattr(module, launcher, lambda *args, **kwargs: None)
        yield lambda kernel: _NoLaunch() if kernel is skipped else kernel


def measure(seqlen, heads, head_dim, causal, softcap, dropout):
    batch = TOKENS // seqlen
    shape = (batch, seqlen, heads, head_dim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    if softcap:
        q = q * 3  # scores past the cap
    options = AttentionOptions(softmax_scale=head_dim ** -0.5, causal=causal, softcap=softcap, dropout_p=dropout,
                               rng_state=draw_rng_state(q.device) if dropout else None)
    out, lse = attention_forward(q, k, v, options)
    layout = SequenceLayout.of(q, k)
    label = f"seqlen {seqlen:5d} causal={causal!s:5} softcap={softcap:g} dropout={dropout:g}"
    os.environ["FLASH_ATTENTION_GLUON"] = "1"
    taken = tuple(name for name in KERNELS
                  if hopper_route.chosen(f"bwd_{name}", options, layout, False, (q, k, v, dout)))
    if not taken:
        return f"{label}: not taken by Gluon"

    def backward(gluon, skip=None):
        with _kernels(gluon, skip) as wrap:
            return attention_backward(dout, q, k, v, out, lse, options, wrap_kernel=wrap)

    errors = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
              for a, b in zip(backward(taken)[:3], backward(())[:3])]
    pairs = seqlen * (seqlen + 1) / 2 if causal else seqlen * seqlen
    products = 2 * batch * heads * pairs * head_dim * 1e-9  # (GFLOP per product, per ms: TFLOP/s)
    # what to time: (Gluon kernels, skipped kernel); interleaved over ROUNDS, medians, since the H200 lowers
    # its clock under these kernels' power draw and a later measurement runs slower (docs/benchmarks.md#method)
    cases = [(gluon, other) for name, other in (("dkdv", "dq"), ("dq", "dkdv")) if name in taken
             for gluon in ((), (name,))]
    routes = ((), ("dkdv",), ("dkdv", "dq"))[:1 + len(taken)]
    cases += [(gluon, None) for gluon in routes]
    runs = {case: [] for case in cases}
    for _ in range(ROUNDS):
        for gluon, skip in cases:
            runs[gluon, skip].append(do_bench(lambda: backward(gluon, skip)))
    ms = {case: statistics.median(times) for case, times in runs.items()}
    alone = []
    for name, other, count in (("dkdv", "dq", 4), ("dq", "dkdv", 3)):
        if name in taken:
            tl_ms, gluon_ms = ms[(), other], ms[(name,), other]
            alone.append(f"{name} tl {count * products / tl_ms:.0f} Gluon {count * products / gluon_ms:.0f} "
                         f"(x{tl_ms / gluon_ms:.3f})")
        else:
            alone.append(f"{name} not taken by Gluon")
    totals = " ".join(f"{'+'.join(gluon) or 'tl'} {ms[gluon, None]:.3f}" for gluon in routes)
    return (f"{label}: TFLOP/s {', '.join(alone)}; backward ms (Gluon kernels) {totals}; max rel. difference "
            + " ".join(f"{name} {error:.1e}" for name, error in zip(("dQ", "dK", "dV"), errors)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128, choices=hopper_route.HEAD_DIMS)
    parser.add_argument("--softcap", type=float, default=50.0)
    parser.add_argument("--dropout", type=float, default=0.1)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, Triton {triton.__version__}, {torch.cuda.get_device_name()}")
    for seqlen in args.seqlens:
        for causal in (True, False):
            for softcap, dropout in ((0.0, 0.0), (args.softcap, 0.0), (0.0, args.dropout)):
                print(measure(seqlen, args.heads, args.head_dim, causal, softcap, dropout), flush=True)


if __name__ == "__main__":
    main()
