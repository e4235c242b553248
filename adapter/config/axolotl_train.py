"""Axolotl's keys for what is trained and how: precision, optimizer, LR schedule and cadences, batch size, the
best-checkpoint rule and LoRA / QLoRA adapters. Each mapping takes what corresponds exactly, refuses in one line what
cannot be honoured, and appends to `notes` what the run's first lines must say."""
from __future__ import annotations

from typing import Any

from adapter.config import axolotl_scope
from adapter.config.schema import set_dotted
from adapter.errors import bad

ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw")
ADAMW_8BIT = ("adamw_8bit", "adamw_bnb_8bit", "adamw_torch_8bit", "paged_adamw_8bit")  # bitsandbytes', torchao's
ADAMW_4BIT = ("adamw_torch_4bit",)  # torchao's AdamW4bit, as transformers' Trainer builds it
ADAMW_PAGED = ("paged_adamw_32bit",)  # bitsandbytes' AdamW with fp32 states in paged memory: AdamW's update
PAGING = "paging is not used: the states stay on the GPU (`nd-adapter plan` says whether they fit)"
# LoRA's keys (map_lora): carried over only with `adapter: lora|qlora`, a LoRA key without it is refused
LORA_MAP = {"lora_r": "lora.r", "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout",
            "lora_target_modules": "lora.target_modules", "lora_target_linear": "lora.target_linear",
            "lora_modules_to_save": "lora.modules_to_save", "peft_layers_to_transform": "lora.layers",
            "peft_use_rslora": "lora.rslora", "peft_use_dora": "lora.use_dora", "lora_model_dir": "lora.init_from",
            "load_in_4bit": "lora.quantize_base",
            "lora_target_parameters": "lora.target_parameters", "quantize_moe_experts": "lora.quantize_experts",
            "loraplus_lr_ratio": "lora.plus_lr_ratio", "loraplus_lr_embedding": "lora.plus_lr_embedding",
            "lora_rank_pattern": "lora.rank_pattern", "lora_alpha_pattern": "lora.alpha_pattern",
            "peft_trainable_token_indices": "lora.trainable_token_indices"}
LORA_KEYS = set(LORA_MAP) | {"adapter", "bnb_config_kwargs", "peft_layers_pattern", "peft_init_lora_weights",
                             "load_in_8bit", "lora_fan_in_fan_out"}
# Schedule keys mapped by map_schedule (Axolotl key -> native key)
SCHEDULE_MAP = {"num_epochs": "optimizer.num_epochs", "warmup_ratio": "optimizer.warmup_ratio", "eval_steps":
                "eval.every", "evals_per_epoch": "eval.per_epoch", "saves_per_epoch": "checkpoint.saves_per_epoch"}


def map_lora(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """`adapter: lora|qlora` and the lora_* keys -> the `lora:` section, with PEFT's defaults where Axolotl passes
    None on (lora_r 8, lora_alpha 8). A QLoRA without `load_in_4bit`, or 8/4-bit weights without an adapter are
    refused, as Axolotl refuses them; lora_* keys without `adapter` are unused, as in Axolotl (its full fine-tune
    examples keep them beside an empty `adapter:`), and the first lines say so."""
    adapter = raw.get("adapter")
    given = [k for k in (*LORA_MAP, "load_in_8bit") if axolotl_scope.is_on(raw.get(k))]
    if not adapter and raw.get("loraplus_lr_ratio") is not None:  # Axolotl's trainer applies it to any model
        raise bad("loraplus_lr_ratio", raw["loraplus_lr_ratio"], "LoRA+ without `adapter`: Axolotl would still group "
                  "the full fine-tune's parameters as PEFT's create_loraplus_optimizer does (every norm and bias at "
                  "lr × the ratio, no weight decay anywhere)", "remove it, or set adapter: lora")
    if not adapter:
        for k in ("load_in_4bit", "load_in_8bit"):  # Axolotl refuses an 8/4-bit base without an adapter
            if axolotl_scope.is_on(raw.get(k)):
                raise bad(k, raw[k], "a LoRA setting without `adapter` would train every weight",
                          f"set adapter: lora (or qlora with load_in_4bit: true), or remove {k}")
        if given:  # Axolotl's full fine-tune examples keep lora_* keys beside an empty `adapter:`; it ignores them
            notes.append(f"{', '.join(given)}: unused, as in Axolotl: `adapter` is unset, so this is a full fine-tune "
                         "of every weight (set adapter: lora to train adapters instead)")
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
    if axolotl_scope.is_on(raw.get("lora_fan_in_fan_out")):  # PEFT 0.21's dispatch_default and bnb's layers
        notes.append("lora_fan_in_fan_out: true changes nothing: PEFT sets fan_in_fan_out from each layer's type "
                     "(false on nn.Linear and bitsandbytes' layers, true on GPT-2's Conv1D) whatever the key says")
    init = raw.get("peft_init_lora_weights")
    if init == "gaussian":
        set_dotted(out, "lora.init_weights", "gaussian")
    elif init is not None and init is not True:
        raise bad("peft_init_lora_weights", init, "only PEFT's default (A Kaiming-uniform, B zero) and gaussian "
                  "initialisations are supported (PiSSA, OLoRA, LoftQ and the data-driven ones change or read the "
                  "base weights)", "remove it, or use gaussian")
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


def enabled(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() in ("true", "auto", "full"))


# Axolotl's model_quantization_config (its loaders/model.py): the transformers class it builds from
# model_quantization_config_kwargs and hands to from_pretrained
QUANT_CLASSES = ("Mxfp4Config", "FineGrainedFP8Config")


def map_dequantize(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """`model_quantization_config: Mxfp4Config` (or FineGrainedFP8Config) with `dequantize: true`: the pre-quantised
    checkpoint loaded as 16-bit weights that train (model.dequantize; Axolotl's gpt-oss examples). Without
    `dequantize: true` the codes would stay and train through their own kernels, which nd-adapter does not build."""
    name, kw = raw.get("model_quantization_config"), raw.get("model_quantization_config_kwargs")
    if name is None:
        return
    if name not in QUANT_CLASSES:
        raise bad("model_quantization_config", name, f"Axolotl builds {' or '.join(QUANT_CLASSES)} only",
                  "use one of them, or remove it")
    if not isinstance(kw, dict) or kw.get("dequantize") is not True:
        raise bad("model_quantization_config_kwargs", kw, f"{name} without dequantize: true keeps the checkpoint's "
                  "quantised codes to train through their kernels, which nd-adapter does not build",
                  "set model_quantization_config_kwargs: {dequantize: true} (16-bit weights that train)")
    rest = sorted(k for k in kw if k != "dequantize")
    if rest:
        notes.append(f"model_quantization_config_kwargs {', '.join(rest)}: no effect on a dequantized checkpoint")
    set_dotted(out, "model.dequantize", True)


def map_precision(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """Axolotl: `bf16: true|auto|full` -> bf16, `fp16: true` -> fp16, neither -> fp32 (full precision).
    `bfloat16: true` is bf16 too: its schema calls it "no AMP", but Axolotl's code passes `bf16 or bfloat16` to
    TrainingArguments.bf16 and loads the weights in bf16 for either (core/builders/base.py, utils/config)."""
    bf16, fp16 = raw.get("bf16"), raw.get("fp16")
    via_bfloat16 = not enabled(bf16) and raw.get("bfloat16") is True
    if (enabled(bf16) or via_bfloat16) and fp16 is True:
        raise bad("fp16", fp16, f"conflicts with {'bfloat16' if via_bfloat16 else 'bf16'}="
                  f"{True if via_bfloat16 else bf16!r}", "set only one of bf16 / fp16")
    if via_bfloat16:
        out["precision"], why = "bf16", "bfloat16: true, which Axolotl runs as bf16: true"
    elif enabled(bf16):
        out["precision"], why = "bf16", f"bf16: {str(bf16).lower()}"
    elif fp16 is True:
        out["precision"], why = "fp16", "fp16: true"
    else:
        out["precision"], why = "fp32", "neither bf16 nor fp16 is on"
    notes.append(f"precision: {out['precision']} ({why})")


def map_master_weights(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """What Axolotl's bf16 keeps of the trained weights (docs/config.md, "Precision as Axolotl trains"). Axolotl loads
    the weights in bf16 for `bf16`/`bfloat16` (utils/config.resolve_dtype). Under DeepSpeed (`deepspeed:`) the ZeRO
    optimizer keeps fp32 masters and moments (its JSON's bf16 section may say otherwise: axolotl_parallel); under
    FSDP (fsdp_config, or the dp_shard / context-parallel axes Accelerate builds FSDP2 for) Accelerate upcasts the
    trained weights to fp32 masters (fsdp2_prepare_model, mixed precision on). Otherwise (one GPU, DDP, tensor
    parallelism) transformers' Trainer steps torch's AdamW on the bf16 weights themselves: no master, bf16 moments
    -> optimizer.state_dtype bf16. LoRA's adapters are PEFT's fp32 ones either way (unchanged here); the 8/4-bit and
    paged optimizers keep nd-adapter's fp32 master (bf16 weights stepped in place by them are not built), said."""
    if out.get("precision") != "bf16" or raw.get("adapter") or (out.get("optimizer") or {}).get("state_dtype"):
        return
    fsdp = [k for k in ("fsdp_config", "fsdp", "fsdp_version") if raw.get(k)] + [
        k for k in ("dp_shard_size", "context_parallel_size") if isinstance(raw.get(k), int) and raw[k] > 1]
    if raw.get("deepspeed") or fsdp:
        how = "DeepSpeed's ZeRO keeps" if raw.get("deepspeed") else f"{fsdp[0]}: Accelerate's FSDP upcasts the " \
            "trained weights to"
        notes.append(f"master weights: fp32 masters and moments ({how} fp32 masters of Axolotl's bf16 weights)")
        return
    name = raw.get("optimizer")
    if name is not None and name not in ADAMW:
        notes.append(f"master weights: fp32 (optimizer {name}: Axolotl's run steps it on the bf16 weights themselves; "
                     "nd-adapter keeps an fp32 master beside its moments)")
        return
    set_dotted(out, "optimizer.state_dtype", "bf16")
    notes.append("master weights: none -> optimizer.state_dtype: bf16 (bf16 without deepspeed or FSDP: Axolotl loads "
                 "the weights in bf16 and transformers' Trainer steps torch's AdamW on them: bf16 weights updated in "
                 "place, bf16 moments)")


def map_schedule(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    pairs = (("warmup_steps", "warmup_ratio"), ("eval_steps", "evals_per_epoch"), ("save_steps", "saves_per_epoch"))
    for a, b in pairs:
        if raw.get(a) is not None and raw.get(b) is not None:
            raise bad(b, raw[b], f"Axolotl takes {a} or {b}, not both (here {a}={raw[a]!r})", "drop one of them")
    map_optimizer(raw.get("optimizer"), out, notes)
    for key in ("num_epochs", "warmup_ratio", "eval_steps", "evals_per_epoch", "saves_per_epoch"):
        if raw.get(key) is not None:
            set_dotted(out, SCHEDULE_MAP[key], raw[key])
    if raw.get("max_steps") is None and raw.get("num_epochs") is None:
        set_dotted(out, "optimizer.num_epochs", 1.0)
        notes.append("num_epochs: 1 (Axolotl's default: neither num_epochs nor max_steps is set)")
    if not map_save_strategy(raw, out, notes) and raw.get("save_steps") is None \
            and raw.get("saves_per_epoch") is None and raw.get("datasets"):
        set_dotted(out, "checkpoint.saves_per_epoch", 1)  # Axolotl's default save_strategy "epoch"
    if raw.get("save_total_limit") is None:
        set_dotted(out, "checkpoint.keep_last", 4)  # Axolotl's default save_total_limit
    if raw.get("output_dir") is not None:  # Axolotl's convention: checkpoints and the final model in output_dir
        set_dotted(out, "checkpoint.export_hf", raw["output_dir"])
    map_best(raw, out, notes)


def map_save_strategy(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> bool:
    """HF's save_strategy as Axolotl passes it (core/builders/base.py): save_steps wins ("steps"); else the value;
    else "epoch". "no" writes no checkpoint at all, and output_dir still gets the trained model at the end
    (Axolotl's save_model). True when it decided the cadence."""
    value = raw.get("save_strategy")
    value = "no" if value is False else value  # YAML 1.1 reads an unquoted no as false
    if value is None or value == "best":  # "best": map_best refuses it
        return False
    if value not in ("no", "steps", "epoch"):
        raise bad("save_strategy", value, "not one of HF's save strategies", 'set "no", "steps" or "epoch"')
    if raw.get("save_steps") is not None and value != "steps":  # Axolotl's own check (schemas/validation.py)
        raise bad("save_strategy", value, f"save_steps={raw['save_steps']!r} asks for saves every N steps",
                  "set save_strategy: steps, or remove save_steps")
    if value == "no":
        if raw.get("saves_per_epoch") is not None:
            raise bad("save_strategy", value, f"saves_per_epoch={raw['saves_per_epoch']!r} asks for saves",
                      "remove one of them")
        set_dotted(out, "checkpoint.dir", None)
        notes.append("save_strategy: no -> no checkpoints (nothing to --resume from, a preemption signal saves "
                     "nothing)" + (f"; the trained model goes to output_dir {raw['output_dir']} at the end"
                                   if raw.get("output_dir") is not None else ""))
        return True
    if value == "steps" and raw.get("save_steps") is None:
        set_dotted(out, "checkpoint.save_every", 500)  # HF TrainingArguments' save_steps default
        notes.append("save_strategy: steps without save_steps -> a checkpoint every 500 steps (HF's default)")
        return True
    if value == "epoch" and raw.get("saves_per_epoch") is None:
        set_dotted(out, "checkpoint.saves_per_epoch", 1)
    return True


def map_best(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """HF's load_best_model_at_end as Axolotl sets it (core/builders/causal.py): on unless set to false, or with
    early stopping, whenever there is an eval set and save_steps is a multiple of eval_steps, both in Axolotl's own
    units (fractions of the run from saves/evals_per_epoch). Unset counts as on, so an Axolotl run with e.g.
    evals_per_epoch 4 and saves_per_epoch 2 exports its best checkpoint, not its last: so does this one."""
    metric = raw.get("metric_for_best_model")
    if metric is not None and metric not in ("loss", "eval_loss"):
        raise bad("metric_for_best_model", metric, "the best checkpoint is chosen by the eval loss here (no other "
                  "metric is computed)", "remove it (or set eval_loss)")
    if enabled(raw.get("greater_is_better")):
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
    saves_per_epoch, evals_per_epoch = num("saves_per_epoch"), num("evals_per_epoch")
    if save is None and saves_per_epoch:
        save = 1.0 / (saves_per_epoch * epochs)
        save = save if save < 1.0 else None
    if every is None and (val or tests) and evals_per_epoch:
        every = 1.0 / (evals_per_epoch * epochs)
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
    """AdamW, with fp32, 8-bit or 4-bit moments; any other optimizer is refused (it would train differently)."""
    if name is None or (isinstance(name, str) and name in ADAMW):
        return
    if isinstance(name, str) and name in ADAMW_4BIT:
        set_dotted(out, "optimizer.name", "adamw_4bit")
        notes.append(f"optimizer: {name} -> torchao's AdamW4bit (4-bit moments in blocks of 256, fp32 master weights)")
        return
    if isinstance(name, str) and name in ADAMW_PAGED:
        notes.append(f"optimizer: {name} -> AdamW with fp32 moments (bitsandbytes' 32-bit AdamW is the same update); "
                     + PAGING)
        return
    if not isinstance(name, str) or name not in ADAMW_8BIT:
        raise bad("optimizer", name, "nd-adapter trains with AdamW (fp32, 8-bit or 4-bit moments) only",
                  f"use one of {', '.join(ADAMW + ADAMW_PAGED + ADAMW_8BIT + ADAMW_4BIT)}, or remove the key")
    set_dotted(out, "optimizer.name", "adamw_8bit")
    paged = f"; {PAGING}" if name.startswith("paged_") else ""
    notes.append(f"optimizer: {name} -> bitsandbytes' AdamW8bit (block-wise 8-bit moments, fp32 master weights)"
                 f"{paged}")


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
