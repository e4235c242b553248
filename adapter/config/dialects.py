"""The two foreign dialects mapped onto the native dict: an Axolotl YAML and an Accelerate launch config, unchanged.

Each maps only what it can map exactly; every Axolotl key it does not use is reported once as ignored (in
`RunConfig.notes`, which the run's first lines and `plan` print), and a key it cannot honour is refused rather than
dropped. Axolotl's training, FSDP, context-parallel and kernel keys live in axolotl.py.
"""
from __future__ import annotations

from typing import Any

from adapter.config import axolotl, axolotl_scope
from adapter.config.schema import SIZE_KEYS, DatasetEntry
from adapter.errors import bad

# ----------------------------------------------------------------------------------------------------------------

AXOLOTL_MARKERS = {"base_model", "sequence_len", "tensor_parallel_size", "context_parallel_size", "datasets",
                   "sequence_parallel_degree", "micro_batch_size", "learning_rate", "num_epochs"}
# Axolotl keys we understand; every other Axolotl key is reported once as ignored.
AXOLOTL_KNOWN = AXOLOTL_MARKERS | {
    "dp_shard_size", "dp_replicate_size", "gradient_accumulation_steps", "bf16", "fp16", "tf32", "max_steps",
    "warmup_steps", "lr_scheduler", "weight_decay", "max_grad_norm", "output_dir", "save_steps", "save_total_limit",
    "optimizer", "adam_beta1", "adam_beta2", "adam_epsilon", "seed", "gradient_checkpointing", "cosine_min_lr_ratio",
    "logging_steps", "use_tensorboard", "wandb_project", "ring_attn_func", "heads_k_stride", "base_model_config",
    "model_type", "tokenizer_type", "flash_attention", "sdp_attention", "strict", "ddp_timeout", "wandb_name",
    "wandb_entity", "wandb_mode",
} | axolotl.KEYS
AXOLOTL_SEQUENCE_LEN, AXOLOTL_SEED = 512, 42  # its schema's defaults
ACCELERATE_MARKERS = {"parallelism_config", "compute_environment", "distributed_type", "num_processes", "num_machines"}


def detect_dialect(raw: dict[str, Any]) -> str:
    if "model" in raw and isinstance(raw.get("model"), dict):
        return "native"
    if raw.keys() & ACCELERATE_MARKERS:
        return "accelerate"
    if raw.keys() & AXOLOTL_MARKERS:
        return "axolotl"
    return "native"


def set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for i, k in enumerate(keys[:-1]):
        if d.get(k) is None:
            d[k] = {}
        if not isinstance(d[k], dict):
            where = ".".join(keys[: i + 1])
            raise bad(where, d[k], "must be a mapping", f"write `{where}:` with its keys indented below it")
        d = d[k]
    d[keys[-1]] = value


def from_axolotl(raw: dict[str, Any]) -> dict[str, Any]:
    axolotl_scope.check_scope(raw)  # first: a LoRA or DPO config is refused before anything else is said of it
    out: dict[str, Any] = {"source": "axolotl"}
    mapping = {
        "base_model": "model.path", "dp_shard_size": "parallelism.dp_shard_size",
        "dp_replicate_size": "parallelism.dp_replicate_size", "tensor_parallel_size": "parallelism.tp_size",
        "context_parallel_size": "parallelism.cp_size", "micro_batch_size": "batch.micro_batch_size",
        "gradient_accumulation_steps": "batch.gradient_accumulation_steps", "sequence_len": "seq_len",
        "learning_rate": "optimizer.lr", "weight_decay": "optimizer.weight_decay", "warmup_steps":
        "optimizer.warmup_steps", "max_steps": "optimizer.max_steps", "max_grad_norm": "optimizer.clip_grad",
        "adam_epsilon": "optimizer.eps", "output_dir": "checkpoint.dir", "save_steps": "checkpoint.save_every",
        "save_total_limit": "checkpoint.keep_last", "seed": "seed", "logging_steps": "logging.every",
        "wandb_project": "logging.wandb_project", "wandb_name": "logging.wandb_name",
        "wandb_entity": "logging.wandb_entity", "wandb_mode": "logging.wandb_mode", "ddp_timeout": "dist_timeout_s",
    }
    for key, target in mapping.items():
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
        set_dotted(out, "seq_len", AXOLOTL_SEQUENCE_LEN)
        notes.append(f"sequence_len: {AXOLOTL_SEQUENCE_LEN} (Axolotl's default)")
    if raw.get("seed") is None:
        set_dotted(out, "seed", AXOLOTL_SEED)
        set_dotted(out, "data.seed", AXOLOTL_SEED)
        notes.append(f"seed: {AXOLOTL_SEED} (Axolotl's default): the data order and any held-out split follow it")
    if raw.get("learning_rate") is None:
        raise bad("learning_rate", None, "missing: Axolotl requires it",
                  "set learning_rate (e.g. 2e-5 for a full fine-tune of a 7-8B model)")
    if raw.get("lr_scheduler") is not None:
        sched = raw["lr_scheduler"]
        if sched not in ("cosine", "constant", "constant_with_warmup", "linear"):
            raise bad("lr_scheduler", sched, "not supported", "use cosine, linear or constant")
        set_dotted(out, "optimizer.schedule", "constant" if sched.startswith("constant") else sched)
    if raw.get("cosine_min_lr_ratio") is not None and raw.get("learning_rate") is not None:
        set_dotted(out, "optimizer.min_lr", raw["cosine_min_lr_ratio"] * raw["learning_rate"])
    if raw.get("gradient_checkpointing"):
        out["recompute"] = "full"
    _axolotl_data(raw, out)
    ignored = [k for k in raw if k not in AXOLOTL_KNOWN and k not in AXOLOTL_DATA]
    axolotl.map_training(raw, out, notes, ignored)
    if ignored:  # said once, by the run's first lines (and plan), never as a Python warning from every rank
        notes.append(f"ignored Axolotl keys (not used by nd-adapter): {', '.join(sorted(ignored))}")
    out["notes"] = notes
    return out


def from_accelerate(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"source": "accelerate", "model": {"path": raw.get("model", "")}}
    block = raw.get("parallelism_config") or {}
    if not isinstance(block, dict):
        raise bad("parallelism_config", block, "must be a mapping", "write `parallelism_config:` with its keys below")
    for key, value in block.items():
        name = key.removeprefix("parallelism_config_")
        if name in SIZE_KEYS:
            set_dotted(out, f"parallelism.{name}", value)
        elif name == "cp_comm_strategy":
            if value not in ("allgather", "all_gather"):
                raise bad(key, value, "only the all-gather strategy maps onto this project (as all_gather)",
                          "use allgather, or set parallelism.cp_comm_type: p2p in a native config for the ring")
            set_dotted(out, "parallelism.cp_comm_type", "all_gather")
        else:
            raise bad(f"parallelism_config.{key}", value, "unknown key",
                      f"use parallelism_config_{{{','.join(SIZE_KEYS)}}}")
    nodes, procs = raw.get("num_machines", 1), raw.get("num_processes")
    set_dotted(out, "hardware.nodes", nodes)
    if isinstance(procs, int) and isinstance(nodes, int) and nodes >= 1 and procs % nodes == 0:
        set_dotted(out, "hardware.gpus_per_node", procs // nodes)
    elif procs is not None:
        raise bad("num_processes", procs, f"not divisible by num_machines={nodes}", "make num_processes a multiple")
    mp = raw.get("mixed_precision")
    if mp is not None:
        if mp not in ("bf16", "fp16", "no"):
            raise bad("mixed_precision", mp, "unsupported", "use bf16, fp16 or no")
        out["precision"] = "fp32" if mp == "no" else mp
    return out



# ----------------------------------------------------------------------------------------------------------------
# Axolotl's dataset keys (issue 14): top-level key -> data.<key>; `datasets:` entries are checked key by key.

AXOLOTL_DATA = {
    "datasets": "datasets", "train_on_inputs": "train_on_inputs", "sample_packing": "sample_packing",
    "eval_sample_packing": "eval_sample_packing", "pad_to_sequence_len": "pad_to_sequence_len",
    "excess_length_strategy": "excess_length_strategy", "dataset_prepared_path": "prepared_path",
    "val_set_size": "val_set_size", "shuffle_merged_datasets": "shuffle_merged_datasets",
    "chat_template": "chat_template", "chat_template_jinja": "chat_template_jinja",
    "special_tokens": "special_tokens", "dataset_processes": "num_proc", "dataset_num_proc": "num_proc",
    "test_datasets": "test_datasets", "min_sample_len": "min_sample_len", "dataset_exact_deduplication": "deduplicate",
}
ENTRY_KEYS = set(DatasetEntry.model_fields)
ENTRY_ALIASES = {"message_field_role": "role", "message_field_content": "content"}  # Axolotl's deprecated spellings


def _axolotl_entry(i: int, entry: Any, key: str = "datasets") -> dict[str, Any]:
    where = f"{key}[{i}]"
    if not isinstance(entry, dict):
        raise bad(where, entry, "must be a mapping", "write each entry as `- path: ...` with `type: ...` below it")
    out: dict[str, Any] = {}
    legacy: dict[str, Any] = {}
    for key, value in entry.items():
        if key in ENTRY_ALIASES:
            legacy[ENTRY_ALIASES[key]] = value
        elif key not in ENTRY_KEYS:
            raise bad(f"{where}.{key}", value, "a dataset key nd-adapter does not support",
                      "remove it; the supported keys are listed in docs/config.md (SFT datasets)")
        elif key == "type" and isinstance(value, dict):
            raise bad(f"{where}.type", value, "user-defined prompt formats are not supported",
                      "use type: input_output (segments with labels) or pre-tokenised rows")
        elif value is not None:
            out[key] = value
    if legacy:
        out["message_property_mappings"] = {**legacy, **(out.get("message_property_mappings") or {})}
    return out


def _axolotl_data(raw: dict[str, Any], out: dict[str, Any]) -> None:
    if raw.get("test_datasets") and raw.get("val_set_size"):
        raise bad("val_set_size", raw["val_set_size"], "Axolotl takes test_datasets or val_set_size, not both",
                  "drop val_set_size (the test datasets are the eval set)")
    for key, target in AXOLOTL_DATA.items():
        value = raw.get(key)
        if value is None:
            continue
        if key in ("datasets", "test_datasets"):
            if not isinstance(value, list):
                raise bad(key, value, "must be a list", f"write `{key}:` with `- path: ...` entries below it")
            value = [_axolotl_entry(i, e, key) for i, e in enumerate(value)]
        set_dotted(out, f"data.{target}", value)
    if raw.get("seed") is not None:
        set_dotted(out, "data.seed", raw["seed"])  # Axolotl's seed also shuffles and splits the data
