"""The Gluon kernels load only when a call is routed to them (flash_attention_kernel/hopper_route.py).

Triton 3.4 has Gluon without ``warpgroup_mma``, and a later release may move any other Gluon name,
so importing the package must never import them: a failed import of a Gluon kernel turns that
kernel off with one warning and the tl kernels serve its calls. scripts/triton_matrix.py checks the
import under each Triton release; these tests check the mechanism under the installed one.
"""

import os
import random
import subprocess
import sys

import pytest
import torch

from conftest import PACKAGE_SOURCE
from reference import visible_mask

GLUON_MODULES = ("hopper_gluon", "hopper_forward", "hopper_dq", "hopper_dkdv", "hopper_dropout")


def test_import_loads_no_gluon_kernel(build_dir):
    """Importing the source tree or the Hub variant (as kernels loads it) imports no Gluon kernel
    module (a fresh process: this one may have loaded them for other tests)."""
    script = f"""
import sys
sys.path.insert(0, {str(PACKAGE_SOURCE)!r})
import flash_attention_kernel, kernels, pathlib
fa = kernels.get_local_kernel(pathlib.Path({str(build_dir)!r}))
fa.flash_attn_func  # (the public API is there)
loaded = [name for name in sys.modules if name.rsplit(".", 1)[-1] in {GLUON_MODULES!r}]
assert not loaded, loaded
"""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_failed_gluon_import_turns_the_kernel_off(fa, monkeypatch):
    """A Gluon module that does not build under the installed Triton: None and one warning, then
    None again without a second import attempt or warning."""
    route = fa.flash_attention_kernel.hopper_route
    monkeypatch.setattr(route, "_loaded", {})
    attempts = []

    def failing_import(name, package=None):
        attempts.append(name)
        raise ImportError("cannot import name 'warpgroup_mma' (as under Triton 3.4)")

    monkeypatch.setattr(route.importlib, "import_module", failing_import)
    with pytest.warns(RuntimeWarning, match="Gluon kernel hopper_forward does not build under Triton .*warpgroup_mma"):
        assert route.load_kernel_module("hopper_forward") is None
    assert route.load_kernel_module("hopper_forward") is None
    assert attempts == [".hopper_forward"]


def test_gluon_kernels_build_under_this_triton(fa, monkeypatch):
    """Under the Triton the suite runs with (a checked one on the GPU, 3.7 in CI), each Gluon
    kernel module imports: a Gluon API change shows here as well as in the warning."""
    kernels = fa.flash_attention_kernel
    route = kernels.hopper_route
    monkeypatch.setattr(route, "_loaded", {})
    for kernel, (name, _) in route.KERNELS.items():
        assert route.launcher(kernel) is not None, kernel
        module = route._loaded[name]
        rows, keys = kernels.configs.GLUON_TILES[kernel]
        warpgroups = (2, 1) if kernel != "bwd_dkdv" else (1, 2)
        assert (module.QUERY_ROWS * warpgroups[0], module.KEY_ROWS * warpgroups[1]) == (rows, keys)


def test_route_declines_without_hopper(fa):
    """On CPU (interpreted) and on any GPU but sm_90 no call is routed to Gluon, so its modules
    need not import there."""
    kernels = fa.flash_attention_kernel
    q = torch.randn(1, 128, 2, 64, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
    layout = kernels.launch.SequenceLayout.of(q, q)
    options = kernels.AttentionOptions(0.125, True)
    interpreted = kernels.interpreter_active()
    on_hopper = q.is_cuda and torch.cuda.get_device_capability()[0] == 9 and not interpreted
    for kernel in ("bwd_dkdv", "bwd_dq"):
        assert kernels.hopper_route.chosen(kernel, options, layout, interpreted, (q, q, q, q)) <= on_hopper
    assert kernels.hopper_route.chosen("fwd", options, layout, interpreted, (q, q, q)) <= on_hopper


def test_mean_visible_keys_counts_every_pair(fa):
    """hopper_route.mean_visible_keys (the default route's measure of a forward's length) against a
    count of the visible pairs of the reference's mask (reference.visible_mask): causal or not,
    windows on either side, more queries than keys and fewer, empty sequences."""
    kernels = fa.flash_attention_kernel
    route, rng = kernels.hopper_route, random.Random(0)
    for _ in range(400):
        seqlen_q, seqlen_k = rng.randint(0, 40), rng.randint(0, 40)
        bounds = [rng.choice([-1, rng.randint(0, 50)]) for _ in range(2)]
        options = kernels.AttentionOptions(1.0, rng.random() < 0.5, *bounds)
        pairs = visible_mask(seqlen_q, seqlen_k, options.causal, (options.window_left, options.window_right)).sum()
        expected = pairs.item() / seqlen_q if seqlen_q else 0.0
        assert route.mean_visible_keys(options, seqlen_q, seqlen_k) == pytest.approx(expected, abs=1e-12), (
            seqlen_q, seqlen_k, options.window)
    assert route.mean_visible_keys(kernels.AttentionOptions(1.0, True), 16384, 16384) == 8192.5


def test_short_calls_keep_the_tl_kernels(fa, monkeypatch):
    """The default route gives a call the Gluon kernel only where it is long enough
    (hopper_route.long_enough: the forward from a mean of 256 keys a query row at head dim 128 and
    1024 at 64, the backward from 256 keys); FLASH_ATTENTION_GLUON=1 gives it every call it fits.
    ``fits`` is a stand-in here (true everywhere, as on an H100), and this Triton counts as checked."""
    kernels = fa.flash_attention_kernel
    route = kernels.hopper_route
    monkeypatch.setattr(route, "fits", lambda *args, **kwargs: True)
    monkeypatch.setattr(route, "CHECKED_VERSIONS", (__import__("triton").__version__,))
    monkeypatch.delenv("FLASH_ATTENTION_GLUON", raising=False)
    monkeypatch.delenv("FLASH_ATTENTION_TMA", raising=False)

    def chosen(kernel, seqlen, head_dim, causal, window=(-1, -1)):
        q = torch.empty(1, seqlen, 2, head_dim, dtype=torch.bfloat16)
        options = kernels.AttentionOptions(head_dim ** -0.5, causal, *window)
        tensors = (q, q, q) if kernel == "fwd" else (q, q, q, q)
        return route.chosen(kernel, options, kernels.launch.SequenceLayout.of(q, q), False, tensors)

    expected = {  # (kernel, seqlen, head dim, causal): chosen
        ("fwd", 256, 128, True): False, ("fwd", 512, 128, True): True, ("fwd", 256, 128, False): True,
        ("fwd", 128, 128, False): False, ("fwd", 1024, 64, True): False, ("fwd", 2048, 64, True): True,
        ("fwd", 512, 64, False): False, ("fwd", 1024, 64, False): True,
        ("bwd_dq", 128, 128, False): False, ("bwd_dkdv", 128, 64, True): False,
        ("bwd_dq", 256, 128, True): True, ("bwd_dkdv", 256, 64, True): True,
    }
    assert {case: chosen(*case) for case in expected} == expected
    assert not chosen("fwd", 4096, 128, False, window=(100, 7))  # (a window leaves each row 108 keys)
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", "1")
    assert all(chosen(*case) for case in expected)
    assert chosen("fwd", 4096, 128, False, window=(100, 7))
