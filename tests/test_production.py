"""The package as users run it in production: non-finite inputs, devices, CUDA graphs,
torch.compile, streams, a second GPU and tensors past 2**31 elements.

* NaN and Inf propagate as in PyTorch's attention, and no further. A poisoned input makes NaN
  exactly where the math needs it: a NaN query row poisons its own output row, lse and dq row,
  and the dk / dv of the keys that row sees; a NaN (or +Inf) key poisons the output rows that see
  it. The gradients PyTorch's math attention poisons beyond that (its softmax turns a NaN row's
  masked entries into NaN too, and 0 * NaN spreads it through the products) may or may not be
  NaN here, depending on which tiles a kernel visits: every NaN of ours must be one of PyTorch's,
  every NaN the math needs must be ours, and every finite value must equal, bitwise, a clean run
  whose poisoned entries are zeros (and whose poisoned rows have a zero output gradient, so that
  they contribute nothing, as a NaN row contributes nothing to the finite entries). Masked -inf
  never makes NaN (rows that see no key: out 0 and finite gradients), and large finite inputs
  do not overflow.
* Tensors on different devices are refused with an error that names them (CPU vs meta on CPU
  runs; CUDA vs CPU and cuda:0 vs cuda:1 on GPU runs).
* GPU only (each needs CUDA itself): CUDA graph capture and replay of forward + backward, dropout
  included (a replay after torch.cuda.manual_seed(s) equals an eager call after the same seed,
  bitwise, and successive replays draw new masks, as PyTorch's graph-safe generator promises),
  and of a flash_attn_with_kvcache decode step; torch.compile(mode="reduce-overhead"); calls on a
  non-default stream and on cuda:1 ordered on that device's current stream (their inputs are
  written there after a long sleep kernel: work launched anywhere else would read the NaN that
  was there before); tensors past 2**31 elements in every kernel family, checked on slices
  against the float64 reference.
* Dynamic shapes (CPU too, through the aot_eager backend): a new sequence length does not
  recompile.
"""

import types

import pytest
import torch

from conftest import DEVICE, ON_GPU
from inputs import cu_seqlens, random_qkv
from reference import BWD_FACTOR, FWD_FACTOR, assert_within_bar, attention_ref, run_ref, run_varlen_ref, visible_mask
from sizes import BF16, DTYPES

NAN = float("nan")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs CUDA itself (graphs, streams, devices, GPU memory)")
TWO_GPUS = ON_GPU and torch.cuda.device_count() >= 2


def _run(fa, q, k, v, dout, **options):
    """out, lse and (dq, dk, dv) of flash_attn_func."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = fa.flash_attn_func(*leaves, return_attn_probs=True, **options)
    return out, lse, torch.autograd.grad(out, leaves, dout)


# --------------------------------------------------------------------------------------------
# NaN and Inf


def _assert_pattern(name, ours, must, allowed):
    """NaN in ``ours`` wherever ``must`` says, and only in (token, head) vectors where ``allowed``
    has a NaN. (Vectors, not entries: PyTorch's masked_fill zeroes the score gradient of masked
    pairs, so a NaN query coordinate reaches only that coordinate of a masked key's dk, 0 * NaN,
    where a kernel that visits the pair's tile spreads it over the key's vector.)"""
    nan = torch.isnan(ours)
    allowed = allowed.any(dim=-1, keepdim=True).expand_as(allowed)
    assert not (must & ~nan).any(), f"{name}: {(must & ~nan).sum().item()} entries should be NaN and are not"
    assert not (nan & ~allowed).any(), f"{name}: NaN leaked to {(nan & ~allowed).sum().item()} entries " \
                                       "that PyTorch's attention keeps finite"


def _check_poisoned(fa, poisoned, clean, dout, must, options):
    """Runs the poisoned inputs (q, k, v) and their clean version; ``must``: the NaN (out, dq, dk,
    dv) the math needs. PyTorch's float64 math attention bounds the NaN from above; finite entries
    equal the clean run's bitwise."""
    out, lse, grads = _run(fa, *poisoned, dout, **options)
    clean_out, clean_lse, clean_grads = _run(fa, *clean, dout, **options)
    scale = poisoned[0].shape[-1] ** -0.5
    causal, window = options.get("causal", False), options.get("window_size", (-1, -1))
    torch_out, torch_grads = run_ref(*poisoned, dout, causal, scale, torch.float64, window=window)
    _assert_pattern("out", out, must[0], torch.isnan(torch_out))
    _assert_pattern("out (as PyTorch)", torch_out, must[0], torch.isnan(out))
    row_nan = must[0].any(dim=-1).transpose(1, 2)  # (batch, heads, seqlen_q)
    assert torch.equal(~torch.isfinite(lse), row_nan), "lse must be NaN (or +inf) exactly on the poisoned rows"
    assert not torch.isneginf(lse).any()
    assert torch.equal(lse[~row_nan], clean_lse[~row_nan])
    for name, ours, need, theirs, clean_value in zip(("dq", "dk", "dv"), grads, must[1:], torch_grads, clean_grads):
        _assert_pattern(name, ours, need, torch.isnan(theirs))
        finite = ~torch.isnan(ours)
        assert torch.equal(ours[finite], clean_value[finite]), f"{name}: finite entries differ from the clean run"
    finite = ~must[0]
    assert torch.equal(out[finite], clean_out[finite]), "out: finite entries differ from the clean run"
    # the clean run itself is right
    truth_out, truth_grads = run_ref(*clean, dout, causal, scale, torch.float64, window=window)
    same_out, same_grads = run_ref(*clean, dout, causal, scale, clean[0].dtype, window=window)
    assert_within_bar("clean out", clean_out, same_out, truth_out, FWD_FACTOR)
    for name, ours, same, truth in zip(("dq", "dk", "dv"), clean_grads, same_grads, truth_grads):
        assert_within_bar(f"clean {name}", ours, same, truth, BWD_FACTOR)


# (batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype): awkward sizes, and a shape the
# Gluon kernels can take on Hopper (full 128-row tiles, bf16, head dim 64; short for their default
# route, hopper_route.long_enough, so the test asks for them with FLASH_ATTENTION_GLUON=1)
POISON_SHAPES = {"awkward": (2, 37, 45, 4, 2, 40, torch.float16), "full_tiles": (1, 128, 256, 2, 1, 64, BF16)}
MASKS = {"full": dict(), "causal": dict(causal=True), "window": dict(window_size=(9, 3))}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("shape", list(POISON_SHAPES))
def test_nan_query_row_stays_in_its_row(fa, monkeypatch, shape, mask):
    batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype = POISON_SHAPES[shape]
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", "1")
    options = MASKS[mask]
    q, k, v = random_qkv((batch, seqlen_q, heads_q, head_dim), (batch, seqlen_k, heads_k, head_dim), dtype)
    b, i, h = batch - 1, seqlen_q // 2, heads_q - 1
    kv_head = h // (heads_q // heads_k)
    dout = torch.randn_like(q)
    dout[b, i, h] = 0  # (the clean run's row then contributes nothing)
    poisoned_q, clean_q = q.clone(), q.clone()
    poisoned_q[b, i, h, head_dim // 3] = NAN
    clean_q[b, i, h] = 0
    must_out = torch.zeros(q.shape, dtype=torch.bool, device=DEVICE)
    must_out[b, i, h] = True
    must_kv = torch.zeros(k.shape, dtype=torch.bool, device=DEVICE)
    seen = visible_mask(seqlen_q, seqlen_k, options.get("causal", False), options.get("window_size", (-1, -1)),
                        device=DEVICE)[i]
    must_kv[b, seen, kv_head] = True
    _check_poisoned(fa, (poisoned_q, k, v), (clean_q, k, v), dout, (must_out, must_out, must_kv, must_kv), options)


@pytest.mark.parametrize("value", [NAN, float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("mask", ["causal", "window"])
def test_nonfinite_key_poisons_the_rows_that_see_it(fa, mask, value):
    """A NaN key, or a key whose score is +inf for every query (q's first coordinate > 0, the key's
    +inf): the rows that see it get NaN (inf - inf in the softmax), the others stay exact."""
    batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype = POISON_SHAPES["awkward"]
    options = MASKS[mask]
    q, k, v = random_qkv((batch, seqlen_q, heads_q, head_dim), (batch, seqlen_k, heads_k, head_dim), dtype)
    q[..., 0] = q[..., 0].abs() + 0.25
    b, j, kv_head = 0, seqlen_k - seqlen_q + 12, heads_k - 1
    group = heads_q // heads_k
    heads = slice(kv_head * group, (kv_head + 1) * group)
    seen = visible_mask(seqlen_q, seqlen_k, options.get("causal", False), options.get("window_size", (-1, -1)),
                        device=DEVICE)
    rows = seen[:, j]  # the query rows that see key j
    assert rows.any() and not rows.all()
    poisoned_k, clean_k = k.clone(), k.clone()
    poisoned_k[b, j, kv_head, 0] = value
    clean_k[b, j, kv_head] = 0
    dout = torch.randn_like(q)
    dout[b, rows, heads] = 0
    must_out = torch.zeros(q.shape, dtype=torch.bool, device=DEVICE)
    must_out[b, rows, heads] = True
    must_kv = torch.zeros(k.shape, dtype=torch.bool, device=DEVICE)
    must_kv[b, seen[rows].any(dim=0), kv_head] = True  # every key a poisoned row sees
    _check_poisoned(fa, (q, poisoned_k, v), (q, clean_k, v), dout, (must_out, must_out, must_kv, must_kv), options)


FULLY_MASKED = {  # options whose first rows see no key when seqlen_q > seqlen_k
    "causal": dict(causal=True),
    "window": dict(window_size=(4, 1)),
    "causal_softcap_alibi": dict(causal=True, softcap=5.0, alibi=True),
    "window_sinks": dict(window_size=(3, 0), sinks=True),
    "causal_dropout": dict(causal=True, dropout_p=0.25),
}


@pytest.mark.parametrize("case", list(FULLY_MASKED))
def test_fully_masked_rows_never_make_nan(fa, case):
    """Rows that see no key (their scores all -inf) output 0 (lse +inf, or the sink), and every
    gradient is finite; the other rows match the float64 reference."""
    options = dict(FULLY_MASKED[case])
    seqlen_q, seqlen_k, heads, head_dim = 61, 23, 2, 48
    q, k, v = random_qkv((2, seqlen_q, heads, head_dim), (2, seqlen_k, heads, head_dim), torch.float16)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(heads, device=DEVICE) * 0.5
    if options.pop("sinks", False):
        options["s_aux"] = torch.randn(heads, device=DEVICE)
    dout = torch.randn_like(q)
    out, lse, grads = _run(fa, q, k, v, dout, **options)
    window = options.get("window_size", (-1, -1))
    empty = ~visible_mask(seqlen_q, seqlen_k, options.get("causal", False), window, device=DEVICE).any(dim=1)
    assert empty.any() and not empty.all()
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty])), "rows without keys must output 0"
    if "s_aux" in options:
        sinks = options["s_aux"][None, :, None].expand_as(lse[..., empty])
        assert torch.allclose(lse[..., empty], sinks, rtol=0, atol=1e-6), "rows without keys: lse must be the sink"
    else:
        assert torch.isposinf(lse[..., empty]).all()
    assert torch.isfinite(lse[..., ~empty]).all() and torch.isfinite(out).all()
    for name, grad in zip(("dq", "dk", "dv"), grads):
        assert torch.isfinite(grad).all(), f"{name} has non-finite entries"
    if "dropout_p" in options:
        return  # (the mask is random: the finite checks are the point here)
    ref_options = dict(window=window, softcap=options.get("softcap", 0.0), alibi_slopes=options.get("alibi_slopes"))
    scale = head_dim ** -0.5
    truth_out, truth_grads = run_ref(q, k, v, dout, options.get("causal", False), scale, torch.float64,
                                     sinks=options.get("s_aux"), **ref_options)
    same_out, same_grads = run_ref(q, k, v, dout, options.get("causal", False), scale, q.dtype,
                                   sinks=options.get("s_aux"), **ref_options)
    assert_within_bar("out", out, same_out, truth_out, FWD_FACTOR)
    for name, ours, same, truth in zip(("dq", "dk", "dv"), grads, same_grads, truth_grads):
        assert_within_bar(name, ours, same, truth, BWD_FACTOR)


def test_empty_varlen_sequences_never_make_nan(fa):
    """Varlen batches with sequences of no keys and of no queries: out 0 there, gradients finite."""
    lens_q, lens_k = [5, 0, 17, 9], [0, 11, 23, 9]
    q, k, v = random_qkv((sum(lens_q), 4, 32), (sum(lens_k), 2, 32), torch.float16, requires_grad=True)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    assert torch.equal(out[:5], torch.zeros_like(out[:5]))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    truth_out, truth_grads, _ = run_varlen_ref(q, k, v, dout, cu_q, cu_k, True, 32 ** -0.5, torch.float64)
    same_out, same_grads, _ = run_varlen_ref(q, k, v, dout, cu_q, cu_k, True, 32 ** -0.5, torch.float16)
    assert_within_bar("out", out, same_out, truth_out, FWD_FACTOR)
    for name, ours, same, truth in zip(("dq", "dk", "dv"), grads, same_grads, truth_grads):
        assert_within_bar(name, ours, same, truth, BWD_FACTOR)


# (dtype, scale of q and k): scores far beyond exp's range (fp16: |s| ~ 1e4; bf16 and fp32: ~1e29)
# q and k scaled so that logits reach about scale^2: fp16 to its range, fp32 to 1e30. bf16 to 1e6:
# the 2-byte path forms exp2(s * scale_log2 - pivot) in one FMA, whose unrounded product leaves the
# row's largest key an exponent of up to half an ulp of the pivot, which overflows once base-2
# logits pass 2^24 (about 1e7; an H100 gave NaN rows from 1e16 on). A known limit: docs/production.md#known-limits.
LARGE = {"float16": (torch.float16, 60.0), "bfloat16": (BF16, 1e3), "float32": (torch.float32, 1e15)}


@pytest.mark.parametrize("case", list(LARGE))
def test_large_finite_inputs_do_not_overflow(fa, case):
    """Huge finite logits: finite out, lse and gradients, within the bar of the float64 truth
    (PyTorch's own softmax subtracts the row max; so must we)."""
    dtype, scale = LARGE[case]
    if dtype not in DTYPES:
        pytest.skip(f"{dtype} is not supported on this GPU")
    q, k, v = random_qkv((1, 77, 2, 64), (1, 93, 2, 64), dtype)
    q, k = q * scale, k * scale
    assert torch.isfinite(q).all() and torch.isfinite(k).all()
    dout = torch.randn_like(q)
    out, lse, grads = _run(fa, q, k, v, dout, causal=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    for name, grad in zip(("dq", "dk", "dv"), grads):
        assert torch.isfinite(grad).all(), f"{name} overflowed"
    truth_out, truth_grads = run_ref(q, k, v, dout, True, 64 ** -0.5, torch.float64)
    same_out, same_grads = run_ref(q, k, v, dout, True, 64 ** -0.5, dtype)
    assert_within_bar("out", out, same_out, truth_out, FWD_FACTOR)
    assert_within_bar("dv", grads[2], same_grads[2], truth_grads[2], BWD_FACTOR)


# --------------------------------------------------------------------------------------------
# Tensors on different devices

OTHER_DEVICES = ["meta"] if not ON_GPU else [
    "cpu", pytest.param("cuda:1", marks=pytest.mark.skipif(not TWO_GPUS, reason="needs a second GPU"))]


def _int32(values, device=DEVICE):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _device_cases(other):
    """name -> (call(fa), message): one argument of a valid call moved to device ``other``."""
    def t(*shape, device=DEVICE):
        return torch.randn(*shape, device=device, dtype=torch.float16)

    q, k, v = t(2, 9, 4, 32), t(2, 11, 2, 32), t(2, 11, 2, 32)
    qv, kv_, vv = t(20, 4, 32), t(22, 2, 32), t(22, 2, 32)
    cu = _int32([0, 9, 20]), _int32([0, 11, 22])
    cache, seqlens = t(2, 32, 2, 32), _int32([3, 17])
    pages, table = t(4, 16, 2, 32), _int32([[0, 1], [2, 3]])
    cos = torch.randn(32, 8, device=DEVICE, dtype=torch.float16)
    return {
        "k": (lambda fa: fa.flash_attn_func(q, k.to(other), v), r"q, k, v must be on the same device.*k (meta|cpu|cuda)"),
        "v": (lambda fa: fa.flash_attn_func(q, k, v.to(other)), r"q, k, v must be on the same device.*v (meta|cpu|cuda)"),
        "q": (lambda fa: fa.flash_attn_func(q.to(other), k, v), r"q, k, v must be on the same device, got q "),
        "kv packed": (lambda fa: fa.flash_attn_kvpacked_func(q, torch.stack([k, v], 2).to(other)),
                      r"q, k, v must be on the same device"),
        "alibi_slopes": (lambda fa: fa.flash_attn_func(q, k, v, alibi_slopes=torch.ones(4, device=other)),
                         r"alibi_slopes must be on the same device as q"),
        "s_aux": (lambda fa: fa.flash_attn_func(q, k, v, s_aux=torch.ones(4, device=other)),
                  r"s_aux must be on the same device as q"),
        "varlen k": (lambda fa: fa.flash_attn_varlen_func(qv, kv_.to(other), vv, *cu, 11, 11),
                     r"q, k, v must be on the same device"),
        "cu_seqlens_q": (lambda fa: fa.flash_attn_varlen_func(qv, kv_, vv, cu[0].to(other), cu[1], 11, 11),
                         r"cu_seqlens_q must be on the same device as q"),
        "cu_seqlens_k": (lambda fa: fa.flash_attn_varlen_func(qv, kv_, vv, cu[0], cu[1].to(other), 11, 11),
                         r"cu_seqlens_k must be on the same device as [qk]"),
        "block_table": (lambda fa: fa.flash_attn_varlen_func(qv, pages, pages, cu[0], _int32([0, 20, 32]), 11, 20,
                                                             block_table=table.to(other)),
                        r"block_table must be on q's device"),
        "k_cache": (lambda fa: fa.flash_attn_with_kvcache(q, cache.to(other), cache, cache_seqlens=seqlens),
                    r"q, k_cache, v_cache must be on the same device"),
        "cache_seqlens": (lambda fa: fa.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=seqlens.to(other)),
                          r"cache_seqlens must be on q's device"),
        "new k": (lambda fa: fa.flash_attn_with_kvcache(q, cache, cache, k[:, :2].to(other), k[:, :2],
                                                        cache_seqlens=seqlens),
                  r"q, k, v must be on the same device"),
        "cache_batch_idx": (lambda fa: fa.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=seqlens,
                                                                  cache_batch_idx=_int32([1, 0], other)),
                            r"cache_batch_idx must be on q's device"),
        "paged block_table": (lambda fa: fa.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=seqlens,
                                                                    block_table=table.to(other)),
                              r"block_table must be on q's device"),
        "rotary_cos": (lambda fa: fa.flash_attn_with_kvcache(q, cache, cache, k[:, :2], v[:, :2], cos.to(other), cos,
                                                             cache_seqlens=seqlens),
                       r"rotary_cos must have q's dtype and device"),
        "rotary cos": (lambda fa: fa.apply_rotary_emb(q, cos.to(other), cos), r"cos must be on x's device"),
    }


CASE_NAMES = list(_device_cases("meta"))


def test_launchers_make_their_tensors_device_current(fa, monkeypatch):
    """Triton launches on the current device's stream, so each launcher makes its first tensor's
    CUDA device current (launch.on_tensor_device), and only when it is not already: checked here
    with stand-in devices, on two GPUs by test_second_gpu (cuda:1 inputs gave NaN without it)."""
    kernels = fa.flash_attention_kernel
    entered = []

    class Guard:
        def __init__(self, device):
            entered.append(device)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", Guard)
    ran = []
    guarded = kernels.launch.on_tensor_device(lambda x, *args: ran.append(x.device))
    for device in (torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")):
        guarded(types.SimpleNamespace(device=device))
    assert entered == [torch.device("cuda", 1)] and len(ran) == 3
    for launcher in (kernels.attention_forward, kernels.attention_backward, kernels.attention_with_kvcache,
                     kernels.apply_rotary, kernels.attention_probabilities):
        assert launcher.__code__ is guarded.__code__, launcher.__name__


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("other", OTHER_DEVICES)
def test_tensors_on_different_devices_are_refused(fa, other, case):
    call, message = _device_cases(other)[case]
    with pytest.raises((ValueError, TypeError), match=message):
        call(fa)


# --------------------------------------------------------------------------------------------
# Dynamic shapes: a new sequence length does not recompile


def _compile_counter():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    return CompileCounterWithBackend("inductor" if ON_GPU else "aot_eager")


@pytest.mark.parametrize("how", ["dynamic", "mark_dynamic"])
def test_new_sequence_length_does_not_recompile(fa, how):
    """dynamic=True, or torch._dynamo.mark_dynamic on the sequence dims: forward and backward
    compile once and serve three sequence lengths, each within the bar."""
    counter = _compile_counter()

    def attention(q, k, v):
        return fa.flash_attn_func(q, k, v, causal=True, softcap=20.0)

    compiled = torch.compile(attention, backend=counter, fullgraph=True, dynamic=True if how == "dynamic" else None)
    frames = []  # compiled frames after each call: the first call's count (dynamo may compile more than one
    # frame for it) must not grow with a new length
    for seqlen_q, seqlen_k in ((37, 45), (53, 71), (29, 90)):
        q, k, v = random_qkv((2, seqlen_q, 4, 32), (2, seqlen_k, 2, 32), torch.float16, requires_grad=True)
        if how == "mark_dynamic":
            for x in (q, k, v):
                torch._dynamo.mark_dynamic(x, 1)
        out = compiled(q, k, v)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        truth_out, truth_grads = run_ref(q, k, v, dout, True, 32 ** -0.5, torch.float64, softcap=20.0)
        same_out, same_grads = run_ref(q, k, v, dout, True, 32 ** -0.5, torch.float16, softcap=20.0)
        assert_within_bar("out", out, same_out, truth_out, FWD_FACTOR)
        assert_within_bar("dq", grads[0], same_grads[0], truth_grads[0], BWD_FACTOR)
        frames.append(counter.frame_count)
    assert frames[0] == frames[-1], f"compiled frames after each of three sequence lengths: {frames}"


def test_new_varlen_batch_does_not_recompile(fa):
    """Varlen: new cu_seqlens values, a new token count and a new max_seqlen compile once."""
    counter = _compile_counter()

    def attention(q, k, v, cu, max_seqlen):
        return fa.flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True)

    compiled = torch.compile(attention, backend=counter, fullgraph=True, dynamic=True)
    frames = []  # (as in test_new_sequence_length_does_not_recompile)
    for lengths in ([17, 40, 3], [9, 1, 60], [33, 33, 2]):
        q, k, v = random_qkv((sum(lengths), 4, 32), (sum(lengths), 2, 32), torch.float16)
        cu = cu_seqlens(lengths)
        out = compiled(q, k, v, cu, max(lengths))
        truth, _, _ = run_varlen_ref(q, k, v, torch.zeros_like(q), cu, cu, True, 32 ** -0.5, torch.float64)
        same, _, _ = run_varlen_ref(q, k, v, torch.zeros_like(q), cu, cu, True, 32 ** -0.5, torch.float16)
        assert_within_bar("out", out, same, truth, FWD_FACTOR)
        frames.append(counter.frame_count)
    assert frames[0] == frames[-1], f"compiled frames after each of three batches: {frames}"


# --------------------------------------------------------------------------------------------
# CUDA graphs and torch.compile(mode="reduce-overhead")

# (batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype)
GRAPH_SHAPES = {"awkward": (2, 113, 203, 4, 2, 80, torch.float16), "full_tiles": (2, 256, 384, 4, 2, 128, BF16)}


def _train_step(fa, q, k, v, dout, options):
    out = fa.flash_attn_func(q, k, v, **options)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def _warm_up(fn, times=2):
    """Runs ``fn`` on a side stream (compiles the kernels before a capture, as PyTorch asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(side)


def _assert_bitwise(name, got, want):
    assert got.shape == want.shape and torch.equal(got, want), \
        f"{name}: max difference {(got.double() - want.double()).abs().max().item():.3g}"


@gpu_only
@pytest.mark.parametrize("dropout_p", [0.0, 0.17], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("shape", list(GRAPH_SHAPES))
def test_cuda_graph_forward_backward(fa, shape, dropout_p):
    """Forward + backward captured once: a replay after torch.cuda.manual_seed(s) equals an eager
    call after the same seed, on new inputs copied into the captured buffers too; with dropout,
    successive replays draw different masks (the generator advances per replay)."""
    batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype = GRAPH_SHAPES[shape]
    options = dict(causal=True, softcap=15.0, dropout_p=dropout_p,
                   alibi_slopes=torch.rand(heads_q, device=DEVICE) * 0.1)
    q, k, v = random_qkv((batch, seqlen_q, heads_q, head_dim), (batch, seqlen_k, heads_k, head_dim), dtype,
                         requires_grad=True)
    dout = torch.randn_like(q)
    _warm_up(lambda: _train_step(fa, q, k, v, dout, options))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _train_step(fa, q, k, v, dout, options)
    for seed in (11, 12):
        with torch.no_grad():  # new inputs into the captured buffers
            for x in (q, k, v, dout):
                x.normal_()
        torch.cuda.manual_seed(seed)
        graph.replay()
        replayed = [t.clone() for t in captured]
        torch.cuda.manual_seed(seed)
        eager = _train_step(fa, q, k, v, dout, options)
        for name, got, want in zip(("out", "dq", "dk", "dv"), replayed, eager):
            _assert_bitwise(f"replay (seed {seed}) {name}", got, want)
    if dropout_p > 0:
        graph.replay()
        again = captured[0].clone()
        graph.replay()
        assert not torch.equal(again, captured[0]), "two replays drew the same dropout mask"


@gpu_only
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cuda_graph_decode_step(fa, paged):
    """A decode step (append one token with rotary, attend with split-KV) captured once and
    replayed for several steps, cache_seqlens advanced in place between replays, gives eager's
    output, lse and caches bitwise."""
    batch, heads_q, heads_k, head_dim, capacity, dtype = 3, 8, 2, 128, 512, BF16
    page_size = 64
    if paged:
        pages = batch * capacity // page_size
        table = torch.randperm(pages, device=DEVICE).to(torch.int32).view(batch, -1)
        cache_shape = (pages, page_size, heads_k, head_dim)
    else:
        table, cache_shape = None, (batch, capacity, heads_k, head_dim)
    k0, v0 = (torch.randn(cache_shape, device=DEVICE, dtype=dtype) for _ in range(2))
    angles = torch.rand(capacity, head_dim // 4, device=DEVICE) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q = torch.randn(batch, 1, heads_q, head_dim, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(batch, 1, heads_k, head_dim, device=DEVICE, dtype=dtype) for _ in range(2))
    seqlens = _int32([5, 300, 17])
    k_cache, v_cache = k0.clone(), v0.clone()

    def step(k_cache, v_cache):
        return fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=seqlens,
                                          block_table=table, causal=True, rotary_interleaved=False,
                                          return_softmax_lse=True)

    _warm_up(lambda: step(k_cache, v_cache))
    k_cache.copy_(k0)
    v_cache.copy_(v0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(k_cache, v_cache)
    k_cache.copy_(k0)  # (the capture ran nothing, but be sure)
    v_cache.copy_(v0)
    k_eager, v_eager = k0.clone(), v0.clone()
    for _ in range(3):
        for x in (q, k, v):
            x.normal_()
        graph.replay()
        replayed = [t.clone() for t in captured]
        eager = step(k_eager, v_eager)
        for name, got, want in zip(("out", "lse", "k_cache", "v_cache"), (*replayed, k_cache, v_cache),
                                   (*eager, k_eager, v_eager)):
            _assert_bitwise(name, got, want)
        seqlens += 1


@gpu_only
def test_compile_reduce_overhead(fa):
    """torch.compile(mode="reduce-overhead") (CUDA graphs through cudagraph trees) over forward and
    backward gives eager's results (within the compiled graph's own rounding of the rest of the
    step) for several steps on new inputs, and both are within the bar of the float64 truth."""
    batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype = GRAPH_SHAPES["awkward"]
    options = dict(causal=True, window_size=(64, 0), softcap=20.0)

    def step(q, k, v):
        return fa.flash_attn_func(q, k, v, **options) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # cudagraph trees record on the second or third call, then replay
        torch.compiler.cudagraph_mark_step_begin()
        q, k, v = random_qkv((batch, seqlen_q, heads_q, head_dim), (batch, seqlen_k, heads_k, head_dim), dtype,
                             requires_grad=True)
        dout = torch.randn_like(q)
        out = compiled(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        out, grads = out.clone(), [g.clone() for g in grads]
        eager_out = step(q, k, v)
        eager_grads = torch.autograd.grad(eager_out, (q, k, v), dout)
        torch.testing.assert_close(out, eager_out)
        for got, want in zip(grads, eager_grads):
            torch.testing.assert_close(got, want)
        truth_out, truth_grads = run_ref(q, k, v, dout * 2, True, head_dim ** -0.5, torch.float64,
                                         window=(64, 0), softcap=20.0)
        same_out, same_grads = run_ref(q, k, v, dout * 2, True, head_dim ** -0.5, dtype, window=(64, 0), softcap=20.0)
        assert_within_bar("out", out / 2, same_out, truth_out, FWD_FACTOR)
        for name, ours, same, truth in zip(("dq", "dk", "dv"), grads, same_grads, truth_grads):
            assert_within_bar(name, ours, same, truth, BWD_FACTOR)


# --------------------------------------------------------------------------------------------
# Streams and devices: the work runs where the caller's current stream is

SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU clock: anything not ordered after it reads the NaN


def _written_late(x, device, requires_grad=False):
    """A copy of ``x`` on ``device`` that starts as NaN and gets x's values on that device's current
    stream only after a long sleep kernel there."""
    late = torch.full(x.shape, NAN, dtype=x.dtype, device=device)
    source = x.detach().to(device)
    torch.cuda.synchronize(device)
    with torch.cuda.device(device):
        torch.cuda._sleep(SLEEP_CYCLES)
        late.copy_(source)
    return late.requires_grad_(requires_grad)


def _calls(fa, q, k, v, dout, device):
    """Dense forward + backward, varlen forward and a decode step on ``device`` inputs, each input
    written late on the device's current stream; returns every output (on the host)."""
    leaves = [_written_late(x, device, requires_grad=True) for x in (q, k, v)]
    out = fa.flash_attn_func(*leaves, causal=True)
    grads = torch.autograd.grad(out, leaves, _written_late(dout, device))
    flat = [_written_late(x.flatten(0, 1), device) for x in (q, k, v)]
    cu = _int32([0, 100, q.shape[0] * q.shape[1]], device)
    varlen = fa.flash_attn_varlen_func(*flat, cu, cu, 126, 126)
    with torch.no_grad():
        cache = _written_late(k, device)
        decode = fa.flash_attn_with_kvcache(_written_late(q[:, -1:], device), cache, cache.clone(),
                                            _written_late(k[:, :1], device), _written_late(v[:, :1], device),
                                            cache_seqlens=_int32([90, 100], device))
    results = (out, *grads, varlen, decode, cache)
    assert all(r.device == leaves[0].device for r in results)
    return [r.detach().cpu() for r in results]


@gpu_only
def test_non_default_stream(fa):
    """Calls made under torch.cuda.stream(s) run on s: their inputs, written on s after a long
    sleep, are read after it; results equal the default stream's bitwise."""
    q, k, v = random_qkv((2, 113, 4, 64), (2, 113, 2, 64), BF16)
    dout = torch.randn_like(q)
    expected = _calls(fa, q, k, v, dout, DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = _calls(fa, q, k, v, dout, DEVICE)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert not torch.isnan(g).any(), f"result {i} read its inputs before the stream wrote them"
        _assert_bitwise(f"result {i}", g, e)


@pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs")
def test_second_gpu(fa):
    """Tensors on cuda:1 while cuda:0 is the current device: the kernels run on cuda:1, ordered on
    its current stream, and give cuda:0's results bitwise."""
    q, k, v = random_qkv((2, 113, 4, 64), (2, 113, 2, 64), BF16)
    dout = torch.randn_like(q)
    expected = _calls(fa, q, k, v, dout, "cuda:0")
    with torch.cuda.device(0):
        got = _calls(fa, q, k, v, dout, "cuda:1")
    for i, (g, e) in enumerate(zip(got, expected)):
        assert not torch.isnan(g).any(), f"result {i} read its inputs before cuda:1's stream wrote them"
        _assert_bitwise(f"result {i}", g, e)


# --------------------------------------------------------------------------------------------
# Tensors past 2**31 elements (each kernel family), checked on slices against float64

INT32_ELEMENTS = 2 ** 31


def _check_slice(name, ours, truth, tolerance):
    err = (ours.double() - truth).abs().max().item()
    assert err <= tolerance, f"{name}: max error {err:.3g} > {tolerance}"


@gpu_only
@pytest.mark.parametrize("seqlen", [8200, 8192], ids=["tl", "full_tiles"])
@pytest.mark.usefixtures("large_gpu_memory")
def test_dense_past_int32(fa, seqlen):
    """Dense forward + backward, q, k, v, out and every gradient of 2.18e9 elements (a batch
    entry's rows cross 2**31 inside the second entry); full tiles take the Gluon kernels on
    Hopper. The last heads of the last entry are checked against the float64 reference."""
    batch, heads, head_dim = 2, 1040, 128
    assert batch * seqlen * heads * head_dim > INT32_ELEMENTS
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device=DEVICE, dtype=BF16).requires_grad_()
               for _ in range(3))
    out = fa.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    part = (slice(batch - 1, batch), slice(None), slice(heads - 2, heads))
    truth_out, truth_grads = run_ref(q[part], k[part], v[part], dout[part], True, head_dim ** -0.5, torch.float64)
    _check_slice("out", out[part], truth_out, 2e-2)
    for name, ours, truth in zip(("dq", "dk", "dv"), grads, truth_grads):
        _check_slice(name, ours[part], truth, 5e-2)


@gpu_only
@pytest.mark.usefixtures("large_gpu_memory")
def test_varlen_past_int32(fa):
    """Varlen forward + backward (the preprocess kernel too) over 1.06e6 tokens x 16 heads x 128
    (2.17e9 elements); the last two sequences and one in the middle are checked."""
    heads, head_dim = 16, 128
    lengths = []
    while sum(lengths) * heads * head_dim <= INT32_ELEMENTS + 2 ** 20:
        lengths += [2047, 1, 3001, 1000, 4093, 577]
    total = sum(lengths)
    assert total * heads * head_dim > INT32_ELEMENTS
    q, k, v = (torch.randn(total, heads, head_dim, device=DEVICE, dtype=BF16).requires_grad_() for _ in range(3))
    cu = cu_seqlens(lengths)
    out = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    starts = cu.tolist()
    for b in (len(lengths) // 2, len(lengths) - 2, len(lengths) - 1):
        rows = slice(starts[b], starts[b + 1])
        sl = [x[rows].detach()[None] for x in (q, k, v, dout)]
        truth_out, truth_grads = run_ref(*sl, True, head_dim ** -0.5, torch.float64)
        _check_slice(f"out of sequence {b}", out[rows], truth_out[0], 2e-2)
        for name, ours, truth in zip(("dq", "dk", "dv"), grads, truth_grads):
            _check_slice(f"{name} of sequence {b}", ours[rows], truth[0], 5e-2)


@gpu_only
@pytest.mark.usefixtures("large_gpu_memory")
def test_paged_cache_past_int32(fa):
    """Paged caches of 8200 pages x 256 keys x 8 heads x 128 (2.15e9 elements each), the tables
    listing pages past element 2**31: flash_attn_varlen_func(block_table=...) and a paged decode
    step of flash_attn_with_kvcache (appending one key) against the gathered keys in float64."""
    pages, page_size, heads_k, heads_q, head_dim = 8200, 256, 8, 16, 128
    assert pages * page_size * heads_k * head_dim > INT32_ELEMENTS
    k_cache, v_cache = (torch.randn(pages, page_size, heads_k, head_dim, device=DEVICE, dtype=BF16) for _ in range(2))
    lens_k = [1000, 513, 2048]
    per_seq = max(-(-n // page_size) for n in lens_k) + 1
    table = torch.stack([torch.arange(pages - per_seq * (b + 1), pages - per_seq * b, device=DEVICE)
                         for b in range(len(lens_k))]).flip(1).to(torch.int32)  # the last pages, reversed
    with torch.no_grad():
        lens_q = [1, 17, 128]
        q = torch.randn(sum(lens_q), heads_q, head_dim, device=DEVICE, dtype=BF16)
        out = fa.flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q),
                                        max(lens_k), causal=True, block_table=table)
        starts = cu_seqlens(lens_q).tolist()
        for b, n in enumerate(lens_k):
            keys = [x[table[b].long()].flatten(0, 1)[:n][None] for x in (k_cache, v_cache)]
            rows = slice(starts[b], starts[b + 1])
            truth, _ = attention_ref(q[rows][None], *keys, True, head_dim ** -0.5)
            _check_slice(f"paged varlen out of sequence {b}", out[rows], truth[0], 2e-2)
        q1 = torch.randn(len(lens_k), 1, heads_q, head_dim, device=DEVICE, dtype=BF16)
        new_k, new_v = (torch.randn(len(lens_k), 1, heads_k, head_dim, device=DEVICE, dtype=BF16) for _ in range(2))
        decode = fa.flash_attn_with_kvcache(q1, k_cache, v_cache, new_k, new_v, cache_seqlens=_int32(lens_k),
                                            block_table=table)
        for b, n in enumerate(lens_k):
            keys = [x[table[b].long()].flatten(0, 1)[:n + 1][None] for x in (k_cache, v_cache)]
            assert torch.equal(keys[0][0, n], new_k[b, 0]) and torch.equal(keys[1][0, n], new_v[b, 0])
            truth, _ = attention_ref(q1[b:b + 1], *keys, False, head_dim ** -0.5)
            _check_slice(f"paged decode out of sequence {b}", decode[b], truth[0], 2e-2)


@gpu_only
@pytest.mark.usefixtures("large_gpu_memory")
def test_decode_cache_past_int32(fa):
    """A contiguous cache of 64 x 33000 keys x 8 heads x 128 (2.16e9 elements): a decode step
    appending one key at lengths near the end writes exactly those rows (the rest of the
    cache is bitwise unchanged) and attends like the float64 reference, split-KV merge included."""
    batch, capacity, heads_k, heads_q, head_dim = 64, 33000, 8, 32, 128
    assert batch * capacity * heads_k * head_dim > INT32_ELEMENTS
    k_cache, v_cache = (torch.randn(batch, capacity, heads_k, head_dim, device=DEVICE, dtype=BF16) for _ in range(2))
    k_before, v_before = k_cache.clone(), v_cache.clone()
    lengths = torch.randint(1, capacity - 1, (batch,), device=DEVICE, dtype=torch.int32)
    lengths[-2:] = torch.tensor([capacity - 1, 7], dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, 1, heads_q, head_dim, device=DEVICE, dtype=BF16)
    new_k, new_v = (torch.randn(batch, 1, heads_k, head_dim, device=DEVICE, dtype=BF16) for _ in range(2))
    with torch.no_grad():
        out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, new_k, new_v, cache_seqlens=lengths, num_splits=0)
    rows = torch.arange(batch, device=DEVICE)
    k_before[rows, lengths.long()] = new_k[:, 0]  # what the cache must hold now, every other row unchanged
    v_before[rows, lengths.long()] = new_v[:, 0]
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
    del k_before, v_before
    for b in (0, batch - 2, batch - 1):
        n = int(lengths[b]) + 1
        truth, _ = attention_ref(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], False, head_dim ** -0.5)
        _check_slice(f"decode out of entry {b}", out[b], truth[0], 2e-2)

