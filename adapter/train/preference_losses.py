"""Preference objectives other than DPO's, per pair, from the per-token losses the loop's model returns (the policy's
forward over a `dpo.flat` micro-batch: every chosen row, then every rejected one). adapter/train/dpo.py runs them,
normalises them over the step and evaluates them.

ORPO, as TRL 1.8.0's ORPOTrainer computes it (trl/experimental/orpo/orpo_trainer.py, `odds_ratio_loss` and
`get_batch_loss_metrics`): each answer's log-probability is the *mean* over its completion tokens (average_log_prob);
log-odds = (c − r) − (log(1 − e^c) − log(1 − e^r)); the pair's term is −α·log σ(log-odds) (α: TRL's `beta`, which
Axolotl fills from `orpo_alpha`); the loss adds the chosen sequences' next-token cross-entropy over every token of
them, prompt included (TRL: labels = input_ids where attended), averaged over those tokens. No reference model.
Logged: rewards/chosen and /rejected = α·c and α·r, rewards/accuracies, rewards/margins, logps/chosen and /rejected
(the means c, r), nll_loss, log_odds_ratio (the mean of log σ(log-odds)) and log_odds_chosen (the mean log-odds);
TRL's logits/chosen and /rejected (means over padded [batch, seq, vocab] logits, so they depend on its padding) are
not. Normalisation: TRL averages over its batch; nd-adapter over the optimizer step's global batch (the pairs' terms
over its pairs, the NLL over its chosen tokens), which is TRL's when its batch is the step's (one process, no
gradient accumulation), as for DPO.

IPO (TRL 1.8.0's DPOTrainer, loss_type ipo) is DPO's forward with another per-pair loss (`ipo_losses`, run from
dpo.pair_terms): each answer's log-ratio policy/reference divided by its completion's token count, then
(Δ − 1/(2β))². Rewards and logps are DPO's (β·ratio of the sums; the summed log-probabilities).

SimPO (TRL 1.8.0's CPOTrainer, loss_type simpo; trl/experimental/cpo/cpo_trainer.py `cpo_loss`,
`concatenated_forward`, `get_batch_loss_metrics`): like ORPO, no reference and each answer's log-probability the mean
over its completion tokens (average_log_prob for ipo/simpo); per pair −log σ(β·(c − r) − γ) (TRL: logits − γ/β,
times β; label smoothing 0, Axolotl passes none); the loss adds cpo_alpha × the chosen sequences' next-token
cross-entropy over their *completion* tokens only (TRL's labels are −100 over the prompt), averaged over those tokens
(0, and nll_loss logged 0, when cpo_alpha is 0). Logged: rewards/* (β·c, β·r), logps/* (the means), nll_loss; TRL's
logits/* (means over padded logits) are not.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")
# per-pair metrics (means over pairs), then the token-level ones the step vector carries as sums and counts
PAIR_METRICS = {"dpo": DPO_METRICS, "ipo": DPO_METRICS, "orpo": (*DPO_METRICS, "log_odds_ratio", "log_odds_chosen"),
                "simpo": DPO_METRICS,
                "reward": ("accuracy", "margin", "mean_reward", "min_reward", "max_reward")}  # adapter/train/reward.py
TOKEN_METRICS = {"dpo": (), "ipo": (), "orpo": ("nll_loss",), "simpo": ("nll_loss",), "reward": ()}
# which chosen tokens an objective's NLL covers: ORPO every token of the sequence, CPO/SimPO the completion's
NLL_MASK = {"orpo": "seq_mask", "simpo": "loss_mask"}


def nll_weight(cfg) -> float:
    """The weight of an objective's NLL term in its loss (ORPO 1, SimPO cpo_alpha; 0 without one)."""
    return {"orpo": 1.0, "simpo": cfg.simpo.cpo_alpha}.get(cfg.objective, 0.0)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − e^x) for x < 0, TRL's stable form (branch at −ln 2)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_terms(out: torch.Tensor, batch: dict, alpha: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair odds-ratio term [m] with its graph, chosen NLL sums [m] with their graph, chosen token counts [m],
    per-pair metrics [m, 8] in PAIR_METRICS["orpo"]'s order) from per-token losses `out` [2m, seq]."""
    mask = batch["loss_mask"]
    avg = -(out * mask).sum(1) / mask.sum(1)
    c, r = avg.chunk(2)
    m = c.shape[0]
    log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
    ratio = F.logsigmoid(log_odds)
    seq = batch["seq_mask"][:m]
    nll, tokens = (out[:m] * seq).sum(1), seq.sum(1)
    rc, rr = alpha * c.detach(), alpha * r.detach()
    stats = torch.stack([rc, rr, (rc > rr).float(), rc - rr, c.detach(), r.detach(), ratio.detach(),
                         log_odds.detach()], 1)
    return -alpha * ratio, nll, tokens, stats


def ipo_losses(chosen_ratio: torch.Tensor, rejected_ratio: torch.Tensor, mask: torch.Tensor, beta: float
               ) -> torch.Tensor:
    """IPO's per-pair loss from DPO's log-ratios [m] and the `flat` batch's completion mask [2m, seq]."""
    n_c, n_r = mask.sum(1).clamp(min=1.0).chunk(2)
    return ((chosen_ratio / n_c - rejected_ratio / n_r) - 1 / (2 * beta)) ** 2


def simpo_terms(out: torch.Tensor, batch: dict, cfg
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair SimPO term [m] with its graph, chosen completion NLL sums [m] with their graph, their token counts
    [m], per-pair metrics [m, 6] in PAIR_METRICS["simpo"]'s order) from per-token losses `out` [2m, seq]."""
    beta, gamma = cfg.simpo.beta, cfg.simpo.gamma
    mask = batch["loss_mask"]
    avg = -(out * mask).sum(1) / mask.sum(1)
    c, r = avg.chunk(2)
    m = c.shape[0]
    losses = -F.logsigmoid(beta * ((c - r) - gamma / beta))
    nll, tokens = (out[:m] * mask[:m]).sum(1), mask[:m].sum(1)
    if cfg.simpo.cpo_alpha == 0:  # TRL: nll_loss = 0, not computed
        nll = nll * 0
    rc, rr = beta * c.detach(), beta * r.detach()
    stats = torch.stack([rc, rr, (rc > rr).float(), rc - rr, c.detach(), r.detach()], 1)
    return losses, nll, tokens, stats


__all__ = ["DPO_METRICS", "PAIR_METRICS", "TOKEN_METRICS", "NLL_MASK", "nll_weight", "log1mexp", "orpo_terms",
           "ipo_losses", "simpo_terms"]
