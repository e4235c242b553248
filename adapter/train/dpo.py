"""The preference objectives' step and eval, on either engine (both return per-token losses): DPO (TRL 1.8.0's
sigmoid loss) here, with IPO's per-pair loss on the same reference, ORPO's and SimPO's terms from
adapter/train/preference_losses.py (no reference; their NLL is divided by the step's chosen tokens, which `step_norm`
counts before the first micro-batch, as the SFT loss is divided by the step's trained tokens).

DPO over preference pairs. The reference: for fresh LoRA adapters the base with the adapters disabled (PEFT's
`disable_adapter()`, or the native adapters' switch; no second copy); for a full fine-tune the starting weights, and
for LoRA started from a saved adapter that adapter (TRL's frozen "ref" copy), whose log-probabilities of every pair
are computed once before step 1 (TRL's `precompute_ref_log_probs`; before a resumed checkpoint is loaded, so a
resumed run keeps the same reference: the config's `fixed_reference`).

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
from megatron.core import parallel_state

from adapter.data.sft.preference import row_lengths, shared_prefix
from adapter.kernels.attention import sum_over_cp, whole_from_cp
from adapter.models.checks import NO_PAIRS
from adapter.train import kto
from adapter.train.preference_losses import DPO_METRICS as METRICS
from adapter.train.preference_losses import (
    NLL_MASK,
    PAIR_METRICS,
    TOKEN_METRICS,
    ipo_losses,
    nll_weight,
    orpo_terms,
    simpo_terms,
)
from adapter.train.reward import reward_terms


def collate(items: list[dict]) -> dict:
    """Dataset items (numpy arrays) stacked into one host micro-batch of tensors."""
    return {k: torch.from_numpy(np.stack([it[k] for it in items])) for k in items[0]}


def flat(batch: dict) -> dict:
    """[mb, 2, seq] pairs -> [2·mb, seq] rows: every chosen row, then every rejected one (TRL's order). KTO's
    [mb, 1, seq] rows -> [2·mb, seq]: the rows, then their KL rows (adapter/train/kto.py)."""
    out = {k: v.transpose(0, 1).reshape(-1, *v.shape[2:]) for k, v in batch.items()}
    return kto.rows(out) if "kto_label" in out else out


def trained(b: dict) -> torch.Tensor:
    """The loss mask of the rows a micro-batch trains: all of them but KTO's KL rows (its second half, no gradient),
    for the step line's trained-token count."""
    return b["loss_mask"][:b["loss_mask"].shape[0] // 2] if "kto_label" in b else b["loss_mask"]


PADDING_FREE = ("pairs: padding-free (dpo.padding_free, TRL's padding_free): each micro-batch's sequences run as one "
                "stream of their real tokens, attention confined to each sequence; no padding is computed")


SHARED_PROMPT = ("pairs: each pair's prompt runs once for both answers (dpo.share_prompt: auto; the same numbers), "
                 "its sequences as one stream of their real tokens without padding")


def sharing_line(run) -> str | None:
    """The first lines' word on how a run's pairs reach the model (None: padded rows, said by nobody)."""
    why = run.unshared
    if why is None:
        return SHARED_PROMPT
    if why == NO_PAIRS:
        return None
    off = f"; the prompt is not shared: {why}" if why != "dpo.share_prompt: false" else ""
    if run.cfg.padding_free_pairs():
        return PADDING_FREE + off
    return f"pairs: one padded row per answer{off}" if off else None


def computed(run, b: dict) -> float:
    """Positions a host micro-batch runs: all of its rows, padding-free pairs' real tokens only, or those less each
    shared prompt's second copy."""
    if run.shares_prompt:
        return float(row_lengths(b).sum() - shared_prefix(b).sum())
    if run.cfg.padding_free_pairs():
        return float(row_lengths(b).sum())
    return float(b["loss_mask"].numel())


def _token_losses(ds, batch) -> torch.Tensor:
    """[rows, seq] per-token losses of the whole sequences; at cp > 1 each rank's model runs its slice (the batch's
    cp_* keys: adapter/train/batches.place) and the slices are put back together, so the per-sequence sums and the
    loss are the same on every CP rank (each rank's gradient flows through its own tokens)."""
    if "pf_tokens" in batch:  # padding-free: the stream's losses put back in their rows (adapter/train/batches.py)
        out = ds(batch["pf_tokens"], batch["pf_position_ids"], None, labels=batch["pf_labels"],
                 loss_mask=batch["pf_loss_mask"], packed_seq_params=batch["pf_packed_seq_params"])
        rows, real = batch["loss_mask"], batch["pf_real"][0]
        # every stream position, its padding's losses zeroed (its row_index is 0): a boolean selection would make
        # the host wait for the forward (its size is data-dependent) before it can queue the next one
        whole = out.new_zeros(rows.numel(), dtype=torch.float32).index_add(
            0, batch["pf_row_index"][0], torch.where(real > 0, out[0].float(), 0.0))
        group = parallel_state.get_context_parallel_group()
        if dist.get_world_size(group) > 1:  # each CP rank ran its chunks of every sequence
            whole = sum_over_cp(whole, group)
        return whole.view(rows.shape)
    cp = "cp_tokens" in batch
    k = (lambda n: f"cp_{n}") if cp else (lambda n: n)
    out = ds(batch[k("tokens")], batch[k("position_ids")], None, labels=batch[k("labels")],
             loss_mask=batch[k("loss_mask")])
    if out.dim() == 0:
        raise RuntimeError("preference objectives need per-token losses; the model returned a summed loss")
    if cp:
        group = parallel_state.get_context_parallel_group()  # the layout's CP group, on either engine
        out = whole_from_cp(out, group, dist.get_world_size(group), dist.get_rank(group))
    return out.float()


def _logps(ds, batch) -> torch.Tensor:
    return -(_token_losses(ds, batch) * batch["loss_mask"]).sum(1)


def adapters_off(module):
    """The base alone: PEFT's `disable_adapter()` on the transformers engine (adapter/modeling/hf_build.
    CausalLMLosses holds PEFT's model), the native adapters' switch on the native one."""
    peft_model = getattr(module, "model", None)
    if peft_model is not None and hasattr(peft_model, "disable_adapter"):
        return peft_model.disable_adapter()
    from adapter.modeling.lora import disabled

    return disabled(module)


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
                b = place(flat(collate(items)))
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
    """The DPO reference tables of a run whose reference is fixed (config's `fixed_reference`: a full fine-tune, LoRA
    from a saved adapter), of the training pairs and of the held-out ones (adapter/train/trainer.py's set-up, before
    a checkpoint is loaded); None otherwise (the adapters are disabled each step)."""
    from adapter.train.batches import place

    t = trainer
    if not t.cfg.fixed_reference():
        return None, None
    if t.cfg.objective == "kto":  # KL rows: fixed by the in-order sampler's micro-batches (adapter/train/kto.py)
        table = kto.reference_table(t.engine.ds, t.dataset, t.sampler, group=t.groups.dp, logps=_logps,
                                    batch_of=lambda items: place(t.run, t.cp_rank, t.device, flat(collate(items))))
        held = t.val_dataset is not None and len(t.val_dataset) > 0
        t._say(f"KTO reference: the starting weights' log-probabilities of the {len(t.dataset)} rows"
               + (f" and of the {len(t.val_dataset)} held-out rows" if held else "") + " and of their KL rows, "
               "computed once before step 1 (TRL's frozen reference model; its precompute_ref_log_probs)")
        return table, kto.eval_table(t, _logps, lambda items: t._on_device(flat(collate(items)))) if held else None
    tables = [None if data is None or not len(data) else
              reference_table(t.engine.ds, data, dp_rank=t.layout.data_rank(t.rank), dp=t.layout.dp,
                              group=t.groups.dp, micro=t.cfg.batch.micro_batch_size,
                              place=lambda b: place(t.run, t.cp_rank, t.device, b))
              for data in (t.dataset, t.val_dataset)]
    held = f" and of the {len(t.val_dataset)} held-out pairs" if tables[1] is not None else ""
    saved = t.cfg.lora is not None and bool(t.cfg.lora.init_from)  # (either engine's adapters)
    name = t.cfg.objective.upper()
    start = ("starting adapter's" if saved else "base's (fresh LoRA adapters: B = 0)" if t.run.adapters else
             "starting weights'")
    t._say(f"{name} reference: the {start} log-probabilities of the {len(t.dataset)} pairs{held}, computed once "
           "before step 1 (TRL's precompute_ref_log_probs" + ("; TRL's frozen copy of a pretrained adapter)" if
                                                             saved else ")"))
    return tables[0], tables[1]


def pair_terms(cfg, ds, batch, table: torch.Tensor | None = None, group=None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair loss with its graph [m], chosen NLL sums [m] and their token counts [m] (ORPO's; zeros for DPO),
    per-pair metrics [m, K] in PAIR_METRICS' order) of one micro-batch on the device (a `flat` batch). `table`: the
    precomputed DPO reference (`reference_table`), else LoRA's adapters are disabled. `group`: the data-parallel
    ranks (a reward model's min and max scores are over all of theirs)."""
    if cfg.objective == "orpo":  # no reference (adapter/train/preference_losses.py)
        return orpo_terms(_token_losses(ds, batch), batch, cfg.orpo.alpha)
    if cfg.objective == "simpo":  # no reference either
        return simpo_terms(_token_losses(ds, batch), batch, cfg)
    if cfg.objective == "reward":  # a score per sequence (adapter/train/reward.py)
        return reward_terms(cfg, ds, batch, group)
    beta = cfg.dpo.beta
    if table is not None:
        ids = batch["pair"][:, 0]
        m = ids.shape[0] // 2
        ref = torch.cat([table[ids[:m], 0], table[ids[m:], 1]]).to(torch.float32)
    else:
        with torch.no_grad(), adapters_off(ds.module):
            ref = _logps(ds, batch)
    pol = _logps(ds, batch)
    chosen, rejected = pol.chunk(2)
    ref_chosen, ref_rejected = ref.chunk(2)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    losses = (ipo_losses(chosen_ratio, rejected_ratio, batch["loss_mask"], beta) if cfg.objective == "ipo" else
              -F.logsigmoid(beta * (chosen_ratio - rejected_ratio)))
    rc, rr = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    stats = torch.stack([rc, rr, (rc > rr).float(), rc - rr, chosen.detach(), rejected.detach()], 1)
    none = torch.zeros_like(rc)
    return losses, none, none, stats


def step_norm(t, micro: list[dict]) -> torch.Tensor:
    """[pairs, chosen NLL tokens] of trainer `t`'s whole optimizer step (host micro-batches, summed over DP on the
    device): what a micro-batch's sums are divided by."""
    n = sum(b["tokens"].shape[0] // 2 for b in micro)
    key = NLL_MASK.get(t.cfg.objective)
    tokens = sum(float(b[key][:b[key].shape[0] // 2].sum()) for b in micro) if key else 0.0
    v = torch.tensor([n, tokens], dtype=torch.float64).to(t.device, non_blocking=True)
    dist.all_reduce(v, group=t.groups.dp)  # whole pairs: tp ranks of a dp rank count the same
    return v


def step_terms(t, batch, norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(this micro-batch's share of the step's loss, with its graph; its sums [pairs, NLL, NLL tokens, metrics...]
    for `step_metrics`)."""
    if t.cfg.objective == "kto":  # unpaired rows, a KL term over the micro-batch: adapter/train/kto.py
        return kto.step_terms(t, batch, _logps)
    losses, nll, tokens, stats = pair_terms(t.cfg, t.engine.ds, batch, t.ref_table, t.groups.dp)
    local = losses.sum() / norm[0].float()
    if TOKEN_METRICS[t.cfg.objective]:  # ORPO's / SimPO's NLL: Σ over the step's chosen tokens / their count
        local = local + nll_weight(t.cfg) * nll.sum() / norm[1].clamp(min=1).float()
    # the pair count as a fill, not a host scalar's copy: that copy would make the host wait for the forward
    head = torch.stack([losses.new_full((), float(losses.shape[0])), nll.detach().sum(), tokens.sum()])
    return local, torch.cat([head, stats.sum(0)]).double()


def step_metrics(cfg, values) -> dict[str, float]:
    """TRL's logged metrics of a step from `step_terms`' sums over the step: means over its pairs, NLL per token."""
    if cfg.objective == "kto":
        return kto.step_metrics(values)
    pairs, nll, tokens, *stats = values
    out = {k: v / pairs for k, v in zip(PAIR_METRICS[cfg.objective], stats)}
    return {**out, **{k: nll / max(tokens, 1.0) for k in TOKEN_METRICS[cfg.objective]}}


def evaluate(t) -> tuple[float | None, int, dict[str, float]]:
    """(eval_loss, held-out pairs, {metric: value}) over the whole held-out set of trainer `t`, as TRL evaluates
    (module docstring). Every DP rank runs the same number of rounds (ZeRO gathers are collective); the last
    round's missing pairs are copies of pair 0 that count nowhere."""
    if t.cfg.objective == "kto":  # labelled rows, their KL rows built per chunk: adapter/train/kto.py
        return kto.evaluate(t, _logps, lambda items: t._on_device(flat(collate(items))))
    val, mb, layout, ds, cfg = t.val_dataset, t.cfg.batch.micro_batch_size, t.layout, t.engine.ds, t.cfg
    n, per_round, dp_rank = len(val), layout.dp * mb, layout.data_rank(t.rank)
    rounds = -(-n // per_round)
    names = PAIR_METRICS[cfg.objective]
    acc = torch.zeros(rounds, 4 + len(names), dtype=torch.float64, device=t.device)  # loss, pairs, NLL, tokens, ...
    ds.eval()
    try:
        with torch.no_grad():
            for r in range(rounds):
                idx = range(r * per_round + dp_rank * mb, r * per_round + (dp_rank + 1) * mb)
                items = [val[i] if i < n else dict(val[0]) for i in idx]
                b = t._on_device(flat(collate(items)))
                losses, nll, tokens, stats = pair_terms(cfg, ds, b, t.val_ref, t.groups.dp)
                w = torch.tensor([float(i < n) for i in idx], dtype=torch.float64, device=t.device)
                acc[r] = torch.cat([torch.stack([losses.double() @ w, w.sum(), nll.double() @ w, tokens.double() @ w]),
                                    w @ stats.double()])
    finally:
        ds.train()
    dist.all_reduce(acc, group=t.groups.dp)  # the DP ranks hold disjoint pairs; TP peers compute the same
    acc = acc.cpu()
    pairs = acc[:, 1]
    nll = acc[:, 2] / acc[:, 3].clamp(min=1)  # a round's (TRL batch's) mean NLL per chosen token; 0 for DPO
    count = float(pairs.sum())
    metrics = dict(zip(names, (acc[:, 4:] / pairs[:, None].clamp(min=1)).mean(0).tolist()))
    metrics.update({k: float(nll.mean()) for k in TOKEN_METRICS[cfg.objective]})
    t.clock.reset()  # evaluation is not training time
    # HF's eval_loss: each batch's loss (its pairs' mean + its NLL) once per pair, over all pairs
    loss = float((acc[:, 0] + pairs * nll_weight(cfg) * nll).sum()) / count if count else None
    return loss, int(count), metrics


def line(values: dict[str, float]) -> str:
    """The metrics on the step's log line."""
    return " | ".join(f"{k} {v:.4f}" for k, v in values.items())


__all__ = ["METRICS", "PADDING_FREE", "SHARED_PROMPT", "sharing_line", "collate", "flat", "trained", "computed",
           "reference_table", "reference_for", "pair_terms", "step_norm", "step_terms", "step_metrics",
           "evaluate", "line"]
