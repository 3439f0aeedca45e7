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
    "dropout out of range": (dict(dropout_p=1.5), ValueError, r"dropout_p must be a number in \[0, 1\)"),
    "dropout": (dict(dropout_p=0.1), NotImplementedError, r"dropout_p"),
    "window malformed": (dict(window_size=(4,)), ValueError, r"window_size must be a pair"),
    "window": (dict(window_size=(16, 0)), NotImplementedError, r"window_size"),
    "softcap negative": (dict(softcap=-1.0), ValueError, r"softcap must be a number >= 0"),
    "softcap": (dict(softcap=30.0), NotImplementedError, r"softcap"),
    "alibi": (dict(alibi_slopes=torch.ones(2, 4)), NotImplementedError, r"alibi_slopes"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(fa, case):
    kwargs, error, message = CASES[case]
    with pytest.raises(error, match=message):
        _call(fa, **kwargs)


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
