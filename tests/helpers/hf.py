"""Tiny random HF checkpoints, and damaging a converted one, shared by the conversion and training tests."""
from __future__ import annotations

from pathlib import Path

import torch

from adapter.convert import hf_io
from adapter.convert import megatron_io as mio

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=300, max_position_embeddings=256)



LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}



CASES = {  # name -> (config class, overrides)
    "llama": ("LlamaConfig", {}),
    "llama2_mha": ("LlamaConfig", {"num_key_value_heads": 4}),  # Llama-2: one query group per head
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama_mqa": ("LlamaConfig", {"num_key_value_heads": 1}),  # nkv < tp at tp 2 and 4
    "llama31": ("LlamaConfig", {"rope_theta": 500000.0, "rope_scaling": LLAMA31_ROPE}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "use_sliding_window": False}),  # head_dim != hidden / heads
    # q, k, v and gate, up packed in one HF tensor each; no pad row (Phi-3's pad id is past this vocab)
    "phi3": ("Phi3Config", {"sliding_window": None, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2}),
    # RoPE on 3/4 of each head (Phi-4-mini's 0.75): the rest of the head passes unrotated
    "phi3_partial": ("Phi3Config", {"sliding_window": None, "pad_token_id": None, "bos_token_id": 1,
                                    "eos_token_id": 2, "partial_rotary_factor": 0.75}),
    # Phi-4-mini's LongRoPE (short factors up to the original length, cos/sin scaled by its attention factor)
    # GLM-4: q/k/v biases, gate/up packed, post-norms on both sub-layers, interleaved RoPE on half of each head
    "glm4": ("Glm4Config", {"attention_bias": True, "partial_rotary_factor": 0.5, "pad_token_id": None,
                            "bos_token_id": 1, "eos_token_id": 2, "head_dim": 16}),
    # Gemma 3: (1 + w) norms, sandwich and q/k norms, √hidden embeddings, GeGLU, query_pre_attn_scalar; a local
    # layer (window 6 < the tests' sequences, RoPE base 10k) and a global one (1M, linear scaling ×8); tied
    "gemma3": ("Gemma3TextConfig", {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 6, "tie_word_embeddings": True,
        "layer_types": ["sliding_attention", "full_attention"], "pad_token_id": None, "bos_token_id": 1,
        "eos_token_id": 2, "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                               "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1000000.0}}}),
    # Gemma 2: attention and final-logit soft-capping (small caps, so they bite on random weights), alternating
    # windows from its default pattern; untied
    "gemma2": ("Gemma2Config", {
        "head_dim": 16, "query_pre_attn_scalar": 32, "sliding_window": 6, "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2}),
    "phi3_longrope": ("Phi3Config", {
        "sliding_window": None, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2,
        "partial_rotary_factor": 0.75, "max_position_embeddings": 1024, "original_max_position_embeddings": 128,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 5.0],
                         "long_factor": [2.0, 3.0, 4.0, 6.0, 9.0, 14.0]}}),
    # mixtures of experts: 4 experts, top 2, routed as each family does; the aux loss on
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4,
                                     "num_experts_per_tok": 2, "norm_topk_prob": True, "use_sliding_window": False,
                                     "output_router_logits": True, "router_aux_loss_coef": 0.1}),
    "mixtral": ("MixtralConfig", {"intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2,
                                  "sliding_window": None, "output_router_logits": True, "router_aux_loss_coef": 0.1}),
    "olmoe": ("OlmoeConfig", {"intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                              "num_key_value_heads": 4,  # as OLMoE's 16 of 16
                              "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2,
                              "output_router_logits": True, "router_aux_loss_coef": 0.1}),
}



def make_hf(case: str, path: Path, dtype=torch.float32, seed: int = 0, shard: str | None = "40KB",
            safe: bool = True, fused: bool = False) -> Path:
    """A tiny random HF checkpoint; every parameter (norms, biases too) random so a wrong mapping shows. `fused`: a
    mixture of experts saved in transformers 5's own layout (3-D expert tensors: save_original_format=False)."""
    import transformers

    cls_name, extra = CASES[case]
    cfg = getattr(transformers, cls_name)(**{**TINY, "tie_word_embeddings": False, **extra})
    if cls_name == "Gemma3TextConfig":  # AutoModelForCausalLM would build its Gemma3ForCausalLM, not the config's
        cfg.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 0 if cls_name.startswith("Gemma") else 1  # Gemma's norms scale by 1 + w: w is stored near 0
            p.copy_(centre + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.to(dtype).save_pretrained(path, max_shard_size=shard or "5GB", **({"save_original_format": False}
                                                                             if fused else {}))
    if not safe:  # transformers 5 writes only safetensors; make the legacy pytorch_model.bin layout by hand
        sd = {k: v.clone() for k, v in model.state_dict().items()
              if k != "lm_head.weight" or not cfg.tie_word_embeddings}
        for f in list(path.glob("model*.safetensors*")):
            f.unlink()
        torch.save(sd, path / "pytorch_model.bin")
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": {}}')
    return path



def make_gemma3_vl(path: Path, modern_names: bool = False) -> Path:
    """A tiny Gemma3ForConditionalGeneration (the "gemma3" case's language model, a one-layer SigLIP tower and its
    projector), saved as transformers saves it (the hub's pre-v5 names, language_model.model.*), or with transformers
    5's in-memory names (model.language_model.*)."""
    import transformers
    from safetensors.torch import load_file, save_file

    text = transformers.Gemma3TextConfig(**{**TINY, **CASES["gemma3"][1]})
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                    image_token_index=299, boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(path)
    if modern_names:
        f = path / "model.safetensors"
        sd = load_file(f)
        save_file({hf_io.modern_name(k): v for k, v in sd.items()}, f, metadata={"format": "pt"})
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": {}}')
    return path


def tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    ck = hf_io.HFCheckpoint(hf_dir)
    return {n: ck.get(n) for n in ck.names()}



def flip_chunk(root: Path, key_part: str) -> str:
    """Flip 4 bytes inside one stored chunk's data, as a bad disk or an interrupted copy would; returns its id."""
    reader = mio.DistCheckpointReader(mio.resolve_ckpt_dir(root))
    key, ch = next((k, c) for k, c in reader.chunks() if key_part in k)
    path, pos = reader._locate(key, ch)
    with open(path, "r+b") as f:
        f.seek(pos + 4)
        b = f.read(4)
        f.seek(pos + 4)
        f.write(bytes(x ^ 0xFF for x in b))
    return mio.chunk_id(key, ch.offsets)
