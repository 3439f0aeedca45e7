"""Which backward calls the fused Gluon backward for mma.sync GPUs takes, decided without importing Gluon.

``ampere_backward`` computes dK, dV and dQ in one kernel, dQ by fp32 atomics (FlashAttention-2's
backward), where the tl backward runs two kernels and recomputes P and dP for dQ. Its sums are not
bitwise repeatable, so it takes only calls that do not ask for determinism (``deterministic=False``,
flash-attn's default, and ``torch.use_deterministic_algorithms`` off); the others keep the tl
kernels, whose every gradient is repeatable.

``chosen`` asks: the kernels enabled (``hopper_route.gluon_setting``: FLASH_ATTENTION_GLUON not
"0", a Triton in hopper_route.CHECKED_VERSIONS unless it is "1"), no override of a backward pass
(configs.set_override: the override's kernel runs), and the call ``fits``. Its module is imported
on first use like the Hopper kernels' (``hopper_route.load_kernel_module``: one warning and the tl
kernels where a Triton's Gluon cannot build it).
"""

import torch
from torch._subclasses.fake_tensor import is_fake

from . import configs
from .hopper_route import BACKWARD_MIN_SEQLEN_K, gluon_setting, load_kernel_module
from .launch import SequenceLayout, device_gpu_class
from .options import MASK_RIGHT, SINKS, AttentionOptions

# The options it applies: causal masking (the window (-1, 0)) or none, and sinks (through the
# lse); a window, softcap, ALiBi or dropout keep the tl kernels
OPTION_BITS = MASK_RIGHT | SINKS
WINDOWS = ((-1, -1), (-1, 0))


def chosen(options: AttentionOptions, layout: SequenceLayout, interpreted: bool, tensors) -> bool:
    """Whether the fused backward runs this call (``tensors``: q, k, v, dout) (module docstring)."""
    if options.deterministic or torch.are_deterministic_algorithms_enabled():
        return False
    setting = gluon_setting()
    if setting is None:
        return False
    if any(configs.overridden_implementation(kernel) is not None for kernel in ("bwd_dq", "bwd_dkdv")):
        return False
    return fits(options, layout, interpreted, tensors) and (setting == "1" or layout.seqlen_k >= BACKWARD_MIN_SEQLEN_K)


def fits(options: AttentionOptions, layout: SequenceLayout, interpreted: bool, tensors) -> bool:
    """Whether the fused backward can run this call: a GPU class and head dim configs.FUSED_BACKWARD
    has tiles for (the A100 class at d64 and d128: 160 KB of shared memory, where the RTX class
    has 99; other head dims keep the tl kernels), dense bf16 or fp16, full tiles, no option beyond
    causal masking and sinks, tensors whose rows cp.async reads 16 bytes at a time
    (``_copies_rows``), compiled (not interpreted, not traced by torch.compile: the graph keeps
    the tl kernels)."""
    if interpreted or any(is_fake(x) for x in tensors):
        return False
    q = tensors[0]
    if (options.variant & ~OPTION_BITS or options.window not in WINDOWS or layout.is_varlen
            or q.dtype not in (torch.float16, torch.bfloat16)):
        return False
    config = configs.FUSED_BACKWARD.get(gpu_class_name(q.device), {}).get(q.shape[-1])
    if config is None or layout.seqlen_q % config.query_tile or layout.seqlen_k % config.key_tile:
        return False
    return all(_copies_rows(x) for x in tensors)


def _copies_rows(x: torch.Tensor) -> bool:
    """Whether the kernel's cp.async copies can read ``x``'s rows 16 bytes at a time: unit last
    stride, 16-byte aligned, and every other stride a multiple of 16 elements, which Triton
    specialises on (a stride of 8 would compile to copies of one element, which cp.async refuses)."""
    return x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(stride % 16 == 0 for stride in x.stride()[:-1])


def gpu_class_name(device: torch.device):
    """The config class (configs.GPU_CLASSES) of a CUDA device; None for other devices."""
    if device.type != "cuda" or torch.version.hip:
        return None
    return device_gpu_class(device).name


def config(device: torch.device, head_dim: int) -> configs.FusedBackwardConfig:
    """The fused backward's tiles on ``device``'s GPU class at ``head_dim`` (a call ``fits`` there)."""
    return configs.FUSED_BACKWARD[gpu_class_name(device)][head_dim]


def launcher():
    """``ampere_backward.attention_backward_fused``, its module imported on first use; None where
    the installed Triton's Gluon cannot build it."""
    module = load_kernel_module("ampere_backward")
    return module and module.attention_backward_fused
