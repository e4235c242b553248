"""RunConfig + Layout -> the DeepSpeed ZeRO-3 JSON.

Batch keys are written consistently with how DeepSpeed counts the data-parallel world when our MPU is given
(dp_replicate·dp_shard; cp ranks share samples). torch's AdamW is chosen over DeepSpeed's JIT-built fused Adam,
which fails to build on some hosts (docs/internals.md). `gradient_clipping` is always explicit: DeepSpeed's silent
default is 1.0. The LR schedule is DeepSpeed's own, so it is saved in and restored from its checkpoints.
"""
from __future__ import annotations

import copy
from typing import Any

from adapter.config import RunConfig, setting, spell
from adapter.config.values import lax_bool
from adapter.errors import bad
from adapter.parallel.layout import Layout


def partition_size(cfg: RunConfig, layout: Layout) -> int:
    """Ranks one ZeRO-3 shard set spans: dp_shard×cp for exact HSDP, all of dp×cp for hpZ."""
    if cfg.deepspeed.replicate_mode == "hsdp":
        return layout.size("dp_shard_cp")
    return layout.size("dp_cp")


def zero_stage(cfg: RunConfig, layout: Layout) -> int:
    """ZeRO-3 whenever there is something to shard. A shard group of one (tp-only layouts without replicas) would
    only pay ZeRO-3's gather hooks, so it runs stage 1 (nothing to partition either way). Not stage 0:
    DeepSpeed's bf16 stage-0 optimizer under-counts the TP grad norm by √tp (measured), so clipping would be wrong.
    Every consumer (train, preflight, plan, search) asks this first, so the layout refusals live here."""
    return _zero_stage(cfg, layout)


def _zero_stage(cfg: RunConfig, layout: Layout) -> int:
    if partition_size(cfg, layout) == 1 and layout.dp_replicate == 1:
        return 1
    if cfg.deepspeed.zero_stage == 3 and cfg.model.compile and cfg.deepspeed.gather_granularity == "module":
        raise bad(spell(cfg, "model.compile"), True,
                  "compiled layers under ZeRO-3 need each layer gathered whole before its graph runs; per-module "
                  "gathers would run inside it (adapter/modeling/compile.py)",
                  f"set deepspeed.gather_granularity: layer (the default), or {setting(cfg, 'model.compile', False)}")
    if cfg.deepspeed.zero_stage == 2 and layout.dp_replicate > 1:
        raise bad(spell(cfg, "deepspeed.zero_stage"), 2, "dp_replicate_size > 1 needs ZeRO-3 (exact HSDP averages "
                  "ZeRO-3's gradient partitions over replicas; hpZ is a ZeRO-3 feature)",
                  f"set {setting(cfg, 'deepspeed.zero_stage', 3)}, or fold dp_replicate into dp_shard")
    if layout.ep > 1 and layout.dp_replicate > 1 and cfg.deepspeed.replicate_mode == "hpz":
        raise bad(spell(cfg, "parallelism.ep_size"), layout.ep, "expert parallelism beside hpZ's secondary "
                  "partitions is not built (exact HSDP partitions the experts inside each replica)",
                  "set deepspeed.replicate_mode: hsdp (the default), or ep_size 1")
    return cfg.deepspeed.zero_stage


_DS_OPTIMIZER_KEYS = ("zero_optimization", "optimizer", "bf16", "fp16")


def _flat_refused(cfg: RunConfig, nothing_to_shard: bool) -> str | None:
    if cfg.optimizer.impl == "deepspeed":
        return "optimizer.impl is deepspeed"
    if not nothing_to_shard:
        return "it needs a layout with nothing to shard (dp_shard, dp_replicate and cp all 1)"
    if cfg.precision == "fp16":
        return "fp16 needs DeepSpeed's loss scaling"
    if any(k in cfg.deepspeed.overrides for k in _DS_OPTIMIZER_KEYS):
        return f"deepspeed.overrides set {', '.join(k for k in _DS_OPTIMIZER_KEYS if k in cfg.deepspeed.overrides)}"
    return None


def flat_optimizer(cfg: RunConfig, layout: Layout) -> bool:
    """Whether the run uses nd-adapter's flat AdamW (adapter/train/optim.py) instead of DeepSpeed's ZeRO optimizer:
    only where ZeRO would have nothing to partition (stage 1 on a shard group of one), in bf16 or fp32, and when
    the DeepSpeed overrides do not configure the optimizer themselves. `optimizer.impl: flat` where it cannot
    apply is refused."""
    why = _flat_refused(cfg, zero_stage(cfg, layout) == 1)
    if why and cfg.optimizer.impl == "flat":
        raise bad("optimizer.impl", "flat", why, "use optimizer.impl: auto (or deepspeed)")
    return why is None


def flat_at_stage(cfg: RunConfig, stage: int) -> bool:
    """`flat_optimizer` for plan's models, which know the ZeRO stage (1 = nothing to shard); never raises."""
    return _flat_refused(cfg, stage == 1) is None


def _merge(base: dict[str, Any], over: dict[str, Any], path: str = "deepspeed.overrides") -> dict[str, Any]:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v, f"{path}.{k}")
        elif isinstance(base.get(k), dict):
            raise bad(f"{path}.{k}", v, "DeepSpeed reads this key as a section (a mapping), not a value",
                      "give its keys below it, or remove it")
        elif k in base and isinstance(v, dict):
            raise bad(f"{path}.{k}", v, f"DeepSpeed reads this key as a value (here {base[k]!r}), not a section",
                      "give a value, or remove it")
        else:
            if v == "auto":
                raise bad(f"{path}.{k}", v, "'auto' is silently dropped by DeepSpeed", "give a concrete value")
            base[k] = v
    return base


def skips_nonfinite_steps(conf: dict[str, Any]) -> bool:
    """Whether DeepSpeed itself skips steps with inf/NaN gradients (fp16 loss scaling, or bf16 with its check on)."""
    return "fp16" in conf or bool(lax_bool(conf.get("bf16", {}).get("check_grad_overflow", False)))  # "false" too


def build(cfg: RunConfig, layout: Layout) -> dict[str, Any]:
    o, d = cfg.optimizer, cfg.deepspeed
    stage = zero_stage(cfg, layout)
    flat = flat_optimizer(cfg, layout)
    zero: dict[str, Any] = {"stage": stage} if stage == 1 else {
        "stage": 2,
        "overlap_comm": d.overlap_comm,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": d.reduce_bucket_size,
        "allgather_bucket_size": d.prefetch_bucket_size,
    } if stage == 2 else {
        "stage": 3,
        "overlap_comm": d.overlap_comm,
        "contiguous_gradients": True,
        "reduce_bucket_size": d.reduce_bucket_size,
        "stage3_prefetch_bucket_size": d.prefetch_bucket_size,
        "stage3_param_persistence_threshold": d.param_persistence_threshold,
        "stage3_gather_16bit_weights_on_model_save": False,
    }
    if layout.dp_replicate > 1 and d.replicate_mode == "hpz":
        zero["zero_hpz_partition_size"] = layout.size("dp_shard_cp")
    conf: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.batch.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "train_batch_size": cfg.batch.micro_batch_size * cfg.grad_accum * layout.dp,
        "gradient_clipping": o.clip_grad,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {
            "lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay, "torch_adam": True,
            "fused": True}},
        # no "scheduler": the run hands DeepSpeed its own (adapter/train/engine.py: transformers' schedules exactly;
        # DeepSpeed's WarmupCosineLR runs the first step at lr 0 and the warm-up one step late)
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # its throughput timer synchronises the device at every forward and step (~3 ms/step of idle GPU on the 1B
        # shape, BENCHMARKS); the loop times steps with CUDA events instead
        "timers": {"throughput": {"enabled": False}},
    }
    if o.name != "adamw" and "optimizer" in d.overrides:
        raise bad("deepspeed.overrides.optimizer", d.overrides["optimizer"], f"it would replace the {o.name[-4]}-bit "
                  f"AdamW (optimizer.name: {o.name}) with DeepSpeed's own", "remove one of them")
    if o.name != "adamw" and not flat:
        # the client optimizer is bitsandbytes' AdamW8bit or torchao's AdamW4bit (adapter/train/optim.py), which ZeRO
        # steps on its fp32 partitions like any torch optimizer; DeepSpeed asks for this flag for optimizers it does
        # not list
        del conf["optimizer"]
        conf["zero_allow_untested_optimizer"] = True
    if flat:
        # the client optimizer (FlatAdamW) owns precision, clipping and the step; DeepSpeed runs the loop's
        # bookkeeping (accumulation, the schedule, checkpoints) around it, with nothing to reduce
        conf.update(zero_optimization={"stage": 0}, gradient_clipping=0.0)
        del conf["optimizer"]
    elif cfg.param_precision == "bf16":
        # DeepSpeed's bf16 default scans every gradient for inf/NaN before each step (hundreds of small kernels and
        # host syncs: ~13 ms of idle GPU per step on the 1B shape, BENCHMARKS). bf16 has no loss scale to adjust, so
        # the loop stops on a non-finite grad norm instead, as Megatron-LM does.
        conf["bf16"] = {"enabled": True, "check_grad_overflow": False}
        if o.state_dtype == "bf16":  # no fp32 master: ZeRO's partitions of the bf16 weights and bf16 moments, stepped
            # by torch's fused AdamW (fp32 arithmetic, one rounding), as torch's AdamW steps a bf16 model
            conf["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    elif cfg.precision == "fp16":
        conf["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return _merge(conf, copy.deepcopy(d.overrides))
