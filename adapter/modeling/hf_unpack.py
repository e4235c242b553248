"""Packed samples through a model with recurrent layers: each packed document runs as its own row of a padded batch.

transformers confines attention to each packed document by its positions (adapter/patches/hf_masks.py), but a
linear-attention, state-space or short-convolution layer (Qwen3-Next's gated delta net, Mamba, LFM2's conv) carries
its state from one document into the next: packed, the second document would be conditioned on the first. Axolotl's
`sample_packing` means each document is trained on its own, as if it were alone. So, for these models only, a
micro-batch of packed rows [b, s] is cut at its document starts (positions restarting at 0) into one row per
document, right-padded to the longest ([n, L]), run as one batch, and its per-token losses put back where the packed
row had them. Exact for every causal layer: a right pad is never seen by the tokens before it, and each row starts
from a zero state as the document alone would. Documents without a trained token (the bin's padded tail) are
dropped, but never all of them (every rank runs one forward per micro-batch: ZeRO-3's gathers are collective).

It costs the padding up to the micro-batch's longest document instead of none; the bins stay Axolotl's (the same
documents in each step, the same normalisation). The fused varlen kernels some of these layers have (flash-linear-
attention's `cu_seqlens`) would avoid that padding on CUDA, but not every recurrent layer of transformers takes them.
"""
from __future__ import annotations

import torch


def documents_of(position_ids: torch.Tensor, loss_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [n, L] into the flattened [b·s] micro-batch, valid [n, L]) of its documents with a trained token, each
    a row from its first position, right-padded (pads index the row's own first token: any token would do)."""
    b, s = position_ids.shape
    flat = position_ids.reshape(-1)
    starts = flat == 0
    starts[::s] = True  # a row always starts a document (a sample cut mid-document restarts there too)
    first = starts.nonzero().squeeze(1)
    length = torch.diff(first, append=first.new_tensor([b * s]))
    if loss_mask is not None:
        doc = torch.cumsum(starts.long(), 0) - 1
        trained = torch.zeros(len(first), device=flat.device).index_add_(0, doc, (loss_mask.reshape(-1) > 0).float())
        keep = trained > 0
        if not bool(keep.any()):
            keep[0] = True
        first, length = first[keep], length[keep]
    span = torch.arange(int(length.max()), device=flat.device)
    valid = span[None, :] < length[:, None]
    index = torch.where(valid, first[:, None] + span[None, :], first[:, None])
    return index, valid


def is_packed(position_ids: torch.Tensor) -> bool:
    """More than one document in some row (a restart of the positions after the row's first token)."""
    return bool((position_ids[:, 1:] == 0).any())


def unpack(index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[b, s] -> [n, L] by `documents_of`'s index."""
    return x.reshape(-1)[index]


def repack(index: torch.Tensor, valid: torch.Tensor, y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """[n, L] per-token values back to the packed [b, s] (zeros where no kept document is), differentiably."""
    out = y.new_zeros(shape.numel())
    return out.index_put((index[valid],), y[valid]).view(shape)


__all__ = ["documents_of", "is_packed", "unpack", "repack"]
