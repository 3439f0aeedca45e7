"""Experimental: PyTorch's own context parallelism, running this package's kernel on every block.

``torch.distributed.tensor.experimental.context_parallel`` shards the sequence across the ranks
of a device mesh and, inside its context, turns each ``F.scaled_dot_product_attention`` call into
a ring: SDPA's inputs become DTensors sharded on the sequence, and the DTensor dispatcher hands
SDPA's aten ops to handlers from a table (``_context_parallel._attention.custom_ops``, read when
the context is entered) that run torch's templated ring (``_templated_ring_attention`` and its
backward: rotate the key/value blocks, attend, merge by logsumexp) around the local SDPA op.
Torch's table covers only SDPA's own backends. ``kernels_in_torch_context_parallel()`` puts
handlers for SDPA's flash ops (``_scaled_dot_product_flash_attention`` on GPUs,
``_scaled_dot_product_flash_attention_for_cpu`` on the CPU) into that table for its ``with``
block, so that the same templated ring runs this package's kernel at every step, through
flash-attn's private entry points (entry_points.py: the backward takes the ring's merged output
and logsumexp). Enter it before ``context_parallel``:

    with fa.kernels_in_torch_context_parallel(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)

No torch code is changed: the handlers go into torch's table and are taken out again. The table,
the templated ring and their signatures are private to torch (checked at entry: a torch without
them is a RuntimeError naming what is missing), hence experimental. The handlers take what SDPA's
flash ops take without an attention mask and without dropout (NotImplementedError otherwise, as
a ring cannot regenerate each step's dropout mask); torch's ring itself needs causal calls for its
default load balancing (``_cp_options.enable_load_balance``; non-causal calls need it off).
"""

import contextlib

import torch

from .entry_points import FLASH_ATTN_DTYPES, _flash_attn_backward, _flash_attn_forward

SEQ_DIM = 2  # SDPA's (batch, heads, seqlen, headdim), as torch's ring takes it


def _torch_ring():
    """torch's private context-parallel module, with the names the handlers use."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError as error:
        raise RuntimeError(f"kernels_in_torch_context_parallel needs torch's context parallelism "
                           f"(torch.distributed.tensor.experimental._context_parallel, torch 2.9 and newer): "
                           f"{error}") from error
    for name in ("custom_ops", "_templated_ring_attention", "_templated_ring_attention_backward"):
        if not hasattr(_attention, name):
            raise RuntimeError(f"kernels_in_torch_context_parallel: torch {torch.__version__} has no "
                               f"_context_parallel._attention.{name}, which this experimental route uses")
    return _attention, DTensor


@contextlib.contextmanager
def kernels_in_torch_context_parallel():
    """Within this block, torch's context_parallel runs this package's kernel (module docstring)."""
    ring, _ = _torch_ring()
    aten = torch.ops.aten
    handlers = {
        aten._scaled_dot_product_flash_attention.default: _forward_handler,
        aten._scaled_dot_product_flash_attention_backward.default: _backward_handler,
        aten._scaled_dot_product_flash_attention_for_cpu.default: _forward_handler,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _backward_handler,
    }
    saved = {op: ring.custom_ops[op] for op in handlers if op in ring.custom_ops}
    ring.custom_ops.update(handlers)
    try:
        yield
    finally:
        for op in handlers:
            ring.custom_ops.pop(op, None)
        ring.custom_ops.update(saved)


def _arguments(op_call, args, kwargs) -> dict:
    """The op's arguments by schema name, defaults filled in."""
    bound = {}
    for index, argument in enumerate(op_call._schema.arguments):
        if index < len(args):
            bound[argument.name] = args[index]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
        else:
            bound[argument.name] = None
    if bound.get("attn_mask") is not None:
        raise NotImplementedError("kernels_in_torch_context_parallel: no attn_mask (SDPA's flash ops take none on GPUs)")
    if bound.get("dropout_p"):
        raise NotImplementedError("kernels_in_torch_context_parallel: no dropout (a ring cannot regenerate each "
                                  "step's dropout mask in its backward)")
    return bound


def _forward_handler(op_call, args, kwargs):
    ring, DTensor = _torch_ring()
    bound = _arguments(op_call, args, kwargs)
    query = bound["query"]
    mesh, placements = query.device_mesh, query.placements
    local = [bound[name].to_local() for name in ("query", "key", "value")]
    out, lse = ring._templated_ring_attention(mesh.get_group(), SEQ_DIM, _step, *local, is_causal=bound["is_causal"],
                                              scale=bound["scale"])[:2]
    out, lse = (DTensor.from_local(x, mesh, placements, run_check=False) for x in (out, lse))
    if op_call is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
        return out, lse
    # the GPU op's other results, which only its backward reads (and this package's ignores):
    # cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask
    empty = local[0].new_empty(0)
    seqlen_q, seqlen_k = query.shape[SEQ_DIM], bound["key"].shape[SEQ_DIM]
    state = local[0].new_empty(2, dtype=torch.int64)
    return out, lse, empty, empty, seqlen_q, seqlen_k, state, state, empty


def _backward_handler(op_call, args, kwargs):
    ring, DTensor = _torch_ring()
    bound = _arguments(op_call, args, kwargs)
    query = bound["query"]
    mesh, placements = query.device_mesh, query.placements
    local = {name: bound[name].to_local() for name in ("grad_out", "query", "key", "value", "out", "logsumexp")}
    grads = ring._templated_ring_attention_backward(mesh.get_group(), SEQ_DIM, _step_backward, grad_out_name="grad_out",
                                                    is_causal=bound["is_causal"], scale=bound["scale"], **local)[:3]
    return tuple(DTensor.from_local(grad, mesh, placements, run_check=False) for grad in grads)


def _step(query, key, value, is_causal, scale=None, **_):
    """One ring step in SDPA's layout: (out, lse) of this block of keys."""
    if query.dtype not in FLASH_ATTN_DTYPES:  # (the entry points refuse it too; this says why for this route)
        raise TypeError(f"kernels_in_torch_context_parallel: SDPA's inputs must be float16 or bfloat16 for this "
                        f"kernel's ring, got {query.dtype} (its backward reads the ring's merged output, which "
                        f"the fp32 path cannot)")
    out, lse, _, _ = _flash_attn_forward(*(x.transpose(1, 2) for x in (query, key, value)), 0.0, scale, is_causal, -1, -1,
                                         0.0, None, False)
    return out.transpose(1, 2), lse


def _step_backward(query, key, value, out, logsumexp, is_causal, grad_out, scale=None, **_):
    """One ring step's gradients in SDPA's layout, from the ring's merged out and logsumexp."""
    grads = [torch.empty(x.transpose(1, 2).shape, dtype=x.dtype, device=x.device) for x in (query, key, value)]
    _flash_attn_backward(*(x.transpose(1, 2) for x in (grad_out, query, key, value, out)), logsumexp, *grads, 0.0,
                         scale, is_causal, -1, -1, 0.0, None, False)
    return tuple(grad.transpose(1, 2) for grad in grads)
