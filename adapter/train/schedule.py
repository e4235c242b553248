"""How long a run is and when it evaluates and saves, from the config and the training set's size.

Pure arithmetic (no torch), so unit tests check it against hand-computed values. An epoch is what the sampler
(adapter/data/sampler.DPSampler) makes of the data: rounds of dp·micro_batch samples, the tail that cannot fill a
round dropped; an optimizer step takes grad_accum rounds. `num_epochs` therefore means
floor(num_epochs · rounds_per_epoch / grad_accum) optimizer steps (at least one): the LR schedule ends with the data,
never after it. `max_steps` wins when given (Axolotl and HF do the same). Cadences given as a fraction in (0, 1) are
that share of the total steps, rounded up (HF's rule); `*_per_epoch` cadences are steps_per_epoch / n, rounded up.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from adapter.config import RunConfig, spell
from adapter.errors import bad

DEFAULT_MAX_STEPS = 1000  # a native config that gives neither max_steps nor num_epochs (pre-training, benchmarks)
AXOLOTL_WARMUP = (0.03, 100)  # Axolotl's warm-up when neither warmup_steps nor warmup_ratio is set: min(3%, 100)


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """The learning rate of optimizer step `step` (0-based) over the peak, exactly as transformers' schedulers
    (get_cosine_schedule_with_warmup / get_constant_schedule_with_warmup, the ones Axolotl and HF Trainer run):
    linear warm-up from 0 over warmup_steps, then constant, linear down to 0, or a half cosine down to min_ratio,
    reached at total_steps. `cosine_quadratic_warmup`: Axolotl's get_cosine_schedule_with_quadratic_warmup
    (`lr_quadratic_warmup`), the warm-up's linear ramp squared."""
    if step < warmup_steps:
        ramp = step / max(1, warmup_steps)
        return ramp * ramp if schedule == "cosine_quadratic_warmup" else ramp
    if schedule == "constant":
        return 1.0
    if schedule == "linear":  # get_linear_schedule_with_warmup: down to 0 at total_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Schedule:
    total_steps: int
    warmup_steps: int
    length_from: str                 # "max_steps", "num_epochs" or "default"
    warmup_from: str                 # "warmup_steps", "fraction", "warmup_ratio", "axolotl default" or "none"
    warmup_bumped: bool = False      # Axolotl's 1 warm-up step made 2
    samples: int | None = None       # training samples (None: synthetic data, no epochs)
    samples_per_epoch: int | None = None
    steps_per_epoch: float | None = None
    eval_every: int | None = None    # periodic evaluation every N steps (None: none)
    eval_at_start: bool = False      # Axolotl evaluates before the first step when a cadence is set
    eval_at_end: bool = False
    save_every: int = 0              # 0: only the final save
    load_best: bool = False          # reload and export the best checkpoint (adapter/train/best.py)
    patience: int | None = None      # early stopping after this many evaluations without a new best

    @property
    def epochs(self) -> float | None:
        return None if not self.steps_per_epoch else self.total_steps / self.steps_per_epoch


def _cadence(every, per_epoch: int | None, total: int, steps_per_epoch: float | None, key: str) -> int | None:
    if per_epoch is not None:
        if not steps_per_epoch:
            raise bad(key, per_epoch, "a per-epoch cadence needs a dataset of known size (synthetic data has no "
                      "epochs)", "give the cadence in steps instead")
        return max(1, math.ceil(steps_per_epoch / per_epoch))
    if not every:
        return None
    if isinstance(every, float):
        return max(1, math.ceil(every * total))
    return every


def resolve(cfg: RunConfig, samples: int | None, *, has_val: bool = False) -> Schedule:
    """The run's schedule. `samples`: the training set's size (None for synthetic data); `has_val`: a held-out set
    exists (evaluation is then on, at least once at the end)."""
    o, b = cfg.optimizer, cfg.batch
    per_round = b.micro_batch_size * cfg.dp_size
    samples_per_epoch = steps_per_epoch = None
    if samples is not None:
        rounds = samples // per_round
        samples_per_epoch = rounds * per_round
        steps_per_epoch = rounds / cfg.grad_accum
    if o.max_steps is not None:
        total, length_from = o.max_steps, "max_steps"
    elif o.num_epochs is not None:
        if samples is None:
            raise bad(spell(cfg, "optimizer.num_epochs"), o.num_epochs, "epochs need a dataset (this run uses "
                      "synthetic tokens)", f"set {spell(cfg, 'optimizer.max_steps')}")
        total, length_from = max(1, math.floor(o.num_epochs * steps_per_epoch)), "num_epochs"
    else:
        total, length_from = DEFAULT_MAX_STEPS, "default"
    if isinstance(o.warmup_steps, float):  # transformers' get_warmup_steps for 0 < warmup_steps < 1
        warmup, warmup_from = math.ceil(o.warmup_steps * total), "fraction"
    elif o.warmup_steps is not None:
        warmup, warmup_from = o.warmup_steps, "warmup_steps"
    elif o.warmup_ratio is not None:
        warmup, warmup_from = int(o.warmup_ratio * total), "warmup_ratio"
    elif cfg.source == "axolotl":
        warmup, warmup_from = min(int(AXOLOTL_WARMUP[0] * total), AXOLOTL_WARMUP[1]), "axolotl default"
    else:
        warmup, warmup_from = 0, "none"
    bumped = cfg.source == "axolotl" and warmup == 1 and warmup_from != "fraction"
    warmup += bumped  # Axolotl's trainer builder turns a warm-up of 1 step (given or computed) into 2
    e, c = cfg.eval, cfg.checkpoint
    has_val = has_val and e.per_epoch != 0  # evaluations switched off (Axolotl's evals_per_epoch: 0)
    eval_every = _cadence(e.every, e.per_epoch, total, steps_per_epoch, spell(cfg, "eval.per_epoch")) \
        if has_val else None
    save_every = _cadence(c.save_every, c.saves_per_epoch, total, steps_per_epoch, "checkpoint.saves_per_epoch") or 0
    patience = e.early_stopping_patience
    if patience is not None and eval_every is None:
        raise bad(spell(cfg, "eval.early_stopping_patience"), patience, "early stopping needs evaluations during the "
                  "run: an eval set and a cadence" if has_val else "early stopping needs an eval set",
                  f"set {spell(cfg, 'eval.every')} (or {spell(cfg, 'eval.per_epoch')})" if has_val else
                  "give val_set_size or test_datasets, or remove it")
    if c.load_best and not (has_val and c.dir):
        raise bad(spell(cfg, "checkpoint.load_best"), True, "the best checkpoint needs an eval set and saved "
                  "checkpoints" + ("" if c.dir else f" ({spell(cfg, 'checkpoint.dir')} is not set)"),
                  "give both, or remove it")
    return Schedule(total_steps=total, warmup_steps=min(warmup, total), length_from=length_from,
                    warmup_from=warmup_from, warmup_bumped=bumped, samples=samples, samples_per_epoch=samples_per_epoch,
                    steps_per_epoch=steps_per_epoch, eval_every=eval_every, eval_at_start=eval_every is not None,
                    eval_at_end=has_val, save_every=save_every if c.dir else 0, load_best=c.load_best,
                    patience=patience)


def apply(cfg: RunConfig, s: Schedule) -> RunConfig:
    """The config with the schedule's numbers written in (what the engine and the loop read)."""
    opt = cfg.optimizer.model_copy(update={"max_steps": s.total_steps, "warmup_steps": s.warmup_steps,
                                           "warmup_ratio": None})
    ck = cfg.checkpoint.model_copy(update={"save_every": s.save_every, "saves_per_epoch": None})
    ev = cfg.eval.model_copy(update={"every": s.eval_every, "per_epoch": None})
    return cfg.model_copy(update={"optimizer": opt, "checkpoint": ck, "eval": ev})


def describe(cfg: RunConfig, s: Schedule) -> list[str]:
    """The run's first lines about its length, warm-up and cadences (numbers derived from the config are said)."""
    lines = []
    gb = cfg.global_batch
    if s.samples is not None:
        dropped = s.samples - s.samples_per_epoch
        epoch = (f"{s.samples:,} training samples; an epoch is {s.samples_per_epoch:,} of them in "
                 f"{s.steps_per_epoch:g} steps of {gb} (global batch)" +
                 (f", {dropped} dropped (they do not fill a round of dp×micro_batch = "
                  f"{cfg.dp_size * cfg.batch.micro_batch_size})" if dropped else ""))
        lines.append(f"data: {epoch}")
    if s.length_from == "num_epochs":
        length = f"num_epochs {cfg.optimizer.num_epochs:g} × {s.steps_per_epoch:g} steps per epoch, rounded down"
    else:
        length = {"max_steps": "from max_steps",
                  "default": f"no max_steps or num_epochs given: {DEFAULT_MAX_STEPS}"}[s.length_from]
    if s.length_from == "max_steps" and s.epochs is not None:
        length += f" (= {s.epochs:.2f} epochs)"
    warm = {"warmup_steps": "warmup_steps", "warmup_ratio": f"warmup_ratio {cfg.optimizer.warmup_ratio}",
            "fraction": f"{spell(cfg, 'optimizer.warmup_steps')} {cfg.optimizer.warmup_steps}: that fraction of the "
                        "steps, rounded up, as transformers reads it",
            "axolotl default": "Axolotl's default, min(3% of the steps, 100)", "none": "none"}[s.warmup_from]
    if s.warmup_bumped:
        warm += "; 1 step made 2, as Axolotl does"
    lines.append(f"schedule: {s.total_steps:,} optimizer steps ({length}); warm-up {s.warmup_steps:,} steps "
                 f"({warm}), then {cfg.optimizer.schedule}")
    if s.eval_every is not None:
        lines.append(f"eval: loss over the whole eval set before the first step, every {s.eval_every:,} steps "
                     "and at the end")
    elif s.eval_at_end:
        lines.append("eval: loss over the whole eval set at the end (eval.every / eval.per_epoch add more)")
    elif cfg.eval.per_epoch == 0:
        lines.append(f"eval: none ({spell(cfg, 'eval.per_epoch')}: 0)")
    elif cfg.eval.every is not None or cfg.eval.per_epoch is not None:
        lines.append("eval: none: an eval cadence is set but there is no eval set (val_set_size or test_datasets)")
    if cfg.checkpoint.dir:
        cadence = f"every {s.save_every:,} steps and at the end" if s.save_every else "at the end"
        lines.append(f"checkpoints: {cfg.checkpoint.dir}, {cadence}, keeping the last {cfg.checkpoint.keep_last}"
                     + (" and the best" if s.load_best else ""))
    if s.patience is not None:
        lines.append(f"early stopping: the run ends after {s.patience} evaluation(s) in a row without a lower eval "
                     "loss (HF's EarlyStoppingCallback)")
    if s.load_best:
        lines.append("best checkpoint: the saved one with the lowest eval loss is reloaded and exported at the end "
                     "(load_best_model_at_end)")
    return lines


__all__ = ["lr_factor", "DEFAULT_MAX_STEPS", "Schedule", "resolve", "apply", "describe"]
