"""Test setup: pick the device, build the Hub variant, load it through ``kernels``.

With a CUDA GPU the suite runs there at GPU sizes; without one it runs on CPU through Triton's
interpreter at small sizes. TRITON_INTERPRET must be set before triton is first imported, which
``import kernels`` does, so it is decided here, right after importing torch (which does not).

The package under test is always the built variant (scripts/build_variants.py into a temporary
folder, loaded with kernels.get_local_kernel), never the source tree.
"""

import fcntl
import gc
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from sizes import DEVICE, ON_GPU

if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    assert "triton" not in sys.modules, "triton was imported before TRITON_INTERPRET could be set"

import kernels  # noqa: E402  (imports triton)

REPO_ROOT = Path(__file__).resolve().parent.parent
# the source package's folder: tests that drive one kernel module directly put it on sys.path and
# import its flash_attention_kernel/ as a top-level package
PACKAGE_SOURCE = REPO_ROOT / "torch-ext" / "flash_attention"
sys.path.insert(0, str(REPO_ROOT / "scripts"))
import build_variants  # noqa: E402

__all__ = ["DEVICE", "ON_GPU", "PACKAGE_SOURCE", "REPO_ROOT", "benchmark_module", "skip_unless_interpreter_runs"]


def benchmark_module(name: str):
    """benchmarks/<name>.py imported as a module, for the tests of a benchmark's own logic
    (targets.py's verdicts, triton_parity.py's comparison) that need no GPU."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def skip_unless_interpreter_runs(what: str) -> None:
    """Skip the calling test where this Triton's CPU interpreter cannot run the kernels beside this
    NumPy (scripts/triton_matrix.interpreter_runs: 3.6's takes int() of one-element arrays, which
    NumPy 2.4 refuses); ``what`` says what needs the interpreter."""
    import numpy
    import triton
    from triton_matrix import interpreter_runs

    if not interpreter_runs(triton.__version__):
        pytest.skip(f"{what}, and Triton {triton.__version__}'s interpreter cannot run these kernels beside "
                    f"NumPy {numpy.__version__}")


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory) -> Path:
    return build_variants.build(out_dir=tmp_path_factory.mktemp("build"))


@pytest.fixture(scope="session")
def fa(build_dir):
    """The flash-attention module, loaded from the built variant."""
    return kernels.get_local_kernel(build_dir)


# One file lock for every pytest process on the machine (each xdist worker is one)
LARGE_GPU_MEMORY_LOCK = Path(tempfile.gettempdir()) / "flash-attention-tests-large-gpu-memory.lock"


@pytest.fixture
def large_gpu_memory():
    """For a test that holds tens of GB of GPU memory (the past-2**31-element cases, about 45 GB
    with their gradients): only one such test runs at a time across the xdist workers, and each
    hands its memory back to the driver when it ends. Two of them in flight, or one worker's
    caching allocator still holding a finished one's blocks, fill an H200's 139 GB beside the other
    workers' tests. (A failing test's traceback keeps its tensors alive; the lock is released all
    the same.)"""
    with open(LARGE_GPU_MEMORY_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_report_header(config):
    where = torch.cuda.get_device_name() if ON_GPU else "CPU, Triton interpreter (TRITON_INTERPRET=1)"
    import triton

    return f"flash-attention tests on {where}; torch {torch.__version__}, triton {triton.__version__}"
