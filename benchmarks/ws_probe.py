"""Does Triton's warp specialisation work on this GPU for an attention forward? (lab probe)

With Triton 3.6 on an H200, ``tl.range(..., warp_specialize=True)`` crashed the compiler or returned
wrong results for our forward in every 4-warp config tried while it read tiles through per-(batch,
head) descriptors (docs/design.md#warp-specialised-tl-loops), although a minimal kernel gains 13-19 %; the kernels
now take it only in the shape found to work (descriptors over the whole tensor, one loop of full
tiles). This script keeps that minimal kernel, non-causal,
head dim 128, N a multiple of 128, descriptors over (B * H * N, D) rows, and adds one feature of
ours at a time (flags, combinable), so a newer Triton can be re-checked in a minute:

  h  per-(batch, head) descriptors built from an offset base pointer (as tiles.tile_descriptors)
  a  an extra accumulator carried through the loop unchanged (our second head-dim chunk, DIM_B = 0)
  s  the output written with masked pointer stores (as tiles.store_tile) instead of a descriptor
  m  scores scaled after the dot, as forward.py does, instead of inside the exp2 argument

Each variant runs in its own process (a compiler assertion aborts it) and prints TFLOP/s and its
largest difference from SDPA; "nan" means rows were never written (the output starts as NaN).

Usage: python benchmarks/ws_probe.py [--seqlen 4096] [flags ...]   (default: - h a s m hs)
"""

import math
import subprocess
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def probe(Q, K, V, O, N, H, qk_scale, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
          PER_HEAD: tl.constexpr, DUMMY_ACC: tl.constexpr, PTR_STORE: tl.constexpr, OUR_MATH: tl.constexpr):
    start_m = tl.program_id(0) * BM
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    if PER_HEAD:  # one descriptor per (batch, head) over its N rows, from an offset base pointer
        off = b.to(tl.int64) * H * N * D + h.to(tl.int64) * N * D
        q_desc = tl.make_tensor_descriptor(Q + off, shape=[N, D], strides=[D, 1], block_shape=[BM, D])
        k_desc = tl.make_tensor_descriptor(K + off, shape=[N, D], strides=[D, 1], block_shape=[BN, D])
        v_desc = tl.make_tensor_descriptor(V + off, shape=[N, D], strides=[D, 1], block_shape=[BN, D])
        row0 = 0
    else:
        rows = tl.num_programs(1) * N
        q_desc = tl.make_tensor_descriptor(Q, shape=[rows, D], strides=[D, 1], block_shape=[BM, D])
        k_desc = tl.make_tensor_descriptor(K, shape=[rows, D], strides=[D, 1], block_shape=[BN, D])
        v_desc = tl.make_tensor_descriptor(V, shape=[rows, D], strides=[D, 1], block_shape=[BN, D])
        row0 = bh * N
    q = q_desc.load([row0 + start_m, 0])
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    acc_b = tl.zeros([BM, 16], tl.float32)
    for start_n in tl.range(0, N, BN, warp_specialize=True):
        k = k_desc.load([row0 + start_n, 0])
        if OUR_MATH:
            s = tl.dot(q, tl.trans(k)) * qk_scale
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_ij[:, None])
        else:
            qk = tl.dot(q, k.T)
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([row0 + start_n, 0])
        acc = acc * alpha[:, None]
        if DUMMY_ACC:
            acc_b = acc_b * 1.0
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
    acc = acc / l_i[:, None]
    if DUMMY_ACC:
        acc = acc + tl.sum(acc_b, 1)[:, None]
    if PTR_STORE:
        offs_m = start_m + tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        ptrs = O + bh.to(tl.int64) * N * D + offs_m[:, None] * D + offs_d[None, :]
        tl.store(ptrs, acc.to(O.dtype.element_ty), mask=offs_m[:, None] < N)
    else:
        o_desc = tl.make_tensor_descriptor(O, shape=[tl.num_programs(1) * N, D], strides=[D, 1], block_shape=[BM, D])
        o_desc.store([bh * N + start_m, 0], acc.to(O.dtype.element_ty))


def run_variant(seqlen, flags):
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    head_dim, heads, block = 128, 16, 128
    batch = 16384 // seqlen
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    out = torch.full_like(q, float("nan"))
    features = dict(PER_HEAD="h" in flags, DUMMY_ACC="a" in flags, PTR_STORE="s" in flags, OUR_MATH="m" in flags)
    launch = lambda: probe[(seqlen // block, batch * heads)](  # noqa: E731
        q, k, v, out, seqlen, heads, head_dim ** -0.5 * math.log2(math.e), D=head_dim, BM=block, BN=block,
        **features, num_warps=4, num_stages=2)
    launch()
    difference = (out - expected).abs().max().item()
    ms = triton.testing.do_bench(launch, return_mode="median")
    flops = 4 * batch * heads * seqlen * seqlen * head_dim
    print(f"N={seqlen} flags {flags}: {flops / ms * 1e-9:.0f} TFLOP/s, max difference from SDPA {difference:.3g}")


def main(argv):
    seqlen = 4096
    if argv[:1] == ["--seqlen"]:
        seqlen, argv = int(argv[1]), argv[2:]
    if argv[:1] == ["--one"]:
        return run_variant(seqlen, argv[1])
    for flags in argv or ["-", "h", "a", "s", "m", "hs"]:
        done = subprocess.run([sys.executable, __file__, "--seqlen", str(seqlen), "--one", flags],
                              capture_output=True, text=True)
        lines = (done.stdout + done.stderr).strip().splitlines()
        failure = next((line for line in lines if "rror" in line or "ssert" in line or "UNREACHABLE" in line), "")
        print(lines[-1] if done.returncode == 0 else f"N={seqlen} flags {flags}: failed ({failure[:160]})", flush=True)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")


if __name__ == "__main__":
    main(sys.argv[1:])
