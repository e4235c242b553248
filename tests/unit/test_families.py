"""Family records against transformers: the config defaults a record fills in are the HF config class's, and the
architecture read from a config (both of its formats) is the model transformers builds from it (parameter counts on
the meta device, per-layer windows and RoPE bases)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapter.errors import UserError
from adapter.models import counts, families
from adapter.models.arch import arch_from_hf_dict

ROOT = Path(__file__).resolve().parents[2]
# the hub's Gemma-3-4B layout (config.json before transformers 5): most text keys left to the class defaults
GEMMA3_4B_TEXT = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                  "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                  "sliding_window": 1024}


@pytest.mark.parametrize("fam, cls", [("gemma2", "Gemma2Config"), ("gemma3", "Gemma3TextConfig")])
def test_defaults_are_the_hf_config_class_s(fam, cls):
    import transformers

    hf = getattr(transformers, cls)()
    rope = hf.rope_parameters
    theirs = {**vars(hf), "rope_theta": (rope.get("full_attention") or rope)["rope_theta"],
              "rope_local_base_freq": (rope.get("sliding_attention") or {}).get("rope_theta")}
    for key, value in families.family(fam).defaults:
        assert theirs[key] == value, (fam, key, theirs[key], value)


def _meta_params(cfg) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())


def test_gemma3_image_text_config_reads_its_language_model():
    """Gemma3ForConditionalGeneration (the 4B+ checkpoints; configs/models/gemma-3-4b-it is the hub's file): the
    language model's config nests under text_config and leaves most keys to Gemma3TextConfig's defaults; nd-adapter
    trains that language model (its parameter count is Gemma3ForCausalLM's on the same text config; the vision
    tower is not built)."""
    from transformers import Gemma3TextConfig

    cfg = json.loads((ROOT / "configs/models/gemma-3-4b-it/config.json").read_text())
    assert cfg["text_config"] == GEMMA3_4B_TEXT
    arch = arch_from_hf_dict(cfg)
    assert (arch.family, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.vocab_size) == (
        "gemma3_vl", 8, 4, 256, 262208)
    assert arch.tie_embeddings and arch.norm_offset and arch.embed_scale == 2560 ** 0.5
    assert arch.softmax_scale == 256 ** -0.5 and arch.activation == "gelu_tanh" and arch.qk_norm
    assert arch.window_layers == tuple((i + 1) % 6 != 0 for i in range(34)) and arch.sliding_window == 1024
    assert (arch.rope_theta, arch.local_rope_theta, arch.rope_linear_factor) == (1e6, 1e4, 8.0)
    hf = Gemma3TextConfig(**GEMMA3_4B_TEXT)
    assert counts.num_params(arch) == _meta_params(hf)
    # transformers 5 writes the same config as rope_parameters per layer type and layer_types: same architecture
    new = {**hf.to_dict(), "architectures": ["Gemma3ForCausalLM"]}
    assert arch_from_hf_dict(new).to_dict() == {**arch.to_dict(), "family": "gemma3",
                                                "architecture": "Gemma3ForCausalLM"}


@pytest.mark.parametrize("name,heads,head_dim,scalar,layers,params", [
    ("gemma-3-12b-it", 16, 256, 256, 48, 11_766_034_176), ("gemma-3-27b-it", 32, 128, 168, 62, 27_009_346_304)])
def test_gemma3_12b_and_27b_configs(name, heads, head_dim, scalar, layers, params):
    """The two larger Gemma 3 checkpoints: 27B is the one whose query_pre_attn_scalar (168) is not head_dim. The
    counts are Gemma3ForCausalLM's on the text config (meta device); 12B's also equals keras-hub's published
    text-only count, 11,765,788,416, once its 262,144-row vocabulary is widened to the Hub's 262,208."""
    from transformers import Gemma3TextConfig

    cfg = json.loads((ROOT / "configs/models" / name / "config.json").read_text())
    arch = arch_from_hf_dict(cfg)
    assert (arch.num_heads, arch.head_dim, arch.num_layers, arch.vocab_size) == (heads, head_dim, layers, 262208)
    assert arch.softmax_scale == scalar ** -0.5 and arch.window_layers == tuple((i + 1) % 6 != 0 for i in range(layers))
    assert counts.num_params(arch) == _meta_params(Gemma3TextConfig(**cfg["text_config"])) == params


def test_gemma2_windows_caps_and_count():
    from transformers import Gemma2Config

    hf = Gemma2Config(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
                      num_key_value_heads=8)
    arch = arch_from_hf_dict({**hf.to_dict(), "architectures": ["Gemma2ForCausalLM"]})
    assert arch.window_layers == tuple(i % 2 == 0 for i in range(42)) and arch.local_rope_theta is None
    assert (arch.attn_softcap, arch.final_softcap, arch.sliding_window) == (50.0, 30.0, 4096)
    assert counts.num_params(arch) == _meta_params(hf)
    # a window layer's attention spans its window: 21 layers of 4096 and 21 of 8192 at seq 8192
    assert counts.attended(arch, 8192) == 21 * 4096 + 21 * 8192


def test_gemma_bad_configs_are_refused_in_one_line():
    base = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 2}
    with pytest.raises(UserError, match=r"^layer_types=.*must list 'sliding_attention' or 'full_attention'"):
        arch_from_hf_dict({**base, "layer_types": ["sliding_attention"]})
    with pytest.raises(UserError, match=r"^use_bidirectional_attention=True"):
        arch_from_hf_dict({**base, "use_bidirectional_attention": True})
    with pytest.raises(UserError, match=r"^hidden_activation='relu': only gated MLPs"):
        arch_from_hf_dict({**base, "hidden_activation": "relu"})
    with pytest.raises(UserError, match=r"^text_config=None: Gemma3ForConditionalGeneration keeps"):
        arch_from_hf_dict({"architectures": ["Gemma3ForConditionalGeneration"]})
    with pytest.raises(UserError, match=r"^attn_logit_softcapping=-1"):
        arch_from_hf_dict({**base, "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": -1})


def test_longrope_is_announced_where_its_long_factors_can_apply():
    """Phi-3.5-mini (LongRoPE, original 4096): past it the first lines say which batches rotate with the long
    factors (packed: per micro-batch; padded: every batch); within it, or for plain RoPE, nothing."""
    from adapter.models.announce import longrope_note
    from adapter.models.arch import load_arch

    phi = load_arch(ROOT / "configs/models" / "phi-3.5-mini-instruct")
    assert phi.rope_original_max == 4096
    assert "by each micro-batch's longest packed document" in longrope_note(phi, 8192, packed=True)
    assert "every batch, its samples padded to seq_len 8192" in longrope_note(phi, 8192, packed=False)
    assert longrope_note(phi, 4096, packed=False) is None
    assert longrope_note(load_arch(ROOT / "configs/models" / "qwen3-8b"), 32768, packed=True) is None
