"""Prepared calls: an eager call's launches recorded once per signature, then replayed.

An eager ``attention_forward``, ``attention_backward`` or ``attention_with_kvcache`` call does
much host work that depends only on its signature: the sequence layout, the plan (which kernel,
which config), the Gluon layouts and descriptors, each launch's argument list of strides, lengths
and option scalars, and the direct launch's own key (issue 41: on an H100's host that work took
about half of a short training step's host time). A ``replayed`` launcher does it once per
signature and keeps the result:

* The signature (``signature``) is what the launches can depend on: each tensor argument's
  type, shape, strides, dtype, device and 16-byte alignment, which tensor arguments are the same
  memory (equal data pointers), every other argument by value (AttentionOptions by its scalars
  and its tensors as tensors) and ``planner.launch_environment`` (the environment switches and
  torch's determinism flag, which the backward's route reads); the device
  is the tensors' (the launchers run under launch.on_tensor_device, which makes it current).
* The first call of a signature runs the launcher as it is (a signature that never comes again,
  such as a varlen batch's max_seqlen or a decode step's int cache_seqlen, costs one dict entry).
* The second runs it recording (``record``) the torch ops it runs (a dispatch mode) and the
  launches it makes (``direct_launch.recording_launches``: each compiled kernel, grid, argument
  list and constexprs). The record becomes a ``_Prepared`` call when the launcher did nothing
  but allocate tensors, take views and launch through direct launches, and when every tensor a
  launch takes is either at an argument's address or in memory the call allocated: then each
  launch's arguments are a template in which tensors are slots (an argument, or an allocation
  made again on each call) plus byte offsets, and host tensor descriptors are their template
  over a slot's address. Otherwise (a copy, a fill, a launch through JITFunction.run, a tensor
  at an offset into an argument) the signature is remembered as not replayable and its calls
  run the launcher as they did.
* From the third call on, calls of the signature allocate the outputs and temporaries again
  (same shapes and strides), put each slot's address into the templates and call each compiled
  kernel's launcher: the data pointers are the only per-call inputs.

Bitwise the same results as the launcher's own path: the same kernels with the same arguments.
Only eager calls replay: under torch.compile (``wrap_kernel`` is not identity_wrap) the launches
are traced, a launch hook (a profiler) sends calls through the launcher so that the hook sees
them, and a replayed launcher called inside another's record runs as it is, so that the outer
record sees its launches. Setting a config override empties the prepared calls
(configs.cleared_by_overrides); FLASH_ATTENTION_REPLAY=0 turns replays off, and so does every
condition without direct launches (a Triton older than direct_launch.CHECKED_TRITON,
FLASH_ATTENTION_DIRECT_LAUNCH=0), which then costs no signature.
docs/design.md#prepared-calls has the numbers.
"""

import copy
import functools
import types

import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

from . import configs
from .direct_launch import CHECKED_TRITON, launch_hooked, recording, recording_launches
from .launch import MAX_REMEMBERED, PLAIN_TENSORS, ensure_scratch_allocator, identity_wrap
from .options import AttentionOptions
from .planner import SWITCHES, launch_environment

_aten = torch.ops.aten
_ALLOCATING = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
               _aten.new_empty.default, _aten.new_empty_strided.default}
_REPLAY_SWITCH = SWITCHES.index("FLASH_ATTENTION_REPLAY")
_DIRECT_SWITCH = SWITCHES.index("FLASH_ATTENTION_DIRECT_LAUNCH")
_DIRECT_TRITON = triton.__version__.startswith(CHECKED_TRITON)  # (direct launches exist under this Triton)
_OFF = ("0", b"0")  # (planner.switches gives os.environ's bytes where it can)
_SEEN = object()  # a signature called once
_NOT_REPLAYABLE = object()  # a signature whose record could not be prepared
_PREPARED_CALLS = []  # every replayed launcher's cache, emptied by an override


def replayed(launcher):
    """``launcher`` (its tensors and options positional or keyword, ``wrap_kernel`` keyword)
    with eager calls replayed per signature (module docstring)."""
    prepared_calls = {}
    _PREPARED_CALLS.append(prepared_calls)

    @functools.wraps(launcher)
    def call(*args, wrap_kernel=identity_wrap, **kwargs):
        if wrap_kernel is not identity_wrap or launch_hooked() or recording():  # (inside a record: its launches)
            return launcher(*args, wrap_kernel=wrap_kernel, **kwargs)
        environment = launch_environment()
        if not _DIRECT_TRITON or environment[_REPLAY_SWITCH] in _OFF or environment[_DIRECT_SWITCH] in _OFF:
            return launcher(*args, **kwargs)  # (without direct launches no record could be replayed)
        tensors = []
        key = signature(args, kwargs, environment, tensors)
        if key is None:
            return launcher(*args, **kwargs)
        prepared = prepared_calls.get(key)
        if prepared is None:  # (a first call: a signature seen once is not worth a record)
            if len(prepared_calls) >= MAX_REMEMBERED:
                prepared_calls.clear()
            prepared_calls[key] = _SEEN
            return launcher(*args, **kwargs)
        if prepared is _SEEN:
            result, prepared_calls[key] = record(launcher, args, kwargs, tensors)
            return result
        if prepared is _NOT_REPLAYABLE:
            return launcher(*args, **kwargs)
        return prepared.run(tensors)

    return call


configs.cleared_by_overrides(types.SimpleNamespace(cache_clear=lambda: [calls.clear() for calls in _PREPARED_CALLS]))


def signature(args: tuple, kwargs: dict, environment: tuple, tensors: list):
    """The hashable signature of a call (module docstring), or None where it has an argument of a
    type it does not know (a tensor subclass); its tensor arguments, in order, go to ``tensors``.
    One flat tuple: each value's facts after its type, a sequence's length before its items."""
    facts, pointers = [*environment, *kwargs], []
    if not _facts((*args, *kwargs.values()), facts, tensors, pointers):
        return None
    facts.append(tuple(map(pointers.index, pointers)))  # (which tensor arguments are the same memory)
    return tuple(facts)


_SCALARS = (int, float, bool, str, type(None))


def _facts(values, facts: list, tensors: list, pointers: list) -> bool:
    for value in values:
        kind = type(value)
        if kind in PLAIN_TENSORS:
            pointer = value.data_ptr()
            tensors.append(value)
            pointers.append(pointer)
            facts.append((value.shape, value.stride(), value.dtype, value.device, pointer & 15))
        elif kind in _SCALARS:
            facts += (kind, value)
        elif kind is tuple or kind is list:
            facts += (kind, len(value))
            if not _facts(value, facts, tensors, pointers):
                return False
        elif kind is AttentionOptions:
            facts += (kind, value.scalar_values)
            if not _facts(value.tensors(), facts, tensors, pointers):
                return False
        else:
            return False
    return True


class _Unknown(Exception):
    """A record that cannot be replayed (``_Prepared``)."""


class _OpsSeen(TorchDispatchMode):
    """The torch ops run while it is on: the storages of the tensors that allocating ops make
    (``allocated``: storage address -> the most bytes allocated there, as memory a call freed can
    be allocated again within it) and whether any op other than those and views ran."""

    def __init__(self):
        super().__init__()
        self.allocated, self.other = {}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in _ALLOCATING:
            storage = result.untyped_storage()
            self.allocated[storage.data_ptr()] = max(storage.nbytes(), self.allocated.get(storage.data_ptr(), 0))
        elif not getattr(func, "is_view", False):
            self.other.append(func)
        return result


def record(launcher, args: tuple, kwargs: dict, tensors: list):
    """(launcher's result, its ``_Prepared`` call or _NOT_REPLAYABLE)."""
    ops = _OpsSeen()
    with recording_launches() as launches, ops:
        result = launcher(*args, **kwargs)
    try:
        prepared = _Prepared(result, launches, ops, tensors) if not ops.other and None not in launches else None
    except _Unknown:
        prepared = None
    return result, prepared if prepared is not None else _NOT_REPLAYABLE


class _Prepared:
    """A recorded call as templates (module docstring): ``run(tensors)`` replays it on new tensor
    arguments of the same signature."""

    def __init__(self, result, launches: list, ops: _OpsSeen, tensors: list):
        self.arguments = len(tensors)
        pointers = [x.data_ptr() for x in tensors]
        # slots: the tensor arguments, then one per storage the call allocated and a launch or the
        # result uses; new storages are made as an output tensor (its shape and strides) where
        # the result holds one at the storage's start, else as bytes
        self.allocations, storages = [], {}

        def slot_of(x: torch.Tensor):
            if x.data_ptr() in pointers:
                return pointers.index(x.data_ptr()), 0
            storage = x.untyped_storage()
            if storage.data_ptr() not in ops.allocated:
                raise _Unknown  # (a view into an argument at an offset, or memory from elsewhere)
            if storage.data_ptr() not in storages:
                storages[storage.data_ptr()] = self.arguments + len(self.allocations)
                self.allocations.append(("bytes", ops.allocated[storage.data_ptr()], x.device))
            return storages[storage.data_ptr()], x.data_ptr() - storage.data_ptr()

        self.outputs = []  # ("argument", index) / ("allocation", slot) / ("value", value)
        for value in result if type(result) is tuple else (result,):
            argument = next((i for i, x in enumerate(tensors) if value is x), None)
            if argument is not None:
                self.outputs.append(("argument", argument))
            elif type(value) in PLAIN_TENSORS:
                storage = value.untyped_storage()
                # (made again by empty_strided: it must own exactly its storage, which held nothing
                # larger earlier in the call)
                owned = storage.nbytes() == _extent(value) == ops.allocated.get(storage.data_ptr())
                if value.storage_offset() != 0 or storage.data_ptr() in storages or not owned:
                    raise _Unknown
                storages[storage.data_ptr()] = self.arguments + len(self.allocations)
                self.allocations.append(("tensor", (value.shape, value.stride()), value.dtype, value.device))
                self.outputs.append(("allocation", storages[storage.data_ptr()]))
            elif value is None:
                self.outputs.append(("value", None))
            else:
                raise _Unknown
        self.single = type(result) is not tuple
        self.launches = [_LaunchTemplate(launch, slot_of) for launch in launches]

    def run(self, tensors: list):
        if self.launches:
            ensure_scratch_allocator()  # (per thread: autograd runs the backward on its own)
        made = []
        for allocation in self.allocations:
            if allocation[0] == "tensor":
                (shape, strides), dtype, device = allocation[1:]
                made.append(torch.empty_strided(shape, strides, dtype=dtype, device=device))
            else:
                made.append(torch.empty(allocation[1], dtype=torch.uint8, device=allocation[2]))
        if self.launches:
            addresses = [x.data_ptr() for x in tensors] + [x.data_ptr() for x in made]
            stream = current_stream()
            for launch in self.launches:
                launch.run(addresses, stream)
        results = tuple(tensors[index] if kind == "argument" else made[index - self.arguments] if kind == "allocation"
                        else index for kind, index in self.outputs)
        return results[0] if self.single else results


def current_stream() -> int:
    """The current device's current CUDA stream, where Triton launches (a test's stand-in on CPU)."""
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())


def _extent(x: torch.Tensor) -> int:
    """Bytes from x's first element to one past its last (what empty_strided allocates for it)."""
    if x.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()))) * x.element_size()


class _Address(int):
    """A device address where a host tensor descriptor's launch reads ``base.data_ptr()``."""

    def data_ptr(self) -> int:
        return int(self)


class _LaunchTemplate:
    """One recorded launch: its compiled kernel, grid and constexprs, and its arguments with each
    tensor a (position, slot, byte offset) and each host tensor descriptor a (position, slot,
    offset, the descriptor) whose copy takes the slot's address as its base."""

    def __init__(self, launch: tuple, slot_of):
        self.compiled, self.grid, args, self.constexprs = launch
        self.template, self.tensors, self.descriptors = list(args), [], []
        for position, value in enumerate(args):
            if isinstance(value, torch.Tensor):
                self.tensors.append((position, *slot_of(value)))
                self.template[position] = None
            elif hasattr(value, "base") and isinstance(value.base, torch.Tensor):  # (a host tensor descriptor)
                template = copy.copy(value)
                template.__dict__["base"] = None  # (the template keeps no tensor alive)
                self.descriptors.append((position, *slot_of(value.base), template))
                self.template[position] = None

    def run(self, addresses: list, stream: int):
        args = self.template.copy()
        for position, slot, offset in self.tensors:
            args[position] = addresses[slot] + offset
        for position, slot, offset, descriptor in self.descriptors:
            placed = object.__new__(type(descriptor))
            placed.__dict__.update(descriptor.__dict__, base=_Address(addresses[slot] + offset))
            args[position] = placed
        compiled = self.compiled
        compiled.run(*self.grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *args,
                     *self.constexprs)
