"""Axolotl keys that change what is trained and that nd-adapter does not do: refused in one line when they are on.

An Axolotl YAML must do here what it says. A LoRA config run as a full fine-tune, a DPO config run as SFT, or a
run that ignores `unfrozen_parameters` would all finish and export a model, only not the one the user asked for.
So each key here is refused when set, naming the key and what to do instead. Keys that only touch speed, logging,
the hub or memory placement are not listed: they are mapped or reported as ignored by axolotl.py and its mappings.
Checked against Axolotl's config reference and schemas (axolotl-ai-cloud/axolotl, 2025-06 and main of 2026-11).
"""
from __future__ import annotations

from typing import Any

from adapter.errors import bad

_FULL = "remove it for a full fine-tune of every weight, or run this config with Axolotl"
_SFT = "remove it and give an SFT dataset (e.g. type: chat_template), or run this config with Axolotl"
_ONE_LR = "remove it: nd-adapter trains every weight with one learning_rate and its schedule"
# a GPTQ base holds packed int4 codes: its 16-bit original (and load_in_4bit for a 4-bit frozen base) is the way
_16BIT = ("remove it and point base_model at the 16-bit checkpoint the GPTQ one was quantised from (nd-adapter loads "
          "16/32-bit weights); for a 4-bit frozen base use adapter: qlora with load_in_4bit: true")
_LORA = "remove it for plain LoRA (adapter: lora), or run this config with Axolotl"
_VOCAB = "remove it, and give new tokens under tokens: (they get new embedding rows)"

# key -> (why it cannot be honoured, the fix)
UNSUPPORTED: dict[str, tuple[str, str]] = {
    # adapters, freezing (adapter: lora|qlora and their keys are mapped in axolotl_train.py's map_lora)
    "lisa_n_layers": ("LISA (a few layers trained at a time) is not supported", _FULL),
    "relora_steps": ("ReLoRA (adapters merged and restarted during training) is not supported", _LORA),
    "relora": ("ReLoRA (adapters merged and restarted during training) is not supported", _LORA),
    "peft_ensure_weight_tying": ("tying trained copies of tied embeddings is not supported (each trains alone, as "
                                 "PEFT's default does)", "remove it"),
    "loftq_config": ("LoftQ initialisation is not supported", "remove it (adapters start as PEFT's default)"),
    "peft": ("LoftQ initialisation (peft.loftq_config) is not supported", "remove it"),
    "peft_layer_replication": ("duplicating layers changes the architecture; not supported", _FULL),
    # quantised weights
    "gptq": ("GPTQ-quantised base weights are not supported", _16BIT),
    "fp8": ("Axolotl's FP8 (torchao float8 on every linear) is not what nd-adapter runs", "use bf16: true, or "
            "--set precision=fp8 (nd-adapter's: the MLP matmuls in fp8, tp = 1)"),
    "float16": ("pure fp16 training is not supported", "use fp16: true (fp16 compute, fp32 master weights)"),
    # other objectives
    # rl: mapped (rl: dpo) or refused in one line by axolotl_rl.py
    "kd_trainer": ("knowledge distillation is not supported", "remove the KD plugin and its kd_* keys"),
    # data and tokens
    "added_tokens_overrides": ("renaming tokens changes the vocabulary", _VOCAB),
    "fix_untrained_tokens": ("rewriting the embeddings of untrained tokens is not supported", "remove it"),
    "shrink_embeddings": ("resizing the embeddings is not supported", "remove it"),
    "role_boundaries": ("custom role markers for image-text rows are not built (the format's own are used)",
                        "remove role_boundaries, or run this config with Axolotl"),
    "dataset_shard_num": ("training on one shard of the data is not supported",
                          "shard the files yourself, or remove dataset_shard_num / dataset_shard_idx"),
    "use_pose": ("PoSE position ids are not supported", "remove use_pose"),
    "s2_attention": ("shifted-sparse attention is not supported (attention here is exact and causal)",
                     "remove s2_attention"),
    # optimisation and schedule
    "optim_args": ("optimizer arguments beyond adam_beta1/2, adam_epsilon and weight_decay are not supported",
                   "remove it"),
    "optim_target_modules": ("per-module optimizers are not supported", _ONE_LR),
    "lr_groups": ("per-module learning rates are not supported", _ONE_LR),
    "embedding_lr": ("a separate embedding learning rate is not supported", _ONE_LR),
    "embedding_lr_scale": ("a separate embedding learning rate is not supported", _ONE_LR),
    "cosine_constant_lr_ratio": ("a constant phase inside the cosine schedule is not supported",
                                 "remove it (cosine_min_lr_ratio sets the floor)"),
    "lr_scheduler_kwargs": ("scheduler arguments are not supported", "remove it"),
    "neftune_noise_alpha": ("NEFTune embedding noise is not implemented", "remove it"),
    "noisy_embedding_alpha": ("NEFTune embedding noise is not implemented", "remove it"),
    "auto_find_batch_size": ("searching the batch size at run time is not supported",
                             "set micro_batch_size (`nd-adapter plan` says what fits)"),
    # resume
    "resume_from_checkpoint": ("nd-adapter resumes only from its own checkpoints, which it finds in output_dir",
                               "remove it: --resume (or auto_resume_from_checkpoints: true) continues from the "
                               "newest checkpoint in output_dir"),
}

# plugins: (tag in the module path, what it is); anything else is refused (distillation, freezing, gradient filters,
# other objectives or adapters all change what is trained)
KERNEL_PLUGINS = ("cut_cross_entropy", "liger", "integrations.kernels")
CP_PLUGIN = "integrations.context_parallel"
EP_PLUGIN = "integrations.expert_parallel"  # its expert_parallel_size is mapped (axolotl_parallel.map_expert_parallel)
HARMLESS_PLUGINS = ("integrations.lm_eval", "integrations.swanlab")  # evaluation / logging only: ignored


# Axolotl's model_type values that train the next-token loss on the LM head: causal LMs, and image-text checkpoints
# (their language model, on text; the class config.json names is what is built either way)
CAUSAL_CLASSES = ("ForCausalLM", "ForConditionalGeneration", "AutoModelForImageTextToText", "AutoModelForVision2Seq")


def is_on(value: Any) -> bool:
    """Set to something that does anything: not None/False/0/''/[]/{}."""
    return value is not None and value is not False and value != 0 and value != "" and value != [] and value != {}


def check_scope(raw: dict[str, Any]) -> None:
    """Refuse the first key that asks for training nd-adapter does not do (the order above: the weightiest first)."""
    for key, (why, fix) in UNSUPPORTED.items():
        if key in raw and is_on(raw[key]):
            raise bad(key, raw[key], why, fix)
    if is_on(raw.get("group_by_length")) and not is_on(raw.get("sample_packing")) \
            and not is_on(raw.get("curriculum_sampling")):  # HF's sampler then (Axolotl's trainer: without packing)
        raise bad("group_by_length", raw["group_by_length"], "HF's length-grouped sampler (micro-batches of similar "
                  "lengths) is not built: the batches would differ", "remove it (random order), or set "
                  "sample_packing: true")
    kind = raw.get("model_type")
    scores = is_on(raw.get("reward_model")) and isinstance(kind, str) and kind.endswith("ForSequenceClassification")
    scores |= is_on(raw.get("process_reward_model")) and isinstance(kind, str) and kind.endswith(
        "ForTokenClassification")
    if kind is not None and not (isinstance(kind, str) and kind.endswith(CAUSAL_CLASSES)) and not scores:
        raise bad("model_type", kind, "nd-adapter trains causal language models (next-token loss on the model's "
                  "LM head), reward models (reward_model: true) with a sequence-classification head and process "
                  "reward models (process_reward_model: true) with a token-classification head; this head is not "
                  "what it trains", "remove it (or use AutoModelForCausalLM), or run this config with Axolotl")
    rev = raw.get("model_revision")
    if rev not in (None, "main"):
        raise bad("model_revision", rev, "only the cached default revision of base_model is read",
                  "remove it, or point base_model at that revision's snapshot directory")
    over = raw.get("model_config", raw.get("overrides_of_model_config"))
    if is_on(over):  # Axolotl sets each key on the HF config before loading: only the MoE loss switch is mapped
        if not isinstance(over, dict):
            raise bad("model_config", over, "must be a mapping of config.json keys", "write it as key: value lines")
        for key, value in over.items():
            if key != "output_router_logits":
                raise bad(f"model_config.{key}", value, "overriding this config.json key changes the model and is "
                          "not mapped (only output_router_logits is)", "edit config.json in a copy of the model")
            if not isinstance(value, bool):
                raise bad("model_config.output_router_logits", value, "must be true or false", "write true or false")
    tok = raw.get("tokenizer_config")
    if tok not in (None, raw.get("base_model"), raw.get("base_model_config")):
        raise bad("tokenizer_config", tok, "a tokenizer other than base_model's is not supported",
                  "remove it, or copy that tokenizer's files into the model directory")


def plugin_kind(plugin: Any) -> str:
    """'kernel', 'cp', 'ep', 'harmless', or refused in one line."""
    name = str(plugin)
    if any(tag in name for tag in KERNEL_PLUGINS):
        return "kernel"
    if CP_PLUGIN in name:
        return "cp"
    if EP_PLUGIN in name:
        return "ep"
    if any(tag in name for tag in HARMLESS_PLUGINS):
        return "harmless"
    raise bad("plugins", name, "this plugin may change what is trained (distillation, freezing, gradient filters, "
              "other objectives) and has no nd-adapter counterpart", "remove it, or run this config with Axolotl")


KEYS = set(UNSUPPORTED) | {"model_revision", "tokenizer_config", "model_type"}

__all__ = ["UNSUPPORTED", "KEYS", "check_scope", "plugin_kind", "is_on"]
