"""The costs beside throughput: odd head dims, first-call time, peak memory.

* Head dims: forward and backward TFLOP/s at head dims 64, 80, 96, 128, 160, 192, 224, 256
  (bf16, 16 heads, 16k tokens, N = 4096, non-causal), each with its ratio to the next power of
  two (head dims are padded to one inside the kernels).
* First call: in a fresh process with an empty Triton cache, the wall time of the first forward
  and the first backward on a new shape (compilation included), then of a call at another
  sequence length of the same size bucket, which must not compile again.
* Peak memory: device memory allocated at the peak of forward + backward beyond the inputs and
  output gradient, this kernel against SDPA FLASH (N = 16k, head dim 128, bf16).
* Host time per call: on a shape so small that the GPU waits for the CPU (1 x 128 x 16 x 128),
  the wall time of a forward and of a forward + backward, averaged over back-to-back calls, this
  kernel against SDPA FLASH: the Python cost of checks, op dispatch and kernel launches, which
  short sequences feel.

Usage: python benchmarks/bench_extras.py   (after scripts/build_variants.py; on a GPU)
"""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_flash_attention import attention_flops, load_kernel, time_tflops

REPO_ROOT = Path(__file__).resolve().parent.parent
HEAD_DIMS = [64, 80, 96, 128, 160, 192, 224, 256]


def head_dim_table(fa, seqlen=4096, heads=16, tokens=16384):
    batch = tokens // seqlen
    rates = {}
    for head_dim in HEAD_DIMS:
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        rates[head_dim] = tuple(
            time_tflops(fa.flash_attn_func, (q, k, v),
                        attention_flops(batch, heads, seqlen, head_dim, False, direction), direction)
            for direction in ("fwd", "bwd"))
    print(f"\nhead dims (bf16, {heads} heads, N = {seqlen}, non-causal): TFLOP/s and ratio to the next power of two")
    print(f"{'d':>4} {'fwd':>7} {'ratio':>6} {'bwd':>7} {'ratio':>6}")
    for head_dim, (forward, backward) in rates.items():
        power = 1 << (head_dim - 1).bit_length()
        print(f"{head_dim:>4} {forward:>7.1f} {forward / rates[power][0]:>6.2f} {backward:>7.1f} {backward / rates[power][1]:>6.2f}")


FIRST_CALL_SCRIPT = textwrap.dedent("""
    import json, sys, time, pathlib, torch, kernels
    fa = kernels.get_local_kernel(pathlib.Path(sys.argv[1]))
    head_dim = int(sys.argv[2])
    def timed(seqlen):
        q, k, v = (torch.randn(4, seqlen, 2048 // head_dim, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fa.flash_attn_func(q, k, v, causal=True)
        torch.cuda.synchronize()
        middle = time.perf_counter()
        out.sum().backward()
        torch.cuda.synchronize()
        return middle - start, time.perf_counter() - middle
    first = timed(4096)
    again = timed(4000)
    print(json.dumps(dict(first=first, new_seqlen=again)))
""")


def first_call_table():
    print("\nfirst call in a fresh process with an empty Triton cache (bf16, causal, 4 x N x 2048/d heads):")
    for head_dim in (64, 128):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            result = subprocess.run([sys.executable, "-c", FIRST_CALL_SCRIPT, str(REPO_ROOT / "build"), str(head_dim)],
                                    env=env, capture_output=True, text=True, check=True)
        times = json.loads(result.stdout.strip().splitlines()[-1])
        print(f"  d{head_dim}: first forward {times['first'][0]:.2f} s, first backward {times['first'][1]:.2f} s; "
              f"N = 4000 afterwards: forward {times['new_seqlen'][0] * 1e3:.1f} ms, "
              f"backward {times['new_seqlen'][1] * 1e3:.1f} ms")


def peak_memory_table(fa, seqlen=16384, head_dim=128, heads=16):
    def sdpa_flash(q, k, v):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    providers = {"triton-fa": lambda q, k, v: fa.flash_attention_forward(q, k, v, causal=True),
                 "sdpa-flash": sdpa_flash}
    print(f"\npeak memory of forward + backward beyond inputs and dout (bf16, 1 x {heads} x {seqlen} x {head_dim}, causal):")
    for name, attention in providers.items():
        q, k, v = (torch.randn(1, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        attention(q, k, v).backward(dout)  # warm up (compilation, workspaces)
        for x in (q, k, v):
            x.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        attention(q, k, v).backward(dout)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        print(f"  {name:>10}: {extra / 2**20:8.1f} MiB (q, k, v are {q.numel() * 2 / 2**20:.1f} MiB each)")


def host_time_table(fa, calls=200):
    def sdpa_flash(q, k, v):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    providers = {"triton-fa": lambda q, k, v: fa.flash_attention_forward(q, k, v, causal=True),
                 "sdpa-flash": sdpa_flash}
    q, k, v = (torch.randn(1, 16, 128, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    print("\nhost time per call, back to back (bf16, 1 x 16 x 128 x 128, causal), microseconds:")
    for name, attention in providers.items():
        steps = {"forward": lambda: attention(q, k, v),
                 "forward + backward": lambda: torch.autograd.grad(attention(q, k, v).sum(), (q, k, v))}
        times = []
        for step in steps.values():
            for _ in range(20):
                step()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) / calls * 1e6)
        print(f"  {name:>10}: " + ", ".join(f"{label} {t:.0f}" for label, t in zip(steps, times)))


def main():
    fa = load_kernel()
    head_dim_table(fa)
    first_call_table()
    peak_memory_table(fa)
    host_time_table(fa)
    print(f"\ndevice {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")


if __name__ == "__main__":
    main()
