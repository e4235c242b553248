"""KTO's step on the transformers engine: TRL 1.8.0's KTOTrainer (trl/trainer/kto_trainer.py, loss_type "kto",
`_compute_loss`, `_get_kl_dataset`) on nd-adapter's micro-batches. The objective's config: adapter/config/schema_rl.py.

How TRL's batches map onto nd-adapter's. TRL samples its rows in order (KTOConfig's train_sampling_strategy
"sequential"), builds each row's KL completion once, before training, by rotating the completions by one inside
consecutive chunks of per_device_train_batch_size rows (row i's prompt with row i−1's completion, the chunk's first
row with its last one's), and under accelerate hands per-device batch j to process j mod world. nd-adapter's KTO
rows are sampled in their prepared order too (adapter/train/batches.py: no shuffle), and a round of dp ×
micro_batch_size rows is split over the DP ranks in the same way, so nd-adapter's micro-batch on DP rank r *is*
TRL's per-device batch on process r with micro_batch_size = per_device_train_batch_size (Axolotl passes
micro_batch_size there) and the same gradient accumulation; the KL rows are built from the micro-batch itself
(`rows`). The one place they part: an epoch's tail that does not fill a round of dp × micro_batch_size rows is skipped
here (adapter/data/sampler.py) where TRL trains a short last batch.

Per micro-batch, as TRL's `_compute_loss`: the reference (the base with the LoRA adapters disabled, no gradient;
for a full fine-tune the starting weights' values, computed once before step 1: `reference_table`) of the rows and
of the KL rows, the policy of the KL rows (no gradient) and of the rows; z = the mean over the
micro-batch of policy − reference of the KL rows, then the mean of that over the DP ranks' micro-batches of the
same accumulation step (TRL's gather_for_metrics(kl).mean()), clamped at 0. Per row, r = log-ratio policy/reference
of its completion's summed log-probabilities: desirable rows desirable_weight·(1 − σ(β(r − z))), undesirable ones
undesirable_weight·(1 − σ(β(z − r))); the micro-batch's loss is their mean, and the step's the mean of its
micro-batches' (TRL's loss/GA summed, averaged over processes by DDP).

Logged, as TRL logs them (each micro-batch's values gathered over the DP ranks, then the mean over the step's
micro-batches): kl; rewards/chosen and logps/chosen (Σ over the desirable rows of β·r and of the policy's
log-probability ÷ their count; micro-batches without a desirable row do not count), rewards/rejected and
logps/rejected likewise, rewards/margins (chosen − rejected, micro-batches holding both). Not logged: TRL's
logits/* (sums over padded logits), entropy and num_tokens.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

METRICS = ("kl", "rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected", "rewards/margins")
KEYS = ("kto_prompt", "kto_completion", "kto_len", "kto_label")


def rows(b: dict) -> dict:
    """A host micro-batch of m rows (`dpo.flat` of adapter/data/sft/preference_kto.KTODataset items) -> [2m, seq]:
    the rows, then their KL rows (row i's prompt with row i−1's completion, row 0 with row m−1's, cut at seq)."""
    tok, m, seq = b["tokens"], b["tokens"].shape[0], b["tokens"].shape[1]
    kl_tok = torch.zeros_like(tok)  # any id pads: past a row's end nothing is trained or attended to
    kl_mask = torch.zeros(m, seq, dtype=b["loss_mask"].dtype)
    for i in range(m):
        j = (i - 1) % m
        p, c = int(b["kto_len"][i, 0]), int(b["kto_len"][j, 1])
        ids = torch.cat([b["kto_prompt"][i, :p], b["kto_completion"][j, :c]])[:seq]
        kl_tok[i, :len(ids)] = ids
        kl_mask[i, p:len(ids)] = 1
    labels = torch.cat([kl_tok[:, 1:], kl_tok[:, :1] * 0], 1)
    loss_mask = torch.cat([kl_mask[:, 1:], kl_mask[:, :1] * 0], 1)
    out = {k: torch.cat([b[k], v]) for k, v in (("tokens", kl_tok), ("labels", labels), ("loss_mask", loss_mask),
                                                ("position_ids", b["position_ids"]))}
    out["kto_label"] = torch.cat([b["kto_label"], b["kto_label"]])
    if "pair" in b:  # each row's index, for its KL row too (a full fine-tune's reference table: `reference_table`)
        out["pair"] = torch.cat([b["pair"], b["pair"]])
    return out


def reference_table(ds, dataset, sampler, *, group, batch_of, logps) -> torch.Tensor:
    """[rows, 2] the starting weights' log-probabilities of every row's completion and of its KL row (a full
    fine-tune's reference: TRL keeps a frozen copy of the model; here it is computed once before step 1, as TRL's
    precompute_ref_log_probs). A row's KL row depends on the rows beside it in its micro-batch, which the in-order
    sampler (`sampler`, this DP rank's: a fresh copy of the trainer's) fixes for every epoch at a given layout, so
    each DP rank computes the rows it will train and a resume at another layout computes its own table again.
    `batch_of(items)`: a micro-batch's dataset items as the loop's device batch (`rows` applied); `logps(ds, batch)`:
    each row's summed completion log-probability (both adapter/train/dpo.py's)."""
    from adapter.data.sampler import DPSampler

    n, s = len(dataset), sampler
    order = iter(DPSampler(n, dp_rank=s.dp_rank, dp_size=s.dp_size, micro_batch=s.micro_batch, shuffle=False))
    table = None
    ds.eval()
    try:
        with torch.no_grad():
            for _ in range(s.batches_per_epoch):
                b = batch_of([dataset[i] for i in next(order)])
                lp = logps(ds, b).double()
                if table is None:
                    table = torch.zeros(n, 2, dtype=torch.float64, device=lp.device)
                m = lp.shape[0] // 2
                table[b["pair"][:m, 0]] = torch.stack([lp[:m], lp[m:]], 1)
    finally:
        ds.train()
    assert table is not None
    dist.all_reduce(table, group=group)  # each row written by the one DP rank that trains it
    return table


def step_terms(t, batch, logps) -> tuple[torch.Tensor, torch.Tensor]:
    """(this micro-batch's share of the step's loss with its graph, its metric sums for `step_metrics`) of trainer
    `t`, from a `rows` batch on the device. `logps(ds, batch)`: each row's summed completion log-probability."""
    cfg, ds, dp = t.cfg, t.engine.ds, t.layout.dp
    beta, m = cfg.kto.beta, batch["tokens"].shape[0] // 2
    own = {k: v[:m] for k, v in batch.items()}
    kl_rows = {k: v[m:] for k, v in batch.items()}
    with torch.no_grad():
        if t.ref_table is not None:  # a full fine-tune: the starting weights' (`reference_table`)
            ref, ref_kl = (t.ref_table[own["pair"][:, 0], j].to(torch.float32) for j in (0, 1))
        else:  # LoRA: the base, PEFT's adapters disabled (adapter/modeling/hf_build.CausalLMLosses holds PEFT's model)
            with ds.module.model.disable_adapter():
                ref, ref_kl = logps(ds, own), logps(ds, kl_rows)
        pol_kl = logps(ds, kl_rows)
    pol = logps(ds, own)
    good = batch["kto_label"][:m, 0] > 0.5
    ratio = pol - ref
    rewards = beta * ratio.detach()
    g, b = good.to(rewards.dtype), (~good).to(rewards.dtype)
    sums = torch.stack([(pol_kl - ref_kl).mean(), g.sum(), b.sum(), rewards @ g, rewards @ b, pol.detach() @ g,
                        pol.detach() @ b]).double()
    dist.all_reduce(sums, group=t.groups.dp)  # TRL's gather over processes: the same values on every rank
    kl = (sums[0] / dp).clamp(min=0).to(ratio.dtype)
    local = loss_of(cfg, ratio, good, kl).mean() / (cfg.grad_accum * dp)
    nc, nr = sums[1], sums[2]
    hc, hr = (nc > 0).double(), (nr > 0).double()
    c_mean, r_mean = sums[3] / nc.clamp(min=1), sums[4] / nr.clamp(min=1)
    stats = torch.stack([torch.ones_like(nc), kl.double(), hc, hc * c_mean, hc * sums[5] / nc.clamp(min=1), hr,
                         hr * r_mean, hr * sums[6] / nr.clamp(min=1), hc * hr, hc * hr * (c_mean - r_mean)])
    return local, stats / dp  # the trainer sums them over the DP ranks, which hold the same values


def step_metrics(values) -> dict[str, float]:
    """TRL's logged KTO metrics of a step from `step_terms`' sums over its micro-batches."""
    n, kl, hc, rc, lc, hr, rr, lr, hb, margin = values
    out = {"kl": kl / n}
    if hc > 0.5:
        out.update({"rewards/chosen": rc / hc, "logps/chosen": lc / hc})
    if hr > 0.5:
        out.update({"rewards/rejected": rr / hr, "logps/rejected": lr / hr})
    if hb > 0.5:
        out["rewards/margins"] = margin / hb
    return out


def loss_of(cfg, logratio: torch.Tensor, good: torch.Tensor, kl: torch.Tensor) -> torch.Tensor:
    """Per-row KTO loss: TRL's loss_type "kto" (its Eqn. 7), weighted by the row's label."""
    beta = cfg.kto.beta
    return torch.where(good, cfg.kto.desirable_weight * (1 - F.sigmoid(beta * (logratio - kl))),
                       cfg.kto.undesirable_weight * (1 - F.sigmoid(beta * (kl - logratio))))


__all__ = ["METRICS", "KEYS", "rows", "reference_table", "step_terms", "step_metrics", "loss_of"]
