"""Which calls the Gluon kernels for Hopper take, decided without importing Gluon.

The Gluon kernels (``hopper_forward``, ``hopper_dq``, ``hopper_dkdv``, with their shared parts in
``hopper_gluon`` and ``hopper_dropout``) are written against ``triton.experimental.gluon``, whose
API changes between Triton releases: Triton 3.4 has Gluon but no ``warpgroup_mma``, 3.9 renamed
TMA's load, and a later release may move anything else. So nothing here imports Gluon, and no
module of the package imports the Gluon kernels at import time: ``forward``, ``dq`` and ``dkdv``
below first check that a call is one the kernels take (``fits``: a Hopper GPU, a checked Triton,
the dtypes, head dims and full tiles they handle), and only then import the kernel's module, once
per process (``_load``). If that import fails under some Triton, a warning names the error once
and every call takes the tl kernels, which run under every Triton from 3.4 on.

``FLASH_ATTENTION_GLUON``: unset, the Gluon kernels run on every call they take, under a Triton in
``CHECKED_VERSIONS`` (they are faster than the tl kernels on each, docs/benchmarks.md#hopper-kernels
and docs/design.md#hopper-gluon-kernels); "1" also under other Tritons (the import may then fail, as above); "0" never.
"""

import importlib
import os
import warnings

import torch
import triton
from torch._subclasses.fake_tensor import is_fake

from .launch import SequenceLayout, _splits_into_rows, _tma_possible
from .options import ALIBI, DROPOUT, MASK_LEFT, MASK_RIGHT, SINKS, SOFTCAP, AttentionOptions

# Triton releases under which the Gluon kernels ran the GPU suite (docs/design.md#constants)
CHECKED_VERSIONS = ("3.6.", "3.9.")
HEAD_DIMS = (64, 128)

# The VARIANT bits the Gluon kernels read; sinks reach them through the lse
KERNEL_BITS = MASK_LEFT | MASK_RIGHT | SOFTCAP | ALIBI | DROPOUT
ALL_OPTIONS = KERNEL_BITS | SINKS

# (query rows, keys) of one program of each kernel: a call fits only if its sequence lengths are
# multiples of both (TMA reads full tiles; a ragged one would read the next slice's rows). The
# forward and dQ hold two consumer warpgroups of 64 query rows each and stream key tiles of 128
# (forward) or 64 (dQ); dK/dV holds two warpgroups of 64 keys each and streams query tiles of 64.
# Each kernel module takes its tile sizes from here.
PROGRAM_TILES = {"hopper_forward": (128, 128), "hopper_dq": (128, 64), "hopper_dkdv": (64, 128)}

_loaded = {}  # module name -> the imported module, or None where its import failed


def forward(options: AttentionOptions, layout: SequenceLayout, interpreted: bool, q, k, v):
    """``hopper_forward.attention_forward`` if it runs this forward, else None (the tl kernel)."""
    module = _route("hopper_forward", options, layout, interpreted, (q, k, v), ALL_OPTIONS)
    return module and module.attention_forward


def dq(options: AttentionOptions, layout: SequenceLayout, interpreted: bool, *tensors: torch.Tensor):
    """``hopper_dq.attention_dq`` if it runs this dQ (``tensors``: q, k, v, dout), else None.
    Dropout without causal masking stays on the tl kernel, which is 4% faster there (the Philox
    draws weigh more against this kernel's products, docs/design.md#gluon-dq)."""
    allowed = ALL_OPTIONS & ~(0 if options.causal else DROPOUT)
    module = _route("hopper_dq", options, layout, interpreted, tensors, allowed)
    return module and module.attention_dq


def dkdv(options: AttentionOptions, layout: SequenceLayout, interpreted: bool, *tensors: torch.Tensor):
    """``hopper_dkdv.attention_dkdv`` if it runs this dK/dV (``tensors``: q, k, v, dout), else None."""
    module = _route("hopper_dkdv", options, layout, interpreted, tensors, ALL_OPTIONS)
    return module and module.attention_dkdv


def _route(name: str, options: AttentionOptions, layout: SequenceLayout, interpreted: bool, tensors,
           allowed_options: int):
    """The kernel module ``name`` if ``fits`` and its import works, else None."""
    query_tile, key_tile = PROGRAM_TILES[name]
    if not fits(options, layout, interpreted, tensors, query_tile, key_tile, allowed_options):
        return None
    return _load(name)


def fits(options: AttentionOptions, layout: SequenceLayout, interpreted: bool, tensors, query_tile: int,
         key_tile: int, allowed_options: int = ALL_OPTIONS) -> bool:
    """Whether a Gluon kernel whose programs cover ``query_tile`` query rows and ``key_tile`` keys
    can run this call, with options among ``allowed_options`` (VARIANT bits): sm_90, dense bf16 or
    fp16, head dim 64 or 128, full tiles, tensors TMA can read as rows (``launch.RowGeometry``),
    compiled (not interpreted, not traced by torch.compile: the graph keeps the tl kernels).
    ``tensors``: q, k, v (and dout for the backward)."""
    if interpreted or any(is_fake(x) for x in tensors):
        return False
    setting = os.environ.get("FLASH_ATTENTION_GLUON", "")
    if setting == "0" or os.environ.get("FLASH_ATTENTION_TMA", "") == "0":
        return False
    if setting != "1" and not triton.__version__.startswith(CHECKED_VERSIONS):
        return False
    q = tensors[0]
    if (options.variant & ~allowed_options or layout.is_varlen
            or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] not in HEAD_DIMS):
        return False
    if layout.seqlen_q % query_tile or layout.seqlen_k % key_tile:
        return False
    if q.device.type != "cuda" or torch.version.hip or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    return _tma_possible(False, tensors) and all(_splits_into_rows(x, layout) for x in tensors)


def _load(name: str):
    """Import the kernel module ``name`` on first use; None, with one warning, where the installed
    Triton's Gluon cannot build it."""
    if name not in _loaded:
        try:
            _loaded[name] = importlib.import_module(f".{name}", __package__)
        except Exception as error:  # any Gluon API change: ImportError, AttributeError, TypeError, ...
            warnings.warn(f"flash-attention: the Gluon kernel {name} does not build under Triton "
                          f"{triton.__version__} ({type(error).__name__}: {error}); the tl kernels serve its calls",
                          RuntimeWarning, stacklevel=3)
            _loaded[name] = None
    return _loaded[name]
