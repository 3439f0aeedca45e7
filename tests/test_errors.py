"""Bad input raises a clear exception that names the argument, before any kernel runs."""

import subprocess
import sys

import pytest
import torch

from conftest import DEVICE, ON_GPU, REPO_ROOT


def _t(*shape, dtype=torch.float16, device=DEVICE):
    return torch.randn(*shape, device=device).to(dtype)


GOOD = dict(q=(2, 17, 4, 64), k=(2, 23, 2, 64), v=(2, 23, 2, 64))


def _call(fa, q=None, k=None, v=None, **kwargs):
    q = _t(*GOOD["q"]) if q is None else q
    k = _t(*GOOD["k"]) if k is None else k
    v = _t(*GOOD["v"]) if v is None else v
    return fa.flash_attn_func(q, k, v, **kwargs)


# A device other than q's (meta on CPU runs, the CPU on GPU runs).
OTHER_DEVICE = "cpu" if ON_GPU else "meta"

# Bad attention options, for q (2, 17, 4, 64), k and v (2, 23, 2, 64) (dense) or two sequences of
# q (12, 4, 64) (varlen): flash-attn 2.8's checks, each naming the argument.
OPTION_CASES = {
    "dropout 1.5": (dict(dropout_p=1.5), ValueError, r"dropout_p"),
    "dropout 1": (dict(dropout_p=1.0), ValueError, r"dropout_p"),
    "dropout negative": (dict(dropout_p=-0.1), ValueError, r"dropout_p"),
    "window one value": (dict(window_size=(4,)), ValueError, r"window_size"),
    "window three values": (dict(window_size=(4, 0, 1)), ValueError, r"window_size"),
    "window int": (dict(window_size=4), ValueError, r"window_size"),
    "window None": (dict(window_size=None), ValueError, r"window_size"),
    "window floats": (dict(window_size=(1.5, 2.0)), ValueError, r"window_size"),
    "window left < -1": (dict(window_size=(-2, 0)), ValueError, r"window_size"),
    "window right < -1": (dict(window_size=(0, -5)), ValueError, r"window_size"),
    "window float tensor": (dict(window_size=torch.tensor([1.0, 2.0])), ValueError, r"window_size"),
    "window 3-element tensor": (dict(window_size=torch.tensor([1, 2, 3])), ValueError, r"window_size"),
    "window tensor < -1": (dict(window_size=torch.tensor([-3, 0])), ValueError, r"window_size"),
    "softcap negative": (dict(softcap=-1.0), ValueError, r"softcap"),
    "softcap string": (dict(softcap="30"), ValueError, r"softcap"),
    "softcap None": (dict(softcap=None), ValueError, r"softcap"),
    "alibi float16": (dict(alibi_slopes=torch.ones(4, dtype=torch.float16, device=DEVICE)), TypeError,
                      r"alibi_slopes"),
    "alibi float64": (dict(alibi_slopes=torch.ones(4, dtype=torch.float64, device=DEVICE)), TypeError,
                      r"alibi_slopes"),
    "alibi int": (dict(alibi_slopes=torch.ones(4, dtype=torch.int32, device=DEVICE)), TypeError, r"alibi_slopes"),
    "alibi too few heads": (dict(alibi_slopes=torch.ones(3, device=DEVICE)), ValueError, r"alibi_slopes"),
    "alibi wrong batch": (dict(alibi_slopes=torch.ones(3, 4, device=DEVICE)), ValueError, r"alibi_slopes"),
    "alibi 3-D": (dict(alibi_slopes=torch.ones(2, 4, 1, device=DEVICE)), ValueError, r"alibi_slopes"),
    "alibi wrong device": (dict(alibi_slopes=torch.ones(4, device=OTHER_DEVICE)), ValueError, r"alibi_slopes"),
    "s_aux too few heads": (dict(s_aux=torch.zeros(3, device=DEVICE)), ValueError, r"s_aux"),
    "s_aux 2-D": (dict(s_aux=torch.zeros(1, 4, device=DEVICE)), ValueError, r"s_aux"),
    "s_aux 0-D": (dict(s_aux=torch.tensor(0.0, device=DEVICE)), ValueError, r"s_aux"),
    "s_aux int": (dict(s_aux=torch.zeros(4, dtype=torch.int32, device=DEVICE)), TypeError, r"s_aux"),
    "s_aux bool": (dict(s_aux=torch.zeros(4, dtype=torch.bool, device=DEVICE)), TypeError, r"s_aux"),
}

CASES = {
    "q not a tensor": (dict(q=[[1.0]]), TypeError, r"q must be a torch.Tensor"),
    "q rank 3": (dict(q=_t(2, 17, 64)), ValueError, r"q must have 4 dims \(batch, seqlen, nheads, headdim\)"),
    "k rank 5": (dict(k=_t(2, 23, 2, 64, 1)), ValueError, r"k must have 4 dims"),
    "integer q": (dict(q=torch.ones(2, 17, 4, 64, dtype=torch.int32, device=DEVICE)), TypeError,
                  r"q has dtype torch.int32; supported dtypes are float16, bfloat16 and float32"),
    "float64 v": (dict(v=_t(2, 23, 2, 64, dtype=torch.float64)), TypeError, r"v has dtype torch.float64"),
    "mixed dtypes": (dict(k=_t(2, 23, 2, 64, dtype=torch.bfloat16)), TypeError,
                     r"q, k, v must have the same dtype, got q torch.float16, k torch.bfloat16"),
    "k v shapes differ": (dict(v=_t(2, 24, 2, 64)), ValueError, r"k and v must have the same shape"),
    "batch differs": (dict(k=_t(3, 23, 2, 64), v=_t(3, 23, 2, 64)), ValueError, r"same batch size, got 2 and 3"),
    "head dims differ": (dict(k=_t(2, 23, 2, 32), v=_t(2, 23, 2, 32)), ValueError, r"same head dim, got 64 and 32"),
    "head dim 512": (dict(q=_t(2, 17, 4, 512), k=_t(2, 23, 2, 512), v=_t(2, 23, 2, 512)), ValueError,
                     r"head dim must be between 1 and 256, got 512"),
    "heads not divisible": (dict(k=_t(2, 23, 3, 64), v=_t(2, 23, 3, 64)), ValueError,
                            r"number of query heads \(4\) must be a multiple of the number of key/value heads \(3\)"),
    "softmax_scale nan": (dict(softmax_scale=float("nan")), ValueError, r"softmax_scale must be a finite number"),
    "softmax_scale string": (dict(softmax_scale="0.1"), ValueError, r"softmax_scale must be a finite number"),
    **OPTION_CASES,
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(fa, case):
    kwargs, error, message = CASES[case]
    with pytest.raises(error, match=message):
        _call(fa, **kwargs)


def _varlen_call(fa, q=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=9, max_seqlen_k=9, **kwargs):
    torch.manual_seed(0)
    q = _t(12, 4, 64) if q is None else q
    good_cu = torch.tensor([0, 9, 12], dtype=torch.int32, device=DEVICE)
    cu_q = good_cu if cu_seqlens_q is None else cu_seqlens_q
    cu_k = good_cu if cu_seqlens_k is None else cu_seqlens_k
    return fa.flash_attn_varlen_func(q, _t(12, 2, 64), _t(12, 2, 64), cu_q, cu_k, max_seqlen_q, max_seqlen_k, **kwargs)


VARLEN_CASES = {
    "q rank 4": (dict(q=_t(1, 12, 4, 64)), ValueError, r"q must have 3 dims \(total_tokens, nheads, headdim\)"),
    "cu_seqlens int64": (dict(cu_seqlens_q=torch.tensor([0, 9, 12], device=DEVICE)), TypeError,
                         r"cu_seqlens_q must have dtype torch.int32, got torch.int64"),
    "cu_seqlens list": (dict(cu_seqlens_k=[0, 9, 12]), TypeError, r"cu_seqlens_k must be a torch.Tensor"),
    "cu_seqlens 2-D": (dict(cu_seqlens_q=torch.zeros(1, 3, dtype=torch.int32, device=DEVICE)), ValueError,
                       r"cu_seqlens_q must be one-dimensional with batch \+ 1 entries"),
    "cu_seqlens lengths differ": (dict(cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32, device=DEVICE)),
                                  ValueError, r"cu_seqlens_q and cu_seqlens_k must both have batch \+ 1 entries"),
    "max_seqlen float": (dict(max_seqlen_q=9.0), ValueError, r"max_seqlen_q must be a non-negative int"),
    "max_seqlen negative": (dict(max_seqlen_k=-1), ValueError, r"max_seqlen_k must be a non-negative int"),
    "block_table with packed k": (dict(block_table=torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)), ValueError,
                                  r"k must have 4 dims \(num_blocks, page_size, nheads_k, headdim\)"),
    **OPTION_CASES,
}


@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_bad_varlen_input(fa, case):
    kwargs, error, message = VARLEN_CASES[case]
    with pytest.raises(error, match=message):
        _varlen_call(fa, **kwargs)


@pytest.mark.parametrize("cu_seqlens, max_seqlen, message", [
    ([1, 9, 12], 9, r"cu_seqlens_q must start at 0, got 1"),
    ([0, 9, 11], 9, r"cu_seqlens_q must end at the number of tokens \(12\), got 11"),
    ([0, 13, 12], 13, r"cu_seqlens_q must be non-decreasing"),
    ([0, 9, 12], 8, r"max_seqlen_q \(8\) is smaller than the longest sequence in cu_seqlens_q \(9\)"),
])
def test_varlen_debug_checks(fa, monkeypatch, cu_seqlens, max_seqlen, message):
    """Checks that read cu_seqlens' values (a device-to-host copy) run under the debug switch."""
    cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=DEVICE)
    monkeypatch.setenv("FLASH_ATTENTION_CHECK_INPUTS", "1")
    with pytest.raises(ValueError, match=message):
        _varlen_call(fa, cu_seqlens_q=cu, max_seqlen_q=max_seqlen)


# Option values flash-attn 2.8 accepts (with an int tensor window as its own tests pass one).
GOOD_OPTIONS = {
    "window tensor": dict(window_size=torch.tensor([3, 0])),
    "window int32 tensor": dict(window_size=torch.tensor([3, 0], dtype=torch.int32)),
    "window list": dict(window_size=[3, 0]),
    "window -1": dict(window_size=(-1, 2)),
    "deterministic": dict(deterministic=True),
    "not deterministic": dict(deterministic=False),
    "int dropout 0": dict(dropout_p=0),
    "int softcap": dict(softcap=5),
    "softcap 0": dict(softcap=0.0),
    "alibi (nheads,)": dict(alibi_slopes=torch.full((4,), 0.1, device=DEVICE)),
    "alibi (batch, nheads)": dict(alibi_slopes=torch.full((2, 4), 0.1, device=DEVICE)),
    "s_aux fp32": dict(s_aux=torch.zeros(4, device=DEVICE)),
    "s_aux bf16": dict(s_aux=torch.zeros(4, device=DEVICE, dtype=torch.bfloat16)),
    "s_aux fp16 requires grad": dict(s_aux=torch.zeros(4, device=DEVICE, dtype=torch.float16, requires_grad=True)),
    "dropout": dict(dropout_p=0.5, return_attn_probs=True),
}


@pytest.mark.parametrize("case", list(GOOD_OPTIONS))
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_accepted_options(fa, varlen, case):
    """Valid option values run: an int tensor window gives the tuple's bits; deterministic is taken."""
    kwargs = GOOD_OPTIONS[case]
    call = _varlen_call if varlen else _call
    torch.manual_seed(0)
    result = call(fa, **kwargs)
    out = result[0] if isinstance(result, tuple) else result
    assert torch.isfinite(out).all()
    if "window_size" in kwargs:
        torch.manual_seed(0)
        assert torch.equal(out, call(fa, window_size=tuple(int(w) for w in kwargs["window_size"])))


@pytest.mark.parametrize("fn, extra, kwargs, error, message", [
    ("flash_attn_qkvpacked_func", lambda: (_t(2, 17, 3, 4, 64),), dict(s_aux=torch.zeros(3, device=DEVICE)),
     ValueError, r"s_aux"),
    ("flash_attn_kvpacked_func", lambda: (_t(2, 17, 4, 64), _t(2, 17, 2, 2, 64)), dict(window_size=(-2, 0)),
     ValueError, r"window_size"),
    ("flash_attn_kvpacked_func", lambda: (_t(2, 17, 4, 64), _t(2, 17, 2, 2, 64)),
     dict(alibi_slopes=torch.ones(4, dtype=torch.float16, device=DEVICE)), TypeError, r"alibi_slopes"),
    ("flash_attn_varlen_qkvpacked_func",
     lambda: (_t(12, 3, 4, 64), torch.tensor([0, 12], dtype=torch.int32, device=DEVICE), 12),
     dict(softcap=-2.0), ValueError, r"softcap"),
    ("flash_attn_varlen_kvpacked_func",
     lambda: (_t(12, 4, 64), _t(12, 2, 2, 64), *(torch.tensor([0, 12], dtype=torch.int32, device=DEVICE),) * 2,
              12, 12),
     dict(dropout_p=1.0), ValueError, r"dropout_p"),
])
def test_bad_packed_options(fa, fn, extra, kwargs, error, message):
    """The packed functions check their options like the unpacked ones."""
    with pytest.raises(error, match=message):
        getattr(fa, fn)(*extra(), **kwargs)


def test_max_seqlen_zero_dim_tensor(fa):
    """transformers passes max_seqlen as a 0-d tensor on its packed-sequence path."""
    out = _varlen_call(fa, max_seqlen_q=torch.tensor(9), max_seqlen_k=torch.tensor(9))
    assert torch.equal(out, _varlen_call(fa))


@pytest.mark.parametrize("fn, args, message", [
    ("flash_attn_qkvpacked_func", lambda: (_t(2, 17, 2, 4, 64),), r"qkv must have size 3 in dim -3"),
    ("flash_attn_kvpacked_func", lambda: (_t(2, 17, 4, 64), _t(2, 17, 2, 64)), r"kv must have 5 dims"),
    ("flash_attn_varlen_qkvpacked_func",
     lambda: (_t(12, 3, 4, 64), torch.tensor([0, 12], dtype=torch.int64, device=DEVICE), 12),
     r"cu_seqlens_q must have dtype torch.int32"),
])
def test_bad_packed_input(fa, fn, args, message):
    with pytest.raises((ValueError, TypeError), match=message):
        getattr(fa, fn)(*args())


def test_bad_input_bhsd(fa):
    q = _t(2, 4, 17, 64)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of the number of key/value heads \(3\)"):
        fa.flash_attention_forward(q, _t(2, 3, 23, 64), _t(2, 3, 23, 64))
    with pytest.raises(ValueError, match=r"q must have 4 dims \(batch, nheads, seqlen, headdim\)"):
        fa.flash_attention_forward(q[0], q[0], q[0])


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU to hold tensors on two devices")
def test_mixed_devices(fa):
    with pytest.raises(ValueError, match=r"q, k, v must be on the same device"):
        _call(fa, k=_t(*GOOD["k"], device="cpu"))


def test_cpu_tensors_without_interpreter(build_dir):
    """Without TRITON_INTERPRET=1, CPU tensors get an error saying how to run (GPU or interpreter)."""
    script = (
        "import torch, kernels, pathlib\n"
        f"fa = kernels.get_local_kernel(pathlib.Path({str(build_dir)!r}))\n"
        "q = torch.randn(1, 8, 2, 32)\n"
        "try:\n"
        "    fa.flash_attn_func(q, q, q)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "CPU tensors" in result.stdout and "TRITON_INTERPRET=1" in result.stdout and "GPU" in result.stdout
