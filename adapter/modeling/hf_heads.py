"""The loop's calls on transformers' classification models (the transformers engine): a reward model's sequence
scores and a process reward model's per-token class losses, in place of CausalLMLosses' next-token losses."""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from adapter.modeling import hf_cp
from adapter.patches.hf_masks import documents, prepare


class RewardScores(torch.nn.Module):
    """The loop's call on a reward model (transformers' sequence-classification class, one label): each row's
    score [rows] in fp32, as the model pools it (its last token that is not the pad token). The rows come right-
    padded with the pad token and without an attention mask: a real token attends only to those before it, so
    the pooled token's score is the one TRL gets with its mask."""

    def __init__(self, model, cp: tuple | None = None):
        super().__init__()
        self.model = model
        self.cp = cp  # nd-adapter's attention kernels at cp = 1 (checks.own_attention), as CausalLMLosses runs them

    def forward(self, tokens, position_ids, attention_mask=None, **_):
        with hf_cp.forward(*self.cp, None) if self.cp else nullcontext():
            out = self.model(input_ids=tokens, position_ids=position_ids, use_cache=False)
        return out.logits[:, 0].float()


class TokenClassLosses(torch.nn.Module):
    """A process reward model (transformers' token-classification class, model.num_labels outputs: TRL's
    PRMTrainer): each labelled token's cross-entropy over its classes, in fp32, as transformers' token-
    classification loss computes it. The loop hands every model its next-token layout (adapter/data/sft/bins.py
    shifts the labels one to the left, so `labels[:, t]` is token t+1's class and `loss_mask[:, t]` says whether it
    has one); position t's loss here is therefore token t+1's: its logits against its class. The sum over the loss
    mask, divided by the labelled tokens of the step, is TRL's loss. `hits` holds the last eval-mode forward's
    correctly classified labelled tokens (argmax == class, the eval's accuracy: TRL's compute_accuracy)."""

    def __init__(self, model, cp: tuple | None = None):
        super().__init__()
        self.model = model
        self.cp = cp  # nd-adapter's attention kernels at cp = 1 (checks.own_attention), as CausalLMLosses runs them
        self.hits = None
        prepare(model)  # packed rows' masks, whatever the model hands its mask builders (adapter/patches/hf_masks)

    def forward(self, tokens, position_ids, attention_mask=None, *, labels, loss_mask=None, packed_seq_params=None,
                **_):
        across = hf_cp.forward(*self.cp, packed_seq_params) if self.cp else nullcontext()
        with documents(position_ids), across:  # packed documents attend within themselves, as CausalLMLosses's
            out = self.model(input_ids=tokens, position_ids=position_ids, use_cache=False)
        logits = out.logits[:, 1:].float()
        target = labels[:, :-1]
        loss = torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
        loss[:, :-1] = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view_as(target)
        if loss_mask is not None and not self.training:  # (read by the eval only)
            with torch.no_grad():
                right = (logits.argmax(-1) == target).float() * loss_mask[:, :-1]
                self.hits = right.sum()
        return loss


__all__ = ["RewardScores", "TokenClassLosses"]
