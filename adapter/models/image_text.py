"""What an image-text run (`data.processor_type`, Axolotl's processor_type: adapter/data/sft/multimodal.py) does
not build yet, said from the config and the model's facts alone, so `plan` refuses it in the same line `train`
would."""
from __future__ import annotations

from adapter.errors import bad


def check(cfg, arch) -> None:
    """What an image-text run does not build yet, each refused in one line (plan says it too): a checkpoint without
    another tower, tp / cp / ep > 1, a preference objective, Liger's cross-entropy, compiled layers, and LoRA's
    target_linear (Axolotl's list of every linear's name, the vision tower's among them)."""
    from adapter.config import spell

    p, key, value = cfg.parallelism, spell(cfg, "data.processor_type"), cfg.data.processor_type
    if not arch.image_text:
        raise bad(key, value, f"{arch.architecture} has no vision or audio tower for the processor to feed",
                  "remove processor_type (and skip_prepare_dataset) to train on text conversations")
    for on, what, fix in ((p.tp_size > 1 or p.cp_size > 1 or p.ep_size > 1, "tensor, context or expert parallelism "
                           "beside image-text rows", "use data-parallel ranks (dp_shard_size / dp_replicate_size)"),
                          (cfg.objective != "sft", f"{cfg.objective} on image-text rows", "train SFT on them"),
                          (any("cross_entropy" in k for k in cfg.model.liger), "Liger's cross-entropy beside "
                           "image-text rows", "remove liger_cross_entropy / liger_fused_linear_cross_entropy"),
                          (cfg.model.compile is True, "compiled layers beside image-text rows",
                           "remove torch_compile (model.compile: false)"),
                          (cfg.lora is not None and cfg.lora.target_linear, "lora_target_linear beside image-text "
                           "rows (Axolotl adds every linear's name, the vision tower's too)",
                           "list the modules under lora_target_modules (Axolotl's examples give a regex)")):
        if on:
            raise bad(key, value, f"{what} is not built", fix)


__all__ = ["check"]
