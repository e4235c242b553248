"""The learning rate each optimizer step runs at, through DeepSpeed's engine with the run's scheduler, equals
transformers' schedulers (the ones Axolotl and HF Trainer use): linear warm-up from 0, then constant, a half cosine
to 0 or to min_lr, or linear to 0. DeepSpeed's own WarmupCosineLR ran the first step at lr 0 and the warm-up one
step late."""
from __future__ import annotations

from pathlib import Path

from tests.helpers.dist import run_workers

MODEL = str(Path(__file__).resolve().parents[2] / "configs/models/llama-3.1-8b")

STEPS, LR = 12, 1e-3
CASES = [("cosine", 0, 0.0), ("cosine", 3, 0.0), ("cosine", 3, 1e-4), ("constant", 0, 0.0), ("constant", 4, 0.0),
         ("linear", 0, 0.0), ("linear", 3, 0.0)]


def _worker(rank, world):
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers.optimization import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_cosine_with_min_lr_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    from adapter import config
    from adapter.train.engine import lr_scheduler_for

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    out = {}
    for schedule, warm, min_lr in CASES:
        cfg = config.build({"model": {"path": MODEL}, "optimizer": {
            "lr": LR, "min_lr": min_lr, "schedule": schedule, "warmup_steps": warm, "max_steps": STEPS}}, env={})
        model = torch.nn.Linear(4, 4)
        conf = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,
                "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
                "zero_optimization": {"stage": 1}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf,
                                          lr_scheduler=lr_scheduler_for(cfg))
        got = []
        for _ in range(STEPS):
            engine.backward(engine(torch.ones(1, 4)).sum())
            got.append(engine.optimizer.param_groups[0]["lr"])
            engine.step()
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.AdamW([p], lr=LR)
        ref_sched = (get_constant_schedule_with_warmup(opt, warm) if schedule == "constant" else
                     get_linear_schedule_with_warmup(opt, warm, STEPS) if schedule == "linear" else
                     get_cosine_with_min_lr_schedule_with_warmup(opt, warm, STEPS, min_lr=min_lr) if min_lr else
                     get_cosine_schedule_with_warmup(opt, warm, STEPS))
        ref = []
        for _ in range(STEPS):
            ref.append(opt.param_groups[0]["lr"])
            opt.step()
            ref_sched.step()
        out[(schedule, warm, min_lr)] = (got, ref)
    return out


def test_learning_rate_per_step_is_transformers():
    for key, (got, ref) in run_workers(_worker, 1, timeout=300)[0].items():
        assert len(got) == STEPS and max(abs(a - b) for a, b in zip(got, ref)) <= 1e-12, (key, got, ref)
        assert (got[0] == 0.0) == (key[1] > 0)  # warm-up starts at 0; without it the first step runs at the peak
