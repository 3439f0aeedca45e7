"""Every config-table entry fits the shared memory of its GPU class, for each architecture of the
class (sm_75, sm_80, sm_86, sm_89, sm_90, sm_100, sm_120), proven without those GPUs:
benchmarks/resource_report.py --table cross-compiles each distinct entry with Triton's compiler
and the ptxas in its wheel and compares Triton's shared-memory allocation (what its launch checks
against the GPU's limit) with the class's limit. Runs in a subprocess without TRITON_INTERPRET
(the interpreter replaces the kernels that this compiles)."""

import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

CLASSES = ("sm90", "sm100", "sm80", "sm86", "sm75")


@pytest.mark.parametrize("gpu", CLASSES)
def test_table_fits_every_arch(gpu):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "resource_report.py"), "--table", gpu],
                            env=env, capture_output=True, text=True, timeout=1800)
    print(result.stdout)
    assert result.returncode == 0, f"entries of {gpu} that fail or exceed its limit:\n" + "\n".join(
        line for line in (result.stdout + result.stderr).splitlines() if "EXCEEDS" in line or "failed" in line
        or "Error" in line)
