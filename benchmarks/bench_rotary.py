"""Rotary embeddings: GB/s of apply_rotary_emb against PyTorch, in one run.

Bytes moved per call: x read and the result written (in place: the rotated features only, read
and written) plus the cos/sin rows read. Peers, timed in the same process on the same inputs:
the formula in eager PyTorch (flash-attn's apply_rotary_emb_torch: cat of the halves times
cos/sin), the same compiled by torch.compile, and x.clone() as the copy ceiling. Shapes: bf16,
head dim 128 (rotary over all of it and over half), 32 heads, GPT-NeoX and GPT-J pairing; a
prefill of 16k tokens (batch 4 x 4096) and decode steps (batch 1 / 64, one token at offset 4096).
Times are triton.testing.do_bench medians; the host time of a call is part of a decode step's.

Usage: python benchmarks/bench_rotary.py   (after scripts/build_variants.py)
"""

import sys
from pathlib import Path

import torch
import triton
import triton.testing

REPO_ROOT = Path(__file__).resolve().parent.parent
HEADS, HEAD_DIM, DTYPE = 32, 128, torch.bfloat16
SHAPES = [("prefill", 4, 4096, 0), ("decode b1", 1, 1, 4096), ("decode b64", 64, 1, 4096)]


def torch_rotary(x, cos, sin, offset, interleaved):
    """The formula in eager PyTorch, as flash-attn's reference writes it."""
    rotary_dim = 2 * cos.shape[-1]
    cos = cos[offset:offset + x.shape[1]]
    sin = sin[offset:offset + x.shape[1]]
    if interleaved:
        cos = cos.repeat_interleave(2, dim=-1)[:, None, :]
        sin = sin.repeat_interleave(2, dim=-1)[:, None, :]
        x1, x2 = x[..., :rotary_dim:2], x[..., 1:rotary_dim:2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        cos = cos.repeat(1, 2)[:, None, :]
        sin = sin.repeat(1, 2)[:, None, :]
        x1, x2 = x[..., :rotary_dim // 2], x[..., rotary_dim // 2:rotary_dim]
        rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x[..., :rotary_dim] * cos + rotated * sin, x[..., rotary_dim:]), dim=-1)


def main():
    import kernels

    fa = kernels.get_local_kernel(REPO_ROOT / "build")
    compiled_torch = torch.compile(torch_rotary, dynamic=False)
    print(f"{'shape':12} {'rotary':>6} {'pairing':>8} | GB/s: {'ours':>7} {'in place':>8} {'torch':>7} "
          f"{'compiled':>8} {'copy':>7} | ours / torch, / compiled, / copy | ours us")
    for name, batch, seqlen, offset in SHAPES:
        for rotary_dim in (HEAD_DIM, HEAD_DIM // 2):
            for interleaved in (False, True):
                x = torch.randn(batch, seqlen, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
                angles = torch.rand(offset + seqlen, rotary_dim // 2, device="cuda") * 6.28
                cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)
                table_bytes = 2 * batch * seqlen * cos.shape[1] * cos.element_size()
                copy_bytes = 2 * x.numel() * x.element_size() + table_bytes
                inplace_bytes = 2 * x[..., :rotary_dim].numel() * x.element_size() + table_bytes
                want = torch_rotary(x.double(), cos.double(), sin.double(), offset, interleaved)
                got = fa.apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offset)
                error = (got.double() - want).abs().max().item()
                times = {
                    "ours": lambda: fa.apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offset),
                    "in place": lambda: fa.apply_rotary_emb(x, cos, sin, interleaved=interleaved, inplace=True,
                                                            seqlen_offsets=offset),
                    "torch": lambda: torch_rotary(x, cos, sin, offset, interleaved),
                    "compiled": lambda: compiled_torch(x, cos, sin, offset, interleaved),
                    "copy": lambda: x.clone(),
                }
                ms = {key: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                      for key, fn in times.items()}
                rate = {key: (inplace_bytes if key == "in place" else copy_bytes) / t * 1e-6 for key, t in ms.items()}
                print(f"{name:12} {rotary_dim:6} {'gptj' if interleaved else 'neox':>8} | "
                      f"{rate['ours']:12.1f} {rate['in place']:8.1f} {rate['torch']:7.1f} {rate['compiled']:8.1f} "
                      f"{rate['copy']:7.1f} | {ms['torch'] / ms['ours']:5.2f} {ms['compiled'] / ms['ours']:5.2f} "
                      f"{rate['ours'] / rate['copy']:5.2f} | {ms['ours'] * 1e3:7.1f}  (max error {error:.1e})",
                      flush=True)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")


if __name__ == "__main__":
    sys.exit(main())
