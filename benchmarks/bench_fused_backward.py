"""The fused backward of the A100 class (flash_attention_kernel/ampere_backward.py) against the split
tl backward it replaces and FlashAttention-2 (SDPA's FLASH backend), same inputs, same process.

Through the built Hub package, as users call it: ``flash_attn_func`` with ``deterministic=False``
(the fused kernel, where ampere_route takes the call) and ``deterministic=True`` (the split tl
kernels, bitwise repeatable). For each row (head dim 128 or 64, hidden 2048 = heads x head dim,
batch x seqlen = 16k tokens, causal or not) it checks that the two paths' gradients agree to bf16/fp16 rounding, then prints
the backward's TFLOP/s (triton.testing.do_bench medians; backward FLOPs = 2.5x the forward's) and
the ratios (bench_flash_attention.time_tflops, its SDPA FLASH provider). On an A100, or on an
H100/H200 emulating one:

    EMULATE_GPU=sm_80 PYTHONPATH=../shared/tools python benchmarks/bench_fused_backward.py
        [--seqlens 1024 2048 4096 8192 16384] [--dtypes bf16 fp16] [--head-dims 128 64]

(``emulate_gpu`` is imported when EMULATE_GPU is set: mma.sync and the class's shared memory on the
bigger GPU's SMs, a proxy; docs/gpus.md). Where the route does not take the call (another GPU
class) both columns run the split kernels and the script says so.
"""

import argparse
import itertools
import json
import os
import sys

if os.environ.get("EMULATE_GPU"):
    import emulate_gpu  # noqa: F401  (before torch sees the GPU)

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_flash_attention import Attention, attention_flops, load_kernel, time_tflops  # noqa: E402

TOKENS, HIDDEN = 16384, 2048
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    args = parser.parse_args()
    fa = load_kernel()
    kernels = fa.flash_attention_kernel
    attention = Attention(fa)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, file=sys.stderr)
    for name, head_dim, causal, seqlen in itertools.product(args.dtypes, args.head_dims, (False, True), args.seqlens):
        batch, heads = TOKENS // seqlen, HIDDEN // head_dim
        leaves = [torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=DTYPES[name],
                              requires_grad=True) for _ in range(3)]
        bhsd = [x.detach().transpose(1, 2).contiguous().requires_grad_() for x in leaves]
        dout = torch.randn_like(leaves[0])
        layout = kernels.launch.SequenceLayout.of(leaves[0], leaves[1])
        options = kernels.AttentionOptions(head_dim ** -0.5, causal)
        fused_taken = kernels.ampere_route.chosen(options, layout, False, (*leaves, dout))

        def ours(deterministic):  # (the forward the backward is timed after)
            return lambda *tensors: fa.flash_attn_func(*tensors, causal=causal, deterministic=deterministic)

        fused_grads, split_grads = (torch.autograd.grad(ours(det)(*leaves), leaves, dout) for det in (False, True))
        for label, a, b in zip(("dq", "dk", "dv"), fused_grads, split_grads):
            torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2, msg=label)
        flops = attention_flops(batch, heads, seqlen, head_dim, causal, "bwd")
        rates = dict(fused=time_tflops(ours(False), leaves, flops, "bwd"),
                     split=time_tflops(ours(True), leaves, flops, "bwd"),
                     fa2=time_tflops(attention.forward_fn("sdpa-flash", causal, seqlen), bhsd, flops, "bwd"))
        row = dict(dtype=name, head_dim=head_dim, causal=causal, seqlen=seqlen, fused_taken=fused_taken,
                   **{key: round(rate, 1) for key, rate in rates.items()})
        row.update({"fused/fa2": round(rates["fused"] / rates["fa2"], 3),
                    "split/fa2": round(rates["split"] / rates["fa2"], 3),
                    "fused/split": round(rates["fused"] / rates["split"], 3)})
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
