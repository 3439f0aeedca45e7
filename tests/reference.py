"""Reference attention and the flash-attn error bar.

``attention_ref`` is plain PyTorch attention on (batch, seqlen, heads, dim) tensors with GQA and
bottom-right causal masking, computed in a chosen dtype. Run in float64 it is the truth; run in
the inputs' dtype it is "PyTorch math attention in the same dtype", whose error against float64
sets the bar (flash-attn's rule): our error may be at most 2x that for the output and 3x for the
gradients, plus a small slack, 1e-5 relative to the largest reference value, for cases where
PyTorch happens to be exact (e.g. the gradient of a one-key softmax is exactly 0) or nearly so
(fp32 reductions over thousands of keys). The slack is far below TF32 error (~1e-3 relative), so
fp32 inputs silently computed in TF32 still fail.
"""

import torch

FWD_FACTOR = 2.0
BWD_FACTOR = 3.0
SLACK = 1e-5


def attention_ref(q, k, v, causal: bool, softmax_scale: float, dtype: torch.dtype):
    """Returns (out, lse) computed in ``dtype``; rows that see no key give out 0, lse -inf."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k * softmax_scale)
    if causal:
        rows = torch.arange(seqlen_q, device=q.device)[:, None]
        cols = torch.arange(seqlen_k, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + seqlen_k - seqlen_q, float("-inf"))
    lse = torch.logsumexp(scores.float() if dtype != torch.float64 else scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    probs = probs.masked_fill(torch.isneginf(scores).all(dim=-1, keepdim=True), 0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse


def run_ref(q, k, v, dout, causal, softmax_scale, dtype):
    """Output and (dq, dk, dv) of attention_ref in ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, _ = attention_ref(*leaves, causal, softmax_scale, dtype)
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return out, grads


def max_err(x, ref) -> float:
    return (x.double() - ref.double()).abs().max().item() if x.numel() else 0.0


def assert_within_bar(name, ours, pytorch_same_dtype, truth, factor):
    """max|ours - truth| <= factor * max|pytorch - truth| + slack, and no NaN."""
    assert not torch.isnan(ours).any(), f"{name} has NaN"
    err, bar_err = max_err(ours, truth), max_err(pytorch_same_dtype, truth)
    scale = max(1.0, truth.abs().max().item()) if truth.numel() else 1.0
    bound = factor * bar_err + SLACK * scale
    assert err <= bound, f"{name}: max error {err:.3g} > {factor} x PyTorch's {bar_err:.3g} + {SLACK} x {scale:.3g}"
