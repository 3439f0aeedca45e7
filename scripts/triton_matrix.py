"""The package under each Triton release users run, on this CPU machine: imports, compiles, runs.

torch 2.8 pins Triton 3.4, 2.9 pins 3.5, 2.10 and 2.11 pin 3.6, and so on to the newest; every one
must import the package and run the tl kernels (the Gluon kernels run only under the Tritons that
``hopper_route.CHECKED_VERSIONS`` names, and are imported only when a call is routed to them).
For each version asked for, this installs that Triton's wheel (no dependencies) into
``.tritons/VERSION`` once, puts it first on PYTHONPATH beside the environment's torch, and runs the
checks in a fresh process:

* import: ``import flash_attention_kernel`` from the source tree (torch-ext/flash_attention/) and
  the built Hub variant through ``kernels.get_local_kernel`` (as users load it), with no Gluon
  kernel module imported by either;
* compile: every config-table entry of the sm_80 and sm_90 classes cross-compiled to a cubin with
  that Triton's compiler and ptxas, as that Triton would run it
  (``benchmarks/resource_report.py --table sm80 sm90 --as-run``): forward, dQ, dK/dV, KV cache;
* gluon: the Gluon kernels' sm_90 and sm_80 compile tests (``tests/test_hopper_*.py``,
  ``test_ampere_backward.py``, ``-k compiles``) under the releases of ``GLUON_FROM`` on: some
  kernels need a later release and skip under earlier ones;
* run: a small correctness run of the test suite through the CPU interpreter (TRITON_INTERPRET=1;
  the interpreter runs the kernels from Triton 3.6 on; older ones are covered by compile only).

Usage: python scripts/triton_matrix.py [--checks import,compile,gluon,run] VERSION [VERSION ...]
       (default: every check a version supports; exit status 1 if any check fails)
The GPU half of the matrix (the suite's core on an H100 under a packed Triton) is
../shared/tools/device-triton's; docs/gpus.md#triton-releases gives both.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".tritons"
# the interpreter runs these kernels from Triton 3.6 on (earlier releases lack ops it needs), and
# under NumPy 2.4 from 3.7 on (3.6 takes int() of one-element arrays, which NumPy 2.4 refuses)
INTERPRETER_FROM = (3, 6)
INTERPRETER_UNDER_NUMPY_2_4_FROM = (3, 7)
# the first release whose Gluon builds the Hopper kernels (hopper_route.CHECKED_VERSIONS)
GLUON_FROM = (3, 6)
GLUON_COMPILE_TESTS = ["tests/test_hopper_forward.py", "tests/test_hopper_backward.py", "tests/test_ampere_backward.py",
                       "-k", "compiles"]
# the correctness run: dense forward + backward (fp16, bf16, fp32, causal or not, GQA, awkward
# head dims and lengths), varlen, the KV cache's append + rotary + split decode
SMOKE_TESTS = ["tests/test_correctness.py", "tests/test_varlen.py", "tests/test_kvcache.py", "-k",
               "(test_flash_attn_func and q17k17) or test_varlen_matches_dense or test_packed_variants or test_rotary"]

_IMPORT_CHECK = """
import sys, tempfile, pathlib
import torch, triton
sys.path.insert(0, {repo!r} + "/torch-ext/flash_attention"); sys.path.insert(0, {repo!r} + "/scripts")
assert triton.__version__ == {version!r}, f"found triton {{triton.__version__}} at {{triton.__file__}}"
import flash_attention_kernel
import build_variants, kernels
fa = kernels.get_local_kernel(build_variants.build(out_dir=pathlib.Path(tempfile.mkdtemp())))
gluon_kernels = [name for name in sys.modules if name.rsplit(".", 1)[-1].startswith(("hopper_gluon", "hopper_forward",
                 "hopper_dq", "hopper_dkdv", "hopper_dropout"))]
assert not gluon_kernels, f"imported at import time: {{gluon_kernels}}"
assert callable(fa.flash_attn_func) and callable(fa.flash_attn_varlen_func) and callable(fa.flash_attn_with_kvcache)
print(f"torch {{torch.__version__}}, triton {{triton.__version__}}: the source tree and the Hub variant import")
"""


def install(version: str) -> Path:
    """``.tritons/VERSION`` holding that Triton's wheel, installed once."""
    target = CACHE / version
    if not (target / "triton" / "__init__.py").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        "--target", str(target), f"triton=={version}"], check=True)
    return target


def interpreter_runs(version: str) -> bool:
    """Whether Triton ``version``'s CPU interpreter runs these kernels beside this process's NumPy
    (INTERPRETER_FROM; INTERPRETER_UNDER_NUMPY_2_4_FROM beside NumPy 2.4 or newer). tests/test_fuzz.py
    asks it too."""
    import numpy
    interpreter_from = INTERPRETER_UNDER_NUMPY_2_4_FROM if release(numpy.__version__) >= (2, 4) else INTERPRETER_FROM
    return release(version) >= interpreter_from


def release(version: str) -> tuple:
    """(major, minor) of a version string."""
    return tuple(int(part) for part in version.split(".")[:2])


def checks_for(version: str, asked: list) -> list:
    """The checks asked for that this version supports (the run needs ``interpreter_runs``, the
    Gluon compiles GLUON_FROM)."""
    return [check for check in asked
            if (check != "run" or interpreter_runs(version)) and (check != "gluon" or release(version) >= GLUON_FROM)]


def run_check(check: str, version: str, target: Path) -> bool:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")]))
    if check == "import":
        command = [sys.executable, "-c", _IMPORT_CHECK.format(repo=str(REPO), version=version)]
    elif check == "compile":
        command = [sys.executable, str(REPO / "benchmarks" / "resource_report.py"), "--table", "sm80", "sm90",
                   "--as-run", "--jobs", str(min(4, os.cpu_count() or 1))]
    elif check == "gluon":
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n",
                   str(min(8, os.cpu_count() or 1)), *GLUON_COMPILE_TESTS]
    else:
        env["TRITON_INTERPRET"] = "1"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n",
                   str(min(8, os.cpu_count() or 1)), *SMOKE_TESTS]
    start = time.monotonic()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    output = (result.stdout + result.stderr).strip().splitlines()
    if check == "compile":
        entries = [line for line in output if line.startswith("sm")]
        bad = [line for line in entries if " ok," not in line]
        summary = f"{len(entries) - len(bad)} of {len(entries)} table entries compiled and fit"
        detail = bad[:10]
    else:
        summary = output[-1] if output else "(no output)"
        detail = output[-30:] if result.returncode else []
    status = "ok" if result.returncode == 0 else "FAILED"
    print(f"triton {version:6s} {check:8s} {status:6s} {time.monotonic() - start:6.0f} s  {summary}", flush=True)
    for line in detail:
        print(f"    {line}")
    return result.returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("versions", nargs="+", help="Triton releases, e.g. 3.4.0 3.9.0")
    parser.add_argument("--checks", default="import,compile,gluon,run", help="any of import, compile, gluon, run")
    args = parser.parse_args()
    asked = args.checks.split(",")
    ok = True
    for version in args.versions:
        target = install(version)
        for check in checks_for(version, asked):
            ok = run_check(check, version, target) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
