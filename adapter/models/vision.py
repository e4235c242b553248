"""An image-text checkpoint's vision tower as `plan` counts it (adapter/models/counts.py vision_*: its GEMMs and the
activations a trained tower keeps), read from config.json's vision_config alone: torch-free, no other import."""
from __future__ import annotations

from typing import Any

# vision towers whose MLP is gated (gate_proj, up_proj, down_proj), by vision_config.model_type's start (transformers
# 5.25's modeling files); every other ViT block has two linears (fc1, fc2)
GATED_VISION = ("qwen2_5_vl", "glm4v", "glm_ocr", "glm5_next", "pixtral", "gemma4", "deepseek_ocr2", "dots3_note")


def vision_tower(cfg: dict[str, Any]) -> tuple[int, int, int, int, int, int] | None:
    """(layers, hidden, ffn, image_size or 0, patch size, the MLP's input linears: 2 gated, 1 not) of an image-text
    checkpoint's vision tower, read from its vision_config as the ViT-style towers name them (SigLIP's hidden_size /
    num_hidden_layers, Qwen2-VL's embed_dim / depth / mlp_ratio: its hidden_size there is the merger's output); None
    where it names no depth, width or patch."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        return None
    layers = _first_of(v, ("num_hidden_layers", "depth", "num_layers", "n_layers"))
    hidden = _first_of(v, ("embed_dim", "hidden_size", "width", "d_model"))
    patch = _first_of(v, ("patch_size", "spatial_patch_size"))
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (layers, hidden, patch)):
        return None
    ffn = _first_of(v, ("intermediate_size",))
    ffn = ffn if isinstance(ffn, int) and ffn > 0 else int(hidden * float(v.get("mlp_ratio") or 4))
    size = v.get("image_size")
    size = size[0] if isinstance(size, (list, tuple)) and size else size
    gated = str(v.get("model_type") or "").startswith(GATED_VISION)
    return layers, hidden, ffn, size if isinstance(size, int) and size > 0 else 0, patch, 2 if gated else 1


def _first_of(cfg: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((cfg[k] for k in keys if cfg.get(k) is not None), None)


__all__ = ["GATED_VISION", "vision_tower"]
