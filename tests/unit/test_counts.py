"""A model's linears, parameter counts and FLOPs (adapter/models/counts.py) against counts by hand, including a
shape whose attention width is not its hidden size (Qwen3-4B: 32 heads × 128 = 4096 ≠ 2560)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from adapter.models import counts
from adapter.models.arch import arch_from_hf_dict

ROOT = Path(__file__).resolve().parents[2]


def llama(**kw):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 16,
           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256}
    return arch_from_hf_dict({**cfg, **kw})


QWEN3_4B = arch_from_hf_dict({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 2560, "num_hidden_layers": 36,
                              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                              "intermediate_size": 9728, "vocab_size": 151936, "tie_word_embeddings": True})


def test_flops_per_token_tiny_by_hand():
    # N = 1·(4·(4 + 2·4·1/2 + 4) + 3·4·8) + 4·10 = 48 + 96 + 40 = 184;  6N + 12·1·4·3 = 1104 + 144
    tiny = llama(hidden_size=4, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=8,
                 vocab_size=10)
    assert counts.flops_per_token(tiny, 3) == 1248


def test_flops_per_token_llama_1b_shape():
    # per layer 2048·5120 + 3·2048·8192 = 60,817,408; ×16 + 2048·128,256 = 1,235,746,816 = N
    # 6N = 7,414,480,896; 12·16·2048·4096 = 1,610,612,736
    assert counts.flops_per_token(llama(), 4096) == 9_025_093_632


def test_qwen3_4b_by_hand():
    # q 4096×2560, k and v 1024×2560, o 2560×4096, gate/up/down 9728×2560: 100,925,440 weights a layer
    assert sum(lin.weights for lin in counts.linears(QWEN3_4B)) == 100_925_440
    # N = 36·100,925,440 + 2560·151,936 = 3,633,315,840 + 388,956,160 = 4,022,272,000
    assert counts.matmul_params(QWEN3_4B) == 4_022_272_000
    # 6N + 12·36·(32·128)·4096 = 24,133,632,000 + 7,247,757,312 (heads·head_dim, not hidden)
    assert counts.flops_per_token(QWEN3_4B, 4096) == 31_381_389_312
    # + norms 2·2560 + q/k norms 2·128 per layer, the tied embedding once, the final norm: HF's 4.02 B
    assert counts.num_params(QWEN3_4B) == 36 * (100_925_440 + 5120 + 256) + 151_936 * 2560 + 2560 == 4_022_468_096
    # Megatron's GEMMs at tp 2: qkv 6144/2 × 2560, proj 2560 × 4096/2, fc1 19456/2 × 2560, fc2 2560 × 9728/2
    assert counts.layer_gemms(QWEN3_4B, 64, 2) == [(64, 3072, 2560), (64, 2560, 2048), (64, 9728, 2560),
                                                    (64, 2560, 4864)]


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.1-8b", "qwen3-8b", "mistral-7b", "phi-4", "phi-3-mini-4k",
                                  "phi-3.5-mini-instruct", "gemma-2-9b", "gemma-3-4b-shape", "glm-4-9b-0414",
                                  "glm-4-32b-0414", "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b-v0.1",
                                  "olmoe-1b-7b-0924"])
def test_num_params_is_the_hf_model_s(name):
    """The parameter count transformers gives for the shipped configs (a meta-device model: no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from adapter.models.arch import load_arch

    path = ROOT / "configs/models" / name
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    assert counts.num_params(load_arch(path)) == sum(p.numel() for p in model.parameters())
    assert json.loads((path / "config.json").read_text())  # the config the count came from


def test_local_params_split_linears_over_tp_and_keep_norms_whole():
    a = QWEN3_4B
    lp1, lp2 = counts.local_params(a, 1), counts.local_params(a, 2)
    norms = 2 * 2560 + 2 * 128
    assert lp1.layer - norms == 2 * (lp2.layer - norms) and lp2.output == 0  # tied
    assert counts.param_tensors(a) == (8, 36 * 8 + 2)  # 4 linears, 2 norms, q and k norms; embedding, final norm



def test_moe_counts_all_experts_and_flops_only_the_routed_ones():
    """Qwen3-30B-A3B: 128 experts of width 768, top 8. Parameters hold every expert; MFU's N counts the router and
    the 8 experts a token passes through (its "3B active": 3.04 B with the LM head); tp splits the experts' linears,
    never the router."""
    from adapter.models.arch import load_arch

    a = load_arch(ROOT / "configs/models/qwen3-30b-a3b")
    h, g, L = 2048, 768, 48
    attention = 2 * h * 32 * 128 + 2 * h * 4 * 128
    assert counts.matmul_params(a) == L * (attention + 128 * h + 8 * 3 * h * g) + h * 151936
    lp1, lp2 = counts.local_params(a, 1), counts.local_params(a, 2)
    norms = 2 * h + 2 * 128
    assert lp1.layer - norms - 128 * h == 2 * (lp2.layer - norms - 128 * h)
    assert counts.param_tensors(a)[0] == 2 + 1 + 2 * 128 + 2 + 2  # qkv, proj; router; 2 per expert; norms; q/k
    # grouped experts under the flat AdamW: one gradient per expert linear reaches autograd (adapter/modeling/moe.py)
    assert counts.param_tensors(a, grouped_grads=True)[0] == 2 + 1 + 2 + 2 + 2
    cut = load_arch(ROOT / "configs/models/qwen3-30b-a3b-8l-shape")
    assert counts.param_tensors(cut)[1] == 2107  # what the H200 bench's model holds (bench/adamw_bench.py)
    assert counts.layer_gemms(a, 64, 1)[2:] == [(64, 128, h), (64 * 8, 2 * g, h), (64 * 8, h, g)]


def test_liger_chunk_and_the_engines_output_rows():
    """Liger's fused linear CE chunks the tokens so that one chunk's logits are about the hidden states' size, rounded
    up to a power of two (its own example: 16,384 tokens, 32,000 rows, hidden 4,096: 2,048); the transformers engine
    keeps the checkpoint's rows (Olmo-3's unaligned 100,278), the native engine pads them (Megatron's rule)."""
    assert counts.liger_linear_ce_chunk(16384, 32000, 4096) == 2048
    assert counts.liger_linear_ce_chunk(8192, 100278, 4096) == 512       # cdiv(8192, 25) = 328 -> 512
    assert counts.liger_linear_ce_chunk(100, 32000, 4096) == 16
    assert counts.liger_linear_ce_chunk(64, 1000, 4096) == 64            # the whole micro-batch at most
    native = llama(vocab_size=100278)
    hf = dataclasses.replace(native, engine="transformers")
    assert counts.output_rows(native) == 100352 and counts.output_rows(native, tp=2) == 50176
    assert counts.output_rows(hf) == 100278 and counts.output_rows(hf, tp=2) == 50139
    assert counts.output_rows(hf, tp=4) == 100278
