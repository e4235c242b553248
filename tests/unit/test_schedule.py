"""Epoch arithmetic, warm-up and eval/save cadences (adapter/train/schedule.py) against hand-computed values."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from adapter import config
from adapter.errors import UserError
from adapter.train import schedule

ROOT = Path(__file__).resolve().parents[2]
LLAMA = str(ROOT / "configs/models/llama-3.2-1b")


def cfg(world=4, source=None, **over):
    raw = {"model": {"path": LLAMA}, "parallelism": {"dp_shard_size": world},
           "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 3}, "checkpoint": {"dir": "ck"}}
    for k, v in over.items():
        config.set_dotted(raw, k, v)
    c = config.build(raw, env={}, world_size=world)
    return c.model_copy(update={"source": source}) if source else c


def test_epochs_from_the_samplers_rounds():
    # 103 samples, rounds of dp 4 × micro 2 = 8: 12 rounds (96 samples, 7 dropped); 3 rounds per step: 4 steps/epoch
    c = cfg(**{"optimizer.num_epochs": 2.5, "optimizer.warmup_ratio": 0.1, "eval.per_epoch": 3,
               "checkpoint.saves_per_epoch": 1})
    s = schedule.resolve(c, 103, has_val=True)
    assert (s.samples_per_epoch, s.steps_per_epoch, s.total_steps) == (96, 4.0, 10)  # floor(2.5 × 4)
    assert s.warmup_steps == 1 and s.warmup_from == "warmup_ratio"  # int(0.1 × 10)
    assert s.eval_every == 2 and s.eval_at_start and s.eval_at_end  # ceil(4 / 3)
    assert s.save_every == 4
    applied = schedule.apply(c, s)
    o = applied.optimizer
    assert (o.max_steps, o.warmup_steps, o.warmup_ratio) == (10, 1, None)
    assert applied.checkpoint.save_every == 4 and applied.checkpoint.saves_per_epoch is None
    lines = "\n".join(schedule.describe(c, s))
    for needle in ("103 training samples", "96 of them in 4 steps of 24", "7 dropped", "10 optimizer steps",
                   "num_epochs 2.5 × 4 steps per epoch", "warm-up 1 steps (warmup_ratio 0.1)", "every 2 steps",
                   "every 4 steps and at the end"):
        assert needle in lines, (needle, lines)


def test_max_steps_wins_and_fractions_round_up():
    c = cfg(**{"optimizer.num_epochs": 2, "optimizer.max_steps": 10, "eval.every": 0.25,
               "checkpoint.save_every": 0.5})
    s = schedule.resolve(c, 103, has_val=True)
    assert (s.total_steps, s.length_from) == (10, "max_steps") and s.epochs == 2.5
    assert (s.eval_every, s.save_every) == (3, 5)  # ceil(0.25 × 10), ceil(0.5 × 10)


def test_warmup_steps_below_one_is_a_fraction_rounded_up_as_transformers_reads_it():
    """TrainingArguments.get_warmup_steps: ceil(fraction × steps) (Axolotl's expert-parallel examples write 0.1)."""
    from transformers import TrainingArguments

    for total in (50, 7, 1):
        s = schedule.resolve(cfg(**{"optimizer.warmup_steps": 0.1, "optimizer.max_steps": total}), None)
        ref = TrainingArguments(output_dir="unused", warmup_steps=0.1).get_warmup_steps(total)
        assert s.warmup_steps == ref == math.ceil(0.1 * total) and s.warmup_from == "fraction", total
    c = cfg(source="axolotl", **{"optimizer.warmup_steps": 0.1, "optimizer.max_steps": 7})
    s = schedule.resolve(c, None)
    assert s.warmup_steps == 1 and not s.warmup_bumped  # a fraction goes to transformers as it is: no 1 -> 2
    assert "warm-up 1 steps (warmup_steps 0.1: that fraction of the steps, rounded up" in "\n".join(
        schedule.describe(c, s))
    assert cfg(**{"optimizer.warmup_steps": 3.0}).optimizer.warmup_steps == 3  # a whole float is steps
    for bad_value in (1.5, -0.1):
        with pytest.raises(UserError, match=r"optimizer.warmup_steps"):
            cfg(**{"optimizer.warmup_steps": bad_value})


def test_axolotl_makes_a_warmup_of_one_step_two():
    """Axolotl's trainer builder: `if warmup_steps == 1: warmup_steps = 2`, given or computed (Axolotl configs only)."""
    for over in ({"optimizer.warmup_steps": 1}, {"optimizer.warmup_ratio": 0.1},  # int(0.1 × 10) = 1
                 {}):  # Axolotl's default: min(int(0.03 × 10), 100) = 0, so none; 40 steps below
        s = schedule.resolve(cfg(source="axolotl", **{"optimizer.max_steps": 10, **over}), None)
        assert s.warmup_steps == (2 if over else 0) and s.warmup_bumped == bool(over), over
    s = schedule.resolve(cfg(source="axolotl", **{"optimizer.max_steps": 40}), None)
    assert (s.warmup_steps, s.warmup_from, s.warmup_bumped) == (2, "axolotl default", True)
    c = cfg(source="axolotl", **{"optimizer.warmup_steps": 1, "optimizer.max_steps": 10})
    assert "1 step made 2, as Axolotl does" in "\n".join(schedule.describe(c, schedule.resolve(c, None)))
    s = schedule.resolve(cfg(**{"optimizer.warmup_steps": 1, "optimizer.max_steps": 10}), None)
    assert s.warmup_steps == 1 and not s.warmup_bumped  # native configs: as written


def test_defaults_native_and_axolotl():
    s = schedule.resolve(cfg(), None)
    assert (s.total_steps, s.warmup_steps, s.length_from, s.eval_every, s.save_every) == (1000, 0, "default", None, 0)
    s = schedule.resolve(cfg(source="axolotl"), None)
    assert s.warmup_steps == 30 and s.warmup_from == "axolotl default"  # min(int(0.03 × 1000), 100)
    s = schedule.resolve(cfg(source="axolotl", **{"optimizer.max_steps": 5000}), None)
    assert s.warmup_steps == 100
    s = schedule.resolve(cfg(**{"optimizer.warmup_steps": 7, "optimizer.max_steps": 5}), None)
    assert s.warmup_steps == 5  # never longer than the run


def test_fewer_rounds_than_one_step_still_trains_one_step():
    c = cfg(world=1, **{"batch.micro_batch_size": 1, "batch.gradient_accumulation_steps": 16,
                        "optimizer.num_epochs": 1})
    s = schedule.resolve(c, 8)
    assert s.steps_per_epoch == 0.5 and s.total_steps == 1


def test_eval_needs_a_held_out_set_and_cadences_need_epochs():
    c = cfg(**{"optimizer.max_steps": 10, "eval.per_epoch": 2})
    s = schedule.resolve(c, 103, has_val=False)
    assert s.eval_every is None and not s.eval_at_end and not s.eval_at_start
    assert any("no eval set" in line for line in schedule.describe(c, s))
    s = schedule.resolve(cfg(**{"optimizer.max_steps": 10}), 103, has_val=True)
    assert s.eval_every is None and s.eval_at_end and not s.eval_at_start  # once, at the end
    with pytest.raises(UserError, match="optimizer.num_epochs=2.0: epochs need a dataset"):
        schedule.resolve(cfg(**{"optimizer.num_epochs": 2}), None)
    with pytest.raises(UserError, match="checkpoint.saves_per_epoch=1: a per-epoch cadence needs a dataset"):
        schedule.resolve(cfg(**{"optimizer.max_steps": 10, "checkpoint.saves_per_epoch": 1}), None)


def test_schema_rules():
    for over, needle in (({"optimizer.warmup_steps": 3, "optimizer.warmup_ratio": 0.1}, "not both"),
                         ({"checkpoint.save_every": 2.0}, "whole number of steps or a fraction"),
                         ({"eval.every": 3, "eval.per_epoch": 1}, "not both"),
                         ({"checkpoint.save_every": 3, "checkpoint.saves_per_epoch": 1}, "not both"),
                         ({"optimizer.num_epochs": 0}, "optimizer.num_epochs"),
                         ({"optimizer.warmup_ratio": 1.5}, "optimizer.warmup_ratio")):
        with pytest.raises(UserError, match=needle):
            cfg(**over)


def test_axolotl_quadratic_warmup_is_its_cosine_schedule_with_the_ramp_squared():
    """archived/cerebras/btlm-ft.yml's `lr_quadratic_warmup: true` (lr_scheduler cosine): Axolotl's
    _get_cosine_schedule_with_quadratic_warmup_lr_lambda (src/axolotl/utils/schedulers.py, 067b021), step by step;
    its cosine_min_lr_ratio ignored there; with another scheduler the key does nothing (said)."""
    def axolotl(step, warm, total):  # that function, num_cycles 0.5
        if step < warm:
            return (step / max(1, warm)) ** 2
        progress = (step - warm) / max(1, total - warm)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))

    raw = {"base_model": "x", "learning_rate": 1e-4, "lr_scheduler": "cosine", "lr_quadratic_warmup": True,
           "cosine_min_lr_ratio": 0.1, "warmup_steps": 5, "max_steps": 20, "micro_batch_size": 1}
    cfg = config.build(raw, env={}, world_size=1)
    o = cfg.optimizer
    assert (o.schedule, o.min_lr) == ("cosine_quadratic_warmup", 0.0)
    assert any("cosine_min_lr_ratio is ignored" in n for n in cfg.notes), cfg.notes
    got = [schedule.lr_factor(s, schedule=o.schedule, warmup_steps=5, total_steps=20, min_ratio=0.0) for s in range(20)]
    assert got == pytest.approx([axolotl(s, 5, 20) for s in range(20)], abs=1e-12) and got[2] == pytest.approx(0.16)
    linear = config.build({**raw, "lr_scheduler": "linear"}, env={}, world_size=1)
    assert linear.optimizer.schedule == "linear" and any("no effect with lr_scheduler: linear" in n
                                                         for n in linear.notes), linear.notes
