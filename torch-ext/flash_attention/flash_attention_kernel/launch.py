"""Host-side helpers shared by the kernel launchers."""

import contextvars
import functools
import os
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from triton.runtime.errors import OutOfResources
from triton.runtime.interpreter import InterpretedFunction

from .configs import (MIN_CAPABILITY, GpuClass, TileConfig, gpu_class, head_dim_chunks, smaller_config, tile_config,
                      warp_specialized_config)
from .options import (
    ALIBI, DROPOUT, FIXED_PIVOT, FP32_EXACT, LOG2E, SINKS, SOFTCAP, TANH_APPROX, WIDE_PRODUCTS, AttentionOptions,
)


# Host integer helpers for the launchers: triton.cdiv and triton.next_power_of_2 are
# constexpr_functions from Triton 3.7 on, whose wrapper costs more host time than the arithmetic
def cdiv(x: int, y: int) -> int:
    """ceil(x / y) (also of torch.compile's SymInts)."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, as triton.next_power_of_2 (0 for n = 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


# How many entries a cache of per-signature host work (plans, descriptor templates) keeps before it
# starts again: a bound for workloads of ever new shapes, whose entries are cheap to make again
MAX_REMEMBERED = 4096

# Tensor types whose calls can be cached or replayed by their signature (plans, prepared calls) and
# run without the dispatcher (torch_ops): plain tensors and parameters; any other type (a fake
# tensor, a subclass) may mean a tracing or transforming context
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def remembered(cache: dict, key, make: Callable):
    """``cache[key]``, made by ``make()`` where it is missing; ``cache`` is emptied first when it
    holds MAX_REMEMBERED entries."""
    value = cache.get(key)
    if value is None:
        if len(cache) >= MAX_REMEMBERED:
            cache.clear()
        value = cache[key] = make()
    return value


def identity_wrap(kernel):
    """Default ``wrap_kernel``: launch the Triton kernel as it is."""
    return kernel


def is_interpreted(kernel) -> bool:
    """True when Triton runs ``kernel`` through its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(kernel, InterpretedFunction)


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels need a unit stride on the last dim; any other strides are passed through."""
    return x if x.stride(-1) == 1 else x.contiguous()


def use_tma(table_choices, interpreted: bool, *tensors: torch.Tensor):
    """Whether kernels read ``tensors`` through tensor descriptors (``tiles.tile_descriptors``):
    one bool per entry of ``table_choices`` (the config table's ``tma`` flag of each kernel).

    The table chooses unless FLASH_ATTENTION_TMA is set: "0" turns descriptors off, "1" on
    wherever they can work, the CPU interpreter included (it emulates them; the tests use it to
    run this path without a GPU). They need Triton's device-side descriptors
    (``tl.make_tensor_descriptor``, Triton >= 3.4) and, compiled, a Hopper-or-newer NVIDIA GPU,
    whose copy engine (TMA) requires 16-byte aligned addresses: every tensor's data pointer and its
    batch, head and row strides must be multiples of 16 bytes (a head dim that is a multiple of 8
    in 2-byte types, in the usual layouts). Elsewhere the kernels use plain loads.
    """
    setting = os.environ.get("FLASH_ATTENTION_TMA", "")
    wanted = [{"0": False, "1": True}.get(setting, choice and not interpreted) for choice in table_choices]
    if any(wanted) and not _tma_possible(interpreted, tensors):
        return [False] * len(wanted)
    return wanted


# Triton versions whose Hopper warp specialisation computes our forward correctly: 3.6 checked on
# an H200 with the GPU test suite, 3.7-3.9 on an H100 with the warp-specialisation, Gluon and TMA
# test files (docs/design.md#warp-specialised-tl-loops). Triton 3.6 miscompiles
# other shapes of the same loop silently, so an unchecked version keeps the plain pipelined loop.
WARP_SPECIALIZATION_CHECKED = ("3.6.", "3.7.", "3.8.", "3.9.")
INT32_MAX = 2 ** 31 - 1  # (total_k of a paged cache: no row bound, SequenceLayout.cu_seqlens)
# Options whose kernels keep the warp-specialised loop's shape (tests/test_warp_specialization.py)
WARP_SPECIALIZABLE = SOFTCAP | ALIBI | SINKS


@dataclass(frozen=True)
class TlLaunch:
    """How one tl kernel (fwd, bwd_dkdv, bwd_dq, probs, decode) launches: its tile config,
    whether its loop is warp-specialised, whether it reads through tensor descriptors, and
    ``fit_key``, under which launch_fitting remembers a smaller config where this one did not fit
    the GPU."""

    kernel: str
    config: TileConfig
    specialized: bool
    tma: bool
    fit_key: tuple = ()


def tl_launch(kernel: str, head_dim: int, dtype: torch.dtype, options: AttentionOptions, layout: "SequenceLayout",
              interpreted: bool, *tensors: torch.Tensor) -> TlLaunch:
    """The TlLaunch of one launch of ``kernel``: the table's warp-specialised entry where the
    call can take it (``warp_specialize``), else its plain entry, for the class of the GPU that
    holds ``tensors`` (``device_gpu_class``), unless an earlier launch found it too big there.
    The warp-specialised kernels (forward, dQ) loop over key tiles, which are all full when
    seqlen_k is a multiple of BLOCK_N."""
    gpu = "sm90"
    if not interpreted:
        device = tensors[0].device
        check_gpu_supports(device, dtype)
        gpu = device_gpu_class(device).name
    seqlen = max(layout.seqlen_q, layout.seqlen_k)
    mask = options.mask_kind
    # A paged cache's rows are gathered page by page: no descriptors, so no warp-specialised loop
    paged = layout.page_size > 0
    config = None if paged else warp_specialized_config(kernel, head_dim, dtype, interpreted, mask, seqlen, gpu)
    if config is not None and warp_specialize(layout.seqlen_k % config.block_n == 0, interpreted, options, layout,
                                              head_dim, *tensors):
        specialized, tma = True, True
    else:
        config = tile_config(kernel, head_dim, dtype, interpreted, mask, seqlen, options.dropout_p > 0, gpu)
        specialized, [tma] = False, [False] if paged else use_tma([config.tma], interpreted, *tensors)
    fit_key = (tensors[0].device, kernel, int(head_dim), dtype, options.variant, config, specialized)
    if _FITTED and fit_key in _FITTED:  # (empty unless a launch ran out of memory: no hashing per launch)
        return TlLaunch(kernel, _FITTED[fit_key], False, tma, fit_key)
    return TlLaunch(kernel, config, specialized, tma, fit_key)


# fit_key -> the config a launch fell back to after OutOfResources (launch_fitting)
_FITTED: dict = {}


def fixed_tl_launch(kernel: str, config: TileConfig, head_dim: int, dtype: torch.dtype, variant: int,
                    device: torch.device) -> TlLaunch:
    """The TlLaunch of a kernel outside the config table, whose launcher chose ``config``
    itself (the probabilities and KV-cache kernels), for options of constexpr ``variant``, so that
    launch_fitting steps it down where it does not fit."""
    return refitted(TlLaunch(kernel, config, False, False, (device, kernel, int(head_dim), dtype, variant, config,
                                                             False)))


def refitted(tl_launch: TlLaunch) -> TlLaunch:
    """``tl_launch`` with the config an earlier launch of its key fell back to (always a plain
    loop), if one did (a launcher may keep a TlLaunch across calls: planner's cache, decode's)."""
    if _FITTED and tl_launch.fit_key in _FITTED:
        return replace(tl_launch, config=_FITTED[tl_launch.fit_key], specialized=False)
    return tl_launch


def any_refitted() -> bool:
    """Whether any launch has fallen back to a smaller config (launch_fitting)."""
    return bool(_FITTED)


def launch_fitting(tl_launch: TlLaunch, launch: Callable[[TileConfig, bool], None]) -> None:
    """``launch(config, specialized)`` with ``tl_launch``'s config; where the GPU lacks the shared
    memory for it (Triton raises OutOfResources before the kernel runs, e.g. under a Triton
    release whose pipeliner allocates more than the one the table was checked with), retry with
    the plain loop, then with ``configs.smaller_config`` until one fits, remember that one for
    its key and warn once. Under torch.compile the launch is traced, so there the table's
    entry must fit (tests/test_resource_arch.py checks that it does)."""
    config, specialized = tl_launch.config, tl_launch.specialized
    while True:
        try:
            launch(config, specialized)
        except OutOfResources as error:
            smaller = config if specialized else smaller_config(config)
            if smaller is None:
                raise
            warnings.warn(f"flash_attention: the {tl_launch.kernel} kernel's config {config} "
                          f"{'(warp-specialised) ' if specialized else ''}does not fit this GPU ({error}); "
                          f"trying {smaller} for this shape from now on", RuntimeWarning, stacklevel=3)
            config, specialized = smaller, False
            continue
        if config is not tl_launch.config or specialized != tl_launch.specialized:
            _FITTED[tl_launch.fit_key] = config  # (only a config that launched)
        return


@functools.lru_cache(maxsize=None)
def device_gpu_class(device: torch.device) -> GpuClass:
    """The config class (configs.GPU_CLASSES) of a CUDA ``device``, from its capability and its
    per-block shared memory; read once per device."""
    props = torch.cuda.get_device_properties(device)
    return gpu_class((props.major, props.minor), props.shared_memory_per_block_optin)


@functools.lru_cache(maxsize=None)
def check_gpu_supports(device: torch.device, dtype: torch.dtype) -> None:
    """Raise where the GPU holding the inputs cannot run the kernels in ``dtype``: bf16 needs
    Ampere (sm_80) or newer, whose tensor cores multiply it (flash-attn and SDPA's FLASH backend
    refuse bf16 on Turing too); GPUs older than MIN_CAPABILITY are not supported."""
    if device.type != "cuda" or torch.version.hip:
        return
    props = torch.cuda.get_device_properties(device)
    capability = (props.major, props.minor)
    if capability < MIN_CAPABILITY:
        raise RuntimeError(f"flash_attention needs an NVIDIA GPU of compute capability {MIN_CAPABILITY[0]}."
                           f"{MIN_CAPABILITY[1]} (Turing) or newer; {props.name} is {capability[0]}.{capability[1]}")
    if dtype == torch.bfloat16 and capability < (8, 0):
        raise TypeError(f"flash_attention: bfloat16 inputs need an Ampere (compute capability 8.0) or newer GPU; "
                        f"{props.name} is {capability[0]}.{capability[1]} and has no bfloat16 tensor cores: "
                        f"use float16")


def warp_specialize(tiles_full: bool, interpreted: bool, options: AttentionOptions, layout: "SequenceLayout",
                    head_dim: int, *tensors: torch.Tensor) -> bool:
    """Whether a kernel runs its main loop warp-specialised (one warp loads tiles through the copy
    engine while the others compute; ``tl.range(..., warp_specialize=True)``), given that the
    config table has a warp-specialised entry for it.

    Only for the one loop shape Triton compiles correctly: dense, no mask and no dropout (softcap,
    ALiBi and sinks change the scores or the row's start, not the loop), every tile of the loop
    full (``tiles_full``: its sequence length a multiple of the tile, so no tile needs a mask), the
    head dim exactly its chunks (no padding), and the tensors readable through
    ``tiles.tensor_tile_descriptors``.
    FLASH_ATTENTION_WS=0 turns it off, "1" on wherever those hold, the CPU interpreter and any
    Triton included (the interpreter runs the same code without warp specialisation; the tests use
    it to cover this path without a GPU); unset, it runs compiled on Hopper (sm_90) with a Triton
    version in WARP_SPECIALIZATION_CHECKED. It needs tensor descriptors, so FLASH_ATTENTION_TMA=0
    turns it off too.
    """
    if (options.variant & ~WARP_SPECIALIZABLE or layout.is_varlen or not tiles_full
            or head_dim != sum(head_dim_chunks(head_dim))):
        return False
    setting = os.environ.get("FLASH_ATTENTION_WS", "")
    if setting == "0" or os.environ.get("FLASH_ATTENTION_TMA", "") == "0":
        return False
    if setting != "1" and (interpreted or not _checked_hopper(tensors[0].device)):
        return False
    return _tma_possible(interpreted, tensors) and all(_splits_into_rows(x, layout) for x in tensors)


@functools.lru_cache(maxsize=None)
def _checked_hopper(device: torch.device) -> bool:
    """A Hopper GPU (sm_90) under a Triton in WARP_SPECIALIZATION_CHECKED."""
    return (device.type == "cuda" and not torch.version.hip and torch.cuda.get_device_capability(device)[0] == 9
            and triton.__version__.startswith(WARP_SPECIALIZATION_CHECKED))


@dataclass(frozen=True)
class RowGeometry:
    """Where (batch, head, row) of a dense (batch, seqlen, heads, dim) tensor sits when the tensor
    is seen as a matrix of ``stride_row``-element rows: row batch * batch_rows + head * head_rows +
    row, column head * head_cols (``tiles.tensor_tile_descriptors`` derives the same in the
    kernels). ``num_rows`` reaches the last row of the last (batch, head) slice."""
    batch_rows: int
    head_rows: int
    head_cols: int
    stride_row: int
    num_rows: int

    @staticmethod
    def of(x: torch.Tensor, layout: "SequenceLayout") -> "RowGeometry":
        batch, seqlen, heads, _ = x.shape
        stride_batch, stride_head, stride_row = layout.strides(x)
        head_rows, head_cols = divmod(stride_head, stride_row) if heads > 1 else (0, 0)
        batch_rows = stride_batch // stride_row if batch > 1 else 0
        num_rows = (batch - 1) * batch_rows + (heads - 1) * head_rows + seqlen
        return RowGeometry(batch_rows, head_rows, head_cols, stride_row, num_rows)


def _splits_into_rows(x: torch.Tensor, layout: "SequenceLayout") -> bool:
    """Whether dense (batch, seqlen, heads, dim) ``x`` is a matrix of row-stride-long rows in which
    each (batch, head) slice is a block of consecutive rows, its columns inside one row
    (``RowGeometry``), with fewer than 2**31 rows (int32 indices)."""
    batch, _, heads, head_dim = x.shape
    stride_batch, _, stride_row = layout.strides(x)
    if stride_row < head_dim or (batch > 1 and stride_batch % stride_row):
        return False
    geometry = RowGeometry.of(x, layout)
    return (heads - 1) * geometry.head_cols + head_dim <= stride_row and geometry.num_rows < 2 ** 31


def _tma_possible(interpreted: bool, tensors) -> bool:
    if not hasattr(tl, "make_tensor_descriptor"):
        return False
    if not interpreted and (tensors[0].device.type != "cuda" or torch.version.hip
                            or torch.cuda.get_device_capability(tensors[0].device)[0] < 9):
        return False
    return all(_aligned_16_bytes(x) for x in tensors)


def _aligned_16_bytes(x: torch.Tensor) -> bool:
    """Whether ``x`` starts on a 16-byte boundary and its batch, head and row strides are
    multiples of 16 bytes. A tensor traced by torch.compile or opcheck (a fake tensor) has no
    address: its storage offset stands in, since PyTorch's allocators align every storage (and
    inductor copies misaligned inputs of a compiled graph)."""
    if any(offset * x.element_size() % 16 for offset in (x.storage_offset(), *x.stride()[:-1])):
        return False
    return is_fake(x) or x.data_ptr() % 16 == 0


def _torch_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def on_tensor_device(launcher: Callable) -> Callable:
    """``launcher`` run with its first argument's CUDA device current. Triton launches on the
    current device's current stream, so a call on cuda:1 tensors while cuda:0 is current would
    run on cuda:0's stream, unordered with the work that wrote its inputs (flash-attn's CUDA
    kernels take a device guard for the same reason). One integer compare when the devices agree."""

    @functools.wraps(launcher)
    def guarded(x, *args, **kwargs):
        if x.device.type != "cuda" or x.device.index == torch.cuda.current_device():
            return launcher(x, *args, **kwargs)
        with torch.cuda.device(x.device):
            return launcher(x, *args, **kwargs)

    return guarded


def ensure_scratch_allocator() -> None:
    """Give Triton an allocator for the global scratch memory in which device-side tensor
    descriptors are built, unless the caller has set one. Triton keeps it in a context variable,
    per thread, so this runs before every launch that uses descriptors (autograd runs the
    backward on a thread of its own)."""
    from triton.runtime import _allocation

    current = getattr(_allocation, "_allocator", None)
    if isinstance(current, contextvars.ContextVar):  # Triton >= 3.5; 3.4 holds the allocator itself
        current = current.get()
    if current is None or isinstance(current, _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


# FIXED_PIVOT's bound on softcap * log2(e): logits in [-u, u] less the pivot max(u - 32, 0) stay
# at or above 2^-120 in the exp2, inside fp32's and bf16's normal range (scores.row_start)
FIXED_PIVOT_MAX_LOG2 = 76.0


def kernel_variant(options: AttentionOptions, dtype: torch.dtype, interpreted: bool, forward: bool = False,
                   max_keys: int = 0) -> int:
    """The VARIANT constexpr of a launch: the options' bits, plus what a softcap's dtype and value
    allow (scores.py):

    * TANH_APPROX where a softcap on 2-byte inputs runs compiled (the GPU's tanh.approx.f32 costs
      one special-function op where the exact form costs three; its 2^-11 relative error sits
      below fp16/bf16 rounding). fp32 inputs and the interpreter keep the exact form.
    * FIXED_PIVOT where every logit is bounded (no ALiBi or sinks), P is bf16 and the softcap
      is at most FIXED_PIVOT_MAX_LOG2 / log2(e) (about 52.7; Gemma 2 uses 50), unless no row sees
      more than one key (a window of (0, 0), or ``max_keys`` 1: the most keys a row can see, where
      the caller knows it; 0 = unknown). A fixed pivot rounds every P to bf16, where a running max
      gives the row's largest key P = 1 exactly; rows of one key then return their value exactly,
      as PyTorch's softmax does, rather than within half a bf16 ulp of it.
    * WIDE_PRODUCTS where dropout runs compiled in the ``forward`` kernel: Philox's products by
      inline mul.wide.u32, 5-6 % faster there; no faster in the dQ kernel (docs/design.md#options).
    * FP32_EXACT for fp32 inputs: the forms that keep fp32 within PyTorch's own error (issue 39),
      logits in natural units (``options.AttentionOptions.kernel_args`` passes them so), hence no
      FIXED_PIVOT, whose headroom is counted in base 2."""
    variant = options.variant
    if dtype == torch.float32:
        variant |= FP32_EXACT
    if variant & DROPOUT and forward and not interpreted:
        variant |= WIDE_PRODUCTS
    if options.softcap > 0:
        if dtype != torch.float32 and not interpreted:
            variant |= TANH_APPROX
        bounded = not variant & (ALIBI | SINKS) and options.softcap * LOG2E <= FIXED_PIVOT_MAX_LOG2
        one_key_rows = options.window == (0, 0) or max_keys == 1
        if bounded and dtype == torch.bfloat16 and not one_key_rows:
            variant |= FIXED_PIVOT
    return variant


def precision_mode(dtype: torch.dtype, interpreted: bool) -> str:
    """PRECISION for ``tiles.mma`` / ``tiles.round_to``: fp32 inputs are multiplied in full fp32
    ("ieee"), never silently in TF32; bf16 under the interpreter takes its emulation."""
    if dtype == torch.float32:
        return "ieee"
    if dtype == torch.bfloat16 and interpreted:
        return "bf16_emulated"
    return "tf32"


@dataclass(frozen=True)
class SequenceLayout:
    """How the sequences of a batch are stored, and what the kernels need to know about it.

    Dense: tensors (batch, seqlen, heads, dim), per-row statistics (lse, delta) (batch, heads,
    seqlen_q). Varlen: tensors (total_tokens, heads, dim) with sequence b in rows
    [cu_seqlens[b], cu_seqlens[b + 1]), statistics (heads, total_q) as flash-attn returns them;
    seqlen_q / seqlen_k then hold the longest sequence and size the grid only. Paged (varlen with
    a block_table, forward only): k and v are caches (pages, page_size, heads, dim) whose pages
    block_table (batch, max_pages) lists per sequence; cu_seqlens_k then gives key counts only.
    """

    batch: int
    seqlen_q: int
    seqlen_k: int
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    block_table: Optional[torch.Tensor] = None
    page_size: int = 0  # 0: not paged

    @staticmethod
    def of(q, k, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
           block_table=None) -> "SequenceLayout":
        if cu_seqlens_q is None:
            return SequenceLayout(q.shape[0], q.shape[1], k.shape[1])
        page_size = k.shape[1] if block_table is not None else 0
        return SequenceLayout(cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k,
                              block_table, page_size)

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    def strides(self, x: torch.Tensor) -> tuple:
        """(batch, head, row) strides of q/k/v-like ``x``, in kernel argument order."""
        stride = x.stride()
        if self.is_varlen:
            return 0, stride[1], stride[0]
        return stride[0], stride[2], stride[1]

    def kv_strides(self, x: torch.Tensor) -> tuple:
        """``strides`` of k/v-like ``x``; a paged cache's are (page, head, row)."""
        if self.page_size:
            stride = x.stride()
            return stride[0], stride[2], stride[1]
        return self.strides(x)

    def paging(self, k: torch.Tensor) -> tuple:
        """BlockTable, stride_table, num_pages kernel arguments (a stand-in pointer when not paged)."""
        if self.page_size:
            return self.block_table, self.block_table.stride(0), k.shape[0]
        return self.cu_seqlens_k, 0, 0

    def new_row_stats(self, q: torch.Tensor) -> torch.Tensor:
        """An uninitialised fp32 per-query-row statistic (lse, delta) for ``q``."""
        shape = (q.shape[1], q.shape[0]) if self.is_varlen else (q.shape[0], q.shape[2], q.shape[1])
        return torch.empty(shape, dtype=torch.float32, device=q.device)

    def stat_strides(self, stats: torch.Tensor) -> tuple:
        """(batch, head) strides of a contiguous row statistic; its row stride is 1."""
        stride = stats.stride()
        return (0, stride[0]) if self.is_varlen else stride[:2]

    def cu_seqlens(self, q: torch.Tensor, k: torch.Tensor) -> tuple:
        """CuSeqlensQ, CuSeqlensK, total_q, total_k kernel arguments: the cu_seqlens (None for dense
        inputs) and the rows of q and k they may address (``tiles.sequence_span`` clamps each
        sequence into them; 0 when dense). A paged k has no rows to bound: its cu_seqlens counts
        keys, which the forward kernel caps at max_seqlen_k instead."""
        if not self.is_varlen:
            return None, None, 0, 0
        return self.cu_seqlens_q, self.cu_seqlens_k, q.shape[0], INT32_MAX if self.page_size else k.shape[0]

    def seqlens(self) -> tuple:
        """seqlen_q, seqlen_k kernel arguments: the lengths, or the longest ones for varlen."""
        return self.seqlen_q, self.seqlen_k
