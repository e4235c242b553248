"""An Axolotl YAML, unchanged, mapped onto the native dict. This module holds the key tables (what is known, what
carries over as it is), how an Axolotl file spells a native key, and `from_axolotl`, which reads the booleans and
numbers as Axolotl does (axolotl_values.py) and runs the mappings by concern: axolotl_train.py (precision,
optimizer, schedule, batch, best checkpoint, LoRA), axolotl_parallel.py (context and expert parallelism, FSDP,
DeepSpeed, kernels), axolotl_data.py (datasets, pretraining files); refusals of keys that change what is trained:
axolotl_scope.py.

Each mapping takes what corresponds exactly, refuses in one line what cannot be honoured, and appends to `notes`
what the run's first lines must say (a mapping the user should know about, an Axolotl default that differs from
nd-adapter's, a key that has no effect here). Every Axolotl key it does not use is reported once as ignored.
"""
from __future__ import annotations

import typing
from typing import Any

from adapter.config import axolotl_scope, axolotl_values
from adapter.config.axolotl_data import DATA_KEYS, map_data, map_pretraining
from adapter.config.axolotl_parallel import (
    KERNEL_KEYS,
    kernel_note,
    map_context_parallel,
    map_deepspeed,
    map_expert_parallel,
    map_fsdp,
)
from adapter.config.axolotl_rl import RL_KEYS, map_eaft, map_reward, map_rl
from adapter.config.axolotl_train import (
    LORA_KEYS,
    LORA_MAP,
    SCHEDULE_MAP,
    enabled,
    map_batch,
    map_dequantize,
    map_lora,
    map_master_weights,
    map_precision,
    map_schedule,
)
from adapter.config.schema import LigerKernel, set_dotted
from adapter.errors import bad

SCHEDULE_KEYS = {"bf16", "fp16", "num_epochs", "warmup_ratio", "eval_steps", "evals_per_epoch", "saves_per_epoch",
                 "optimizer", "output_dir", "save_steps", "save_total_limit", "max_steps", "warmup_steps", "batch_size",
                 "float32", "default_system_message"}
PARALLEL_KEYS = {"context_parallel", "ring_attn_func", "heads_k_stride", "fsdp", "fsdp_config", "fsdp_version",
                 "deepspeed", "expert_parallel_size", "expert_parallel_backend", "expert_parallel_num_nvl_bytes",
                 "expert_parallel_num_rdma_bytes", "expert_parallel_token_capacity",
                 "expert_parallel_fallback_on_unsupported"}
KEYS = SCHEDULE_KEYS | PARALLEL_KEYS | KERNEL_KEYS | {"plugins", "torch_compile"} | axolotl_scope.KEYS

MARKERS = {"base_model", "sequence_len", "tensor_parallel_size", "context_parallel_size", "datasets",
                   "sequence_parallel_degree", "micro_batch_size", "learning_rate", "num_epochs"}
# Axolotl keys we understand; every other Axolotl key is reported once as ignored.
KNOWN = MARKERS | {
    "dp_shard_size", "dp_replicate_size", "gradient_accumulation_steps", "bf16", "bfloat16", "fp16", "tf32",
    "max_steps", "lr_quadratic_warmup",
    "warmup_steps", "lr_scheduler", "weight_decay", "max_grad_norm", "output_dir", "save_steps", "save_total_limit",
    "optimizer", "adam_beta1", "adam_beta2", "adam_epsilon", "seed", "gradient_checkpointing", "cosine_min_lr_ratio",
    "logging_steps", "use_tensorboard", "wandb_project", "ring_attn_func", "heads_k_stride", "base_model_config",
    "model_type", "tokenizer_type", "flash_attention", "sdp_attention", "strict", "ddp_timeout", "wandb_name",
    "wandb_entity", "wandb_mode", "unfrozen_parameters", "pretraining_dataset", "reinit_weights", "save_only_model",
    "early_stopping_patience", "load_best_model_at_end", "metric_for_best_model", "greater_is_better",
    "model_config", "overrides_of_model_config",  # output_router_logits mapped, the rest refused (axolotl_scope)
    "auto_resume_from_checkpoints", "trust_remote_code", "save_strategy", "mean_resizing_embeddings",
    "model_quantization_config", "model_quantization_config_kwargs", "group_by_length", "qat", "freeze_mm_modules",
    "llama4_linearized_experts",
} | KEYS | LORA_KEYS | RL_KEYS
SEQUENCE_LEN, SEED = 512, 42  # its schema's defaults


# Axolotl key -> native key, where the value carries over as it is (the schedule's keys: axolotl_train)
MAP = {
    "base_model": "model.path", "dp_shard_size": "parallelism.dp_shard_size",
    "dp_replicate_size": "parallelism.dp_replicate_size", "tensor_parallel_size": "parallelism.tp_size",
    "expert_parallel_size": "parallelism.ep_size",
    "context_parallel_size": "parallelism.cp_size", "micro_batch_size": "batch.micro_batch_size",
    "gradient_accumulation_steps": "batch.gradient_accumulation_steps", "sequence_len": "seq_len",
    "learning_rate": "optimizer.lr", "weight_decay": "optimizer.weight_decay", "warmup_steps":
    "optimizer.warmup_steps", "max_steps": "optimizer.max_steps", "max_grad_norm": "optimizer.clip_grad",
    "adam_epsilon": "optimizer.eps", "output_dir": "checkpoint.dir", "save_steps": "checkpoint.save_every",
    "save_total_limit": "checkpoint.keep_last", "trust_remote_code": "model.trust_remote_code",
    "auto_resume_from_checkpoints": "checkpoint.auto_resume",
    "seed": "seed", "logging_steps": "logging.every",
    "wandb_project": "logging.wandb_project", "wandb_name": "logging.wandb_name",
    "wandb_entity": "logging.wandb_entity", "wandb_mode": "logging.wandb_mode", "ddp_timeout": "dist_timeout_s",
    "gradient_checkpointing": "recompute", "torch_compile": "model.compile", "optimizer": "optimizer.name",
    "lr_scheduler": "optimizer.schedule", "cosine_min_lr_ratio": "optimizer.min_lr",
    "unfrozen_parameters": "model.unfrozen_parameters", "early_stopping_patience": "eval.early_stopping_patience",
    "load_best_model_at_end": "checkpoint.load_best", "mean_resizing_embeddings": "model.mean_resizing_embeddings",
    "freeze_mm_modules": "model.freeze_mm_modules", "llama4_linearized_experts": "model.linearized_experts",
} | SCHEDULE_MAP


def spelled(native: str) -> str:
    """How an Axolotl file spells a native key (for messages in the file's own words): `eval.per_epoch` ->
    `evals_per_epoch`, `data.datasets.0.type` -> `datasets.0.type`; the native key where it has no counterpart."""
    parts = native.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in _SPELLED:
            return ".".join([_SPELLED[head], *parts[i:]])
    return native


def from_axolotl(raw: dict[str, Any]) -> dict[str, Any]:
    raw = axolotl_values.typed(raw)  # booleans and numbers as Axolotl's schema reads them ("false", "2e-5")
    axolotl_scope.check_scope(raw)  # then: a LoRA or DPO config is refused before anything else is said of it
    if isinstance(raw.get("unfrozen_parameters"), str):  # Axolotl takes one pattern as a string too
        raw = {**raw, "unfrozen_parameters": [raw["unfrozen_parameters"]]}
    out: dict[str, Any] = {"source": "axolotl"}
    for key, target in MAP.items():
        if key in ("num_epochs", "warmup_ratio", "eval_steps", "evals_per_epoch", "saves_per_epoch",
                   "load_best_model_at_end", "gradient_checkpointing", "torch_compile", "optimizer", "lr_scheduler",
                   "cosine_min_lr_ratio"):
            continue  # mapped below, not as they are

        if raw.get(key) is not None:
            set_dotted(out, target, raw[key])
    notes: list[str] = []
    if raw.get("sequence_parallel_degree") is not None:
        if raw.get("context_parallel_size") is None:
            notes.append("sequence_parallel_degree is deprecated (Axolotl); read as context_parallel_size")
            set_dotted(out, "parallelism.cp_size", raw["sequence_parallel_degree"])
        elif raw["sequence_parallel_degree"] != raw["context_parallel_size"]:
            raise bad("sequence_parallel_degree", raw["sequence_parallel_degree"],
                      f"conflicts with context_parallel_size={raw['context_parallel_size']}",
                      "drop the deprecated sequence_parallel_degree")
    # Axolotl's defaults where nd-adapter's own differ (HF TrainingArguments' betas; its schema's sequence_len, seed)
    betas = tuple(raw.get(k) if raw.get(k) is not None else d for k, d in (("adam_beta1", 0.9), ("adam_beta2", 0.999)))
    set_dotted(out, "optimizer.betas", betas)
    if raw.get("adam_beta1") is None or raw.get("adam_beta2") is None:
        notes.append(f"adam betas {betas[0]:g}/{betas[1]:g} (Axolotl's default, HF's, for the unset adam_beta1/2)")
    if raw.get("sequence_len") is None:
        set_dotted(out, "seq_len", SEQUENCE_LEN)
        notes.append(f"sequence_len: {SEQUENCE_LEN} (Axolotl's default)")
    if raw.get("seed") is None:
        set_dotted(out, "seed", SEED)
        set_dotted(out, "data.seed", SEED)
        notes.append(f"seed: {SEED} (Axolotl's default): the data order and any held-out split follow it")
    if raw.get("learning_rate") is None:
        raise bad("learning_rate", None, "missing: Axolotl requires it",
                  "set learning_rate (e.g. 2e-5 for a full fine-tune of a 7-8B model)")
    if raw.get("lr_scheduler") is not None:
        sched = raw["lr_scheduler"]
        if sched not in ("cosine", "constant", "constant_with_warmup", "linear"):
            raise bad("lr_scheduler", sched, "not supported", "use cosine, linear or constant")
        set_dotted(out, "optimizer.schedule", "constant" if sched.startswith("constant") else sched)
    quadratic = bool(raw.get("lr_quadratic_warmup")) and raw.get("lr_scheduler") in (None, "cosine")
    if quadratic:  # Axolotl's cosine schedule with a quadratic warm-up (it reads the key with cosine only)
        set_dotted(out, "optimizer.schedule", "cosine_quadratic_warmup")
        notes.append("lr_quadratic_warmup: true -> optimizer.schedule: cosine_quadratic_warmup (the warm-up ramp "
                     "squared, then the half cosine to 0" + (": cosine_min_lr_ratio is ignored, as Axolotl ignores "
                     "it there)" if raw.get("cosine_min_lr_ratio") is not None else ")"))
    elif raw.get("lr_quadratic_warmup"):
        notes.append(f"lr_quadratic_warmup: no effect with lr_scheduler: {raw['lr_scheduler']} (Axolotl applies it "
                     "to cosine only)")
    if raw.get("cosine_min_lr_ratio") is not None and raw.get("learning_rate") is not None and not quadratic:
        set_dotted(out, "optimizer.min_lr", raw["cosine_min_lr_ratio"] * raw["learning_rate"])
    if raw.get("gradient_checkpointing"):
        out["recompute"] = "full"
    if raw.get("reinit_weights"):  # Axolotl's pretraining from scratch in base_model's shape
        set_dotted(out, "model.init", "random")
        notes.append("reinit_weights: true -> model.init: random (random weights in base_model's shape, not its "
                     "pre-trained ones)")
    map_lora(raw, out, notes)
    map_rl(raw, out, notes)
    map_eaft(raw, out, notes)
    map_reward(raw, out, notes)
    if axolotl_scope.is_on(raw.get("qat")):  # its keys are Axolotl's QATConfig's (adapter/config/schema_qat.py)
        out["qat"] = raw["qat"]
        notes.append("qat: torchao's fake-quantised linears as Axolotl prepares them (transformers engine), the "
                     "export converted back to plain weights (quantise them afterwards, as `axolotl quantize` does)")
    map_data(raw, out, notes)
    map_pretraining(raw.get("pretraining_dataset"), out, notes, has_sft=bool(raw.get("datasets")))
    ignored = [k for k in raw if k not in KNOWN and k not in DATA_KEYS]
    if raw.get("processor_type"):  # image-text rows: never prepared, every column kept (adapter/data/sft/multimodal)
        said = [k for k in ("skip_prepare_dataset", "remove_unused_columns") if k in ignored]
        ignored = [k for k in ignored if k not in said]
        notes.append(f"processor_type: {raw['processor_type']}: image-text rows batched by the checkpoint's processor "
                     "at each micro-batch, as Axolotl's multimodal collator does" +
                     (f" ({', '.join(said)}: implied)" if said else ""))
    map_training(raw, out, notes, ignored)
    if ignored:  # said once, by the run's first lines (and plan), never as a Python warning from every rank
        notes.append(f"ignored Axolotl keys (not used by nd-adapter): {', '.join(sorted(ignored))}")
    out["notes"] = notes
    return out


_SPELLED = {native: key for key, native in (MAP | LORA_MAP).items()} | {
    f"data.{v}": k for k, v in DATA_KEYS.items()} | {"optimizer.betas": "adam_beta1 / adam_beta2",
                                                      "precision": "bf16 / fp16", "lora": "adapter",
                                                      "model.output_router_logits":
                                                          "model_config.output_router_logits",
                                                      "model.dequantize": "model_quantization_config",
                                                      "checkpoint.export_hf": "output_dir", "eaft": "use_eaft",
                                                      "model.num_labels": "num_labels",
                                                      "eaft.alpha": "eaft_alpha", "eaft.k": "eaft_k"}


def map_training(raw: dict[str, Any], out: dict[str, Any], notes: list[str], ignored: list[str]) -> None:
    map_precision(raw, out, notes)
    map_dequantize(raw, out, notes)
    map_batch(raw, out, notes)
    map_schedule(raw, out, notes)
    map_context_parallel(raw, out, notes)
    map_expert_parallel(raw, out, notes)
    map_fsdp(raw, out, notes, ignored)
    map_deepspeed(raw, out, notes)
    map_master_weights(raw, out, notes)
    if raw.get("default_system_message") is not None:
        notes.append("default_system_message has no effect, as in Axolotl (its chatml template names no default "
                     "system message); give the system turn in the data, or a field_system column")
    if enabled(raw.get("save_only_model")):  # HF Trainer's: checkpoints without optimizer state, which cannot resume
        notes.append("save_only_model: checkpoints still keep the optimizer state, so that --resume (at any layout) "
                     "continues exactly; their size and the disk they need are in the first lines. The trained model "
                     "alone is what output_dir gets at the end")
    over = raw.get("model_config", raw.get("overrides_of_model_config")) or {}
    if "output_router_logits" in over:  # the only override mapped (axolotl_scope refuses the rest)
        set_dotted(out, "model.output_router_logits", over["output_router_logits"])
    if "torch_compile" in raw:  # a speed key: compiled wherever the layout lets it (config/load.py); unset: auto
        set_dotted(out, "model.compile", "if_possible" if enabled(raw["torch_compile"]) else False)
    liger = [k for k in typing.get_args(LigerKernel) if enabled(raw.get(f"liger_{k}"))]
    if liger:  # honoured on the transformers engine (adapter/modeling/hf_build.py); the native engine notes them
        set_dotted(out, "model.liger", liger)
    note = kernel_note(raw, ignored)
    if note:
        notes.append(note)


__all__ = ["MARKERS", "KEYS", "KNOWN", "DATA_KEYS", "from_axolotl", "map_training"]
