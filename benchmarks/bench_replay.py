"""Prepared calls on and off in one process (flash_attention_kernel/replay.py, docs/design.md#prepared-calls).

Eager time per call (100 back-to-back calls, one synchronisation; median of 7, the better of two
rounds) of flash_attn_func forward and forward + backward at batch 1, N = 128 (the host cost) and
at 16k tokens of N = 1024, with FLASH_ATTENTION_REPLAY on and off and the Gluon kernels on and
off, beside SDPA FLASH and CUDNN; and a decode step over a 1k cache (cache_seqlens a tensor).

Usage: python benchmarks/bench_replay.py     (after scripts/build_variants.py, on a GPU; writes
       $OUT/replay.txt where OUT is set)
"""
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_flash_attention import load_kernel  # noqa: E402
fa = load_kernel()
from torch.nn.attention import SDPBackend, sdpa_kernel
F = torch.nn.functional

def eager(fn, calls=100, reps=7):
    for _ in range(10): fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls): fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)

def case(batch, n, heads=16, d=128, causal=True):
    q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    ours_f = lambda: fa.flash_attn_func(q, k, v, causal=causal)
    ours_s = lambda: torch.autograd.grad(fa.flash_attn_func(q, k, v, causal=causal), (q, k, v), do)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dot = do.transpose(1, 2)
    def sd(backend, grad):
        def f():
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                if grad: torch.autograd.grad(o, (qt, kt, vt), dot)
        return f
    return ours_f, ours_s, sd
rows = []
for batch, n in ((1, 128), (16, 1024)):
    ours_f, ours_s, sd = case(batch, n)
    for name, fn in (("fwd", ours_f), ("fwd+bwd", ours_s)):
        res = {}
        for rep in range(2):
            for gluon in ("1", "0"):
                for replay in ("1", "0"):
                    os.environ["FLASH_ATTENTION_GLUON"], os.environ["FLASH_ATTENTION_REPLAY"] = gluon, replay
                    res.setdefault((gluon, replay), []).append(eager(fn))
        peers = {b: eager(sd(getattr(SDPBackend, b), name != "fwd")) for b in ("FLASH_ATTENTION", "CUDNN_ATTENTION")}
        line = f"b{batch} N{n} {name:8} " + "  ".join(f"gluon={g} replay={r}: {min(v):7.1f}" for (g, r), v in res.items())
        line += "  | SDPA FLASH %.1f CUDNN %.1f us" % (peers["FLASH_ATTENTION"], peers["CUDNN_ATTENTION"])
        print(line, flush=True); rows.append(line)
def decode_case():
    q = torch.randn(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(1, 1024, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sl = torch.full((1,), 1000, device="cuda", dtype=torch.int32)
    return lambda: fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sl, causal=True)
fn = decode_case(); res = {}
for rep in range(2):
    for replay in ("1", "0"):
        os.environ["FLASH_ATTENTION_REPLAY"] = replay
        res.setdefault(replay, []).append(eager(fn))
line = "decode 1k cache  " + "  ".join(f"replay={r}: {min(v):7.1f}" for r, v in res.items())
print(line, flush=True); rows.append(line)
Path(os.environ.get("OUT", "."), "replay.txt").write_text("\n".join(rows) + "\n")
