"""The backward's dK/dV kernel alone: the Gluon one for Hopper (flash_attention_kernel/hopper_dkdv.py)
against the tl one (backward._attn_bwd_dkdv_kernel), same inputs, same process.

For each row (bf16, 16 heads, batch x seqlen = 16k tokens; causal or not; plain, softcap or dropout) it
checks that the two kernels' dK and dV agree to bf16 rounding, then prints the time of each
dK/dV kernel (TFLOP/s on its 4 products over the visible pairs, triton.testing.do_bench medians)
and of the whole backward with each. The tl kernel is timed as the backward with the dQ kernel's
launches replaced by nothing (its delta then goes unread), so both sides include the same
launch overhead. Hopper GPU only (NOTES v19, v20).

    python3 benchmarks/bench_dkdv.py [--seqlens 4096 16384] [--head-dim 128] [--softcap 50] [--dropout 0.1]
"""

import argparse
import os
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from flash_attention_kernel import AttentionOptions, attention_backward, attention_forward  # noqa: E402
from flash_attention_kernel import backward as tl_backward  # noqa: E402
from flash_attention_kernel import hopper_dkdv  # noqa: E402
from flash_attention_kernel.launch import SequenceLayout  # noqa: E402
from flash_attention_kernel.options import draw_rng_state  # noqa: E402

TOKENS = 16384


class _NoLaunch:
    """A kernel stand-in whose launches do nothing."""

    def __init__(self, kernel=None):
        pass

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _without_dq(kernel):
    return _NoLaunch() if kernel is tl_backward._attn_bwd_dq_kernel else kernel


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
    os.environ["FLASH_ATTENTION_GLUON"] = "1"
    if not hopper_dkdv.plan(options, layout, False, q, k, v, dout):
        return f"seqlen {seqlen} causal={causal} softcap={softcap:g} dropout={dropout:g}: not taken by Gluon"

    def backward(setting, wrap=tl_backward.identity_wrap):
        os.environ["FLASH_ATTENTION_GLUON"] = setting
        return attention_backward(dout, q, k, v, out, lse, options, wrap_kernel=wrap)

    _, dk_gl, dv_gl, _ = backward("1")
    _, dk_tl, dv_tl, _ = backward("0")
    errors = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
              for a, b in ((dk_gl, dk_tl), (dv_gl, dv_tl))]
    times = {setting: (do_bench(lambda: backward(setting, _without_dq)), do_bench(lambda: backward(setting)))
             for setting in ("0", "1")}
    pairs = seqlen * (seqlen + 1) / 2 if causal else seqlen * seqlen
    flops = 4 * 2 * batch * heads * pairs * head_dim
    (tl_kernel, tl_total), (gl_kernel, gl_total) = times["0"], times["1"]
    return (f"seqlen {seqlen:5d} causal={causal!s:5} softcap={softcap:g} dropout={dropout:g}: "
            f"dK/dV tl {flops / tl_kernel * 1e-9:.0f} Gluon {flops / gl_kernel * 1e-9:.0f} TFLOP/s "
            f"(x{tl_kernel / gl_kernel:.3f}); backward tl {tl_total:.3f} ms, Gluon {gl_total:.3f} ms; "
            f"max rel. difference dK {errors[0]:.1e} dV {errors[1]:.1e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128, choices=sorted(hopper_dkdv.STAGES))
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
