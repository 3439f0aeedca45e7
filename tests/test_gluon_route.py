"""The Gluon kernels load only when a call is routed to them (flash_attention_kernel/hopper_route.py).

Triton 3.4 has Gluon without ``warpgroup_mma``, and a later release may move any other Gluon name,
so importing the package must never import them: a failed import of a Gluon kernel turns that
kernel off with one warning and the tl kernels serve its calls. scripts/triton_matrix.py checks the
import under each Triton release; these tests check the mechanism under the installed one.
"""

import os
import subprocess
import sys

import pytest
import torch

from conftest import PACKAGE_SOURCE

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
        assert route._load("hopper_forward") is None
    assert route._load("hopper_forward") is None
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
