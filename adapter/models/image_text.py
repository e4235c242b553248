"""What an image-text run (`data.processor_type`, Axolotl's processor_type: adapter/data/sft/multimodal.py) does
not build yet, said from the config and the model's facts alone, so `plan` refuses it in the same line `train`
would."""
from __future__ import annotations

from adapter.errors import bad

# Axolotl's image-text formats not written as records yet (adapter/data/sft/multimodal_formats.STRATEGIES), by chat
# template name and by processor class (Axolotl picks the format by them)
UNBUILT_TEMPLATES = ("gemma3n",)
UNBUILT_PROCESSORS = ("VoxtralProcessor", "Mistral3Processor")
# model types whose language layers read the image by cross-attention, run only in micro-batches that hold one
# (adapter/data/sft/multimodal.py refuses rows without an image where every rank must run them)
CROSS_ATTENTION = ("mllama",)


def check(cfg, arch) -> None:
    """What an image-text run does not build yet, each refused in one line (plan says it too): packing,
    mistral-common, the formats not written, a checkpoint without another tower, tp / cp / ep > 1, a preference
    objective, Liger's cross-entropy, and LoRA's target_linear (Axolotl's list of every linear's
    name, the vision tower's among them)."""
    from adapter.config import spell

    p, key, value = cfg.parallelism, spell(cfg, "data.processor_type"), cfg.data.processor_type
    d = cfg.data
    if d.sample_packing or d.eval_sample_packing:
        raise bad(spell(cfg, "data.sample_packing"), True, "image-text rows are batched by the processor, not packed",
                  "set sample_packing: false (Axolotl's multimodal examples do)")
    if d.mistral_common:
        raise bad(spell(cfg, "data.mistral_common"), True, "mistral-common's image-text processors are not built "
                  "beside processor_type", "remove tokenizer_use_mistral_common, or run this config with Axolotl")
    if cfg.data.chat_template in UNBUILT_TEMPLATES:
        raise bad(spell(cfg, "data.chat_template"), cfg.data.chat_template, f"the {cfg.data.chat_template} "
                  "image-text format (its role markers and media tokens) is not built for processor_type runs",
                  "run this config with Axolotl")
    cls = processor_class(cfg.model.path)
    if cls in UNBUILT_PROCESSORS:
        raise bad(key, value, f"{cls}'s image-text format (its media tokens) is not built",
                  "run this config with Axolotl")
    if not arch.image_text:
        raise bad(key, value, f"{arch.architecture} has no vision or audio tower for the processor to feed",
                  "remove processor_type (and skip_prepare_dataset) to train on text conversations")
    for on, what, fix in ((p.tp_size > 1 or p.cp_size > 1 or p.ep_size > 1, "tensor, context or expert parallelism "
                           "beside image-text rows", "use data-parallel ranks (dp_shard_size / dp_replicate_size)"),
                          (cfg.objective != "sft", f"{cfg.objective} on image-text rows", "train SFT on them"),
                          (any("cross_entropy" in k for k in cfg.model.liger), "Liger's cross-entropy beside "
                           "image-text rows", "remove liger_cross_entropy / liger_fused_linear_cross_entropy"),
                          (cfg.lora is not None and cfg.lora.target_linear, "lora_target_linear beside image-text "
                           "rows (Axolotl adds every linear's name, the vision tower's too)",
                           "list the modules under lora_target_modules (Axolotl's examples give a regex)")):
        if on:
            raise bad(key, value, f"{what} is not built", fix)


def processor_class(model_path) -> str | None:
    """The processor class the checkpoint's processor files name (read as JSON: no processor is built)."""
    import json

    from adapter.models.source import model_dir

    try:
        d = model_dir(model_path)
    except Exception:  # (the model's path is checked, in one line, where it is read)
        return None
    for name in ("processor_config.json", "preprocessor_config.json"):
        f = d / name
        if f.is_file():
            try:
                cls = json.loads(f.read_text()).get("processor_class")
            except (OSError, ValueError):
                continue
            if isinstance(cls, str):
                return cls
    return None


__all__ = ["CROSS_ATTENTION", "UNBUILT_TEMPLATES", "UNBUILT_PROCESSORS", "check", "processor_class"]
