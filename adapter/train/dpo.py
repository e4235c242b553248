"""DPO's step on the transformers engine: TRL 1.8.0's sigmoid loss over preference pairs, the reference being the
base with PEFT's adapters disabled (no second copy of the model).

A micro-batch of pairs ([mb, 2, seq] from adapter/data/sft/preference.py) runs as one [2·mb, seq] batch, chosen rows
first, as TRL's collator lays it out. Each row's log-probability is Σ over its completion tokens of log p(token), the
per-token cross-entropy the loop's model returns, negated and summed under the completion mask. The reference runs
first, inside `disable_adapter()` and without gradients, then the policy. Per pair, with Δ = (chosen − ref chosen) −
(rejected − ref rejected): loss −log σ(β·Δ), rewards β·(policy − reference) of each answer. The step's loss is the
mean over all of its pairs (every micro-batch and data-parallel rank): TRL's mean over its batch when that batch is
the step's global batch. The loop divides each micro-batch's sum by the step's pair count, as it divides SFT's
token sums by the step's trained tokens (adapter/train/trainer.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# the reward metrics TRL logs, in the order of the device vector that carries their sums
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def flat(batch: dict) -> dict:
    """[mb, 2, seq] pairs -> [2·mb, seq] rows: every chosen row, then every rejected one (TRL's order)."""
    return {k: v.transpose(0, 1).reshape(-1, *v.shape[2:]) for k, v in batch.items()}


def _logps(ds, batch) -> torch.Tensor:
    out = ds(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], loss_mask=batch["loss_mask"])
    if out.dim() == 0:
        raise RuntimeError("DPO needs per-token losses; the model returned a summed loss")
    return -(out.float() * batch["loss_mask"]).sum(1)


def pair_sums(ds, batch, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ per-pair loss with its graph, the sums of METRICS) of one micro-batch on the device (a `flat` batch)."""
    peft_model = ds.module.model  # adapter/modeling/hf_build.CausalLMLosses holds PEFT's model
    with torch.no_grad(), peft_model.disable_adapter():
        ref = _logps(ds, batch)
    pol = _logps(ds, batch)
    chosen, rejected = pol.chunk(2)
    ref_chosen, ref_rejected = ref.chunk(2)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    rc, rr = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    stats = torch.stack([rc.sum(), rr.sum(), (rc > rr).float().sum(), (rc - rr).sum(), chosen.detach().sum(),
                         rejected.detach().sum()]).double()
    return losses.sum(), stats


def line(values) -> str:
    """The metrics on the step's log line."""
    return " | ".join(f"{k} {v:.4f}" for k, v in zip(METRICS, values))


__all__ = ["METRICS", "flat", "pair_sums", "line"]
