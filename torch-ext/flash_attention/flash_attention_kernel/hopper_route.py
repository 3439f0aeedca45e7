"""Which calls the Gluon kernels for Hopper take, decided without importing Gluon.

The Gluon kernels (``hopper_forward``, ``hopper_dq``, ``hopper_dkdv``, with their shared parts in
``hopper_gluon`` and ``hopper_dropout``) are written against ``triton.experimental.gluon``, whose
API changes between Triton releases: Triton 3.4 has Gluon but no ``warpgroup_mma``, 3.9 renamed
TMA's load, and a later release may move anything else. So nothing here imports Gluon, and no
module of the package imports the Gluon kernels at import time. The planner (``planner``) asks,
per pass (fwd, bwd_dq, bwd_dkdv), whether the kernel is wanted for a call (``chosen``: enabled,
``fits`` with the options it is chosen for) or, where an override forces it, whether it can run
it (``fits``: a Hopper GPU, the dtypes, head dims and full tiles it handles), and only then
imports the kernel's module, once per process (``launcher``). If that import fails under some
Triton, a warning names the error once and every call takes the tl kernels, which run under every
Triton from 3.4 on.

The backward can also run in one kernel, the dK/dV kernel adding dQ (``fused_chosen``,
FLASH_ATTENTION_FUSED_DQ; the planner then plans it as the A100 class's fused backward).

``FLASH_ATTENTION_GLUON``: unset, the Gluon kernels run on the calls they take that are long enough
(``long_enough``), under a Triton in ``CHECKED_VERSIONS``: there they are faster than the tl kernels
(docs/benchmarks.md#hopper-kernels, docs/design.md#hopper-gluon-kernels); "1" on every call they can
run, short ones too and under other Tritons (the import may then fail, as above); "0" never.
"""

import importlib
import os
import warnings

import torch
import triton
from torch._subclasses.fake_tensor import is_fake

from . import configs
from .configs import GLUON_TILES
from .launch import SequenceLayout, _splits_into_rows, _tma_possible
from .options import ALIBI, DROPOUT, MASK_LEFT, MASK_RIGHT, SINKS, SOFTCAP, AttentionOptions

# Triton releases under which the Gluon kernels were checked on a GPU: the suite (3.6, 3.9), their
# own test files (3.7, 3.8) (docs/design.md#constants)
CHECKED_VERSIONS = ("3.6.", "3.7.", "3.8.", "3.9.")
# Head dims the kernels hold: one chunk (64, 128) or two (80 = 64 + 16, 96 = 64 + 32,
# hopper_gluon.tile_arguments); other widths would need padding or other chunks
HEAD_DIMS = (64, 80, 96, 128)

# The VARIANT bits the Gluon kernels read; sinks reach them through the lse
KERNEL_BITS = MASK_LEFT | MASK_RIGHT | SOFTCAP | ALIBI | DROPOUT
ALL_OPTIONS = KERNEL_BITS | SINKS

# pass -> (module, launch function) of its Gluon kernel
KERNELS = {"fwd": ("hopper_forward", "attention_forward"), "bwd_dq": ("hopper_dq", "attention_dq"),
           "bwd_dkdv": ("hopper_dkdv", "attention_dkdv")}

# The shortest calls the default route gives each Gluon kernel (``long_enough``; the H100 sweeps
# behind them and stop 67's H200 one at d64: docs/design.md#hopper-gluon-kernels, "Short calls").
# Forward: the mean number of keys a query row sees, per head dim. Backward (both passes): seqlen_k.
FORWARD_MIN_KEYS = {64: 1024, 80: 256, 96: 256, 128: 256}
BACKWARD_MIN_SEQLEN_K = 256

_loaded = {}  # module name -> the imported module, or None where its import failed

# The backward in one kernel (``fused_chosen``): the dK/dV kernel adds dQ too, FlashAttention-3's
# split (hopper_dkdv's FUSED_DQ), at the head dims configs.GLUON_FUSED_STAGES has rings for.
# FLASH_ATTENTION_FUSED_DQ: "0" never; "1" wherever it can run; otherwise the default rule, where an
# H200 measured it faster (docs/design.md#fused-dq-in-the-gluon-dkdv-kernel): under a Triton
# release of FUSED_DQ_MIN_KEYS (``fused_min_keys``), for a (head dim, mask) it lists ("causal" or
# "none"), one query head a KV head, and a query row seeing on average at least that many keys
# (below, the two kernels win: 0.92x at head dim 128 causal with 1k tokens). Every release adds dQ
# by TMA reductions (3.6 and 3.7 through hopper_gluon._tma_reduce_add). Under 3.6-3.8 the d128
# causal kernel spilled more and ran 0.79-0.91x the two kernels (stops 64-65), 0.99-1.02x with one
# masked loop (stop 66); with its resident tiles indexed in each tile (hopper_dkdv.OPAQUE_RESIDENT_RELEASES,
# stop 71) it runs 1.03x the two kernels at 1k keys a row under 3.6 and 1.06x at 2k. Head dims 80
# and 96 (dQ in two head-dim chunks, stop 75, H100, 3.6 and 3.9): 1.04-1.09x without a mask at 2k
# keys a row, 1.10-1.20x at 16k, causal 0.96-1.02x at 1k keys a row and 1.10-1.16x at 8k; from 2k
# keys a row either way (3.7 and 3.8 take 3.6's entries untimed: same kernel, compiled without spills).
_ODD_HEAD_DIMS = {(80, "none"): 2048, (80, "causal"): 2048, (96, "none"): 2048, (96, "causal"): 2048}
_BEFORE_3_9 = {(64, "none"): 1024, (64, "causal"): 1024, (128, "none"): 1024, (128, "causal"): 1024,
               **_ODD_HEAD_DIMS}
FUSED_DQ_MIN_KEYS = {  # release -> (head dim, mask) -> keys a row
    "3.9.": {(64, "none"): 512, (64, "causal"): 512, (128, "none"): 1024, (128, "causal"): 1024,
             **_ODD_HEAD_DIMS},
    "3.8.": _BEFORE_3_9,
    "3.7.": _BEFORE_3_9,
    "3.6.": _BEFORE_3_9,
}
PLAIN_MASKS = {(-1, -1): "none", (-1, 0): "causal"}  # AttentionOptions.window -> FUSED_DQ_MIN_KEYS' mask


def fused_chosen(options: AttentionOptions, layout: SequenceLayout, interpreted: bool, tensors) -> bool:
    """Whether the backward is to take the fused dK/dV/dQ kernel, where ``fused_launcher`` has one
    (the planner asks it, as ampere_route's ``launcher``): the Gluon dK/dV kernel chosen for the
    call with no override on either pass, a head dim configs.GLUON_FUSED_STAGES has a ring for
    (64, 80, 96, 128), no dropout, no determinism asked for (``deterministic`` or
    torch.use_deterministic_algorithms: dQ is summed by reductions in whatever order programs
    reach them), and FLASH_ATTENTION_FUSED_DQ's rule above."""
    setting = os.environ.get("FLASH_ATTENTION_FUSED_DQ", "")
    # (``chosen`` first: it turns fake tensors away, whose symbolic head dim cannot key a dict)
    if (setting == "0" or options.deterministic or torch.are_deterministic_algorithms_enabled()
            or options.dropout_p > 0 or configs.OVERRIDES.get("bwd_dq") or configs.OVERRIDES.get("bwd_dkdv")
            or not chosen("bwd_dkdv", options, layout, interpreted, tensors)):
        return False
    head_dim = tensors[0].shape[-1]
    if head_dim not in configs.GLUON_FUSED_STAGES:
        return False
    if setting == "1":
        return True
    min_keys = fused_min_keys().get((head_dim, PLAIN_MASKS.get(options.window)))
    return (min_keys is not None and not options.variant & ~MASK_RIGHT and tensors[0].shape[2] == tensors[1].shape[2]
            and mean_visible_keys(options, layout.seqlen_q, layout.seqlen_k) >= min_keys)


def fused_min_keys() -> dict:
    """The running Triton release's FUSED_DQ_MIN_KEYS ((head dim, mask) -> keys a row), empty for
    a release the default rule does not take."""
    return next((thresholds for version, thresholds in FUSED_DQ_MIN_KEYS.items()
                 if triton.__version__.startswith(version)), {})


def fused_launcher():
    """The fused backward's launch function (``hopper_dkdv.attention_dkdv_dq``), its module
    imported on first use; None where the installed Triton's Gluon cannot build it."""
    module = load_kernel_module("hopper_dkdv")
    return module.attention_dkdv_dq if module is not None else None


def chosen(kernel: str, options: AttentionOptions, layout: SequenceLayout, interpreted: bool, tensors) -> bool:
    """Whether the Gluon kernel of pass ``kernel`` is the one to run this call (``tensors``: q, k,
    v, and dout for the backward) unless an override says otherwise: the kernels are enabled
    (FLASH_ATTENTION_GLUON, CHECKED_VERSIONS; FLASH_ATTENTION_TMA=0 turns them off too) and the call
    ``fits``, with options the kernel is chosen for, and, unless FLASH_ATTENTION_GLUON=1, is
    ``long_enough``. The dQ kernel is not chosen for dropout without causal masking, where the tl
    kernel is 4% faster (the Philox draws weigh more against its products, docs/design.md#gluon-dq)."""
    setting = gluon_setting()
    if setting is None or os.environ.get("FLASH_ATTENTION_TMA", "") == "0":
        return False
    allowed = ALL_OPTIONS & ~(DROPOUT if kernel == "bwd_dq" and not options.causal else 0)
    return fits(kernel, options, layout, interpreted, tensors, allowed) and (
        setting == "1" or long_enough(kernel, options, layout, tensors[0].shape[-1]))


def gluon_setting():
    """FLASH_ATTENTION_GLUON's value where the Gluon kernels may run ("1": on under any Triton and
    for short calls too; anything else but "0": the default route), or None where they may not
    (it is "0", or the Triton is not in CHECKED_VERSIONS and it is not "1"). The Hopper kernels'
    route and the fused backward's (ampere_route) both ask it."""
    setting = os.environ.get("FLASH_ATTENTION_GLUON", "")
    if setting == "0" or (setting != "1" and not triton.__version__.startswith(CHECKED_VERSIONS)):
        return None
    return setting


def long_enough(kernel: str, options: AttentionOptions, layout: SequenceLayout, head_dim: int) -> bool:
    """Whether a dense call that the Gluon kernel of pass ``kernel`` fits is long enough for it to
    beat the tl kernel: the forward where a query row sees at least FORWARD_MIN_KEYS[head_dim] keys
    on average (``mean_visible_keys``), the backward from BACKWARD_MIN_SEQLEN_K keys. Below, a
    warp-specialised program's setup (barriers, descriptors, the producer's first loads) is not
    repaid by its pipelining over few key tiles, and the Gluon path costs the host more per call:
    its descriptors (the thresholds date from when the Gluon backward also launched delta's
    preprocess, docs/design.md#hopper-gluon-kernels)."""
    if kernel == "fwd":
        return mean_visible_keys(options, layout.seqlen_q, layout.seqlen_k) >= FORWARD_MIN_KEYS[head_dim]
    return layout.seqlen_k >= BACKWARD_MIN_SEQLEN_K


def mean_visible_keys(options: AttentionOptions, seqlen_q: int, seqlen_k: int) -> float:
    """The mean over query rows of the keys each sees: row i sees keys j of
    i + diag - left <= j <= i + diag + right (diag = seqlen_k - seqlen_q, as in scores.py: the
    causal diagonal and the window are aligned to the bottom right, as in flash-attn; a bound of -1
    is none), clipped to [0, seqlen_k). Exact, in O(1): the count is linear between the two rows
    where a clip starts."""
    if seqlen_q <= 0:
        return 0.0
    left, right = options.window
    diag, unbounded = seqlen_k - seqlen_q, seqlen_q + seqlen_k
    low = diag - left if left >= 0 else -unbounded  # row i's first key is max(0, i + low) ...
    high = diag + right + 1 if right >= 0 else unbounded  # ... and its last + 1 min(seqlen_k, i + high)
    edges = sorted({0, seqlen_q, *(row for row in (-low, seqlen_k - high) if 0 < row < seqlen_q)})
    total = 0
    for first, end in zip(edges, edges[1:]):  # rows [first, end): the count is linear in the row
        count = min(seqlen_k, first + high) - max(0, first + low)
        slope = (first + high < seqlen_k) - (first + low >= 0)
        total += _sum_of_positive(count, slope, end - first)
    return total / seqlen_q


def _sum_of_positive(first: int, step: int, n: int) -> int:
    """sum over t < n of max(0, first + step * t), for step -1, 0 or 1."""
    if step == 0:
        return n * max(0, first)
    low, high = (first, first + n - 1) if step > 0 else (first - n + 1, first)
    low = max(low, 1)
    return (low + high) * (high - low + 1) // 2 if high >= low else 0


def fits(kernel: str, options: AttentionOptions, layout: SequenceLayout, interpreted: bool, tensors,
         allowed_options: int = ALL_OPTIONS) -> bool:
    """Whether the Gluon kernel of pass ``kernel``, whose programs cover GLUON_TILES[kernel]
    (query rows, keys), can run this call, with options among ``allowed_options`` (VARIANT bits):
    sm_90, dense bf16 or fp16, a head dim in HEAD_DIMS, full tiles, tensors TMA can read as rows
    (``launch.RowGeometry``), compiled (not interpreted, not traced by torch.compile: the graph
    keeps the tl kernels). ``tensors``: q, k, v (and dout for the backward)."""
    if interpreted or any(is_fake(x) for x in tensors):
        return False
    query_tile, key_tile = GLUON_TILES[kernel]
    q = tensors[0]
    if (options.variant & ~allowed_options or layout.is_varlen
            or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] not in HEAD_DIMS):
        return False
    if layout.seqlen_q % query_tile or layout.seqlen_k % key_tile:
        return False
    if q.device.type != "cuda" or torch.version.hip or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    return _tma_possible(False, tensors) and all(_splits_into_rows(x, layout) for x in tensors)


def launcher(kernel: str):
    """The launch function of pass ``kernel``'s Gluon kernel (``hopper_forward.attention_forward``,
    ``hopper_dq.attention_dq``, ``hopper_dkdv.attention_dkdv``), its module imported on first use;
    None where the installed Triton's Gluon cannot build it."""
    module_name, function = KERNELS[kernel]
    module = load_kernel_module(module_name)
    return module and getattr(module, function)


def load_kernel_module(name: str):
    """Import the Gluon kernel module ``name`` on first use; None, with one warning, where the
    installed Triton's Gluon cannot build it."""
    if name not in _loaded:
        try:
            _loaded[name] = importlib.import_module(f".{name}", __package__)
        except Exception as error:  # any Gluon API change: ImportError, AttributeError, TypeError, ...
            warnings.warn(f"flash-attention: the Gluon kernel {name} does not build under Triton "
                          f"{triton.__version__} ({type(error).__name__}: {error}); the tl kernels serve its calls",
                          RuntimeWarning, stacklevel=4)
            _loaded[name] = None
    return _loaded[name]
