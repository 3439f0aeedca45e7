"""Padding helpers for the varlen functions, with flash-attn's ``bert_padding`` semantics.

``unpad_input`` gathers the tokens a mask keeps from a padded (batch, seqlen, ...) tensor into a
packed (total_tokens, ...) tensor and returns the cu_seqlens / max_seqlen that
``flash_attn_varlen_func`` takes; ``pad_input`` scatters packed rows back, zero-filling padding.
Both are plain differentiable PyTorch indexing (gradients flow through gather and scatter), so they
also trace under torch.compile. ``unpad_input`` reads max_seqlen with one device-to-host copy.

flash-attn's other helpers are here with its signatures, for code that imports them from
``flash_attn.bert_padding`` (compat/): ``index_first_axis`` / ``index_put_first_axis`` (gather
and scatter along dim 0), ``index_first_axis_residual`` (the gather and its detached input) and
``unpad_input_for_concatenated_sequences`` (several samples packed into each row, their lengths in
``attention_mask_in_length``).
"""

import torch
import torch.nn.functional as F


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    """hidden_states (batch, seqlen, ...); attention_mask (batch, seqlen), 1/True = real token;
    unused_mask (batch, seqlen), tokens that are allocated but not attended to (kept in the packed
    tensor and counted in cu_seqlens, but not in seqused).

    Returns (hidden_states (total_tokens, ...), indices (total_tokens,) into the flattened
    (batch * seqlen) axis, cu_seqlens int32 (batch + 1,), max_seqlen int, seqused int32 (batch,)).
    """
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    return (*_packed(hidden_states, indices, seqlens), seqused)


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor):
    """hidden_states (batch, seqlen, ...); attention_mask_in_length (batch, seqlen) ints: row b holds
    the lengths of the samples packed one after another into row b, then zeros. Returns
    (hidden_states (total_tokens, ...), indices, cu_seqlens int32 (samples + 1,), max_seqlen int),
    one varlen sequence per sample."""
    lengths = attention_mask_in_length.sum(dim=-1)
    seqlen = attention_mask_in_length.shape[-1]
    kept = torch.arange(seqlen, device=lengths.device) < lengths.unsqueeze(1)
    sample_lengths = attention_mask_in_length.flatten()
    sample_lengths = sample_lengths[sample_lengths != 0]
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    return _packed(hidden_states, indices, sample_lengths)


def _packed(hidden_states: torch.Tensor, indices: torch.Tensor, lengths: torch.Tensor) -> tuple:
    """(the rows ``indices`` of hidden_states (batch, seqlen, ...) packed, indices, int32
    cu_seqlens of the sequences ``lengths``, the longest of them as an int)."""
    max_seqlen = int(lengths.max().item()) if lengths.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    return index_first_axis(hidden_states.reshape(-1, *hidden_states.shape[2:]), indices), indices, cu_seqlens, max_seqlen


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x[indices] for x of two or more dims (flash-attn's gather of tokens)."""
    return x[indices]


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """A (first_axis_dim, ...) tensor of zeros with ``values`` at rows ``indices``."""
    return values.new_zeros(first_axis_dim, *values.shape[1:]).index_put((indices,), values)


class _IndexFirstAxisResidual(torch.autograd.Function):
    """(x[indices], x as a second output): both outputs' gradients flow back into x."""

    @staticmethod
    def forward(ctx, x, indices):
        ctx.save_for_backward(indices)
        return x[indices], x.detach()

    @staticmethod
    def backward(ctx, grad_gathered, grad_residual):
        (indices,) = ctx.saved_tensors
        return grad_residual.clone().index_add_(0, indices, grad_gathered), None


def index_first_axis_residual(x: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x[indices], x), as flash-attn's fused-dense path takes them: the second output is x's
    values as a separate output, whose gradient is added to x's with the gathered rows'."""
    return _IndexFirstAxisResidual.apply(x, indices)


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """hidden_states (total_tokens, ...) and the indices from ``unpad_input``; returns
    (batch, seqlen, ...) with zeros at the padded positions."""
    padded = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return padded.reshape(batch, seqlen, *hidden_states.shape[1:])
