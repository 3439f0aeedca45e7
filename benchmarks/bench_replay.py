"""Prepared calls on and off in one process (flash_attention_kernel/replay.py,
docs/design.md#prepared-calls).

Eager time per call (bench_host.eager_us: 100 back-to-back calls, one synchronisation; median
of 7, the better of two rounds) of flash_attn_func forward and forward + backward at batch 1,
N = 128 (the host cost) and at 16k tokens of N = 1024, with FLASH_ATTENTION_REPLAY on and off and
the Gluon kernels on and off (FLASH_ATTENTION_GLUON=1 / 0: at N = 128 the default route takes
the tl kernels), beside SDPA FLASH and CUDNN; the floor of any Python autograd.Function at N = 128
(one that only allocates its outputs); and a decode step over a 1k cache (cache_seqlens a tensor).

Usage: python benchmarks/bench_replay.py     (after scripts/build_variants.py, on a GPU; writes
       $OUT/replay.txt where OUT is set)
"""
import os
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_flash_attention import load_kernel  # noqa: E402
from bench_host import eager_us  # noqa: E402

F = torch.nn.functional


def attention_calls(fa, batch, n, heads=16, d=128, causal=True):
    """(our forward, our forward + backward, sdpa(backend, with_backward) -> SDPA's call)."""
    q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dout_t = dout.transpose(1, 2)

    def sdpa(backend, with_backward):
        def call():
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                if with_backward:
                    torch.autograd.grad(out, (qt, kt, vt), dout_t)
        return call

    return (lambda: fa.flash_attn_func(q, k, v, causal=causal),
            lambda: torch.autograd.grad(fa.flash_attn_func(q, k, v, causal=causal), (q, k, v), dout), sdpa)


class _AllocateOnly(torch.autograd.Function):
    """Attention's autograd shape with no work: the forward allocates out and lse and saves five
    tensors, the backward allocates three gradients. Its eager step is the floor of any
    attention written as a Python autograd.Function on this host."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def autograd_floor_us(batch=1, n=128, heads=16, d=128):
    """(forward, forward + backward) eager us per call of _AllocateOnly at the N = 128 shape."""
    q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    return (eager_us(lambda: _AllocateOnly.apply(q, k, v), runs=7),
            eager_us(lambda: torch.autograd.grad(_AllocateOnly.apply(q, k, v), (q, k, v), dout), runs=7))


def decode_step(fa):
    """One flash_attn_with_kvcache step over a 1k cache, cache_seqlens a tensor."""
    q = torch.randn(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(1, 1024, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.full((1,), 1000, device="cuda", dtype=torch.int32)
    return lambda: fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)


def main():
    fa = load_kernel()
    rows = []
    for batch, n in ((1, 128), (16, 1024)):
        forward, step, sdpa = attention_calls(fa, batch, n)
        for name, fn in (("fwd", forward), ("fwd+bwd", step)):
            times = {}
            for _ in range(2):
                for gluon in ("1", "0"):
                    for replay in ("1", "0"):
                        os.environ["FLASH_ATTENTION_GLUON"], os.environ["FLASH_ATTENTION_REPLAY"] = gluon, replay
                        times.setdefault((gluon, replay), []).append(eager_us(fn, runs=7))
            peers = {backend: eager_us(sdpa(getattr(SDPBackend, backend), name != "fwd"), runs=7)
                     for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION")}
            line = f"b{batch} N{n} {name:8} " + "  ".join(f"gluon={gluon} replay={replay}: {min(us):7.1f}"
                                                         for (gluon, replay), us in times.items())
            line += f"  | SDPA FLASH {peers['FLASH_ATTENTION']:.1f} CUDNN {peers['CUDNN_ATTENTION']:.1f} us"
            print(line, flush=True)
            rows.append(line)
    floor_forward, floor_step = autograd_floor_us()
    line = (f"b1 N128 floor: an autograd.Function that only allocates: fwd {floor_forward:.1f}  "
            f"fwd+bwd {floor_step:.1f} us")
    print(line, flush=True)
    rows.append(line)
    os.environ["FLASH_ATTENTION_GLUON"] = "1"
    fn, times = decode_step(fa), {}
    for _ in range(2):
        for replay in ("1", "0"):
            os.environ["FLASH_ATTENTION_REPLAY"] = replay
            times.setdefault(replay, []).append(eager_us(fn, runs=7))
    line = "decode 1k cache  " + "  ".join(f"replay={replay}: {min(us):7.1f}" for replay, us in times.items())
    print(line, flush=True)
    rows.append(line)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "replay.txt").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
