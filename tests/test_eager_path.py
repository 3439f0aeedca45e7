"""Eager calls skip torch.library's dispatcher (torch_ops.run_attention) and must match the ops.

The public functions run the op bodies directly under an autograd.Function when nothing needs the
registered op, and call the op otherwise (torch function or dispatch modes, fake tensors,
torch.compile, which test_ops.py covers). Both paths must give the same bits, gradients of the
logsumexp included, and the routing must really happen (checked through the grad_fn's type and a
dispatch mode that records the ops it sees).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import DEVICE
from inputs import cu_seqlens, op_options, random_qkv

EAGER_GRAD_FN = "_EagerAttentionBackward"
LENGTHS = [17, 0, 40, 5]


def _case(fa, name):
    """(public call, the same call on the registered op, its differentiable inputs)."""
    if name in ("dense", "kvpacked", "qkvpacked"):
        q, k, v = random_qkv((1, 113, 4, 64), (1, 203, 2, 64), requires_grad=True)
        if name == "dense":
            return (lambda: fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2],
                    lambda: fa.ops.fwd(q, k, v, None, None, 0, 0, None, *op_options(fa, True)), (q, k, v))
        if name == "kvpacked":
            kv = torch.stack((k, v), dim=2).detach().requires_grad_()
            return (lambda: fa.flash_attn_kvpacked_func(q, kv, causal=True, return_attn_probs=True)[:2],
                    lambda: fa.ops.fwd_kvpacked(q, kv, None, None, 0, 0, None, *op_options(fa, True)), (q, kv))
        qkv = torch.randn(1, 113, 3, 2, 64, device=DEVICE, dtype=torch.float16, requires_grad=True)
        return (lambda: fa.flash_attn_qkvpacked_func(qkv, causal=False, return_attn_probs=True)[:2],
                lambda: fa.ops.fwd_qkvpacked(qkv, None, None, 0, 0, None, *op_options(fa, False)), (qkv,))
    cu, longest = cu_seqlens(LENGTHS), max(LENGTHS)
    qkv = torch.randn(sum(LENGTHS), 3, 4, 64, device=DEVICE, dtype=torch.float16, requires_grad=True)
    return (lambda: fa.flash_attn_varlen_qkvpacked_func(qkv, cu, longest, causal=True, return_attn_probs=True)[:2],
            lambda: fa.ops.fwd_qkvpacked(qkv, cu, cu, longest, longest, None, *op_options(fa, True)), (qkv,))


def _outputs_and_grads(call, inputs, dout, dlse):
    out, lse = call()
    loss = (out.float() * dout).sum() + (lse * dlse).sum()
    return out, lse, *torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("name", ["dense", "kvpacked", "qkvpacked", "varlen"])
def test_eager_path_matches_op(fa, name):
    public, op, inputs = _case(fa, name)
    out, lse = public()
    assert type(out.grad_fn).__name__ == EAGER_GRAD_FN
    assert type(op()[0].grad_fn).__name__ != EAGER_GRAD_FN
    dout, dlse = torch.randn(out.shape, device=DEVICE), torch.randn_like(lse)
    eager = _outputs_and_grads(public, inputs, dout, dlse)
    dispatched = _outputs_and_grads(op, inputs, dout, dlse)
    for got, want in zip(eager, dispatched):
        assert torch.equal(got, want)
    with torch.no_grad():
        out_no_grad, lse_no_grad = public()
    assert out_no_grad.grad_fn is None and torch.equal(out_no_grad, out) and torch.equal(lse_no_grad, lse)


def test_eager_path_only_output_used(fa):
    """Only out feeds the loss: the logsumexp's gradient reaches the backward as None."""
    public, op, inputs = _case(fa, "dense")
    dout = torch.randn(public()[0].shape, device=DEVICE, dtype=torch.float16)
    eager = torch.autograd.grad(public()[0], inputs, dout)
    dispatched = torch.autograd.grad(op()[0], inputs, dout)
    for got, want in zip(eager, dispatched):
        assert torch.equal(got, want)


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def test_modes_and_fake_tensors_see_the_op(fa):
    public, _, inputs = _case(fa, "dense")
    want = public()
    with _RecordOps() as recorded:
        got = public()
    assert f"{fa.ops.name}::fwd" in recorded.names
    assert all(torch.equal(g, w) for g, w in zip(got, want))

    with torch.device(DEVICE):  # a torch function mode
        out, _ = public()
    assert type(out.grad_fn).__name__ != EAGER_GRAD_FN and torch.equal(out, want[0])

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        q, k, v = (mode.from_tensor(x) for x in inputs)
        fake_out = fa.flash_attn_func(q, k, v, causal=True)
    assert fake_out.shape == want[0].shape and fake_out.dtype == want[0].dtype
