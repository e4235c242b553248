"""DPO's step on the transformers engine: TRL 1.8.0's sigmoid loss over preference pairs. The reference: for LoRA the
base with PEFT's adapters disabled (no second copy of the model); for a full fine-tune the starting weights, whose
log-probabilities of every pair are computed once before step 1 (TRL's `precompute_ref_log_probs`; before a resumed
checkpoint is loaded, so a resumed run keeps the same reference).

A micro-batch of pairs ([mb, 2, seq] from adapter/data/sft/preference.py) runs as one [2·mb, seq] batch, chosen rows
first, as TRL's collator lays it out. Each row's log-probability is Σ over its completion tokens of log p(token), the
per-token cross-entropy the loop's model returns, negated and summed under the completion mask. The reference runs
first, inside `disable_adapter()` and without gradients, then the policy. Per pair, with Δ = (chosen − ref chosen) −
(rejected − ref rejected): loss −log σ(β·Δ), rewards β·(policy − reference) of each answer. The step's loss is the
mean over all of its pairs (every micro-batch and data-parallel rank): TRL's mean over its batch when that batch is
the step's global batch. The loop divides each micro-batch's sum by the step's pair count, as it divides SFT's
token sums by the step's trained tokens (adapter/train/trainer.py).

The eval (`val_set_size` / `test_datasets`, at the SFT eval's cadence: adapter/train/schedule.py) is TRL's
`evaluate`: no gradients, the same reference (a full fine-tune's held-out pairs get their own table, computed with
the training pairs'), rounds of micro_batch_size pairs per DP rank taken in order, as TRL's eval batches of
per_device_eval_batch_size (Axolotl: micro_batch_size) on every process. eval_loss is the mean over the held-out
pairs (HF's evaluation loop repeats each batch's mean loss per sample); each eval_rewards/* and eval_logps/* metric
is the mean over rounds of the round's mean (TRL logs the mean of the per-batch means it stored), so a short last
round weighs as much as a full one. Where accelerate pads that last batch across processes with pairs from the
start (even_batches), TRL's metrics count those repeats; nd-adapter's round counts only held-out pairs, as a
single-process TRL run does.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
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


def reference_table(ds, dataset, *, dp_rank: int, dp: int, group, micro: int, place) -> torch.Tensor:
    """[pairs, 2] reference log-probabilities (chosen, rejected) of every pair under the current weights, each DP
    rank computing a share (the same number of forwards on every rank: ZeRO-3 gathers are collective)."""
    n = len(dataset)
    per = -(-n // dp)
    mine = list(range(dp_rank * per, (dp_rank + 1) * per))
    table = None
    ds.eval()
    try:
        with torch.no_grad():
            for lo in range(0, per, micro):
                idx = mine[lo:lo + micro]
                items = [dataset[min(i, n - 1)] for i in idx]
                b = place(flat({k: torch.from_numpy(np.stack([it[k] for it in items])) for k in items[0]}))
                lp = _logps(ds, b).double()
                if table is None:
                    table = torch.zeros(per * dp, 2, dtype=torch.float64, device=lp.device)
                rows = torch.tensor(idx, device=lp.device)
                table[rows] = torch.stack(lp.chunk(2), 1)
    finally:
        ds.train()
    assert table is not None
    dist.all_reduce(table, group=group)  # each row written by one DP rank (its TP/CP peers reduce elsewhere)
    return table[:n]


def reference_for(trainer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A full fine-tune's DPO reference tables, of the training pairs and of the held-out ones (adapter/train/
    trainer.py's set-up, before a checkpoint is loaded); None for SFT and for LoRA (whose reference is the base with
    the adapters disabled)."""
    from adapter.train.batches import place

    t = trainer
    if t.cfg.objective != "dpo" or t.run.peft is not None:
        return None, None
    tables = [None if data is None or not len(data) else
              reference_table(t.engine.ds, data, dp_rank=t.layout.data_rank(t.rank), dp=t.layout.dp,
                              group=t.groups.dp, micro=t.cfg.batch.micro_batch_size,
                              place=lambda b: place(t.run, 0, t.device, b))  # the transformers engine runs no cp
              for data in (t.dataset, t.val_dataset)]
    held = f" and of the {len(t.val_dataset)} held-out pairs" if tables[1] is not None else ""
    t._say(f"DPO reference: the starting weights' log-probabilities of the {len(t.dataset)} pairs{held}, computed "
           "once before step 1 (TRL's precompute_ref_log_probs)")
    return tables[0], tables[1]


def pair_terms(ds, batch, beta: float, table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-pair loss with its graph [m], per-pair METRICS [m, 6]) of one micro-batch on the device (a `flat`
    batch). `table`: a full fine-tune's precomputed reference (`reference_table`), else LoRA's adapters are
    disabled."""
    if table is not None:
        ids = batch["pair"][:, 0]
        m = ids.shape[0] // 2
        ref = torch.cat([table[ids[:m], 0], table[ids[m:], 1]]).to(torch.float32)
    else:
        peft_model = ds.module.model  # adapter/modeling/hf_build.CausalLMLosses holds PEFT's model
        with torch.no_grad(), peft_model.disable_adapter():
            ref = _logps(ds, batch)
    pol = _logps(ds, batch)
    chosen, rejected = pol.chunk(2)
    ref_chosen, ref_rejected = ref.chunk(2)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    rc, rr = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    stats = torch.stack([rc, rr, (rc > rr).float(), rc - rr, chosen.detach(), rejected.detach()], 1).double()
    return losses, stats


def pair_sums(ds, batch, beta: float, table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ per-pair loss with its graph, the sums of METRICS) of one micro-batch (`pair_terms` summed)."""
    losses, stats = pair_terms(ds, batch, beta, table)
    return losses.sum(), stats.sum(0)


def evaluate(t) -> tuple[float | None, int, dict[str, float]]:
    """(eval_loss, held-out pairs, {metric: value}) over the whole held-out set of trainer `t`, as TRL evaluates
    (module docstring). Every DP rank runs the same number of rounds (ZeRO gathers are collective); the last
    round's missing pairs are copies of pair 0 that count nowhere."""
    val, mb, layout, ds = t.val_dataset, t.cfg.batch.micro_batch_size, t.layout, t.engine.ds
    n, per_round, dp_rank = len(val), layout.dp * mb, layout.data_rank(t.rank)
    rounds = -(-n // per_round)
    acc = torch.zeros(rounds, 2 + len(METRICS), dtype=torch.float64, device=t.device)  # loss sum, pairs, metrics
    ds.eval()
    try:
        with torch.no_grad():
            for r in range(rounds):
                idx = range(r * per_round + dp_rank * mb, r * per_round + (dp_rank + 1) * mb)
                items = [val[i] if i < n else dict(val[0]) for i in idx]
                b = t._on_device(flat({k: torch.from_numpy(np.stack([it[k] for it in items])) for k in items[0]}))
                losses, stats = pair_terms(ds, b, t.cfg.dpo.beta, t.val_ref)
                w = torch.tensor([float(i < n) for i in idx], dtype=torch.float64, device=t.device)
                acc[r] = torch.cat([(losses.double() * w).sum().reshape(1), w.sum().reshape(1), w @ stats])
    finally:
        ds.train()
    dist.all_reduce(acc, group=t.groups.dp)  # the DP ranks hold disjoint pairs; TP peers compute the same
    acc = acc.cpu()
    count = float(acc[:, 1].sum())
    metrics = (acc[:, 2:] / acc[:, 1:2].clamp(min=1)).mean(0).tolist()
    t.clock.reset()  # evaluation is not training time
    return (float(acc[:, 0].sum()) / count if count else None), int(count), dict(zip(METRICS, metrics))


def line(values) -> str:
    """The metrics on the step's log line."""
    return " | ".join(f"{k} {v:.4f}" for k, v in zip(METRICS, values))


__all__ = ["METRICS", "flat", "reference_table", "reference_for", "pair_terms", "pair_sums", "evaluate", "line"]
