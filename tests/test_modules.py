"""The nn.Modules (modules.py) and kernels layers (layers.py) against plain-PyTorch references.

Every reference is written here (or in reference.py) from the modules' own weights and run twice:
in float64 (the truth) and in the modules' dtype, whose error against the truth sets the bar
(reference.assert_within_bar: 2x for outputs, 3x for gradients, plus a small slack). The modules
run in fp32 on the CPU (Triton interpreter) and in bf16 (fp16 below sm_80) on a GPU.

What is checked:
- FlashSelfAttention (padded qkv and cu_seqlens) and FlashCrossAttention (q, kv, GQA, padded and
  varlen) with causal masks, the forward's causal override, windows, ALiBi and softmax_scale;
- MHA forward and parameter gradients: self-attention with GQA/MQA, rotary (GPT-NeoX, GPT-J, XPos),
  causal, key_padding_mask (left and right padding), cu_seqlens, ALiBi + window, cross-attention
  with key_padding_mask, mixer_subset and no biases; checkpointing and return_residual;
- MHA generation with InferenceParams: prefill + one-token and multi-token steps (causal or not,
  rotary in the kernel or outside it, XPos, ALiBi + window, per-sequence lengths_per_sample) match
  the reference run on each sequence's tokens so far, through a preallocated cache;
- dropout acts in training mode only; the FlashAttention module trains with torch.optim.SGD;
- kernels.kernelize swaps the layers into models (inference, training, torch.compile);
- bad arguments raise errors naming them.
"""

import copy
import math

import kernels
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import DEVICE, ON_GPU
from inputs import cu_seqlens
from reference import BWD_FACTOR, FWD_FACTOR, assert_within_bar, attention_ref
from sizes import BF16

DTYPE = BF16 if ON_GPU else torch.float32
EMBED, HEADS = 64, 4  # head dim 16


def _randn(*shape, dtype=DTYPE, requires_grad=False):
    return torch.randn(*shape, device=DEVICE, dtype=dtype).requires_grad_(requires_grad)


def _mask(rows):
    """bool (batch, seqlen) key_padding_mask from strings of 1 (keep) and 0 (padding)."""
    return torch.tensor([[c == "1" for c in row] for row in rows], device=DEVICE)


def _check(name, got, reference, factor=FWD_FACTOR):
    """got against reference(dtype) computed in float64 (truth) and in got's dtype (bar)."""
    assert_within_bar(name, got, reference(got.dtype), reference(torch.float64), factor)


# --------------------------------------------------------------------------------------------
# FlashSelfAttention, FlashCrossAttention


def _varlen_ref(q, k, v, cu_q, cu_k, dtype, **options):
    """attention_ref per packed sequence: (total_q, heads, d) out in ``dtype``."""
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    outs = [attention_ref(q[bounds_q[b]:bounds_q[b + 1]][None], k[bounds_k[b]:bounds_k[b + 1]][None],
                          v[bounds_k[b]:bounds_k[b + 1]][None], dtype=dtype, **options)[0][0]
            for b in range(len(bounds_q) - 1)]
    return torch.cat(outs)


SELF_CASES = {  # id: (constructor kwargs, forward's causal)
    "plain": ({}, None),
    "causal": ({"causal": True}, None),
    "causal-override": ({}, True),
    "window-scale": ({"window_size": (3, 2), "softmax_scale": 0.2}, None),
    "alibi-causal": ({"causal": True, "alibi": True}, None),
}


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
@pytest.mark.parametrize("case", SELF_CASES)
def test_flash_self_attention(fa, case, varlen):
    kwargs, causal = SELF_CASES[case]
    heads = 3
    slopes = torch.tensor([0.5, 0.25, 0.125], device=DEVICE) if kwargs.pop("alibi", False) else None
    attn = fa.FlashSelfAttention(alibi_slopes=slopes, **kwargs)
    options = dict(causal=attn.causal if causal is None else causal, softmax_scale=attn.softmax_scale,
                   window=attn.window_size, alibi_slopes=slopes)
    if varlen:
        lengths = [5, 0, 13, 1]
        cu = cu_seqlens(lengths)
        qkv = _randn(sum(lengths), 3, heads, 32)
        got = attn(qkv, causal=causal, cu_seqlens=cu, max_seqlen=max(lengths))
        _check(case, got, lambda dtype: _varlen_ref(*qkv.unbind(1), cu, cu, dtype, **options))
    else:
        qkv = _randn(2, 13, 3, heads, 32)
        got = attn(qkv, causal)
        _check(case, got, lambda dtype: attention_ref(*qkv.unbind(2), dtype=dtype, **options)[0])


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_cross_attention(fa, causal, varlen):
    """q attends to kv with half as many heads (GQA); seqlen_q != seqlen_k."""
    attn = fa.FlashCrossAttention(causal=causal, window_size=(-1, -1))
    options = dict(causal=causal, softmax_scale=None)
    if varlen:
        lengths_q, lengths_k = [3, 9, 1], [14, 5, 0]
        cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
        q, kv = _randn(sum(lengths_q), 4, 16), _randn(sum(lengths_k), 2, 2, 16)
        got = attn(q, kv, cu_seqlens=cu_q, max_seqlen=max(lengths_q), cu_seqlens_k=cu_k, max_seqlen_k=max(lengths_k))
        _check("varlen", got, lambda dtype: _varlen_ref(q, *kv.unbind(1), cu_q, cu_k, dtype, **options))
    else:
        q, kv = _randn(2, 9, 4, 16), _randn(2, 14, 2, 2, 16)
        got = attn(q, kv)
        _check("padded", got, lambda dtype: attention_ref(q, *kv.unbind(2), dtype=dtype, **options)[0])


# --------------------------------------------------------------------------------------------
# MHA against a reference built from its weights


def _rotate(rotary, x, key: bool):
    """x (batch, seqlen, heads, d) rotated at positions 0..seqlen-1 by RotaryEmbedding ``rotary``'s
    settings, in x's dtype from float64 tables. XPos scales q by scale^(t / scale_base) and k by its
    inverse: the module centres t on the middle of its tables, which cancels in q.k."""
    dim, seqlen = rotary.dim, x.shape[1]
    positions = torch.arange(seqlen, device=x.device, dtype=torch.float64)[:, None]
    pairs = torch.arange(0, dim, 2, device=x.device, dtype=torch.float64)
    angles = positions * rotary.base ** (-pairs / dim)
    cos, sin = angles.cos(), angles.sin()
    if rotary.scale_base is not None:
        scale = ((pairs + 0.4 * dim) / (1.4 * dim)) ** (positions / rotary.scale_base)
        scale = 1 / scale if key else scale
        cos, sin = cos * scale, sin * scale
    cos, sin = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]
    if rotary.interleaved:
        x1, x2 = x[..., 0:dim:2], x[..., 1:dim:2]
        rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    else:
        x1, x2 = x[..., :dim // 2], x[..., dim // 2:dim]
        rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return torch.cat([rotated, x[..., dim:]], dim=-1)


def mha_reference(m, x, dtype, key_padding_mask=None, x_kv=None, mixer_subset=None):
    """MHA m's forward in plain PyTorch, in ``dtype``, from copies of its parameters: returns
    (out, {name: parameter copy}). Padded queries give a zero context (out = out_proj's bias)."""
    params = {name: p.detach().to(dtype).requires_grad_() for name, p in m.named_parameters()}

    def linear(layer, t):
        return F.linear(t.to(dtype), params[f"{layer}.weight"], params.get(f"{layer}.bias"))

    if m.cross_attn:
        q = linear("Wq", x if mixer_subset is None else x[:, mixer_subset])
        kv = linear("Wkv", x if x_kv is None else x_kv)
    else:
        qkv = linear("Wqkv", x)
        q, kv = qkv[..., :m.embed_dim], qkv[..., m.embed_dim:]
    q = q.unflatten(-1, (m.num_heads, m.head_dim))
    k, v = kv.unflatten(-1, (2, m.num_heads_kv, m.head_dim)).unbind(-3)
    if m.rotary_emb_dim:
        q, k = _rotate(m.rotary_emb, q, key=False), _rotate(m.rotary_emb, k, key=True)
    inner = m.inner_attn
    keys_kept = torch.ones(k.shape[:2], dtype=torch.bool, device=x.device) if key_padding_mask is None \
        else key_padding_mask
    queries_kept = torch.ones(q.shape[:2], dtype=torch.bool, device=x.device) if m.cross_attn else keys_kept
    rows = []
    for b in range(q.shape[0]):
        qi, ki = queries_kept[b].nonzero()[:, 0], keys_kept[b].nonzero()[:, 0]
        out, _ = attention_ref(q[b, qi][None], k[b, ki][None], v[b, ki][None], inner.causal, inner.softmax_scale,
                               dtype, window=inner.window_size, alibi_slopes=inner.alibi_slopes)
        rows.append(torch.zeros_like(q[b]).index_put((qi,), out[0]))
    return linear("out_proj", torch.stack(rows).flatten(-2)), params


def _mha(fa, **kwargs):
    return fa.MHA(EMBED, HEADS, device=DEVICE, dtype=DTYPE, **kwargs)


PAD_ROWS = ["11111111111", "00111111100"]  # left and right padding
MHA_CASES = {  # id: (constructor kwargs, input form)
    "gqa-rotary-causal": ({"num_heads_kv": 2, "rotary_emb_dim": 8, "causal": True}, "dense"),
    "gptj-causal-mask": ({"rotary_emb_dim": 16, "rotary_emb_interleaved": True, "causal": True}, "mask"),
    "mqa-xpos-mask": ({"num_heads_kv": 1, "rotary_emb_dim": 16, "rotary_emb_scale_base": 64.0}, "mask"),
    "gqa-alibi-window-packed": ({"num_heads_kv": 2, "use_alibi": True, "window_size": (4, 1)}, "packed"),
    "causal-scale-packed": ({"causal": True, "softmax_scale": 0.3}, "packed"),
    "cross-gqa-causal-mask": ({"cross_attn": True, "num_heads_kv": 2, "causal": True}, "cross-mask"),
    "cross-subset-nobias": ({"cross_attn": True, "qkv_proj_bias": False, "out_proj_bias": False}, "cross-subset"),
}


@pytest.mark.parametrize("case", MHA_CASES)
def test_mha_forward_backward(fa, case):
    """Output and every parameter's gradient against mha_reference."""
    kwargs, form = MHA_CASES[case]
    m = _mha(fa, **kwargs)
    x = _randn(2, len(PAD_ROWS[0]), EMBED)
    inputs = {}  # forward keywords of both the module and the reference
    if form in ("mask", "packed"):
        inputs["key_padding_mask"] = _mask(PAD_ROWS)
    elif form == "cross-mask":
        inputs.update(x_kv=_randn(2, 7, EMBED), key_padding_mask=_mask(["1111111", "1111000"]))
    elif form == "cross-subset":
        inputs["mixer_subset"] = slice(2, 6)
    if form == "packed":  # the kept tokens back to back, against the padded reference's kept rows
        kept = inputs["key_padding_mask"]
        lengths = kept.sum(1).tolist()
        got = m(x[kept], cu_seqlens=cu_seqlens(lengths), max_seqlen=max(lengths))
        select = lambda out: out[kept]  # noqa: E731
    else:
        got = m(x, **inputs)
        select = lambda out: out  # noqa: E731
    dout = _randn(*got.shape)
    got.backward(dout)

    outs, grads = {}, {}
    for dtype in (DTYPE, torch.float64):
        out, params = mha_reference(m, x, dtype, **inputs)
        outs[dtype] = select(out)
        grads[dtype] = dict(zip(params, torch.autograd.grad(outs[dtype], list(params.values()), dout.to(dtype))))
    assert_within_bar("out", got, outs[DTYPE], outs[torch.float64], FWD_FACTOR)
    for name, p in m.named_parameters():
        assert_within_bar(f"d {name}", p.grad, grads[DTYPE][name], grads[torch.float64][name], BWD_FACTOR)


def test_mha_checkpointing_and_return_residual(fa):
    """checkpointing recomputes the attention in the backward: same output and gradients, bit for
    bit; return_residual returns x too."""
    plain = _mha(fa, num_heads_kv=2, rotary_emb_dim=8, causal=True, dropout=0.2)
    checkpointed = _mha(fa, num_heads_kv=2, rotary_emb_dim=8, causal=True, dropout=0.2, checkpointing=True,
                        return_residual=True)
    checkpointed.load_state_dict(plain.state_dict())
    x = _randn(2, 9, EMBED)
    torch.manual_seed(7)
    want = plain(x)
    torch.manual_seed(7)
    got, residual = checkpointed(x)
    assert residual is x and torch.equal(got, want)
    dout = _randn(*want.shape)
    want.backward(dout)
    got.backward(dout)
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        assert torch.equal(p.grad, q.grad), name


# --------------------------------------------------------------------------------------------
# generation with InferenceParams

DECODE_CASES = {  # id: (constructor kwargs, tokens per call (the first is the prompt), tokens row 1 drops)
    "gqa-rotary-causal-lengths": ({"num_heads_kv": 2, "rotary_emb_dim": 8, "causal": True}, [9, 1, 1, 3, 1], 3),
    "gptj-noncausal": ({"rotary_emb_dim": 16, "rotary_emb_interleaved": True}, [6, 1, 2, 1], 0),
    "mqa-xpos-alibi-window-lengths": ({"num_heads_kv": 1, "rotary_emb_dim": 16, "rotary_emb_scale_base": 64.0,
                                       "causal": True, "use_alibi": True, "window_size": (5, 0)}, [7, 1, 2], 2),
}


@pytest.mark.parametrize("case", DECODE_CASES)
def test_mha_generation(fa, case):
    """Prompt, then one- and multi-token steps through the layer's KV cache: each step's output
    matches the reference run on the sequence so far (the last tokens of it). With a drop, row 1
    continues after its prompt's first tokens only (lengths_per_sample)."""
    kwargs, steps, drop = DECODE_CASES[case]
    m = _mha(fa, layer_idx=3, **kwargs).eval()
    x = _randn(2, sum(steps), EMBED)
    params = fa.InferenceParams(max_seqlen=sum(steps) + 2, max_batch_size=2)
    cache = m.allocate_inference_cache(2, params.max_seqlen)
    assert cache.shape == (2, params.max_seqlen, 2, m.num_heads_kv, m.head_dim) and cache.dtype == DTYPE
    params.key_value_memory_dict[3] = cache.fill_(float("nan"))  # rows read before written show up as NaN
    tokens = [[], []]  # each row's sequence so far, as indices into x
    outs, refs = [], {DTYPE: [], torch.float64: []}
    start = 0
    with torch.no_grad():
        for step, n in enumerate(steps):
            outs.append(m(x[:, start:start + n], inference_params=params))
            for b in range(2):
                tokens[b] += range(start, start + n)
                for dtype, ref in refs.items():
                    ref.append(mha_reference(m, x[b:b + 1, tokens[b]], dtype)[0][0, -n:])
            if step == 0 and drop:
                tokens[1] = tokens[1][:n - drop]
                params.lengths_per_sample = torch.tensor([n, n - drop], dtype=torch.int32, device=DEVICE)
            elif params.lengths_per_sample is not None:
                params.lengths_per_sample += n
            params.seqlen_offset += n
            start += n
    assert params.key_value_memory_dict[3] is cache
    got = torch.cat([out[b] for out in outs for b in range(2)])
    assert_within_bar("decoded", got, torch.cat(refs[DTYPE]), torch.cat(refs[torch.float64]), FWD_FACTOR)
    params.reset(8, 1)
    assert (params.max_seqlen, params.max_batch_size, params.seqlen_offset) == (8, 1, 0)
    assert params.lengths_per_sample is None or not params.lengths_per_sample.any()


def test_generation_allocates_missing_cache(fa):
    """Without a preallocated cache the prompt creates key_value_memory_dict[layer_idx]; the
    decoded token matches the full sequence's last output."""
    m = _mha(fa, layer_idx=0, rotary_emb_dim=16, causal=True).eval()
    x = _randn(1, 6, EMBED)
    params = fa.InferenceParams(max_seqlen=10, max_batch_size=1)
    with torch.no_grad():
        m(x[:, :5], inference_params=params)
        assert params.key_value_memory_dict[0].shape == (1, 10, 2, HEADS, EMBED // HEADS)
        params.seqlen_offset = 5
        step = m(x[:, 5:], inference_params=params)
        full = m(x)
    assert torch.allclose(step, full[:, 5:], rtol=1e-2 if ON_GPU else 1e-5, atol=1e-2 if ON_GPU else 1e-6)
    _check("step", step[0], lambda dtype: mha_reference(m, x, dtype)[0][0, 5:].detach())


# --------------------------------------------------------------------------------------------
# dropout, training with an optimizer


def test_dropout_only_in_training(fa):
    m = _mha(fa, dropout=0.5, causal=True)
    no_dropout = _mha(fa, causal=True)
    no_dropout.load_state_dict(m.state_dict())
    x = _randn(2, 16, EMBED)
    torch.manual_seed(1)
    first = m(x)
    torch.manual_seed(1)
    assert torch.equal(m(x), first), "the same seed draws the same mask"
    assert not torch.allclose(m(x), first), "a new draw drops other entries"
    assert not torch.allclose(first, no_dropout(x))
    m.eval()
    assert torch.equal(m(x), no_dropout(x)), "eval mode applies no dropout"


def test_flash_attention_module_trains_with_sgd(fa):
    """FlashAttention on (batch, heads, seqlen, headdim) leaves, GQA and softcap: gradients match
    the reference, and SGD steps lower the loss."""
    attn = fa.FlashAttention(causal=True, softcap=4.0)
    q = _randn(2, 4, 12, 16, requires_grad=True)
    k, v = _randn(2, 2, 12, 16, requires_grad=True), _randn(2, 2, 12, 16, requires_grad=True)
    target = _randn(2, 4, 12, 16)

    def reference(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = attention_ref(*(t.transpose(1, 2) for t in leaves), causal=True, dtype=dtype, softcap=4.0)[0]
        loss = F.mse_loss(out.transpose(1, 2), target.to(dtype), reduction="sum")
        return torch.autograd.grad(loss, leaves)

    out = attn(q, k, v)
    assert out.shape == q.shape
    F.mse_loss(out, target, reduction="sum").backward()
    for name, got, same_dtype, truth in zip("qkv", (q.grad, k.grad, v.grad), reference(DTYPE),
                                            reference(torch.float64)):
        assert_within_bar(f"d{name}", got, same_dtype, truth, BWD_FACTOR)

    optimizer = torch.optim.SGD([q, k, v], lr=0.02)
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = F.mse_loss(attn(q, k, v), target, reduction="sum")
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses


# --------------------------------------------------------------------------------------------
# kernels.kernelize and torch.compile


@kernels.use_kernel_forward_from_hub("FlashSelfAttention")
class ReferenceSelfAttention(nn.Module):
    """A model's own attention (plain PyTorch), replaceable by the hub layer FlashSelfAttention."""

    def __init__(self, causal):
        super().__init__()
        self.causal = causal
        self.softmax_scale = None
        self.drop = nn.Dropout(0.0)

    def forward(self, qkv, causal=None, cu_seqlens=None, max_seqlen=None):
        causal = self.causal if causal is None else causal
        return attention_ref(*qkv.unbind(2), causal, self.softmax_scale, qkv.dtype)[0]


@kernels.use_kernel_forward_from_hub("FlashCrossAttention")
class ReferenceCrossAttention(nn.Module):
    """Attention of q over packed kv, replaceable by the hub layer FlashCrossAttention."""

    def __init__(self, softmax_scale):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, q, kv, causal=None, cu_seqlens=None, max_seqlen=None, cu_seqlens_k=None, max_seqlen_k=None):
        return attention_ref(q, *kv.unbind(2), bool(causal), self.softmax_scale, q.dtype)[0]


@kernels.use_kernel_forward_from_hub("FlashAttention")
class ReferenceAttention(nn.Module):
    """Attention on (batch, heads, seqlen, headdim), replaceable by the hub layer FlashAttention."""

    def __init__(self, window_size):
        super().__init__()
        self.window_size = window_size

    def forward(self, q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return attention_ref(q, k, v, dtype=q.dtype, window=self.window_size)[0].transpose(1, 2)


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 3 * 32, device=DEVICE, dtype=DTYPE)
        self.self_attention = ReferenceSelfAttention(causal=True)
        self.cross_attention = ReferenceCrossAttention(softmax_scale=0.4)
        self.attention = ReferenceAttention(window_size=(2, 1))

    def forward(self, x):
        qkv = self.qkv(x).unflatten(-1, (3, 2, 16))
        heads_first = [t.transpose(1, 2) for t in qkv.unbind(2)]
        return (self.self_attention(qkv) + self.cross_attention(qkv[:, :, 0], qkv[:, :, 1:, :1], causal=True)
                + self.attention(*heads_first).transpose(1, 2))


MODES = {"inference": kernels.Mode.INFERENCE, "training": kernels.Mode.TRAINING,
         "training-compile": kernels.Mode.TRAINING | kernels.Mode.TORCH_COMPILE}


@pytest.mark.parametrize("mode", MODES)
def test_kernelize(fa, build_dir, mode):
    """kernelize puts our layers' forward on the model's attention modules (no fallback), and the
    model gives the reference's output (and gradients in training)."""
    model = TinyModel()
    reference, truth = copy.deepcopy(model), copy.deepcopy(model).double()
    mapping = {name: {DEVICE: kernels.LocalLayerRepository(repo_path=build_dir, layer_name=name)}
               for name in ("FlashSelfAttention", "FlashCrossAttention", "FlashAttention")}
    with kernels.use_kernel_mapping(mapping):
        kernels.kernelize(model, mode=MODES[mode], device=DEVICE, use_fallback=False)
    assert model.self_attention.forward.__func__ is fa.layers.FlashSelfAttention.forward
    assert model.cross_attention.forward.__func__ is fa.layers.FlashCrossAttention.forward
    assert model.attention.forward.__func__ is fa.layers.FlashAttention.forward
    run = torch.compile(model, fullgraph=True, backend="aot_eager") if "compile" in mode else model
    x = _randn(2, 11, 32)
    got, want, true = run(x), reference(x), truth(x.double())
    assert_within_bar("out", got, want, true, FWD_FACTOR)
    if mode != "inference":
        dout = _randn(*got.shape)
        got.backward(dout)
        want.backward(dout)
        true.backward(dout.double())
        for (name, p), q, t in zip(model.named_parameters(), reference.parameters(), truth.parameters()):
            assert_within_bar(f"d {name}", p.grad, q.grad, t.grad, BWD_FACTOR)


def test_modules_compile_fullgraph(fa):
    """The modules (the layers' forward) trace into one graph and match eager."""
    slopes = torch.tensor([0.5, 0.25], device=DEVICE)
    qkv = _randn(2, 9, 3, 2, 16, requires_grad=True)
    attn = fa.FlashSelfAttention(causal=True, window_size=(3, 0), alibi_slopes=slopes)
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(qkv), attn(qkv))
    cross = fa.FlashCrossAttention(causal=True)
    q, kv = qkv[:, :, 0], qkv[:, :, 1:]
    assert torch.equal(torch.compile(cross, fullgraph=True, backend="aot_eager")(q, kv), cross(q, kv))
    bhsd = fa.FlashAttention(softcap=3.0)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    assert torch.equal(torch.compile(bhsd, fullgraph=True, backend="aot_eager")(q, k, v), bhsd(q, k, v))


# --------------------------------------------------------------------------------------------
# package surface and errors


def test_exports_and_alibi_slopes(fa):
    for name in ("layers", "modules", "FlashSelfAttention", "FlashCrossAttention", "MHA", "FlashAttention",
                 "InferenceParams"):
        assert name in fa.__all__ and hasattr(fa, name)
    for name in ("FlashSelfAttention", "FlashCrossAttention", "FlashAttention"):
        module_class, layer = getattr(fa.modules, name), getattr(fa.layers, name)
        assert issubclass(module_class, layer) and module_class.forward is layer.forward
    assert fa.modules.get_alibi_slopes(8) == [2.0 ** -i for i in range(1, 9)]
    assert fa.modules.get_alibi_slopes(6) == [2.0 ** -i for i in (2, 4, 6, 8, 1, 3)]
    twelve = [2.0 ** -i for i in range(1, 9)] + [2.0 ** -i for i in (0.5, 1.5, 2.5, 3.5)]
    assert all(math.isclose(a, b) for a, b in zip(fa.modules.get_alibi_slopes(12), twelve, strict=True))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"dwconv": True}, NotImplementedError, "dwconv"),
    ({"fused_bias_fc": True}, NotImplementedError, "fused_bias_fc"),
    ({"num_heads_kv": 3}, ValueError, "num_heads_kv"),
    ({"rotary_emb_dim": 32}, ValueError, "rotary_emb_dim"),
    ({"cross_attn": True, "rotary_emb_dim": 8}, ValueError, "cross_attn"),
], ids=lambda p: p if isinstance(p, str) else None)
def test_constructor_errors(fa, kwargs, error, match):
    with pytest.raises(error, match=match):
        _mha(fa, **kwargs)
    with pytest.raises(ValueError, match="embed_dim"):
        fa.MHA(30, 4)


def test_forward_errors(fa):
    x = _randn(2, 5, EMBED)
    mask = torch.ones(2, 5, dtype=torch.bool, device=DEVICE)
    m = _mha(fa)
    rotary = _mha(fa, rotary_emb_dim=8, layer_idx=0, dropout=0.1)
    params = fa.InferenceParams(max_seqlen=8, max_batch_size=2)
    cu, packed = cu_seqlens([5, 5]), x.flatten(0, 1)
    with pytest.raises(ValueError, match="x_kv"):
        m(x, x_kv=x)
    with pytest.raises(ValueError, match="mixer_subset"):
        m(x, mixer_subset=slice(1))
    with pytest.raises(ValueError, match="cu_seqlens.*key_padding_mask"):
        m(packed, key_padding_mask=mask, cu_seqlens=cu, max_seqlen=5)
    with pytest.raises(ValueError, match="max_seqlen"):
        m(packed, cu_seqlens=cu)
    with pytest.raises(ValueError, match="rotary"):
        rotary(packed, cu_seqlens=cu, max_seqlen=5)
    with pytest.raises(ValueError, match="key_padding_mask must be"):
        m(x, key_padding_mask=mask[:, :4])
    with pytest.raises(ValueError, match="layer_idx"):
        m(x, inference_params=params)
    with pytest.raises(ValueError, match="key_padding_mask"):
        rotary(x, key_padding_mask=mask, inference_params=params)
    with pytest.raises(ValueError, match="eval"):
        rotary(x, inference_params=params)
    rotary.eval()
    with pytest.raises(ValueError, match="do not fit"):
        with torch.no_grad():
            rotary(_randn(2, 9, EMBED), inference_params=params)
    params.seqlen_offset = 1
    with pytest.raises(ValueError, match="no_grad"):
        rotary(x[:, :1], inference_params=params)
    cross = fa.FlashCrossAttention()
    q, kv = _randn(7, 4, 16), _randn(7, 2, 4, 16)
    with pytest.raises(ValueError, match="without cu_seqlens_k, max_seqlen_k"):
        cross(q, kv, cu_seqlens=cu_seqlens([7]), max_seqlen=7)
