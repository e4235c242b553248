"""Axolotl's booleans and numbers, read as Axolotl's own schema reads them, before any key is mapped.

Axolotl validates its YAML with pydantic v2 models in lax mode (the config, training, peft and fsdp modules of
src/axolotl/utils/schemas/; pydantic 2.12): a quoted `"false"` is False there (as are "0", "no", "off", "f", "n",
in any case), `"2e-5"` is 2e-5 and `"16.0"` is 16; `"maybe"` for a flag or `16.5` for a whole number is refused.
The same pydantic validators, built from the same annotations, read them here, so a quoted boolean plans exactly
as the real one. Two things pydantic lets through are refused in one line naming the key, because no setting means
them: true/false where a number is expected (`learning_rate: true` is lr 1.0 there) and non-finite numbers
(`.nan`, `"inf"`); whole numbers above 2**53 too (config/values.py). DeepSpeed reads its JSON's flags the same way
(its config models are pydantic too), so `map_deepspeed` reads them with `flag` below.
"""
from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from adapter.config.values import MAX_INT
from adapter.errors import bad

FLAG = bool | None
# bf16 / tf32 / torch_compile. `full`: the older spelling of bf16 Axolotl's trainer builder still tests for; read
# as bf16 here (its current schema refuses it)
AUTO_FLAG = Literal["auto", "full"] | bool | None
RECOMPUTE = Literal["offload", "offload_disk"] | bool | None  # gradient_checkpointing
INT = int | None
FLOAT = float | None  # learning_rate is `str | float` there, its string turned into float(...): the same numbers
STEPS = int | float | None  # whole steps or a fraction of the run (warmup_steps is `int` there; a fraction here)

TYPES: dict[str, Any] = {
    **dict.fromkeys((
        "auto_find_batch_size", "auto_resume_from_checkpoints", "bfloat16", "curriculum_sampling",
        "dataset_exact_deduplication", "dpo_padding_free", "eager_attention", "eval_sample_packing", "flash_attention",
        "flash_attn_cross_entropy", "flash_attn_fuse_mlp", "flash_attn_rms_norm", "flash_optimum", "flex_attention",
        "float16", "float32", "fp16", "fp8", "gptq", "greater_is_better", "load_best_model_at_end", "load_in_4bit",
        "load_in_8bit", "lora_embedding_kernel", "lora_fan_in_fan_out", "lora_mlp_kernel", "lora_o_kernel",
        "lora_qkv_kernel", "lora_target_linear", "lr_quadratic_warmup", "mean_resizing_embeddings",
        "pad_to_sequence_len", "peft_ensure_weight_tying", "peft_use_dora", "peft_use_rslora",
        "precompute_ref_log_probs", "process_reward_model", "reinit_weights", "relora",
        "resize_token_embeddings_to_32x", "reward_model", "s2_attention", "sage_attention", "sample_packing",
        "save_only_model", "sdp_attention", "shrink_embeddings", "shuffle_merged_datasets", "strict", "train_on_inputs",
        "use_pose", "use_tensorboard", "xformers_attention",
        # plugins' args (integrations/liger, cut_cross_entropy)
        "liger_rope", "liger_rms_norm", "liger_rms_norm_gated", "liger_layer_norm", "liger_swiglu",
        "liger_glu_activation", "liger_cross_entropy", "liger_fused_linear_cross_entropy", "cut_cross_entropy"),
        FLAG),
    **dict.fromkeys(("bf16", "tf32", "torch_compile"), AUTO_FLAG),
    "gradient_checkpointing": RECOMPUTE,
    **dict.fromkeys((
        "batch_size", "context_parallel_size", "dataset_num_proc", "dataset_processes", "dataset_shard_num",
        "ddp_timeout", "dp_replicate_size", "dp_shard_size", "early_stopping_patience", "evals_per_epoch",
        "fsdp_version", "gradient_accumulation_steps", "heads_k_stride", "lisa_n_layers", "logging_steps",
        "lora_alpha", "lora_r", "max_steps", "micro_batch_size", "min_sample_len", "save_total_limit",
        "saves_per_epoch", "seed", "sequence_parallel_degree", "tensor_parallel_size", "sequence_len",
        "expert_parallel_size", "expert_parallel_token_capacity"), INT),
    **dict.fromkeys((
        "learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "cosine_constant_lr_ratio",
        "cosine_min_lr_ratio", "embedding_lr", "embedding_lr_scale", "lora_dropout", "loraplus_lr_ratio",
        "loraplus_lr_embedding", "max_grad_norm", "neftune_noise_alpha", "noisy_embedding_alpha", "val_set_size",
        "warmup_ratio", "weight_decay", "num_epochs"), FLOAT),
    **dict.fromkeys(("eval_steps", "save_steps", "warmup_steps"), STEPS),
}
# fsdp_config's keys (its schemas' FSDPConfig; Axolotl also takes them with an `fsdp_` prefix)
FSDP_TYPES: dict[str, Any] = {
    **dict.fromkeys(("activation_checkpointing", "offload_params", "sync_module_states", "cpu_ram_efficient_loading",
                     "cpu_offload_pin_memory", "use_orig_params", "reshard_after_forward"), FLAG),
    **dict.fromkeys(("fsdp_version", "version", "min_num_params"), INT),
}
_ADAPTERS: dict[Any, TypeAdapter[Any]] = {}
_NUMBERS = (INT, FLOAT, STEPS)


def read(key: str, value: Any, kind: Any) -> Any:
    """`value` as Axolotl's schema reads a field of type `kind`, or one line naming `key`."""
    if value is None:
        return None
    if kind in _NUMBERS and isinstance(value, bool):
        raise bad(key, value, "a number is expected, not true/false (Axolotl's schema would read it as "
                  f"{float(value):g})", "give the number")
    adapter = _ADAPTERS.setdefault(kind, TypeAdapter(kind))
    try:
        out = adapter.validate_python(value)
    except ValidationError as err:
        raise bad(key, value, err.errors()[0]["msg"].rstrip("."), _fix(kind)) from None
    if isinstance(out, float) and not math.isfinite(out):
        raise bad(key, value, "not a finite number", "give a finite number")
    if any(isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT for v in (value, out)):
        raise bad(key, value, f"larger than any setting can be (at most 2**53 = {MAX_INT:,})", "give a smaller "
                  "number")
    if isinstance(value, int) and not isinstance(value, bool) and isinstance(out, float):
        return value  # the same number; kept as written, so that messages show it so (5, not 5.0)
    return out


def flag(key: str, value: Any) -> Any:
    """A DeepSpeed JSON's boolean (`"enabled": "true"`) as DeepSpeed's pydantic config reads it; "auto" (HF's
    placeholder) stays "auto"."""
    return value if value == "auto" else read(key, value, FLAG)


def _fix(kind: Any) -> str:
    return {FLAG: "write true or false", AUTO_FLAG: "write true, false or auto",
            RECOMPUTE: "write true, false or offload", INT: "give a whole number", FLOAT: "give a number",
            STEPS: "give a whole number of steps, or a fraction of the run below 1"}[kind]


def typed(raw: dict[str, Any]) -> dict[str, Any]:
    """The Axolotl file with each boolean or number key (and fsdp_config's) read as Axolotl's schema reads it."""
    out = {k: read(k, v, TYPES[k]) if k in TYPES else v for k, v in raw.items()}
    block = out.get("fsdp_config")
    if isinstance(block, dict):
        out["fsdp_config"] = {k: read(f"fsdp_config.{k}", v, FSDP_TYPES[name])
                              if (name := str(k).removeprefix("fsdp_")) in FSDP_TYPES else v
                              for k, v in block.items()}
    return out


__all__ = ["TYPES", "FSDP_TYPES", "read", "flag", "typed"]
