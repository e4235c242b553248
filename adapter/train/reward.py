"""A reward model's pair terms (`objective: reward`, Axolotl's `reward_model: true`): TRL 1.8.0's RewardTrainer.

A micro-batch of pairs runs as one [2·mb, seq] batch, chosen rows first (TRL's DataCollatorForPreference lays them out
so), through transformers' sequence-classification model with one label (adapter/modeling/hf_heads.RewardScores),
which scores each row at its last token that is not the pad token. Per pair, with r_c and r_r the chosen and
rejected rows' scores: loss −log σ(r_c − r_r), plus `reward.center_coefficient` · (r_c + r_r)² where set (TRL's
center_rewards_coefficient: its mean of the squared sums over the batch is the mean of these per-pair terms). The
step's loss is the mean over all of its pairs, as adapter/train/dpo.py divides every pair objective's sums.

Logged as TRL logs them, means over the step's pairs: accuracy (r_c > r_r), margin (r_c − r_r) and mean_reward
(the mean of all the step's scores); min_reward and max_reward are each micro-batch's extremes over every
data-parallel rank's scores (TRL gathers each batch's scores), averaged over the step's micro-batches. The loop
reduces metrics as sums over pairs, so each pair carries its micro-batch's extremes: the sum over a micro-batch's
pairs, divided by the pairs, is the mean over micro-batches (each rank takes as many pairs to a micro-batch).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def scores(ds, batch) -> torch.Tensor:
    """[rows] scores of a `flat` micro-batch on the device."""
    out = ds(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], loss_mask=batch["loss_mask"])
    if out.dim() != 1:
        raise RuntimeError("a reward objective needs one score per row; the model returned another shape")
    return out


def reward_terms(cfg, ds, batch, group=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair loss with its graph [m], zeros [m] (no NLL term), zeros [m], per-pair metrics [m, 5] in
    preference_losses.PAIR_METRICS["reward"]'s order): adapter/train/dpo.pair_terms' contract. `group`: the
    data-parallel ranks whose micro-batches make TRL's batch (its min and max are over all of their scores)."""
    out = scores(ds, batch)
    chosen, rejected = out.chunk(2)
    losses = -F.logsigmoid(chosen - rejected)
    c = cfg.reward.center_coefficient
    if c is not None:
        losses = losses + c * (chosen + rejected) ** 2
    rc, rr = chosen.detach(), rejected.detach()
    extremes = torch.stack([-out.detach().min(), out.detach().max()]).float()
    if dist.is_initialized() and dist.get_world_size(group) > 1:  # (tp peers hold the same scores)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    stats = torch.stack([(rc > rr).float(), rc - rr, (rc + rr) / 2, (-extremes[0]).expand_as(rc),
                         extremes[1].expand_as(rc)], 1)
    none = torch.zeros_like(rc)
    return losses, none, none, stats


__all__ = ["scores", "reward_terms"]
