"""flash-attention: pure-Triton FlashAttention for the Kernel Hub.

Load with ``kernels.get_kernel("<org>/flash-attention", version=1)``. The public API follows
flash-attn 2 (``flash_attn_func``) and the kernels-community ``flash_attention_forward``; all
functions are differentiable and work under torch.compile(fullgraph=True). ``ops`` is this build's
torch.ops namespace, holding the ``fwd`` and ``bwd`` ops.

Layers of the package:
* ``interface.py``: public functions, argument checks.
* ``torch_ops.py``: the ``fwd``/``bwd`` torch ops (torch.library.triton_op) and their autograd formula.
* ``flash_attention_kernel/``: the Triton kernels and launchers (copied from the repository's
  top-level ``flash_attention_kernel/`` at build time).
"""

from ._ops import ops
from .interface import flash_attention_forward, flash_attn_func

__all__ = ["flash_attention_forward", "flash_attn_func", "ops"]
