"""The main job: load the built Hub variant through kernels and check it against PyTorch SDPA.

Loads ``<org>/flash-attention`` with ``kernels.get_kernel(..., version=1)`` from the local build
(LOCAL_KERNELS, offline), runs forward + backward of ``flash_attn_func`` (causal, GQA) on the GPU
if there is one, else on CPU through Triton's interpreter, and compares output and gradients
with ``torch.nn.functional.scaled_dot_product_attention``. Exits non-zero on a mismatch.
"""

import os
import sys
import time
import tomllib
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton (by kernels)
repo_id = tomllib.loads((REPO_ROOT / "build.toml").read_text())["general"]["hub"]["repo-id"]
os.environ["LOCAL_KERNELS"] = f"{repo_id}={REPO_ROOT / 'build'}"
os.environ["HF_HUB_OFFLINE"] = "1"

import kernels  # noqa: E402


def main() -> int:
    flash_attention = kernels.get_kernel(repo_id, version=1)
    device = "cuda" if ON_GPU else "cpu"
    batch, seqlen, heads, heads_kv, head_dim = (4, 2048, 16, 4, 128) if ON_GPU else (1, 128, 4, 2, 64)
    dtype = torch.bfloat16
    print(f"{repo_id} loaded from {flash_attention.__file__}")
    print(f"device: {torch.cuda.get_device_name() if ON_GPU else 'CPU (Triton interpreter)'}; "
          f"q (batch={batch}, seqlen={seqlen}, heads={heads}, head_dim={head_dim}) {dtype}, k/v heads={heads_kv}, causal")

    q = torch.randn(batch, seqlen, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, seqlen, heads_kv, head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, seqlen, heads_kv, head_dim, device=device, dtype=dtype, requires_grad=True)
    dout = torch.randn_like(q)

    start = time.perf_counter()
    out = flash_attention.flash_attn_func(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    if ON_GPU:
        torch.cuda.synchronize()
    print(f"flash_attn_func forward + backward: {time.perf_counter() - start:.2f} s (first call, compilation included)")

    # SDPA on (batch, heads, seqlen, dim), fp32 math as the reference.
    q32, k32, v32 = (t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=True, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), dout.float().transpose(1, 2))
    ref = ref.transpose(1, 2)
    ref_grads = [g.transpose(1, 2) for g in ref_grads]

    ok = True
    for name, ours, theirs, tol in [("out", out, ref, 2e-2), *[(n, g, r, 5e-2) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)]]:
        err = (ours.float() - theirs).abs().max().item()
        ok &= err <= tol
        print(f"  {name}: max |flash - sdpa(fp32)| = {err:.2e} (tolerance {tol:.0e}) {'ok' if err <= tol else 'MISMATCH'}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
