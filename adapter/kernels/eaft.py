"""Entropy-Aware Focal Training (Axolotl's `use_eaft`; `eaft:`): each token's cross-entropy weighted by the entropy
of the softmax over its k largest logits, raised to alpha, the weight carrying no gradient (Axolotl's
monkeypatch/loss/eaft.py, after LlamaFactory-EAFT). A token the model is unsure about (a flat top-k) weighs more
than one it already predicts sharply. The weighted losses are normalised like plain ones: their sum over the step's
trained tokens, divided by that count (what HF's Trainer hands Axolotl's loss as num_items_in_batch).

Under tensor parallelism each rank holds a slice of the vocabulary: the k largest of every slice, gathered over the
TP group, hold the k largest of the whole row, so the top-k (and the weight) are the unsplit logits' exactly."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def entropy_weights(logits: torch.Tensor, k: int, alpha: float, *, real: int | None = None, group=None,
                    vocab: int | None = None) -> torch.Tensor:
    """(entropy of softmax(top-k logits))^alpha per row of `logits` [..., v_local], fp32, no gradient. `real`: the
    local columns that are real vocabulary (padding columns after them are left out); `group`: the TP group over
    which the vocabulary is split; `vocab`: the whole vocabulary's real size (k is capped at it, as Axolotl caps k
    at the logits' width)."""
    with torch.no_grad():
        x = logits[..., :real] if real is not None else logits
        k = min(k, vocab or x.size(-1))
        top = x.float().topk(min(k, x.size(-1)), dim=-1).values
        if top.size(-1) < k:  # a slice with fewer real columns than k (the padded end of the vocabulary)
            top = F.pad(top, (0, k - top.size(-1)), value=float("-inf"))
        if group is not None and dist.get_world_size(group) > 1:
            parts = [torch.empty_like(top) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, top.contiguous(), group=group)
            top = torch.cat(parts, dim=-1).topk(k, dim=-1).values
        p = F.softmax(top, dim=-1)
        return (-(p * torch.log(p + 1e-10)).sum(dim=-1)).pow(alpha)


__all__ = ["entropy_weights"]
