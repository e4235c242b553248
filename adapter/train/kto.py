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

The eval (val_set_size / test_datasets) is TRL's `evaluate` with per_device_eval_batch_size = micro_batch_size
(Axolotl's eval_batch_size default): the held-out rows in order, their KL rows rotated inside consecutive chunks of
micro_batch_size rows (TRL builds them with the training batch size, the same number), a round of dp chunks, chunk r
on DP rank r (accelerate's eval sharding); per round the KL estimate is the mean over the round's rows, clamped at 0,
and each metric the round's value as in training; eval_loss is the mean of every held-out row's loss (HF repeats
each batch's mean once per row) and every other metric the mean over rounds (TRL's log). A last round short of
dp × micro_batch_size rows counts only its rows, as a single TRL process's short last batch (accelerate pads it
across processes with rows from the start). `eval_table`: a full fine-tune's reference of the held-out rows.

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
    stats = _stats(kl.double(), *sums[1:7])
    return local, stats / dp  # the trainer sums them over the DP ranks, which hold the same values


def _stats(kl, nc, nr, rc, rr, lc, lr) -> torch.Tensor:
    """One batch's (a step's micro-batch round, or an eval round's: then each argument a column over the rounds)
    TRL metrics as `step_metrics` sums them: [1, kl, has chosen, rewards/chosen, logps/chosen, has rejected,
    rewards/rejected, logps/rejected, has both, margin], from the KL estimate, the desirable / undesirable rows'
    counts and their sums of rewards (rc, rr) and log-probabilities (lc, lr); a side without rows counts nowhere."""
    hc, hr = (nc > 0).double(), (nr > 0).double()
    c_mean, r_mean = rc / nc.clamp(min=1), rr / nr.clamp(min=1)
    return torch.stack([torch.ones_like(nc), kl, hc, hc * c_mean, hc * lc / nc.clamp(min=1), hr, hr * r_mean,
                        hr * lr / nr.clamp(min=1), hc * hr, hc * hr * (c_mean - r_mean)], -1)


def eval_chunks(n: int, dp: int, mb: int, dp_rank: int) -> list[list[int]]:
    """This DP rank's held-out rows in each eval round: chunk round·dp + dp_rank of `mb` rows in order (fewer, or
    none, in a short last round)."""
    return [list(range(lo, min(lo + mb, n))) for lo in range(dp_rank * mb, -(-n // (dp * mb)) * dp * mb, dp * mb)]


def _rounds(t, logps, batch_of, reference: bool):
    """Per eval round of trainer `t`: ([rows, 5] pol, ref, pol_kl, ref_kl, label of this rank's rows, or None where
    it has none; their indices). Every DP rank runs the same forwards (ZeRO-3's gathers are collective): a rank
    without rows runs row 0 and keeps nothing. The reference (`reference`): a full fine-tune's table (`eval_table`,
    t.val_ref), else the base with the adapters disabled; without it, the policy's values stand in. `batch_of(items)`:
    dataset items as the loop's device batch, their KL rows (`rows`) beside them (adapter/train/dpo.py's)."""
    val, ds, mb = t.val_dataset, t.engine.ds, t.cfg.batch.micro_batch_size
    for idx in eval_chunks(len(val), t.layout.dp, mb, t.layout.data_rank(t.rank)):
        b = batch_of([val[i] for i in idx or [0]])
        m = b["tokens"].shape[0] // 2
        own, kl_rows = {k: v[:m] for k, v in b.items()}, {k: v[m:] for k, v in b.items()}
        pol, pol_kl = logps(ds, own), logps(ds, kl_rows)
        ref, ref_kl = pol, pol_kl
        if reference and t.val_ref is not None:
            ref, ref_kl = (t.val_ref[own["pair"][:, 0], j].to(pol.dtype) for j in (0, 1))
        elif reference:
            with ds.module.model.disable_adapter():  # PEFT's model (adapter/modeling/hf_build.CausalLMLosses)
                ref, ref_kl = logps(ds, own), logps(ds, kl_rows)
        label = own["kto_label"][:, 0].to(pol.dtype)
        yield (torch.stack([pol, ref, pol_kl, ref_kl, label], 1) if idx else None), own["pair"][:, 0]


def eval_table(t, logps, batch_of) -> torch.Tensor:
    """[held-out rows, 2] the starting weights' log-probabilities of each held-out row's completion and of its KL
    row: a full fine-tune's eval reference (t.val_ref), computed before step 1 with the training rows' table."""
    table = torch.zeros(len(t.val_dataset), 2, dtype=torch.float64, device=t.device)
    t.engine.ds.eval()
    try:
        with torch.no_grad():
            for vals, ids in _rounds(t, logps, batch_of, reference=False):
                if vals is not None:
                    table[ids] = vals[:, [0, 2]].double()
    finally:
        t.engine.ds.train()
    dist.all_reduce(table, group=t.groups.dp)  # each row written by the one DP rank that holds it
    return table


def evaluate(t, logps, batch_of) -> tuple[float | None, int, dict[str, float]]:
    """(eval_loss, held-out rows, {metric: value}) of trainer `t` over its held-out rows, as TRL evaluates KTO (the
    module docstring). `logps(ds, batch)`: each row's summed completion log-probability; `batch_of`: `_rounds`'."""
    beta, rounds = t.cfg.kto.beta, []
    t.engine.ds.eval()
    try:
        with torch.no_grad():
            for vals, _ in _rounds(t, logps, batch_of, reference=True):
                v = torch.zeros(0, 5, device=t.device) if vals is None else vals
                v = v.double()
                kl = torch.stack([(v[:, 2] - v[:, 3]).sum(), v.new_tensor(float(len(v)))])
                dist.all_reduce(kl, group=t.groups.dp)  # over the round's rows, on every DP rank
                z = (kl[0] / kl[1]).clamp(min=0)
                good = v[:, 4] > 0.5
                r, g, b = beta * (v[:, 0] - v[:, 1]), good.double(), (~good).double()
                sums = torch.stack([loss_of(t.cfg, v[:, 0] - v[:, 1], good, z).sum(), v.new_tensor(float(len(v))),
                                    g.sum(), b.sum(), r @ g, r @ b, v[:, 0] @ g, v[:, 0] @ b])
                dist.all_reduce(sums, group=t.groups.dp)
                rounds.append(torch.cat([sums, z[None]]))
    finally:
        t.engine.ds.train()
    t.clock.reset()  # evaluation is not training time
    a = torch.stack(rounds).cpu()  # per round: loss, rows, nc, nr, rc, rr, lc, lr, kl
    stats = _stats(a[:, 8], *a[:, 2:8].unbind(1))
    count = float(a[:, 1].sum())
    return (float(a[:, 0].sum()) / count if count else None), int(count), step_metrics(stats.sum(0).tolist())


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


__all__ = ["METRICS", "KEYS", "rows", "reference_table", "eval_chunks", "eval_table", "evaluate", "step_terms",
           "step_metrics", "loss_of"]
