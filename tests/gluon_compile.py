"""Compile a Gluon kernel of the built package for sm_90 (or sm_80: the fused backward for mma.sync
GPUs) under the installed Triton, no GPU needed (tests/test_hopper_forward.py,
test_hopper_backward.py, test_ampere_backward.py: Gluon's API changes by release).

In a fresh process: the check needs the installed Triton's compiler only, and a test worker that
has run kernels through TRITON_INTERPRET=1 can carry the interpreter's state into it (CI saw
gl.program_id return a bare IR value there, once, in one worker). The caller's script body sees
``package`` (the built package, imported under its own name ``name``: its Gluon modules load
with ``importlib.import_module(name + ".flash_attention_kernel.hopper_...")``), ``gl`` and
``args`` (its arguments, as strings), ``chunk_descriptors`` (the descriptor types of a tensor's
head-dim chunks) and sets ``function``, ``signature`` and ``constants`` for
``GluonASTSource``. With GLUON_PTX_DIR set, each compiled kernel's PTX (its code, without debug
sections and line records) is also written there, named by the kernel and the arguments, so that
two trees' Gluon kernels compare with ``diff -r``: identical files, identical kernels; and a
``.res`` file of the same name with its shared memory, spill stores (STL in the SASS), HGMMAs and
wgmma waits.
"""

import importlib
import os
import pathlib
import subprocess
import sys

_PRELUDE = """
import importlib, importlib.util, pathlib, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

package_dir, name, *args = sys.argv[1:]
spec = importlib.util.spec_from_file_location(name, pathlib.Path(package_dir) / "__init__.py",
                                              submodule_search_locations=[package_dir])
package = importlib.util.module_from_spec(spec)
sys.modules[name] = package
spec.loader.exec_module(package)

# {tensor_desc: its type, tensor_desc_b: the second head-dim chunk's type} of a bf16 tensor read in
# blocks of ``rows`` rows of each chunk (hopper_gluon.tile_arguments); a second chunk of width 0 is
# a None argument, put in ``constants``
def chunk_descriptors(tensor, rows, chunks, constants):
    def descriptor(width):
        shared = gl.NVMMASharedLayout.get_default_for([rows, width], gl.bfloat16)
        return f"tensordesc<bf16[{rows}, {width}],{shared!r}>"
    if not chunks[1]:
        constants[tensor + "_desc_b"] = None
        return {tensor + "_desc": descriptor(chunks[0])}
    return {tensor + "_desc": descriptor(chunks[0]), tensor + "_desc_b": descriptor(chunks[1])}
"""

_BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
_COMPILE = f"BENCHMARKS = {str(_BENCHMARKS)!r}" + """
compiled = triton.compile(GluonASTSource(function, signature, constants),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
assert compiled.asm["cubin"]
assert "setmaxnreg" in compiled.asm["ptx"]  # the warp roles got their register budgets
# within sm_90's shared memory per block (227 KB): more compiles but fails at launch
assert compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared
# the wgmma pipeline as written: where ptxas cannot keep an async wgmma's registers untouched until
# its wait, it serialises every wgmma (its warning C7514, which Triton does not show), a wait after
# each HGMMA that runs correctly and slower; a pipelined kernel waits once per product or less
sass = compiled.asm["sass"]
hgmma, waits = sass.count("HGMMA."), sass.count("WARPGROUP.DEPBAR")
assert hgmma and waits * 2 < hgmma, f"ptxas serialised the wgmmas: {waits} waits for {hgmma} HGMMAs"
import os
if os.environ.get("GLUON_PTX_DIR"):  # the code alone (resource_report's cut), to diff two trees' kernels
    sys.path.insert(0, BENCHMARKS)
    from resource_report import _code_only
    ptx_name = "_".join([function.__name__, *args]).replace("/", "-") + ".ptx"
    (pathlib.Path(os.environ["GLUON_PTX_DIR"]) / ptx_name).write_text(_code_only(compiled.asm["ptx"]))
    # (beside it, what the kernel holds: shared memory, and its spills as local stores in the SASS)
    (pathlib.Path(os.environ["GLUON_PTX_DIR"]) / ptx_name.replace(".ptx", ".res")).write_text(
        f"shared {compiled.metadata.shared} spill_stores {sass.count('STL')} hgmma {hgmma} waits {waits}\\n")
"""


# The fused backward for mma.sync GPUs (ampere_backward): compiled for sm_80 with its own warps,
# within the A100 class's shared memory (``limit``, set by the body: configs.GPU_CLASSES)
_COMPILE_AMPERE = """
compiled = triton.compile(GluonASTSource(function, signature, constants, attrs),
                          target=GPUTarget("cuda", 80, 32), options=dict(num_warps=num_warps))
assert compiled.asm["cubin"]
assert "mma.sync" in compiled.asm["ptx"] and "cp.async" in compiled.asm["ptx"]
assert compiled.metadata.shared <= limit, (compiled.metadata.shared, limit)
"""


def assert_compiles_for_hopper(fa, body: str, *args) -> None:
    """Run ``body`` between the prelude (the package loaded) and the sm_90 compile, with ``args``."""
    _run(fa, _PRELUDE + body + _COMPILE, args)


def assert_compiles_for_ampere(fa, body: str, *args) -> None:
    """Run ``body`` (which also sets ``attrs``, ``num_warps`` and ``limit``) between the prelude and
    the sm_80 compile, with ``args``."""
    _run(fa, _PRELUDE + body + _COMPILE_AMPERE, args)


def _run(fa, script: str, args) -> None:
    package_dir = str(pathlib.Path(fa.__file__).parent)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script, package_dir, fa.__name__, *map(str, args)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


def gluon_module(fa, name: str):
    """The package's Gluon module ``name`` (hopper_gluon, hopper_forward, ...), imported on demand
    as the kernels' route does (hopper_route): no module imports them at import time."""
    return importlib.import_module(f"{fa.__name__}.flash_attention_kernel.{name}")
