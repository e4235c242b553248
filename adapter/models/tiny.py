"""A checkpoint's config.json cut small, every structural feature kept: the model `nd-adapter rehearse` trains on CPU
processes for the transformers engine (adapter/train/rehearse.py). Torch-free, like the rest of adapter/models."""
from __future__ import annotations

from typing import Any

from adapter.models.generic import LAYER_COUNT_KEYS, LAYER_KIND_KEYS, layer_count, text_part

_TINY = {"hidden_size": 64, "n_embd": 64, "d_model": 64, "intermediate_size": 128, "n_inner": 128,
         "ffn_dim": 128, "intermediate_size_mlp": 128, "moe_intermediate_size": 32, "expert_intermediate_size": 32,
         "shared_expert_intermediate_size": 32, "shared_intermediate_size": 32, "head_dim": 16,
         "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24,
         "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "linear_key_head_dim": 8,
         "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "mamba_d_state": 8,
         "mamba_n_groups": 1, "mamba_chunk_size": 16, "mamba_d_conv": 4, "chunk_size": 16, "attention_chunk_size": 16,
         "max_position_embeddings": 4096, "rotary_dim": 8, "partial_rotary_factor": None}
_CAPS = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "n_shared_experts": 1,
         "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_top_k": 2, "n_group": 1, "topk_group": 1,
         "first_k_dense_replace": 1,
         "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2}
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def tiny_config(raw: dict[str, Any], vocab: int, experts: int = 4) -> dict[str, Any]:
    """A small config.json of the same architecture, every structural feature kept (adapter/train/rehearse.py
    builds the rehearsal's model from it); `vocab`: its vocabulary; `experts`: the most experts a layer keeps (more
    than 4 where expert parallelism needs whole experts on more ranks)."""
    caps = {**_CAPS, **{k: experts for k in _EXPERT_KEYS}}
    out = {k: v for k, v in raw.items() if k != "quantization_config"}  # the rehearsal quantises as it loads
    text, nested = (dict(raw["text_config"]), True) if text_part(raw)[0] is not raw else (out, False)
    for k, v in _TINY.items():
        if k in text and (v is None or isinstance(text[k], int)):
            if v is None:
                text.pop(k)
            else:
                text[k] = v
    for k, cap in caps.items():
        if isinstance(text.get(k), int):
            text[k] = min(text[k], cap)
    for sub in ("attn_config", "ffn_config"):  # DBRX keeps its attention and expert sizes in sub-configs
        if isinstance(text.get(sub), dict):
            part = dict(text[sub])
            for k, v in {**_TINY, "ffn_hidden_size": 128}.items():
                if isinstance(part.get(k), int) and v is not None:
                    part[k] = v
            for k, cap in {**caps, "kv_n_heads": 2, "moe_num_experts": experts, "moe_top_k": 2}.items():
                if isinstance(part.get(k), int):
                    part[k] = min(part[k], cap)
            text[sub] = part
    heads = text.get("num_attention_heads", 4)
    source = text_part(raw)[0] if nested else raw
    if text.get("num_key_value_heads") and (heads % text["num_key_value_heads"]
                                            or source.get("num_key_value_heads") == source.get("num_attention_heads")):
        text["num_key_value_heads"] = heads  # as many as the heads where the model has (MLA computes a key per head)
    if "mamba_n_heads" in text or "mamba_d_head" in text:  # heads × head size = expand × hidden
        text["mamba_n_heads"], text["mamba_d_head"] = 4, (text.get("mamba_expand") or 2) * 64 // 4
        if "mamba_d_ssm" in text:
            text["mamba_d_ssm"] = (text.get("mamba_expand") or 2) * 64
    n = layer_count(text)
    n = n if isinstance(n, int) else 2
    kinds = next((text[k] for k in LAYER_KIND_KEYS if isinstance(text.get(k), list)), None)
    pattern = text.get("hybrid_override_pattern")  # Nemotron-H's string, a character per layer
    if kinds is None and isinstance(pattern, str) and len(pattern) == n:
        kinds = list(pattern)
    keep = sorted({kinds.index(k) for k in kinds}) if kinds else [0, 1]  # the first layer of each kind, in order
    if len(keep) < 2:
        keep = list(range(min(2, n)))
    if isinstance(text.get("first_k_dense_replace"), int):  # dense layers first (DeepSeek): one, then the rest
        text["first_k_dense_replace"] = 1
        keep = [0, *[i for i in keep if i >= 1]] if len(keep) > 1 else [0, 1]
    for k, v in list(text.items()):  # every per-layer setting cut to the kept layers (lists, layer-indexed maps)
        if isinstance(v, list) and len(v) == n and n > 1:
            text[k] = [v[i] for i in keep if i < len(v)]
        elif isinstance(v, dict) and v and all(str(i).isdigit() and int(i) < n for i in v):
            text[k] = {str(j): v[str(i)] if str(i) in v else v.get(i) for j, i in enumerate(keep)
                       if str(i) in v or i in v}
    if isinstance(pattern, str) and len(pattern) == n:
        text["hybrid_override_pattern"] = "".join(pattern[i] for i in keep)
    layers = len(keep)
    _tiny_mrope(text, raw.get("model_type"))
    if isinstance(text.get("cross_attention_layers"), list) and text["cross_attention_layers"] and layers > 1:
        text["cross_attention_layers"] = [1]  # Mllama: a self-attention layer, then one reading the image
    for k in ("intermediate_size", "layer_intermediate_size"):  # per-layer widths (Gemma 3n): one per kept layer
        if isinstance(text.get(k), list):
            text[k] = [128] * layers
    for k in LAYER_COUNT_KEYS:
        if isinstance(text.get(k), int):
            text[k] = layers
    text["vocab_size"] = vocab
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids past the cut vocabulary: its last row (some
        if isinstance(text.get(k), int) and text[k] >= vocab:   # configs, Mllama's, take no None there)
            text[k] = vocab - 1
    if nested:
        out["text_config"] = text
        vision = out.get("vision_config")
        if isinstance(vision, dict):  # the other towers: as small as their own keys allow
            out["vision_config"] = _tiny_vision(vision, text)
    return out


# image-text families whose M-RoPE splits each head's rotary half into (time, height, width) sections that must sum
# to it; where config.json leaves them out, transformers' defaults (16, 24, 24 or 8, 12, 12: 1 : 1.5 : 1.5) apply
SPLIT_MROPE = ("qwen2_vl", "qwen2_5_vl", "glm4v", "glm4v_moe", "glm46v", "paddleocr_vl")


def _tiny_mrope(text: dict[str, Any], model_type: str | None) -> None:
    """M-RoPE's sections cut to the tiny head (16 wide: a rotary half of 8), in their proportions."""
    rope = next((text[k] for k in ("rope_parameters", "rope_scaling") if isinstance(text.get(k), dict)), None)
    sections = rope.get("mrope_section") if rope is not None else None
    if not isinstance(sections, list) and model_type not in SPLIT_MROPE:
        return
    sections = sections if isinstance(sections, list) and len(sections) == 3 and sum(sections) else [16, 24, 24]
    half = int(text.get("head_dim") or 16) * float((rope or {}).get("partial_rotary_factor") or 1.0) // 2
    cut = [max(1, round(x * half / sum(sections))) for x in sections[1:]]
    rope = dict(rope or {"rope_type": "default"})
    rope["mrope_section"] = [int(half) - sum(cut), *cut]
    text["rope_parameters" if "rope_scaling" not in text else "rope_scaling"] = rope


def _tiny_vision(vision: dict[str, Any], text: dict[str, Any]) -> dict[str, Any]:
    """A vision tower's config cut to one layer of width 32, its layer-indexed settings kept consistent: the
    layers whose states it hands on (Mllama's intermediate_layers_indices, Qwen3-VL's deepstack_visual_indexes)
    and Qwen2.5-VL's full-attention blocks cut to that layer; the widths derived from them (Mllama's
    vision_output_dim: its hidden size times those states and the last) and the merger's output (Qwen2.5-VL's
    out_hidden_size, Qwen2-VL's hidden_size beside its embed_dim: the language model's width) recomputed."""
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "depth": 1, "num_global_layers": 1,
             "num_attention_heads": 2, "num_heads": 2, "attention_heads": 2}
    out = {**vision, **{k: v for k, v in small.items() if isinstance(vision.get(k), int)}}
    for k in ("intermediate_layers_indices", "deepstack_visual_indexes", "fullatt_block_indexes"):
        if isinstance(vision.get(k), list) and vision[k]:
            out[k] = [0]
    if isinstance(vision.get("vision_output_dim"), int) and isinstance(out.get("intermediate_layers_indices"), list):
        out["vision_output_dim"] = out["hidden_size"] * (len(out["intermediate_layers_indices"]) + 1)
    if isinstance(vision.get("out_hidden_size"), int) and isinstance(text.get("hidden_size"), int):
        out["out_hidden_size"] = text["hidden_size"]
    if isinstance(vision.get("embed_dim"), int):  # Qwen2-VL: embed_dim is the tower's width, hidden_size its output
        out["embed_dim"] = 32
        if isinstance(text.get("hidden_size"), int):
            out["hidden_size"] = text["hidden_size"]
    return out


__all__ = ["tiny_config"]
