"""flash-attn's ``flash_attn_interface`` module on this package: its public functions and the
private entry points with their ``_wrapped_`` names (compat/entry_points.py documents their
contracts). Code that looks functions up by that path on a loaded kernel finds them here, e.g.
diffusers' FLASH_HUB backend (``flash_attn_interface._wrapped_flash_attn_forward`` / ``_backward``)
pointed at this kernel's repo; ``install_as_flash_attn`` serves the same module as
``flash_attn.flash_attn_interface``."""

from .compat.entry_points import (
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
    _wrapped_flash_attn_backward,
    _wrapped_flash_attn_forward,
    _wrapped_flash_attn_varlen_backward,
    _wrapped_flash_attn_varlen_forward,
)
from .interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .kvcache import flash_attn_with_kvcache

__all__ = [
    "_flash_attn_backward",
    "_flash_attn_forward",
    "_flash_attn_varlen_backward",
    "_flash_attn_varlen_forward",
    "_wrapped_flash_attn_backward",
    "_wrapped_flash_attn_forward",
    "_wrapped_flash_attn_varlen_backward",
    "_wrapped_flash_attn_varlen_forward",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
