"""A reward model's pair terms (`objective: reward`, Axolotl's `reward_model: true`): TRL 1.8.0's RewardTrainer.

A micro-batch of pairs runs as one [2·mb, seq] batch, chosen rows first (TRL's DataCollatorForPreference lays them out
so), through transformers' sequence-classification model with one label (adapter/modeling/hf_build.RewardScores),
which scores each row at its last token that is not the pad token. Per pair, with r_c and r_r the chosen and
rejected rows' scores: loss −log σ(r_c − r_r), plus `reward.center_coefficient` · (r_c + r_r)² where set (TRL's
center_rewards_coefficient: its mean of the squared sums over the batch is the mean of these per-pair terms). The
step's loss is the mean over all of its pairs, as adapter/train/dpo.py divides every pair objective's sums.

Logged as TRL logs them, means over the step's pairs: accuracy (r_c > r_r), margin (r_c − r_r) and mean_reward
(the mean of all the step's scores). TRL's min_reward and max_reward (extremes of each batch, averaged over the
logging window) are not logged: the loop reduces its metrics as sums over pairs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def scores(ds, batch) -> torch.Tensor:
    """[rows] scores of a `flat` micro-batch on the device."""
    out = ds(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], loss_mask=batch["loss_mask"])
    if out.dim() != 1:
        raise RuntimeError("a reward objective needs one score per row; the model returned another shape")
    return out


def reward_terms(cfg, ds, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair loss with its graph [m], zeros [m] (no NLL term), zeros [m], per-pair metrics [m, 3] in
    preference_losses.PAIR_METRICS["reward"]'s order): adapter/train/dpo.pair_terms' contract."""
    chosen, rejected = scores(ds, batch).chunk(2)
    losses = -F.logsigmoid(chosen - rejected)
    c = cfg.reward.center_coefficient
    if c is not None:
        losses = losses + c * (chosen + rejected) ** 2
    rc, rr = chosen.detach(), rejected.detach()
    stats = torch.stack([(rc > rr).float(), rc - rr, (rc + rr) / 2], 1)
    none = torch.zeros_like(rc)
    return losses, none, none, stats


__all__ = ["scores", "reward_terms"]
