"""Tiny random checkpoints of architectures that no native family covers, for the transformers engine's tests.

Each is transformers' own config class for the architecture -- whose defaults are the published model's config
(gpt-oss-20b, DeepSeek-V3, GLM-4.5-Air, Llama-4-Scout, Qwen3-Next-80B-A3B, Granite-4.0, Phi-2, ...) -- with only
the sizes cut down (and dropout off, which a fine-tune's config.json sets anyway), so every structural feature of the
real model (MLA, sinks, shared experts, chunked or sliding attention, linear-attention or Mamba layers, an image-text
wrapper) is kept. `hybrid` marks the ones whose recurrent layers cannot take packed documents.
"""
from __future__ import annotations

from pathlib import Path

TINY = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
# model_type -> (causal-LM class, the sizes to cut besides TINY)
ARCHS: dict[str, tuple[str, dict]] = {
    "phi": ("PhiForCausalLM", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0}),
    "gpt_neox": ("GPTNeoXForCausalLM", {"hidden_dropout": 0.0, "attention_dropout": 0.0}),
    "starcoder2": ("Starcoder2ForCausalLM", {"residual_dropout": 0.0, "embedding_dropout": 0.0,
                                             "attention_dropout": 0.0, "sliding_window": 8}),
    "gpt_oss": ("GptOssForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                                      "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                                      "output_router_logits": False}),
    "deepseek_v3": ("DeepseekV3ForCausalLM", {**_MOE, "n_routed_experts": 4, "n_shared_experts": 1, "n_group": 2,
                                              "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16,
                                              "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                                              "v_head_dim": 16, "head_dim": 8, "num_key_value_heads": 4}),
    "glm4_moe": ("Glm4MoeForCausalLM", {**_MOE, "n_routed_experts": 4, "n_shared_experts": 1, "n_group": 1,
                                        "topk_group": 1, "first_k_dense_replace": 1, "head_dim": 16}),
    "llama4_text": ("Llama4ForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 1,
                                          "intermediate_size_mlp": 96, "head_dim": 16, "attention_chunk_size": 8,
                                          "output_router_logits": False}),
    "qwen3_next": ("Qwen3NextForCausalLM", {**_MOE, "num_experts": 4, "shared_expert_intermediate_size": 32,
                                            "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                            "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                            "layer_types": ["linear_attention", "full_attention"],
                                            "output_router_logits": False}),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 32, "mamba_n_heads": 4,
        "mamba_d_head": 32, "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_chunk_size": 16,
        "layer_types": ["mamba", "attention"], "output_router_logits": False}),
    "olmo3": ("Olmo3ForCausalLM", {"sliding_window": 8,
                                   "layer_types": ["sliding_attention", "full_attention"]}),
}
HYBRID = {"qwen3_next", "granitemoehybrid"}
# image-text: the language model's sizes as above under text_config, a two-layer vision tower
VISION = {"mistral3": ("Mistral3ForConditionalGeneration", {"model_type": "mistral", "head_dim": 16},
                       {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                        "num_attention_heads": 2, "head_dim": 16, "image_size": 64, "patch_size": 16})}


def tiny_config(model_type: str, vocab: int = TINY["vocab_size"]):
    import transformers

    ids = {"pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2}  # inside the tiny vocabulary; no pad row
    if model_type in VISION:
        cls_name, text, vision = VISION[model_type]
        cfg = transformers.CONFIG_MAPPING[model_type](text_config={**TINY, "vocab_size": vocab, **text, **ids},
                                                      vision_config=vision, **ids)
    else:
        cls_name, extra = ARCHS[model_type]
        cfg = transformers.CONFIG_MAPPING[model_type](**{**TINY, "vocab_size": vocab, **extra, **ids})
    cfg.architectures = [cls_name]
    return cfg


def make_arch(model_type: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny random checkpoint of `model_type` (fp32, weights spread so per-token losses differ) with the
    tokenizer's files beside it."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from tests.helpers.sft import _save_with_tokenizer

    auto = AutoModelForImageTextToText if model_type in VISION else AutoModelForCausalLM
    return _save_with_tokenizer(tiny_config(model_type), out, tokenizer_dir, seed, auto=auto)


def reference_model(model_dir: Path, quantize: str | None = None):
    """transformers' model of a tiny checkpoint, loaded as a user would (fp32); `quantize` "nf4": the base in
    bitsandbytes' NF4 with double quantisation, as Axolotl's QLoRA loads it; "int8": LLM.int8() (load_in_8bit);
    "dequantize": an MXFP4 checkpoint as Axolotl's gpt-oss examples load it (Mxfp4Config(dequantize=True))."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, BitsAndBytesConfig

    archs = json.loads((Path(model_dir) / "config.json").read_text())["architectures"]
    auto = AutoModelForImageTextToText if archs[0].endswith("ConditionalGeneration") else AutoModelForCausalLM
    bnb = (BitsAndBytesConfig(load_in_8bit=True) if quantize == "int8" else
           BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32))
    if quantize == "dequantize":
        from transformers import Mxfp4Config

        bnb = Mxfp4Config(dequantize=True)
    kw = {"quantization_config": bnb} if quantize else {}
    model = auto.from_pretrained(str(model_dir), dtype=torch.float32, **kw)
    # in training mode, as transformers' Trainer trains it: from_pretrained's eval mode makes bitsandbytes' NF4 layers
    # on an AVX512-BF16 CPU switch to their bf16 inference kernel for good (adapter/patches/bnb_cpu.py)
    return model.train() if quantize in ("nf4", "int8") else model


def mxfp4(model_dir: Path, out: Path, seed: int = 1) -> Path:
    """`model_dir` (a tiny gpt-oss) as OpenAI ships gpt-oss: every expert weight stored as MXFP4 codes -- FP4 pairs
    per byte in blocks of 32 along the input, an e8m0 exponent per block (`*_blocks`, `*_scales`: transformers'
    integrations/mxfp4.py reads them) -- with `quantization_config: {quant_method: mxfp4}`. The codes are random,
    exponents 2^-10..2^-6 (weights of about 0.02), so the dequantized weights are exactly representable."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copyfile(f, out / f.name)
    g, state = torch.Generator().manual_seed(seed), {}
    for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, rows, cols = v.shape  # the parameter is [experts, in, out]; the codes run along `in` per `out` row
            state[f"{k}_blocks"] = torch.randint(0, 256, (e, cols, rows // 32, 16), generator=g, dtype=torch.uint8)
            state[f"{k}_scales"] = torch.randint(117, 122, (e, cols, rows // 32), generator=g, dtype=torch.uint8)
        else:
            state[k] = v
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    conf = json.loads((out / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(conf))
    return out


def linearized(model_dir: Path, out: Path) -> Path:
    """`model_dir` (a Llama 4 checkpoint in transformers' layout) rewritten in Axolotl's linearized layout (one linear
    per expert and projection: its *-Linearized checkpoints), config.json and tokenizer as they are."""
    import shutil

    from safetensors.torch import load_file, save_file

    from adapter.modeling.hf_linearized import linearized_state
    from adapter.models.linearized import LLAMA4

    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copyfile(f, out / f.name)
    state = linearized_state(load_file(str(Path(model_dir) / "model.safetensors")), LLAMA4)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def prequantized(model_dir: Path, out: Path) -> Path:
    """`model_dir` loaded as transformers' load_in_4bit loads it (NF4, double quantisation: Axolotl's QLoRA) and saved
    with its codes and quantization_config: a pre-quantised bitsandbytes checkpoint, with the tokenizer beside it."""
    import shutil

    reference_model(model_dir, quantize="nf4").save_pretrained(out)
    for f in Path(model_dir).iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "chat_template", "added_tokens")):
            shutil.copyfile(f, out / f.name)
    return out

