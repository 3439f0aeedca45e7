"""Prepared calls (flash_attention_kernel/replay.py): from its third eager call on, a signature
replays the launches its second call recorded, with only the data pointers new, and gives the same
bits.

On CPU the mechanism runs on stand-in launchers whose "kernels" read and write host memory at the
addresses they are given (ctypes), so a replay that passed a wrong address, a stale tensor or a
wrong offset gives a wrong result here; and the package's own launchers (forward, backward,
decode) run with every launch through a stand-in direct launch of the interpreted kernels, whose
replays rebuild tensors at the addresses they are given. On a GPU the real direct launches are
checked: every path (tl and Gluon, forward and backward, dense, varlen, packed gradients, each
option, decode) replayed on new inputs gives bitwise what FLASH_ATTENTION_REPLAY=0 gives, and the
replay really ran.
"""

import ctypes
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from conftest import ON_GPU
from inputs import cu_seqlens, random_qkv


def _floats(address, count):
    return np.ctypeslib.as_array((ctypes.c_float * count).from_address(address))


class _Compiled:
    """A stand-in compiled kernel: out[i] = a[i] * scale + b[i] over ``count`` floats, where each
    of a, b, out is an address, a tensor or a host tensor descriptor (its base)."""

    function = packed_metadata = None

    def run(self, *launch):
        *_, a, b, out, count, scale = launch[7:]
        a, b, out = (_address(x) for x in (a, b, out))
        _floats(out, count)[:] = _floats(a, count) * scale + _floats(b, count)


def _address(x):
    if isinstance(x, int):
        return int(x)
    if isinstance(x, torch.Tensor):
        return x.data_ptr()
    return x.base.data_ptr()


@dataclass
class TensorDescriptor:
    base: torch.Tensor
    shape: list


@pytest.fixture
def replay_module(fa):
    module = fa.flash_attention_kernel.replay
    if not module._DIRECT_TRITON:
        import triton
        pytest.skip(f"Triton {triton.__version__} has no direct launches (direct_launch.CHECKED_TRITON), so no replays")
    return module


@pytest.fixture
def replay(replay_module, monkeypatch):
    """replay.py with the current stream stood in for (CPU launches)."""
    monkeypatch.setattr(replay_module, "current_stream", lambda: 0)
    return replay_module


def _launch(direct_launch, a, b, out, count, scale):
    """One stand-in launch as a DirectKernel makes it: run, and note it for a recording."""
    compiled, args = _Compiled(), (a, b, out, count, scale)
    compiled.run(1, 1, 1, 0, None, None, None, None, None, *args)
    direct_launch._recorded((compiled, (1, 1, 1), args, ()))


def _stand_in(fa, body):
    """(replayed launcher running ``body``, the list of the calls that ran its Python)."""
    direct_launch = fa.flash_attention_kernel.direct_launch
    ran = []

    def launcher(*args, wrap_kernel=None, **kwargs):
        ran.append(args)
        return body(direct_launch, *args, **kwargs)

    return fa.flash_attention_kernel.replay.replayed(launcher), ran


def _two_launches(direct_launch, x, y, scale=2.0):
    """out = (x * scale + y) * 1 + x through a temporary, both outputs new: (out, temporary)."""
    temporary = torch.empty_like(x)
    out = torch.empty_like(x)
    _launch(direct_launch, x, y, temporary, x.numel(), scale)
    _launch(direct_launch, temporary.view(-1), x, out, x.numel(), 1.0)
    return out, None


def _inputs(n=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=generator), torch.randn(n, generator=generator)


def test_a_signatures_third_call_replays_with_new_addresses(fa, replay):
    launcher, ran = _stand_in(fa, _two_launches)
    x, y = _inputs()
    first, _ = launcher(x, y)
    launcher(x, y)  # (records)
    for seed in (1, 2):
        x, y = _inputs(seed=seed)
        out, none = launcher(x, y)
        assert none is None and torch.equal(out, (x * 2.0 + y) + x)
    assert len(ran) == 2, "the third and fourth calls ran the launcher's Python"
    assert torch.equal(first, (_inputs()[0] * 2.0 + _inputs()[1]) + _inputs()[0])


def test_other_signatures_and_scalars_record_again(fa, replay):
    launcher, ran = _stand_in(fa, _two_launches)
    x, y = _inputs()
    launcher(x, y)
    launcher(x, y)
    for _ in range(3):
        assert torch.equal(launcher(x, y, 3.0)[0], (x * 3.0 + y) + x)  # (a scalar by value)
    x, y = _inputs(n=32)
    for _ in range(3):
        assert torch.equal(launcher(x, y)[0], (x * 2.0 + y) + x)  # (another shape)
    assert len(ran) == 6


def test_aliased_arguments_are_part_of_the_signature(fa, replay):
    launcher, ran = _stand_in(fa, _two_launches)
    x, y = _inputs()
    for _ in range(3):
        assert torch.equal(launcher(x, x)[0], (x * 2.0 + x) + x)
    assert torch.equal(launcher(x, y)[0], (x * 2.0 + y) + x)  # (not the replay of (x, x))
    assert len(ran) == 3


def test_an_argument_returned_is_the_callers_tensor(fa, replay):
    def in_place(direct_launch, x, y, out):
        _launch(direct_launch, x, y, out, x.numel(), 1.0)
        return out, torch.empty(3)

    launcher, ran = _stand_in(fa, in_place)
    launcher(*_inputs(), torch.empty(64))
    x, y = _inputs(seed=3)
    buffer = torch.empty(64)
    for _ in range(3):
        out, extra = launcher(x, y, out=buffer)
    assert out is buffer and torch.equal(buffer, x + y) and extra.shape == (3,)
    assert len(ran) == 3  # (out= by keyword is another signature than out positional)


def test_descriptors_take_the_new_tensors_address(fa, replay):
    def with_descriptor(direct_launch, x, y):
        out = torch.empty_like(x)
        _launch(direct_launch, TensorDescriptor(x.view(-1), [x.numel()]), y, out, x.numel(), 1.0)
        return out

    launcher, ran = _stand_in(fa, with_descriptor)
    launcher(*_inputs())
    launcher(*_inputs())
    x, y = _inputs(seed=4)
    assert torch.equal(launcher(x, y), x + y) and len(ran) == 2
    prepared = next(iter(replay._PREPARED_CALLS[-1].values()))
    assert all(template.base is None for launch in prepared.launches for *_, template in launch.descriptors)


@pytest.mark.parametrize("case", ["other op", "offset view", "unrecorded launch"])
def test_calls_that_cannot_be_replayed_run_the_launcher(fa, replay, case):
    def body(direct_launch, x, y):
        out = torch.empty_like(x)
        if case == "other op":
            out.zero_()  # (a fill a replay would not repeat)
        a = x[1:] if case == "offset view" else x
        count = a.numel()
        if case == "unrecorded launch":
            direct_launch._recorded(None)
        _launch(direct_launch, a, y, out, count, 1.0)
        return out

    launcher, ran = _stand_in(fa, body)
    for seed in range(4):
        x, y = _inputs(seed=seed)
        out = launcher(x, y)
        a = x[1:] if case == "offset view" else x
        assert torch.equal(out[:a.numel()], a + y[:a.numel()])
    assert len(ran) == 4


def test_a_replayed_launcher_inside_a_record_launches_for_it(fa, replay):
    inner, inner_ran = _stand_in(fa, _two_launches)

    outer, outer_ran = _stand_in(fa, lambda direct_launch, x, y: inner(x, y))
    x, y = _inputs()
    for _ in range(2):
        inner(x, y)  # (the inner signature is replayable on its own)
    for seed in range(4):
        x, y = _inputs(seed=seed)
        assert torch.equal(outer(x, y)[0], (x * 2.0 + y) + x)
    assert len(outer_ran) == 2, "the outer call's record missed the inner call's launches"


def test_switch_and_traced_launches_skip_replays(fa, replay, monkeypatch):
    launcher, ran = _stand_in(fa, _two_launches)
    x, y = _inputs()
    launcher(x, y)
    launcher(x, y)
    launcher(x, y, wrap_kernel=torch.library.wrap_triton)
    monkeypatch.setenv("FLASH_ATTENTION_REPLAY", "0")
    launcher(x, y)
    monkeypatch.setenv("FLASH_ATTENTION_REPLAY", "1")
    monkeypatch.setenv("FLASH_ATTENTION_DIRECT_LAUNCH", "0")
    launcher(x, y)
    assert len(ran) == 5


def test_torchs_determinism_flag_is_part_of_the_signature(fa, replay):
    """torch.use_deterministic_algorithms changes which backward runs (ampere_route), so a
    signature prepared with it off records again with it on."""
    launcher, ran = _stand_in(fa, _two_launches)
    x, y = _inputs()
    launcher(x, y)
    launcher(x, y)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        launcher(x, y)
    finally:
        torch.use_deterministic_algorithms(previous)
    launcher(x, y)  # (replays the first record)
    assert len(ran) == 3


def test_an_override_empties_the_prepared_calls(fa, replay):
    launcher, ran = _stand_in(fa, _two_launches)
    x, y = _inputs()
    launcher(x, y)
    launcher(x, y)
    configs = fa.flash_attention_kernel.configs
    configs.set_override("fwd", None)
    launcher(x, y)
    assert len(ran) == 3


# ---- the package's launchers on CPU: interpreted kernels behind a stand-in direct launch ---------

class _InterpretedKernel:
    """A compiled kernel's stand-in for an interpreted one: ``run`` takes a launch as a direct
    launch passes it (addresses where the recording had tensors) and runs the interpreter on
    tensors rebuilt at those addresses with the recorded dtypes, shapes and strides."""

    function = packed_metadata = None

    def __init__(self, kernel, args, keywords):
        self.kernel, self.keywords = kernel, keywords
        self.layouts = [(x.dtype, x.shape, x.stride()) if isinstance(x, torch.Tensor) else None for x in args]

    def run(self, grid_x, grid_y, grid_z, *launch):
        args = launch[6:6 + len(self.layouts)]
        args = [_tensor_at(value, layout) if layout is not None and isinstance(value, int) else value
                for value, layout in zip(args, self.layouts)]
        self.kernel[(grid_x, grid_y, grid_z)](*args, **self.keywords)


def _tensor_at(address: int, layout) -> torch.Tensor:
    dtype, shape, strides = layout
    if 0 in shape:
        return torch.empty_strided(shape, strides, dtype=dtype)
    extent = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))
    memory = (ctypes.c_uint8 * (extent * dtype.itemsize)).from_address(address)
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).as_strided(shape, strides)


class _InterpretedDirect:
    """A DirectKernel's stand-in for an interpreted kernel: launches it and notes each launch for a
    recording, as DirectKernel._launch does."""

    def __init__(self, kernel, direct_launch):
        self.kernel, self.direct_launch = kernel, direct_launch

    def __getitem__(self, grid):
        def launch(*args, **keywords):
            grid3 = tuple(grid) + (1,) * (3 - len(grid))
            with _disable_current_modes():  # (the interpreter's own copies are not the launcher's ops)
                self.kernel[grid3](*args, **keywords)
            self.direct_launch._recorded((_InterpretedKernel(self.kernel, args, keywords), grid3, args, ()))
        return launch


@pytest.fixture
def interpreted_replays(fa, replay, monkeypatch):
    """The package's launchers with every launch through ``_InterpretedDirect`` (on CPU only)."""
    if ON_GPU:
        pytest.skip("the stand-in runs interpreted kernels; on a GPU the real direct launches replay")
    kernels = fa.flash_attention_kernel
    identity_wrap = kernels.launch.identity_wrap

    def launcher(kernel, wrap_kernel=identity_wrap):
        if wrap_kernel is not identity_wrap:
            return wrap_kernel(kernel)
        return _InterpretedDirect(kernel, kernels.direct_launch)

    for module in (kernels.forward, kernels.backward, kernels.decode):
        monkeypatch.setattr(module, "launcher", launcher)
    for calls in replay._PREPARED_CALLS:
        calls.clear()
    return replay


CPU_CASES = ["dense_causal", "gqa_window", "softcap_alibi", "dropout", "sinks", "varlen", "qkvpacked", "fp32",
             "decode", "decode_paged", "decode_append_rotary"]


def _cpu_call(fa, case, seed):
    """The outputs and gradients (or the caches) of one small public call on new random inputs."""
    torch.manual_seed(seed)
    dtype = torch.float32 if case == "fp32" else torch.float16
    if case.startswith("decode"):
        q = torch.randn(2, 1, 4, 32, dtype=dtype)
        k_cache, v_cache = (torch.randn(2, 64, 2, 32, dtype=dtype) for _ in range(2))
        options = dict(cache_seqlens=torch.tensor([17, 40], dtype=torch.int32), causal=True)
        if case == "decode_paged":
            k_cache, v_cache = (x.view(-1, 16, 2, 32) for x in (k_cache, v_cache))
            options["block_table"] = torch.randperm(8, dtype=torch.int32).view(2, 4)
        if case == "decode_append_rotary":
            options["k"], options["v"] = (torch.randn(2, 1, 2, 32, dtype=dtype) for _ in range(2))
            angles = torch.rand(64, 16) * 6.28
            options["rotary_cos"], options["rotary_sin"] = angles.cos().to(dtype), angles.sin().to(dtype)
        return fa.flash_attn_with_kvcache(q, k_cache, v_cache, **options), k_cache, v_cache
    if case == "varlen":
        cu = cu_seqlens([17, 5, 30])
        q, k, v = (torch.randn(52, 2, 32, dtype=dtype, requires_grad=True) for _ in range(3))
        out, inputs = fa.flash_attn_varlen_func(q, k, v, cu, cu, 30, 30, causal=True), (q, k, v)
    elif case == "qkvpacked":
        qkv = torch.randn(1, 33, 3, 2, 32, dtype=dtype, requires_grad=True)
        out, inputs = fa.flash_attn_qkvpacked_func(qkv, causal=True), (qkv,)
    else:
        q, k, v = random_qkv((1, 33, 4, 32), (1, 40, 2 if case == "gqa_window" else 4, 32), dtype,
                             requires_grad=True)
        options = {"dense_causal": dict(causal=True), "gqa_window": dict(causal=True, window_size=(8, 0)),
                   "softcap_alibi": dict(softcap=20.0, alibi_slopes=torch.rand(4)), "dropout": dict(dropout_p=0.2),
                   "sinks": dict(s_aux=torch.randn(4)), "fp32": dict(causal=True)}[case]
        out, inputs = fa.flash_attn_func(q, k, v, **options), (q, k, v)
    return (out.detach(), *torch.autograd.grad(out, inputs, torch.randn_like(out)))


@pytest.mark.parametrize("case", CPU_CASES)
def test_the_package_replays_interpreted_calls_bitwise(fa, interpreted_replays, case, monkeypatch):
    replay = interpreted_replays
    for _ in range(2):
        _cpu_call(fa, case, seed=0)  # (counted, then recorded)
    prepared = [value for calls in replay._PREPARED_CALLS for value in calls.values()]
    assert prepared and all(isinstance(value, replay._Prepared) for value in prepared), \
        "every launcher of the call should be replayable"
    runs = []
    run = replay._Prepared.run
    monkeypatch.setattr(replay._Prepared, "run", lambda self, tensors: runs.append(self) or run(self, tensors))
    replayed = _cpu_call(fa, case, seed=1)
    assert len(runs) == len(prepared), "the third call should have replayed every launcher's record"
    monkeypatch.setenv("FLASH_ATTENTION_REPLAY", "0")
    expected = _cpu_call(fa, case, seed=1)
    for got, want in zip(replayed, expected):
        assert torch.equal(got, want)


# ---- the package's launchers, on a GPU ----------------------------------------------------------

GPU_CASES = ["dense_causal", "dense_gqa_window", "softcap_alibi", "dropout", "sinks", "varlen", "qkvpacked",
             "hdim80", "fp32", "decode", "decode_paged", "decode_splits", "decode_append_rotary"]


def _decode_call(fa, case):
    """(out, the caches) of one flash_attn_with_kvcache step on new random inputs (cache_seqlens a
    tensor, as a serving loop keeps it)."""
    batch, heads, heads_k, dim, capacity = 4, 16, 4, 128, 1024
    q = torch.randn(batch, 1, heads, dim, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(batch, capacity, heads_k, dim, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    seqlens = torch.randint(1, capacity - 1, (batch,), device="cuda", dtype=torch.int32)
    options = dict(cache_seqlens=seqlens, causal=True)
    if case == "decode_paged":
        pages = torch.randperm(batch * capacity // 256, device="cuda", dtype=torch.int32).view(batch, -1)
        k_cache, v_cache = (x.view(-1, 256, heads_k, dim) for x in (k_cache, v_cache))
        options["block_table"] = pages
    elif case == "decode_splits":
        options["num_splits"] = 4
    elif case == "decode_append_rotary":
        options["k"], options["v"] = (torch.randn(batch, 1, heads_k, dim, device="cuda", dtype=torch.bfloat16)
                                      for _ in range(2))
        angles = torch.rand(capacity, dim // 2, device="cuda") * 6.28
        options["rotary_cos"], options["rotary_sin"] = angles.cos().bfloat16(), angles.sin().bfloat16()
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, **options)
    return out, k_cache, v_cache


def _gpu_call(fa, case, seed):
    """(loss-free outputs and gradients of one public call on new random inputs)."""
    torch.manual_seed(seed)
    if case.startswith("decode"):
        return _decode_call(fa, case)
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    head_dim = 80 if case == "hdim80" else 128
    if case == "varlen":
        lengths = [128, 64, 256]
        cu, longest = cu_seqlens(lengths), max(lengths)
        q, k, v = (torch.randn(sum(lengths), 8, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                   for _ in range(3))
        out = fa.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)
        inputs = (q, k, v)
    elif case == "qkvpacked":
        qkv = torch.randn(2, 256, 3, 8, head_dim, device="cuda", dtype=dtype, requires_grad=True)
        out, inputs = fa.flash_attn_qkvpacked_func(qkv, causal=True), (qkv,)
    else:
        heads_kv = 2 if case == "dense_gqa_window" else 8
        q, k, v = random_qkv((2, 256, 8, head_dim), (2, 256, heads_kv, head_dim), dtype=dtype, requires_grad=True)
        options = {"dense_causal": dict(causal=True), "dense_gqa_window": dict(causal=True, window_size=(64, 0)),
                   "softcap_alibi": dict(softcap=30.0, alibi_slopes=torch.rand(8, device="cuda")),
                   "dropout": dict(dropout_p=0.1), "sinks": dict(s_aux=torch.randn(8, device="cuda")),
                   "hdim80": dict(causal=True), "fp32": dict(causal=True)}[case]
        out, inputs = fa.flash_attn_func(q, k, v, **options), (q, k, v)
    grads = torch.autograd.grad(out, inputs, torch.randn_like(out))
    return (out.detach(), *grads)


@pytest.mark.skipif(not ON_GPU, reason="the package's launches replay only as compiled kernels (a GPU)")
@pytest.mark.parametrize("gluon", ["1", "0"])
@pytest.mark.parametrize("case", GPU_CASES)
def test_replayed_calls_match_unreplayed_ones_bitwise(fa, replay_module, case, gluon, monkeypatch):
    replay = replay_module
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", gluon)
    for calls in replay._PREPARED_CALLS:
        calls.clear()
    _gpu_call(fa, case, seed=0)
    _gpu_call(fa, case, seed=0)  # (records)
    replayed = _gpu_call(fa, case, seed=1)
    prepared = [value for calls in replay._PREPARED_CALLS for value in calls.values()]
    assert prepared and all(isinstance(value, replay._Prepared) for value in prepared), \
        "every launcher of the call should have replayed"
    monkeypatch.setenv("FLASH_ATTENTION_REPLAY", "0")
    expected = _gpu_call(fa, case, seed=1)
    for got, want in zip(replayed, expected):
        assert torch.equal(got, want)
