"""Launching compiled Triton kernels again without JITFunction.run's per-call work.

``kernel[grid](*args)`` goes through JITFunction.run on every call: it binds the arguments,
formats a string cache key out of every argument's specialisation, checks the kernel's globals,
and only then calls the compiled kernel's launcher. For a kernel of ~60 arguments that is 30-45 us
of host time on an H200's host, longer than a decode step's whole kernel, so it, not the GPU,
would set the speed of decoding (docs/design.md#decode).

A ``DirectKernel`` launches the first call of each specialisation through JITFunction.run, keeps
the CompiledKernel it returns, and calls that kernel's launcher directly from then on. Its key
holds every fact Triton specialises a launch on, or finer ones: the current device, the
constexpr and launch keywords, the arguments' types, each tensor's dtype and 16-byte alignment,
the value of each int the kernel specialises (Triton keeps whether it is 1 or a multiple of 16)
and of every argument of another type, the range of the other ints, and of each host tensor
descriptor (the Gluon kernels' TMA descriptors) its tensor's dtype and alignment, its shape,
strides, block shape, shared layout and padding. A finer key only costs
an extra lookup through JITFunction.run, so it can never launch a kernel compiled for other
arguments. The key is built on every launch, so it is one Python expression generated once per
signature (the arguments' types, the keywords' names and types: ``_ArgumentKinds``), not a loop
over the arguments.

Every kernel of the package launches through ``launcher``: tl and Gluon kernels alike. Direct
launches are used only where they were checked: Triton versions in CHECKED_TRITON, eager calls
(torch.compile traces wrap_triton's launches instead), compiled kernels (not the interpreter),
and no launch hooks (a profiler sets them; JITFunction.run then calls them).
FLASH_ATTENTION_DIRECT_LAUNCH=0 turns them off.
"""

import contextlib
import functools
import operator
import os
import threading

import torch
import triton
from triton.runtime.jit import JITFunction

try:
    from triton import knobs
except ImportError:  # Triton before 3.4 (launcher() never returns a DirectKernel there)
    knobs = None

from .launch import identity_wrap, is_interpreted

CHECKED_TRITON = ("3.6.", "3.7.", "3.8.", "3.9.")
_INT32 = range(-2 ** 31, 2 ** 31)


def _hooked(hook) -> bool:
    """Whether a launch hook is set: since Triton 3.6 hooks are chains (``HookChain``), empty
    when none is set; before, a callable or None."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch_hooked() -> bool:
    """Whether a launch enter or exit hook is set (a profiler's): launches must then go through
    JITFunction.run, which calls them."""
    return knobs is not None and (_hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook))


class _Recording(threading.local):
    """``launches``: this thread's recording (replay.record), or None outside one: each launch a
    (compiled kernel, grid, arguments, constexprs), or None for one that did not go through a
    DirectKernel."""

    launches = None


_RECORDING = _Recording()


@contextlib.contextmanager
def recording_launches():
    """A ``with`` block whose launches on this thread are appended to the list it gives."""
    launches = _RECORDING.launches = []
    try:
        yield launches
    finally:
        _RECORDING.launches = None


def recording() -> bool:
    """Whether this thread is inside ``recording_launches``."""
    return _RECORDING.launches is not None


def _recorded(launch) -> None:
    if _RECORDING.launches is not None:
        _RECORDING.launches.append(launch)


class DirectKernel:
    """``kernel[grid](*runtime_args, **constexprs_and_launch_options)`` with the direct launch of
    the module docstring. The kernel's constexpr parameters must follow all of its runtime ones,
    and calls pass the runtime ones positionally and the constexprs by keyword."""

    def __init__(self, kernel):
        self.kernel = kernel
        params = kernel.params
        runtime = [p for p in params if not p.is_constexpr]
        if params[:len(runtime)] != runtime:
            raise ValueError(f"{kernel.__name__}: constexpr parameters must follow the runtime ones")
        self.specialized = [not p.do_not_specialize for p in runtime]
        # (name, default) of each constexpr parameter, for the values a launch leaves to their defaults
        self.constexprs = [(p.name, p.default) for p in params if p.is_constexpr]
        self.compiled = {}
        self.kinds = {}  # argument types -> _ArgumentKinds

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **keywords):
        device = torch.cuda.current_device()
        signature = (tuple(map(type, args)), tuple(keywords), tuple(map(type, keywords.values())))
        kinds = self.kinds.get(signature)
        if kinds is None:
            kinds = self.kinds[signature] = _ArgumentKinds(*signature, self.specialized)
        key = (device, signature, *kinds.key(args, keywords))
        entry = self.compiled.get(key)
        grid = tuple(grid) + (1,) * (3 - len(grid))
        if entry is None or launch_hooked():
            compiled = self.kernel[grid](*args, **keywords)
            # (the objects keyed by identity stay alive with the entry, so no other object takes their id)
            kept = (*keywords.values(), *[x.layout for x in kinds.descriptors(args) if hasattr(x, "layout")])
            constexprs = tuple(keywords.get(name, default) for name, default in self.constexprs)
            self.compiled[key] = compiled, constexprs, kept
            _recorded(None if entry is not None else (compiled, grid, args, constexprs))
            return
        compiled, constexprs, _ = entry
        compiled.run(*grid, torch._C._cuda_getCurrentRawStream(device), compiled.function, compiled.packed_metadata,
                     None, None, None, *args, *constexprs)
        _recorded((compiled, grid, args, constexprs))


# Keyword values of these types are keyed by value; others (Gluon layouts, whose hash costs more
# host time than a launch should) by identity, kept alive by the compiled entry
_BY_VALUE = (int, bool, float, str, type(None), torch.dtype)


class _ArgumentKinds:
    """For one signature (the arguments' types, the keywords' names and their values' types):
    ``key(args, keywords)``, the launch's facts as the module docstring lists them, as one
    generated expression (a loop over ~60 arguments in Python costs more host time than the
    launch): each tensor's dtype and 16-byte alignment, each host tensor descriptor's
    ``_descriptor_key``, each int the kernel does not specialise by its range (int32 or not),
    every other argument and keyword value by value, keyword values of other types than
    ``_BY_VALUE``'s (Gluon layouts) by identity; and ``descriptors(args)``."""

    def __init__(self, types: tuple, names: tuple, keyword_types: tuple, specialized: list):
        facts, descriptors = [], []
        for i, (kind, special) in enumerate(zip(types, specialized)):
            if issubclass(kind, torch.Tensor):
                facts += [f"a[{i}].dtype", f"a[{i}].data_ptr() % 16 == 0"]
            elif _is_descriptor(kind):
                facts.append(f"descriptor_key(a[{i}])")
                descriptors.append(i)
            elif issubclass(kind, int) and kind is not bool and not special:
                facts.append(f"{_INT32.start} <= a[{i}] < {_INT32.stop}")
            else:
                facts.append(f"a[{i}]")
        for name, kind in zip(names, keyword_types):
            facts.append(f"k[{name!r}]" if kind in _BY_VALUE else f"id(k[{name!r}])")
        namespace = {"descriptor_key": _descriptor_key}
        exec(f"def key(a, k):\n    return ({', '.join(facts)},)", namespace)
        self.key = namespace["key"]
        self.descriptors = _getter(descriptors)


def _is_descriptor(kind) -> bool:
    """Whether arguments of type ``kind`` are host tensor descriptors (Triton's and Gluon's
    TensorDescriptor classes: a base tensor, a shape, strides and a block shape)."""
    return kind.__name__ == "TensorDescriptor" and all(
        name in getattr(kind, "__dataclass_fields__", ()) for name in ("base", "shape", "strides", "block_shape"))


def _descriptor_key(descriptor) -> tuple:
    """What a launch may specialise on of a host tensor descriptor, or finer: its tensor's dtype
    and alignment, and ``descriptor_facts`` (computed once where ``with_launch_facts`` did)."""
    base = descriptor.base
    facts = descriptor.__dict__.get(_FACTS)
    return base.dtype, base.data_ptr() % 16 == 0, descriptor_facts(descriptor) if facts is None else facts


def descriptor_facts(descriptor) -> tuple:
    """A host tensor descriptor's shape, strides and block shape, and (Gluon's) shared layout (by
    identity, as other keyword values not in ``_BY_VALUE``) and padding."""
    return (*descriptor.shape, *descriptor.strides, *descriptor.block_shape, id(getattr(descriptor, "layout", None)),
            getattr(descriptor, "padding", None), getattr(descriptor, "round_f32_to_tf32", None))


_FACTS = "direct_launch_facts"


def with_launch_facts(template):
    """``template`` (a host tensor descriptor) holding its ``descriptor_facts``, for the
    descriptors copied from it onto other tensors with its fields unchanged (hopper_gluon's
    ``_rebased``): their launches then key the facts without recomputing them."""
    template.__dict__[_FACTS] = descriptor_facts(template)
    return template


def _getter(positions: list):
    """args -> the tuple of args at ``positions`` (operator.itemgetter, which returns a bare item
    for one position)."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        return lambda args: (args[positions[0]],)
    return operator.itemgetter(*positions)


@functools.lru_cache(maxsize=None)
def _direct(kernel) -> DirectKernel:
    return DirectKernel(kernel)


def launcher(kernel, wrap_kernel=identity_wrap):
    """What to launch ``kernel`` through: its DirectKernel for eager launches of a compiled
    Triton or Gluon kernel where direct launches are checked (module docstring), else
    ``wrap_kernel(kernel)`` (a traced launch, the interpreter, a test's stand-in)."""
    if (wrap_kernel is not identity_wrap or not isinstance(kernel, JITFunction) or is_interpreted(kernel)
            or not triton.__version__.startswith(CHECKED_TRITON)
            or os.environ.get("FLASH_ATTENTION_DIRECT_LAUNCH", "1") == "0"):
        _recorded(None)  # (a launch a replay could not repeat)
        return wrap_kernel(kernel)
    return _direct(kernel)
