"""The torch ops: opcheck, torch.compile without graph breaks, bitwise repeatability."""

import pytest
import torch

from conftest import DEVICE
from inputs import cu_seqlens, op_options, random_qkv
from sizes import DTYPES


def _qkv(dtype=torch.float16, heads=(4, 2), requires_grad=False):
    return random_qkv((2, 113, heads[0], 64), (2, 203, heads[1], 64), dtype, requires_grad)


DENSE = (None, None, 0, 0, None)


def _varlen_layout():
    lengths = [17, 0, 40, 5]
    cu = cu_seqlens(lengths)
    return sum(lengths), (cu, cu, max(lengths), max(lengths), None)


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_fwd(fa, causal):
    q, k, v = _qkv(requires_grad=True)
    torch.library.opcheck(fa.ops.fwd.default, (q, k, v, *DENSE, *op_options(fa, causal)))


@pytest.mark.parametrize("with_dlse", [False, True])
def test_opcheck_bwd(fa, with_dlse):
    q, k, v = _qkv()
    out, lse = fa.ops.fwd(q, k, v, *DENSE, *op_options(fa, True))
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None
    torch.library.opcheck(fa.ops.bwd.default, (dout, q, k, v, out, lse, dlse, *DENSE, *op_options(fa, True)))


def test_opcheck_varlen_and_packed(fa):
    total, layout = _varlen_layout()
    qkv = torch.randn(total, 3, 4, 64, device=DEVICE, dtype=torch.float16, requires_grad=True)
    q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(dim=1))
    kv = torch.stack((k, v), dim=1).detach().requires_grad_()
    causal, full = op_options(fa, True), op_options(fa, False)
    torch.library.opcheck(fa.ops.fwd.default, (q, k, v, *layout, *causal))
    torch.library.opcheck(fa.ops.fwd_qkvpacked.default, (qkv, *layout, *causal))
    torch.library.opcheck(fa.ops.fwd_kvpacked.default, (q, kv, *layout, *full))
    out, lse = (t.detach() for t in fa.ops.fwd_qkvpacked(qkv, *layout, *causal))
    dout = torch.randn_like(out)
    torch.library.opcheck(fa.ops.bwd_qkvpacked.default, (dout, qkv.detach(), out, lse, None, *layout, *causal))
    torch.library.opcheck(fa.ops.bwd_kvpacked.default, (dout, q.detach(), kv.detach(), out, lse, None, *layout, *causal))


def test_opcheck_every_option(fa):
    """The ops' schema carries every option: window, softcap, ALiBi, sinks (with their gradient),
    dropout with its RNG state, and the probabilities op."""
    q, k, v = _qkv(requires_grad=True)
    sinks = torch.randn(4, device=DEVICE)

    def options(sinks):
        return op_options(fa, True, window_left=40, window_right=3, softcap=20.0, dropout_p=0.2,
                          alibi_slopes=torch.rand(2, 4, device=DEVICE), sinks=sinks,
                          rng_state=fa.flash_attention_kernel.draw_rng_state(q.device))

    torch.library.opcheck(fa.ops.fwd.default, (q, k, v, *DENSE, *options(sinks.requires_grad_())))
    out, lse = (t.detach() for t in fa.ops.fwd(q, k, v, *DENSE, *options(sinks)))
    dout = torch.randn_like(out)
    detached = options(sinks.detach())  # (opcheck would differentiate the backward op through the sinks)
    torch.library.opcheck(fa.ops.bwd.default, (dout, q.detach(), k.detach(), v.detach(), out, lse, None, *DENSE,
                                                *detached))
    torch.library.opcheck(fa.ops.probs.default, (q.detach(), k.detach(), lse, *DENSE, *detached))


def test_torch_compile_fullgraph(fa):
    """forward + backward compile into one graph, and match eager exactly."""

    q, k, v = _qkv(requires_grad=True)
    dout = torch.randn_like(q)

    def loss_grads(fn):
        out = fn(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    compiled = torch.compile(lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True) * 2.0, fullgraph=True)
    eager = loss_grads(lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True) * 2.0)
    for got, want in zip(loss_grads(compiled), eager):
        assert torch.equal(got, want)

    total, (cu, _, longest, _, _) = _varlen_layout()
    qkv = torch.randn(total, 3, 4, 64, device=DEVICE, dtype=torch.float16, requires_grad=True)
    varlen = lambda qkv: fa.flash_attn_varlen_qkvpacked_func(qkv, cu, longest, causal=True)  # noqa: E731
    compiled_varlen = torch.compile(varlen, fullgraph=True)
    out_compiled, out_eager = compiled_varlen(qkv), varlen(qkv)
    dout = torch.randn_like(out_eager)
    assert torch.equal(out_compiled, out_eager)
    assert torch.equal(torch.autograd.grad(out_compiled, qkv, dout)[0], torch.autograd.grad(out_eager, qkv, dout)[0])

    compiled_bhsd = torch.compile(fa.flash_attention_forward, fullgraph=True)
    qt, kt, vt = (t.detach().transpose(1, 2) for t in (q, k, v))
    assert torch.equal(compiled_bhsd(qt, kt, vt, True), fa.flash_attention_forward(qt, kt, vt, causal=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_bitwise_repeatable(fa, dtype):
    """Forward and backward give identical bits on every run (no atomics anywhere)."""
    q, k, v = _qkv(dtype, heads=(6, 2), requires_grad=True)
    dout = torch.randn_like(q)
    runs = []
    for _ in range(3):
        out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        runs.append((out, lse, *torch.autograd.grad(out, (q, k, v), dout)))
    for run in runs[1:]:
        for got, first in zip(run, runs[0]):
            assert torch.equal(got, first)


_INDUCTOR_COPIES = """
import builtins, dis, importlib, importlib.util, pathlib, sys, tempfile
import triton
from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code as closure
sys.path.insert(0, sys.argv[1])
folder, unresolved = pathlib.Path(tempfile.mkdtemp()), []
for module_name in ("forward", "backward", "decode", "rotary", "probabilities"):
    module = importlib.import_module("flash_attention_kernel." + module_name)
    for name, kernel in vars(module).items():
        if not (isinstance(kernel, triton.JITFunction) and name.endswith("kernel")):
            continue
        path = folder / f"{module_name}{name}.py"  # (as inductor writes it: its own imports, then the closure)
        path.write_text("import triton\\nimport triton.language as tl\\nfrom triton.language.extra import libdevice\\n"
                        + closure(kernel))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        copy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(copy)
        names = {instruction.argval for function in vars(copy).values() if isinstance(function, triton.JITFunction)
                 for instruction in dis.Bytecode(function.fn) if instruction.opname == "LOAD_GLOBAL"}
        unresolved += [f"{module_name}.{name}: {n}" for n in sorted(names) if n not in vars(copy)
                       and not hasattr(builtins, n)]
        assert name in vars(copy)
print("\\n".join(unresolved))
sys.exit(1 if unresolved else 0)
"""


def test_inductor_copies_of_the_kernels_resolve_every_name():
    """torch.compile's inductor launches a user-defined Triton kernel from a module of its own: the
    kernel's source and its callees' (found through the kernel's globals), the constants they read,
    and `import triton.language as tl`. Every global a copied function names must exist there (a
    kernel calling a function whose source names a module other than tl, or a global that is not a
    constant, compiles in eager mode and fails under torch.compile). Checked without a GPU: each
    kernel's copy is written as inductor writes it and imported, in a process without the
    interpreter (whose kernels are not JITFunctions)."""
    import os
    import subprocess
    import sys

    from conftest import PACKAGE_SOURCE
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _INDUCTOR_COPIES, str(PACKAGE_SOURCE)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, "names the copies cannot resolve:\n" + result.stdout + result.stderr[-3000:]
