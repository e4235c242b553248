"""An Axolotl YAML, unchanged, mapped onto the native dict: its model, batch, optimizer and schedule keys, datasets,
precision, evaluation and saves, output, context parallelism (the flat `context_parallel_size` keys and the
ring-master plugin's `context_parallel:` block), FSDP (onto its DeepSpeed equivalent) and the keys that name a
peer's kernels.

Each mapping takes what corresponds exactly, refuses in one line what cannot be honoured (keys that change what is
trained: axolotl_scope.py), and appends to `notes` what the run's first lines must say (a mapping the user should
know about, an Axolotl default that differs from nd-adapter's, a key that has no effect here). Every Axolotl key it
does not use is reported once as ignored.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from adapter.config import axolotl_scope
from adapter.config.schema import DatasetEntry, set_dotted
from adapter.errors import bad

# Keys that choose a peer's kernels: nd-adapter always runs its own (adapter/kernels: SDPA attention, fused RoPE,
# SwiGLU and vocab-parallel cross-entropy), so they get one line saying so.
KERNEL_KEYS = {"attn_implementation", "flash_attention", "sdp_attention", "xformers_attention", "flex_attention",
               "sage_attention", "eager_attention", "flash_attn_cross_entropy", "flash_attn_fuse_mlp",
               "flash_attn_rms_norm", "flash_optimum", "cut_cross_entropy", "liger_rope", "liger_rms_norm",
               "liger_rms_norm_gated", "liger_layer_norm", "liger_swiglu", "liger_glu_activation",
               "liger_cross_entropy", "liger_fused_linear_cross_entropy", "lora_mlp_kernel", "lora_qkv_kernel",
               "lora_o_kernel", "lora_embedding_kernel"}
SCHEDULE_KEYS = {"bf16", "fp16", "num_epochs", "warmup_ratio", "eval_steps", "evals_per_epoch", "saves_per_epoch",
                 "optimizer", "output_dir", "save_steps", "save_total_limit", "max_steps", "warmup_steps", "batch_size",
                 "float32", "default_system_message"}
PARALLEL_KEYS = {"context_parallel", "ring_attn_func", "heads_k_stride", "fsdp", "fsdp_config", "fsdp_version",
                 "deepspeed", "expert_parallel_size", "expert_parallel_backend", "expert_parallel_num_nvl_bytes",
                 "expert_parallel_num_rdma_bytes", "expert_parallel_token_capacity",
                 "expert_parallel_fallback_on_unsupported"}
KEYS = SCHEDULE_KEYS | PARALLEL_KEYS | KERNEL_KEYS | {"plugins", "torch_compile"} | axolotl_scope.KEYS

ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw")
ADAMW_8BIT = ("adamw_8bit", "adamw_bnb_8bit", "adamw_torch_8bit", "paged_adamw_8bit")  # bitsandbytes', torchao's
ADAMW_PAGED = ("paged_adamw_32bit",)  # bitsandbytes' AdamW with fp32 states in paged memory: AdamW's update
PAGING = "paging is not used: the states stay on the GPU (`nd-adapter plan` says whether they fit)"
# ring-flash-attn's implementations (Axolotl's ring_attn_func) -> cp_comm_type. Any of them computes exact
# attention; what differs is how K/V travel: all-gathered (Llama 3's "varlen_llama3") or passed around a ring.
RING_ATTN = {"varlen_llama3": "all_gather", "batch_ring": "p2p", "batch_zigzag": "p2p", "varlen_ring": "p2p",
             "varlen_zigzag": "p2p"}
ROTATE = {"allgather": "all_gather", "alltoall": "p2p"}  # the ring-master block's rotate_method (torch's names)
FSDP_STAGE = {"full_shard": 3, "hybrid_shard": 3, "shard_grad_op": 2, "_hybrid_shard_zero2": 2, "hybrid_shard_zero2": 2}
FSDP_USED = {"reshard_after_forward", "offload_params", "activation_checkpointing", "state_dict_type",
             "final_state_dict_type", "auto_wrap_policy", "transformer_layer_cls_to_wrap", "version"}
MARKERS = {"base_model", "sequence_len", "tensor_parallel_size", "context_parallel_size", "datasets",
                   "sequence_parallel_degree", "micro_batch_size", "learning_rate", "num_epochs"}
# LoRA's keys (map_lora): carried over only with `adapter: lora|qlora`, a LoRA key without it is refused
LORA_MAP = {"lora_r": "lora.r", "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout",
            "lora_target_modules": "lora.target_modules", "lora_target_linear": "lora.target_linear",
            "lora_modules_to_save": "lora.modules_to_save", "peft_layers_to_transform": "lora.layers",
            "peft_use_rslora": "lora.rslora", "lora_model_dir": "lora.init_from", "load_in_4bit": "lora.quantize_base"}
LORA_KEYS = set(LORA_MAP) | {"adapter", "bnb_config_kwargs", "peft_layers_pattern", "peft_init_lora_weights",
                             "load_in_8bit"}
# Axolotl keys we understand; every other Axolotl key is reported once as ignored.
KNOWN = MARKERS | {
    "dp_shard_size", "dp_replicate_size", "gradient_accumulation_steps", "bf16", "bfloat16", "fp16", "tf32",
    "max_steps",
    "warmup_steps", "lr_scheduler", "weight_decay", "max_grad_norm", "output_dir", "save_steps", "save_total_limit",
    "optimizer", "adam_beta1", "adam_beta2", "adam_epsilon", "seed", "gradient_checkpointing", "cosine_min_lr_ratio",
    "logging_steps", "use_tensorboard", "wandb_project", "ring_attn_func", "heads_k_stride", "base_model_config",
    "model_type", "tokenizer_type", "flash_attention", "sdp_attention", "strict", "ddp_timeout", "wandb_name",
    "wandb_entity", "wandb_mode", "unfrozen_parameters", "pretraining_dataset", "reinit_weights", "save_only_model",
    "early_stopping_patience", "load_best_model_at_end", "metric_for_best_model", "greater_is_better",
    "model_config", "overrides_of_model_config",  # output_router_logits mapped, the rest refused (axolotl_scope)
} | KEYS | LORA_KEYS
SEQUENCE_LEN, SEED = 512, 42  # its schema's defaults
# Axolotl's dataset keys: top-level key -> data.<key>; `datasets:` entries are checked key by key.
DATA_KEYS = {
    "datasets": "datasets", "train_on_inputs": "train_on_inputs", "sample_packing": "sample_packing",
    "eval_sample_packing": "eval_sample_packing", "pad_to_sequence_len": "pad_to_sequence_len",
    "excess_length_strategy": "excess_length_strategy", "dataset_prepared_path": "prepared_path",
    "val_set_size": "val_set_size", "shuffle_merged_datasets": "shuffle_merged_datasets",
    "chat_template": "chat_template", "chat_template_jinja": "chat_template_jinja", "eot_tokens": "eot_tokens",
    "special_tokens": "special_tokens", "dataset_processes": "num_proc", "dataset_num_proc": "num_proc",
    "resize_token_embeddings_to_32x": "resize_vocab_to_32x",
    "test_datasets": "test_datasets", "min_sample_len": "min_sample_len", "dataset_exact_deduplication": "deduplicate",
}
ENTRY_KEYS = set(DatasetEntry.model_fields)
ENTRY_ALIASES = {"message_field_role": "role", "message_field_content": "content"}  # Axolotl's deprecated spellings


# Axolotl key -> native key, where the value carries over as it is
MAP = {
    "base_model": "model.path", "dp_shard_size": "parallelism.dp_shard_size",
    "dp_replicate_size": "parallelism.dp_replicate_size", "tensor_parallel_size": "parallelism.tp_size",
    "expert_parallel_size": "parallelism.ep_size",
    "context_parallel_size": "parallelism.cp_size", "micro_batch_size": "batch.micro_batch_size",
    "gradient_accumulation_steps": "batch.gradient_accumulation_steps", "sequence_len": "seq_len",
    "learning_rate": "optimizer.lr", "weight_decay": "optimizer.weight_decay", "warmup_steps":
    "optimizer.warmup_steps", "max_steps": "optimizer.max_steps", "max_grad_norm": "optimizer.clip_grad",
    "adam_epsilon": "optimizer.eps", "output_dir": "checkpoint.dir", "save_steps": "checkpoint.save_every",
    "save_total_limit": "checkpoint.keep_last", "seed": "seed", "logging_steps": "logging.every",
    "wandb_project": "logging.wandb_project", "wandb_name": "logging.wandb_name",
    "wandb_entity": "logging.wandb_entity", "wandb_mode": "logging.wandb_mode", "ddp_timeout": "dist_timeout_s",
    "num_epochs": "optimizer.num_epochs", "warmup_ratio": "optimizer.warmup_ratio", "eval_steps": "eval.every",
    "evals_per_epoch": "eval.per_epoch", "saves_per_epoch": "checkpoint.saves_per_epoch",
    "gradient_checkpointing": "recompute", "torch_compile": "model.compile", "optimizer": "optimizer.name",
    "lr_scheduler": "optimizer.schedule", "cosine_min_lr_ratio": "optimizer.min_lr",
    "unfrozen_parameters": "model.unfrozen_parameters", "early_stopping_patience": "eval.early_stopping_patience",
    "load_best_model_at_end": "checkpoint.load_best",
}
# Axolotl's numeric keys: YAML 1.1 reads `2e-5` (no dot) as a string, and Axolotl's schema turns it into a number
FLOATS = {"learning_rate", "weight_decay", "warmup_ratio", "max_grad_norm", "adam_beta1", "adam_beta2", "adam_epsilon",
          "cosine_min_lr_ratio", "val_set_size", "num_epochs", "lora_dropout", "lora_alpha"}
STEPS = {"eval_steps", "save_steps", "warmup_steps"}  # whole steps, or a fraction of the run below 1
INTS = {"micro_batch_size", "gradient_accumulation_steps", "batch_size", "sequence_len", "max_steps",
        "evals_per_epoch", "saves_per_epoch", "save_total_limit", "logging_steps", "seed", "min_sample_len",
        "dp_shard_size", "dp_replicate_size", "tensor_parallel_size", "context_parallel_size",
        "sequence_parallel_degree", "ddp_timeout", "dataset_processes", "dataset_num_proc", "heads_k_stride", "lora_r"}


def _number(key: str, value: Any) -> Any:
    """A numeric key's string (`2e-5`, `500_000`) as the number Axolotl reads; anything else as it is (the schema
    then names the key). Steps keys may be fractions of the run (eval_steps: 0.25, warmup_steps: 0.1)."""
    if not isinstance(value, str) or isinstance(value, bool):
        return value
    text = value.strip().replace("_", "")
    try:
        number = float(text)
    except ValueError:
        return value
    if key in INTS or (key in STEPS and number.is_integer() and number >= 1):
        return int(number) if number.is_integer() else value
    return number


def numbers(raw: dict[str, Any]) -> dict[str, Any]:
    return {k: _number(k, v) if k in FLOATS | INTS | STEPS else v for k, v in raw.items()}


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
    axolotl_scope.check_scope(raw)  # first: a LoRA or DPO config is refused before anything else is said of it
    raw = numbers(raw)
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
    if raw.get("cosine_min_lr_ratio") is not None and raw.get("learning_rate") is not None:
        set_dotted(out, "optimizer.min_lr", raw["cosine_min_lr_ratio"] * raw["learning_rate"])
    if raw.get("gradient_checkpointing"):
        out["recompute"] = "full"
    if raw.get("reinit_weights"):  # Axolotl's pretraining from scratch in base_model's shape
        set_dotted(out, "model.init", "random")
        notes.append("reinit_weights: true -> model.init: random (random weights in base_model's shape, not its "
                     "pre-trained ones)")
    map_lora(raw, out, notes)
    _axolotl_data(raw, out)
    map_pretraining(raw.get("pretraining_dataset"), out, notes, has_sft=bool(raw.get("datasets")))
    ignored = [k for k in raw if k not in KNOWN and k not in DATA_KEYS]
    map_training(raw, out, notes, ignored)
    if ignored:  # said once, by the run's first lines (and plan), never as a Python warning from every rank
        notes.append(f"ignored Axolotl keys (not used by nd-adapter): {', '.join(sorted(ignored))}")
    out["notes"] = notes
    return out


_SPELLED = {native: key for key, native in (MAP | LORA_MAP).items()} | {
    f"data.{v}": k for k, v in DATA_KEYS.items()} | {"optimizer.betas": "adam_beta1 / adam_beta2",
                                                      "precision": "bf16 / fp16", "lora": "adapter",
                                                      "model.output_router_logits":
                                                          "model_config.output_router_logits"}


# ------------------------------------------------------------------------------------------------------------------
# Adapters

def map_lora(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """`adapter: lora|qlora` and the lora_* keys -> the `lora:` section, with PEFT's defaults where Axolotl passes
    None on (lora_r 8, lora_alpha 8). A LoRA key without `adapter`, a QLoRA without `load_in_4bit`, or 4-bit weights
    without an adapter are refused, as Axolotl refuses or ignores them: a run must do what its file says."""
    adapter = raw.get("adapter")
    given = [k for k in (*LORA_MAP, "load_in_8bit") if axolotl_scope.is_on(raw.get(k))]
    if not adapter:
        if given:
            raise bad(given[0], raw[given[0]], "a LoRA setting without `adapter` would train every weight",
                      f"set adapter: lora (or qlora with load_in_4bit: true), or remove {given[0]}")
        return
    if adapter not in ("lora", "qlora"):
        raise bad("adapter", adapter, "only LoRA and QLoRA adapters are supported",
                  "use adapter: lora (or qlora), or remove it for a full fine-tune")
    four_bit = axolotl_scope.is_on(raw.get("load_in_4bit"))
    eight_bit = axolotl_scope.is_on(raw.get("load_in_8bit"))
    if four_bit and eight_bit:
        raise bad("load_in_8bit", raw["load_in_8bit"], "conflicts with load_in_4bit: true",
                  "set one of them (4-bit for QLoRA)")
    if adapter == "qlora" and not four_bit:
        raise bad("adapter", adapter, "QLoRA trains adapters on a 4-bit base: it needs load_in_4bit: true (Axolotl "
                  "requires it too)", "set load_in_4bit: true, or use adapter: lora for a 16-bit base")
    for key, native in LORA_MAP.items():
        if raw.get(key) is not None and key != "load_in_4bit":
            set_dotted(out, native, raw[key])
    lora = out.setdefault("lora", {})
    for key, default in (("lora_r", 8), ("lora_alpha", 8)):
        if raw.get(key) is None:
            set_dotted(out, LORA_MAP[key], default)
            notes.append(f"{key}: {default} (PEFT's default, which Axolotl passes on for the unset key)")
    init = raw.get("peft_init_lora_weights")
    if init is not None and init is not True:
        raise bad("peft_init_lora_weights", init, "only PEFT's default initialisation is supported (A Kaiming-"
                  "uniform, B zero)", "remove it")
    pattern = raw.get("peft_layers_pattern")
    if pattern is not None and pattern not in ("layers", ["layers"]):
        raise bad("peft_layers_pattern", pattern, "these models' layers are `model.layers`", "remove it")
    if four_bit:
        kw = raw.get("bnb_config_kwargs") or {}
        for k, want in (("bnb_4bit_quant_type", "nf4"), ("bnb_4bit_use_double_quant", True)):
            if kw.get(k, want) != want:
                raise bad(f"bnb_config_kwargs.{k}", kw[k], f"the 4-bit base is {want} (QLoRA's) here",
                          f"set it to {want}, or remove it")
        lora["quantize_base"] = "nf4"
        notes.append(f"adapter: {adapter} with load_in_4bit: the frozen base in NF4 with double quantisation, bf16 "
                     "compute (bitsandbytes' format, as Axolotl loads it)")
    if eight_bit:
        lora["quantize_base"] = "int8"
        notes.append("load_in_8bit: the frozen base's linears stored in int8 as bitsandbytes quantises them (row-wise "
                     "absmax), each GEMM on the dequantised weight; LLM.int8's activation quantisation is not run")


# ------------------------------------------------------------------------------------------------------------------
# Training, precision, schedule, parallelism and kernel keys

def _on(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() in ("true", "auto", "full"))


def map_precision(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """Axolotl: `bf16: true|auto|full` -> bf16, `fp16: true` -> fp16, neither -> fp32 (full precision).
    `bfloat16: true` is bf16 too: its schema calls it "no AMP", but Axolotl's code passes `bf16 or bfloat16` to
    TrainingArguments.bf16 and loads the weights in bf16 for either (core/builders/base.py, utils/config)."""
    bf16, fp16 = raw.get("bf16"), raw.get("fp16")
    via_bfloat16 = not _on(bf16) and raw.get("bfloat16") is True
    if (_on(bf16) or via_bfloat16) and fp16 is True:
        raise bad("fp16", fp16, f"conflicts with {'bfloat16' if via_bfloat16 else 'bf16'}="
                  f"{True if via_bfloat16 else bf16!r}", "set only one of bf16 / fp16")
    if via_bfloat16:
        out["precision"], why = "bf16", "bfloat16: true, which Axolotl runs as bf16: true"
    elif _on(bf16):
        out["precision"], why = "bf16", f"bf16: {str(bf16).lower()}"
    elif fp16 is True:
        out["precision"], why = "fp16", "fp16: true"
    else:
        out["precision"], why = "fp32", "neither bf16 nor fp16 is on"
    notes.append(f"precision: {out['precision']} ({why})")


def map_schedule(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    pairs = (("warmup_steps", "warmup_ratio"), ("eval_steps", "evals_per_epoch"), ("save_steps", "saves_per_epoch"))
    for a, b in pairs:
        if raw.get(a) is not None and raw.get(b) is not None:
            raise bad(b, raw[b], f"Axolotl takes {a} or {b}, not both (here {a}={raw[a]!r})", "drop one of them")
    map_optimizer(raw.get("optimizer"), out, notes)
    for key in ("num_epochs", "warmup_ratio", "eval_steps", "evals_per_epoch", "saves_per_epoch"):
        if raw.get(key) is not None:
            set_dotted(out, MAP[key], raw[key])
    if raw.get("max_steps") is None and raw.get("num_epochs") is None:
        set_dotted(out, "optimizer.num_epochs", 1.0)
        notes.append("num_epochs: 1 (Axolotl's default: neither num_epochs nor max_steps is set)")
    if raw.get("save_steps") is None and raw.get("saves_per_epoch") is None and raw.get("datasets"):
        set_dotted(out, "checkpoint.saves_per_epoch", 1)  # Axolotl's save_strategy "epoch"
    if raw.get("save_total_limit") is None:
        set_dotted(out, "checkpoint.keep_last", 4)  # Axolotl's default save_total_limit
    if raw.get("output_dir") is not None:  # Axolotl's convention: checkpoints and the final model in output_dir
        set_dotted(out, "checkpoint.export_hf", raw["output_dir"])
    map_best(raw, out, notes)


def map_best(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """HF's load_best_model_at_end as Axolotl sets it (core/builders/causal.py): on unless set to false, or with
    early stopping, whenever there is an eval set and save_steps is a multiple of eval_steps, both in Axolotl's own
    units (fractions of the run from saves/evals_per_epoch). Unset counts as on, so an Axolotl run with e.g.
    evals_per_epoch 4 and saves_per_epoch 2 exports its best checkpoint, not its last: so does this one."""
    metric = raw.get("metric_for_best_model")
    if metric is not None and metric not in ("loss", "eval_loss"):
        raise bad("metric_for_best_model", metric, "the best checkpoint is chosen by the eval loss here (no other "
                  "metric is computed)", "remove it (or set eval_loss)")
    if _on(raw.get("greater_is_better")):
        raise bad("greater_is_better", raw["greater_is_better"], "with the eval loss it would keep the worst "
                  "checkpoint", "remove it")
    if raw.get("save_strategy") == "best":
        raise bad("save_strategy", "best", "saving only on a new best eval loss is not supported",
                  "remove it (load_best_model_at_end keeps and exports the best checkpoint)")
    def num(key: str) -> float | None:  # a malformed value is the schema's to refuse, with its key
        v = raw.get(key)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v > 0 else None

    asked, patience = raw.get("load_best_model_at_end"), raw.get("early_stopping_patience")
    epochs = num("num_epochs") or 1.0
    val, tests = num("val_set_size") or 0, raw.get("test_datasets")
    has_eval = bool((not tests and val > 0) or (tests and val == 0))
    save, every = num("save_steps"), num("eval_steps")
    if save is None and num("saves_per_epoch"):
        save = 1.0 / (num("saves_per_epoch") * epochs)
        save = save if save < 1.0 else None
    if every is None and (val or tests) and num("evals_per_epoch"):
        every = 1.0 / (num("evals_per_epoch") * epochs)
        every = every if every < 1.0 else None
    on = bool((asked is not False or patience) and has_eval and save and every and save % every == 0)
    set_dotted(out, "checkpoint.load_best", on)
    if on:
        notes.append("load_best_model_at_end: on (Axolotl's rule: " + ("set" if asked else
                     "early stopping" if asked is False else "unset counts as on") +
                     ", an eval set, save_steps a multiple of eval_steps): the saved checkpoint with the lowest eval "
                     "loss is reloaded and exported at the end")
    elif asked or patience:
        why = ("there is no eval set" if not has_eval else "no save_steps (saves_per_epoch gives one save per epoch)"
               if not save else "no eval_steps" if not every else f"save_steps {save:g} is not a multiple of "
               f"eval_steps {every:g}")
        notes.append(f"load_best_model_at_end: off, as Axolotl sets it ({why}): the last model is exported")


def map_optimizer(name: Any, out: dict[str, Any], notes: list[str]) -> None:
    """AdamW, with fp32 or 8-bit moments; any other optimizer is refused (it would train differently)."""
    if name is None or (isinstance(name, str) and name in ADAMW):
        return
    if isinstance(name, str) and name in ADAMW_PAGED:
        notes.append(f"optimizer: {name} -> AdamW with fp32 moments (bitsandbytes' 32-bit AdamW is the same update); "
                     + PAGING)
        return
    if not isinstance(name, str) or name not in ADAMW_8BIT:
        raise bad("optimizer", name, "nd-adapter trains with AdamW (fp32 or 8-bit moments) only",
                  f"use one of {', '.join(ADAMW + ADAMW_PAGED + ADAMW_8BIT)}, or remove the key")
    set_dotted(out, "optimizer.name", "adamw_8bit")
    paged = f"; {PAGING}" if name.startswith("paged_") else ""
    notes.append(f"optimizer: {name} -> bitsandbytes' AdamW8bit (block-wise 8-bit moments, fp32 master weights)"
                 f"{paged}")


def _comm(out: dict[str, Any], comm: str, why: str, notes: list[str]) -> None:
    set_dotted(out, "parallelism.cp_comm_type", comm)
    notes.append(f"context parallel: {why} -> parallelism.cp_comm_type {comm} "
                 f"({'K/V all-gathered' if comm == 'all_gather' else 'K/V passed around a ring'})")


def map_context_parallel(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """Both spellings: flat `context_parallel_size` (+ `ring_attn_func`, `heads_k_stride`) and the block."""
    func = raw.get("ring_attn_func")
    if func is not None:
        if not isinstance(func, str) or func not in RING_ATTN:
            raise bad("ring_attn_func", func, "no nd-adapter counterpart (its stripe layout is not implemented)",
                      f"use one of {', '.join(RING_ATTN)}, or remove it")
        _comm(out, RING_ATTN[func], f"ring_attn_func {func}", notes)
    if raw.get("heads_k_stride") is not None:
        notes.append(f"heads_k_stride {raw['heads_k_stride']} has no effect: nd-adapter moves all K/V heads at once")
    block = raw.get("context_parallel")
    if block is None:
        return
    if not isinstance(block, dict):
        raise bad("context_parallel", block, "must be a mapping (size, backend, rotate_method, load_balance, ...)",
                  "write `context_parallel:` with `size: N` indented below it")
    known = {"size", "backend", "ulysses_size", "ring_size", "rotate_method", "load_balance", "ring_impl"}
    for k in block:
        if not isinstance(k, str) or k not in known:
            raise bad(f"context_parallel.{k}", block[k], "unknown key", f"use {', '.join(sorted(known))}")
    for k in ("size", "ulysses_size", "ring_size"):
        if block.get(k) is not None and (isinstance(block[k], bool) or not isinstance(block[k], int) or block[k] < 1):
            raise bad(f"context_parallel.{k}", block[k], "must be a positive integer", "give e.g. 8")
    size = block.get("size", 1)
    flat = raw.get("context_parallel_size") or raw.get("sequence_parallel_degree")
    if flat is not None and flat != size:
        raise bad("context_parallel.size", size, f"conflicts with context_parallel_size={flat}", "give the size once")
    backend = block.get("backend", "auto")
    balance = block.get("load_balance", "head_tail")
    rotate = block.get("rotate_method", "allgather")
    for k, v in (("backend", backend), ("load_balance", balance), ("rotate_method", rotate)):
        if not isinstance(v, str):
            raise bad(f"context_parallel.{k}", v, "must be a name", "see Axolotl's context_parallel block")
    if backend in ("ulysses", "usp") or (block.get("ulysses_size") or 1) > 1:
        key, value = (("context_parallel.backend", backend) if backend in ("ulysses", "usp") else
                      ("context_parallel.ulysses_size", block["ulysses_size"]))
        raise bad(key, value, "Ulysses (all-to-all over attention heads) has no nd-adapter counterpart; its "
                  "context parallelism splits the sequence and moves K/V",
                  "use backend: ring (or auto), without ulysses_size")
    if backend not in ("auto", "ring"):
        raise bad("context_parallel.backend", backend, "unknown backend", "use auto or ring")
    if block.get("ring_size") not in (None, size):
        raise bad("context_parallel.ring_size", block["ring_size"], f"must equal size={size} (a pure ring)",
                  "remove ring_size")
    if balance not in ("head_tail", "auto"):
        raise bad("context_parallel.load_balance", balance, "nd-adapter always splits each sequence into 2·cp "
                  "chunks and gives rank r chunks r and 2·cp−1−r (head_tail)", "use load_balance: head_tail")
    if rotate not in ROTATE:
        raise bad("context_parallel.rotate_method", rotate, "unknown", "use allgather or alltoall")
    set_dotted(out, "parallelism.cp_size", size)
    if size > 1:
        _comm(out, ROTATE[rotate], f"size {size}, backend {backend}, rotate_method {rotate}", notes)


def map_expert_parallel(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """Axolotl's expert_parallel_size (its expert_parallel plugin) -> parallelism.ep_size. Axolotl's ep is a mesh
    axis beside dp_shard (ep × dp_shard = world): the dense weights are sharded over dp_shard and replicated over ep,
    and every rank reads its own data. Megatron lays ep over the data-parallel ranks instead, so the data-parallel
    size here is dp_shard × ep: the same arithmetic, the dense weights sharded over all of them."""
    cap = raw.get("expert_parallel_token_capacity")
    if cap is not None:
        raise bad("expert_parallel_token_capacity", cap, "a per-expert token cap drops routed tokens; nd-adapter's "
                  "experts are dropless, as transformers'", "remove it")
    ep = raw.get("expert_parallel_size")
    if ep is None or ep == 1:
        return
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise bad("expert_parallel_size", ep, "must be a positive integer", "give e.g. 2 (1 disables it)")
    set_dotted(out, "parallelism.ep_size", ep)
    shard = raw.get("dp_shard_size")
    if isinstance(shard, int) and not isinstance(shard, bool):
        set_dotted(out, "parallelism.dp_shard_size", shard * ep)
    notes.append(f"expert_parallel_size: {ep} -> parallelism.ep_size: {ep}, laid over the data-parallel ranks as in "
                 "Megatron-Core" + (f" (dp_shard_size {shard} × ep {ep} = {shard * ep} data-parallel ranks: Axolotl's "
                                    "ep axis reads its own data too)" if isinstance(shard, int) else ""))


def _fsdp_block(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """fsdp_config's keys without Axolotl's optional `fsdp_` prefix, and how the file spells each."""
    block = raw.get("fsdp_config") or {}
    if not isinstance(block, dict):
        raise bad("fsdp_config", block, "must be a mapping", "write `fsdp_config:` with its keys indented below it")
    names = {str(k).removeprefix("fsdp_"): f"fsdp_config.{k}" for k in block}
    return {str(k).removeprefix("fsdp_"): v for k, v in block.items()}, names


def map_fsdp(raw: dict[str, Any], out: dict[str, Any], notes: list[str], ignored: list[str]) -> None:
    """FSDP's sharding onto DeepSpeed ZeRO: reshard_after_forward true (FULL_SHARD) = ZeRO-3, false = ZeRO-2."""
    block, names = _fsdp_block(raw)
    legacy = raw.get("fsdp")
    if not block and not legacy:
        return
    stage, why = 3, "FSDP's default (reshard after forward)"
    if legacy:
        if not isinstance(legacy, (str, list)):
            raise bad("fsdp", legacy, "must be a list of FSDP options", "write e.g. fsdp: [full_shard, auto_wrap]")
        opts = legacy.split() if isinstance(legacy, str) else [str(o) for o in legacy]
        for o in opts:
            if o in FSDP_STAGE:
                stage, why = FSDP_STAGE[o], f"fsdp: {o}"
            elif o not in ("auto_wrap", "offload"):
                raise bad("fsdp", legacy, f"{o!r} has no DeepSpeed counterpart here", "use full_shard or shard_grad_op")
    offload = block.get("offload_params") or (legacy and "offload" in str(legacy))
    if offload and raw.get("adapter"):  # what FSDP would move: adapters and a frozen (often 4-bit) base
        notes.append(f"{names.get('offload_params', 'fsdp: offload')}: not used: an adapter run keeps its frozen "
                     "base and its adapters on the GPU (`plan` says whether they fit)")
    elif offload:  # as an Axolotl DeepSpeed JSON's offload_param (map_deepspeed): where weights live, not the math
        notes.append(f"{names.get('offload_params', 'fsdp: offload')}: not used (memory placement only: the ZeRO "
                     "shards stay on the GPUs; `nd-adapter plan` says whether they fit, and `--search` what does)")
    if block.get("reshard_after_forward") is not None:
        stage = 3 if block["reshard_after_forward"] else 2
        why = f"{names['reshard_after_forward']}: {str(block['reshard_after_forward']).lower()}"
    if block.get("activation_checkpointing"):
        out["recompute"] = "full"
    set_dotted(out, "deepspeed.zero_stage", stage)
    what = ("ZeRO-3: weights, gradients and optimizer states sharded, each transformer layer gathered for its "
            "forward and backward (FSDP FULL_SHARD)" if stage == 3 else
            "ZeRO-2: whole 16-bit weights on every GPU, gradients and optimizer states sharded (FSDP SHARD_GRAD_OP)")
    notes.append(f"FSDP -> DeepSpeed: {why} -> deepspeed.zero_stage {stage} ({what}); checkpoints are DeepSpeed's, "
                 "the final model a full HF export")
    ignored += [names[k] for k in block if k not in FSDP_USED]


def kernel_note(raw: dict[str, Any], ignored: list[str]) -> str | None:
    """One line for every key that picks a peer's kernels; plugins that are neither kernels nor context parallelism
    join the ignored keys."""
    named = [f"{k}: {str(raw[k]).lower() if isinstance(raw[k], bool) else raw[k]}" for k in sorted(KERNEL_KEYS)
             if k in raw and raw[k] not in (None, False)]
    plugins = raw.get("plugins") or []
    for p in plugins if isinstance(plugins, list) else [plugins]:
        kind = axolotl_scope.plugin_kind(p)
        if kind == "kernel":
            named.append(f"plugin {str(p).rsplit('.', 1)[-1]}")
        elif kind == "harmless":
            ignored.append(f"plugins[{p}]")
    if not named:
        return None
    return ("kernels: nd-adapter's own are used (SDPA attention, fused RoPE, SwiGLU and vocab-parallel cross-entropy)"
            f", not the ones named by {', '.join(named)}")


def map_batch(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """Axolotl's `batch_size`: gradient_accumulation_steps = batch_size // micro_batch_size (per process, as Axolotl
    computes it: every data-parallel rank adds its own micro-batches on top)."""
    bs = raw.get("batch_size")
    if bs is None:
        return
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
        raise bad("batch_size", bs, "must be a positive whole number",
                  "give e.g. 32, or use gradient_accumulation_steps")
    if raw.get("gradient_accumulation_steps") is not None:
        raise bad("batch_size", bs, "Axolotl takes gradient_accumulation_steps or batch_size, not both "
                  f"(here gradient_accumulation_steps={raw['gradient_accumulation_steps']!r})", "drop one of them")
    mbs = raw.get("micro_batch_size")
    if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1:
        raise bad("batch_size", bs, "needs a positive micro_batch_size (Axolotl sets gradient_accumulation_steps = "
                  "batch_size // micro_batch_size)", "add micro_batch_size")
    if bs < mbs:
        raise bad("batch_size", bs, f"smaller than micro_batch_size={mbs}",
                  "raise batch_size or lower micro_batch_size")
    set_dotted(out, "batch.gradient_accumulation_steps", bs // mbs)
    notes.append(f"batch_size {bs}: gradient_accumulation_steps = {bs} // micro_batch_size {mbs} = {bs // mbs} "
                 "(Axolotl's rule, per data-parallel rank)")


def _ds_json(raw: dict[str, Any]) -> tuple[dict[str, Any], str]:
    value = raw["deepspeed"]
    if isinstance(value, dict):
        return value, "the deepspeed block"
    if not isinstance(value, str) or not value:
        raise bad("deepspeed", value, "must be the path of a DeepSpeed JSON (or a mapping)",
                  "give e.g. deepspeed_configs/zero3_bf16.json, or remove the key")
    path = Path(value)
    if not path.is_file():
        raise bad("deepspeed", value, "no such file (read relative to the working directory, then the config file's)",
                  "give the path of the DeepSpeed JSON (Axolotl's deepspeed_configs/zero*.json), or remove the key")
    try:
        doc = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise bad("deepspeed", value, "not valid JSON", "fix the file, or remove the key")
    if not isinstance(doc, dict):
        raise bad("deepspeed", value, "not a JSON object", "give a DeepSpeed config file")
    return doc, path.name


def map_deepspeed(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """Axolotl's `deepspeed:` JSON: its ZeRO stage and precision are honoured; offload (memory placement, same math)
    is not used and said; batch and clipping numbers must agree with the YAML's; the rest is nd-adapter's own."""
    if raw.get("deepspeed") is None:
        return
    if raw.get("fsdp_config") or raw.get("fsdp"):
        raise bad("deepspeed", raw["deepspeed"], "conflicts with the FSDP keys (fsdp / fsdp_config)",
                  "give one of deepspeed or fsdp_config")
    doc, name = _ds_json(raw)
    zero = doc.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise bad("deepspeed", name, "zero_optimization must be a mapping", "fix the DeepSpeed JSON")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise bad("deepspeed", name, f"zero_optimization.stage={stage!r} is not 0-3", "fix the DeepSpeed JSON")
    mapped = 3 if stage == 3 else 2
    set_dotted(out, "deepspeed.zero_stage", mapped)
    said = f"deepspeed {name}: zero_optimization.stage {stage} -> deepspeed.zero_stage {mapped}"
    if stage < 2:
        said += " (the same maths; stage 2 also shards the gradients)"
    offload = [k for k in ("offload_optimizer", "offload_param")
               if isinstance(zero.get(k), dict) and zero[k].get("device") not in (None, "none")]
    if offload:
        said += f"; {' and '.join(offload)} not used (memory placement only: `nd-adapter plan` says whether it fits)"
    for section, prec in (("bf16", "bf16"), ("fp16", "fp16")):
        block = doc.get(section)
        if isinstance(block, dict) and block.get("enabled") is True:
            if out.get("precision") not in (prec, None) and (raw.get("bf16") is not None or raw.get("fp16")):
                raise bad("deepspeed", name, f"{section}.enabled true conflicts with the YAML's precision "
                          f"({out['precision']})", f"make them agree (e.g. {section}: true in the YAML)")
            out["precision"] = prec
            said += f"; {section}.enabled -> precision {prec}"
            notes[:] = [f"precision: {prec} ({name}: {section}.enabled true)" if n.startswith("precision:") else n
                        for n in notes]
    said += _master_and_states(doc, name, out)
    for key, yaml_key, default in (("train_micro_batch_size_per_gpu", "micro_batch_size", 1),
                                   ("gradient_accumulation_steps", "gradient_accumulation_steps", 1),
                                   ("gradient_clipping", "max_grad_norm", None)):
        v = doc.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            mine = raw.get(yaml_key, default)
            if mine is not None and v != mine:
                raise bad("deepspeed", name, f"{key}={v} disagrees with {yaml_key}={mine}",
                          f'set "{key}": "auto" in the JSON, or make them agree')
    notes.append(said + "; its other settings are nd-adapter's own (`nd-adapter plan --format json` shows the JSON)")


def _master_and_states(doc: dict, name: str, out: dict[str, Any]) -> str:
    """DeepSpeed's bf16.bf16_master_weights_and_grads + bf16_optimizer_states (no fp32 master, bf16 moments) change
    what is trained: both -> optimizer.state_dtype bf16; one alone, or fp16 masters, is refused."""
    bf16, fp16 = doc.get("bf16") or {}, doc.get("fp16") or {}
    if isinstance(fp16, dict) and fp16.get("fp16_master_weights_and_grads") is True:
        raise bad("deepspeed", name, "fp16.fp16_master_weights_and_grads (fp16 master weights) is not built",
                  "remove it (fp32 master weights), or train in bf16 with bf16 master weights and states")
    if not isinstance(bf16, dict):
        return ""
    master, states = (bf16.get(k) is True for k in ("bf16_master_weights_and_grads", "bf16_optimizer_states"))
    if master and states:
        set_dotted(out, "optimizer.state_dtype", "bf16")
        return "; bf16.bf16_master_weights_and_grads + bf16_optimizer_states -> optimizer.state_dtype bf16"
    if master:
        raise bad("deepspeed", name, "bf16.bf16_master_weights_and_grads without bf16_optimizer_states (bf16 masters "
                  "with fp32 moments) is not built", "set bf16_optimizer_states: true too (optimizer.state_dtype: "
                  "bf16), or remove it")
    if states:
        raise bad("deepspeed", name, "bf16.bf16_optimizer_states needs bf16_master_weights_and_grads (DeepSpeed "
                  "refuses it alone too)", "set both (optimizer.state_dtype: bf16), or neither")
    return ""


def map_training(raw: dict[str, Any], out: dict[str, Any], notes: list[str], ignored: list[str]) -> None:
    map_precision(raw, out, notes)
    map_batch(raw, out, notes)
    map_schedule(raw, out, notes)
    map_context_parallel(raw, out, notes)
    map_expert_parallel(raw, out, notes)
    map_fsdp(raw, out, notes, ignored)
    map_deepspeed(raw, out, notes)
    if raw.get("default_system_message") is not None:
        notes.append("default_system_message has no effect, as in Axolotl (its chatml template names no default "
                     "system message); give the system turn in the data, or a field_system column")
    if _on(raw.get("save_only_model")):  # HF Trainer's: checkpoints without optimizer state, which cannot resume
        notes.append("save_only_model: checkpoints still keep the optimizer state, so that --resume (at any layout) "
                     "continues exactly; their size and the disk they need are in the first lines. The trained model "
                     "alone is what output_dir gets at the end")
    over = raw.get("model_config", raw.get("overrides_of_model_config")) or {}
    if "output_router_logits" in over:  # the only override mapped (axolotl_scope refuses the rest)
        set_dotted(out, "model.output_router_logits", over["output_router_logits"])
    if _on(raw.get("torch_compile")):  # a speed key: compiled layers where the layout allows (config/load.py)
        set_dotted(out, "model.compile", "auto")
    note = kernel_note(raw, ignored)
    if note:
        notes.append(note)


# ------------------------------------------------------------------------------------------------------------------
# Datasets

PRETRAIN_USED = {"path", "type", "text_column", "field", "split", "name", "data_files", "skip", "trust_remote_code"}


def map_pretraining(value: Any, out: dict[str, Any], notes: list[str], *, has_sft: bool) -> None:
    """Axolotl's continued pretraining (`pretraining_dataset`, streamed from the hub there) from local files onto
    nd-adapter's pretraining data (data.files): documents tokenised once into a cache, joined with EOS and cut into
    sequence_len samples, every token trained. Axolotl reads only the first entry; hub names are refused."""
    if value is None:
        return
    entries = [value] if isinstance(value, str) else value
    if not isinstance(entries, list) or not entries:
        raise bad("pretraining_dataset", value, "must be a list of datasets (or one path)",
                  "write `- path: data/corpus.jsonl` below it")
    if has_sft:
        raise bad("pretraining_dataset", value, "given with datasets: Axolotl then pretrains and drops the SFT "
                  "datasets", "give one of pretraining_dataset or datasets")
    entry = entries[0] if isinstance(entries[0], dict) else {"path": entries[0]}
    unknown = sorted(set(entry) - PRETRAIN_USED)
    if unknown:
        raise bad(f"pretraining_dataset[0].{unknown[0]}", entry[unknown[0]], "a key nd-adapter does not support",
                  f"use {', '.join(sorted(PRETRAIN_USED))}")
    path = entry.get("path")
    if not isinstance(path, str) or not path:
        raise bad("pretraining_dataset[0].path", path, "missing", "give the local file or directory of the corpus")
    if entry.get("type", "pretrain") not in ("pretrain", "completion"):
        raise bad("pretraining_dataset[0].type", entry["type"], "pretraining reads raw text",
                  "use type: pretrain (or completion)")
    if entry.get("skip"):
        raise bad("pretraining_dataset[0].skip", entry["skip"], "skipping rows of the corpus is not supported",
                  "remove it (drop the rows from the files instead)")
    root = Path(path)
    if not root.exists():
        raise bad("pretraining_dataset[0].path", path, "not a local file or directory: nd-adapter does not stream "
                  "hub datasets (clusters are often offline)", f"download it (`hf download {path} --repo-type "
                  "dataset`) and point path at its jsonl/txt/parquet files")
    files = entry.get("data_files")
    files = [str(root / f) for f in ([files] if isinstance(files, str) else files)] if files else [str(root)]
    set_dotted(out, "data.files", files)
    set_dotted(out, "data.text_key", entry.get("text_column") or entry.get("field") or "text")
    notes.append(f"pretraining_dataset: {path} -> data.files (documents joined with EOS and cut into sequence_len "
                 "samples, every token trained; Axolotl truncates each document to sequence_len instead)"
                 + ("; only the first entry is read, as in Axolotl" if len(entries) > 1 else ""))


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
    for key, target in DATA_KEYS.items():
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


__all__ = ["MARKERS", "KEYS", "from_axolotl", "map_training"]
