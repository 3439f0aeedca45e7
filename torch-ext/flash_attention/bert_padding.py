"""Padding helpers for the varlen functions, with flash-attn's ``bert_padding`` semantics.

``unpad_input`` gathers the tokens a mask keeps from a padded (batch, seqlen, ...) tensor into a
packed (total_tokens, ...) tensor and returns the cu_seqlens / max_seqlen that
``flash_attn_varlen_func`` takes; ``pad_input`` scatters packed rows back, zero-filling padding.
Both are plain differentiable PyTorch indexing (gradients flow through gather and scatter), so they
also trace under torch.compile. ``unpad_input`` reads max_seqlen with one device-to-host copy.
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
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    packed = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return packed, indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """hidden_states (total_tokens, ...) and the indices from ``unpad_input``; returns
    (batch, seqlen, ...) with zeros at the padded positions."""
    rest = hidden_states.shape[1:]
    padded = hidden_states.new_zeros(batch * seqlen, *rest).index_put((indices,), hidden_states)
    return padded.reshape(batch, seqlen, *rest)
