"""One record per model family: which HF checkpoints it covers, what differs between its members, its weight table.

Adding a family means adding a `Family` here (HF architecture names and model_type, its flags, its table of typed
rules from adapter/models/mapping.py) and nothing else; docs/adding-a-model.md walks through it. `load_arch`
(adapter/models/arch.py) reads the flags, the converter reads the table, and everything refused is refused by the
record's checks in one place. Declarative: `plan` imports this without torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from adapter.models.mapping import (
    LAYER,
    PackedGateUp,
    PackedQKV,
    Rule,
    copy,
    fused_qkv,
    gated_mlp,
    has_qkv_bias,
    packed_gate_up,
    packed_qkv,
    untied,
    vocab,
)


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]       # HF `architectures[0]` values
    model_types: tuple[str, ...]         # HF `model_type` values (read when `architectures` is absent)
    table: tuple[Rule, ...]              # HF <-> Megatron weight mapping
    qkv_bias: bool | None = None         # True: always (Qwen2); None: the config's `attention_bias`
    qk_norm: bool = False                # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window_default: bool = False  # `use_sliding_window` when the config omits it (Mistral v0.1 has one)
    post_norms: bool = False             # an RMSNorm on the attention's and the MLP's outputs before each residual add
    rotary_interleaved: bool = False     # RoPE rotates pairs (2i, 2i+1), not halves (GLM)


_L = "model.layers.{i}."
LLAMA_TABLE: tuple[Rule, ...] = (
    vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    copy(LAYER + "self_attention.linear_qkv.layer_norm_weight", _L + "input_layernorm.weight", "h"),
    fused_qkv(LAYER + "self_attention.linear_qkv.weight", _L + "self_attn.q_proj.weight",
              _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"),
    fused_qkv(LAYER + "self_attention.linear_qkv.bias", _L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias",
              _L + "self_attn.v_proj.bias", bias=True, when=has_qkv_bias),
    copy(LAYER + "self_attention.linear_proj.weight", _L + "self_attn.o_proj.weight", "h q", tp_axis=1),
    copy(LAYER + "mlp.linear_fc1.layer_norm_weight", _L + "post_attention_layernorm.weight", "h"),
    gated_mlp(LAYER + "mlp.linear_fc1.weight", _L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
    copy(LAYER + "mlp.linear_fc2.weight", _L + "mlp.down_proj.weight", "h f", tp_axis=1),
    copy("decoder.final_layernorm.weight", "model.norm.weight", "h"),
    vocab("output_layer.weight", "lm_head.weight", when=untied),
)
QWEN3_TABLE = LLAMA_TABLE + (
    copy(LAYER + "self_attention.q_layernorm.weight", _L + "self_attn.q_norm.weight", "d"),
    copy(LAYER + "self_attention.k_layernorm.weight", _L + "self_attn.k_norm.weight", "d"),
)

# Phi-3 / Phi-4 (Phi3ForCausalLM): Llama's layer with q, k, v in one HF tensor and gate, up in another
PHI3_TABLE = tuple(
    packed_qkv(r.megatron, _L + "self_attn.qkv_proj.weight") if r.megatron == LAYER + "self_attention.linear_qkv.weight"
    else packed_gate_up(r.megatron, _L + "mlp.gate_up_proj.weight") if r.megatron == LAYER + "mlp.linear_fc1.weight"
    else r for r in LLAMA_TABLE if r.megatron != LAYER + "self_attention.linear_qkv.bias")

# GLM-4 (Glm4ForCausalLM): Llama's attention (q, k, v biases as its config says), gate and up packed in one HF
# tensor, and "sandwich" norms: each sub-layer's output normed again before its residual add
GLM4_TABLE = tuple(
    packed_gate_up(r.megatron, _L + "mlp.gate_up_proj.weight") if r.megatron == LAYER + "mlp.linear_fc1.weight"
    else r for r in LLAMA_TABLE) + (
    copy(LAYER + "self_attention.linear_proj.post_norm.weight", _L + "post_self_attn_layernorm.weight", "h"),
    copy(LAYER + "mlp.linear_fc2.post_norm.weight", _L + "post_mlp_layernorm.weight", "h"),
)

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM",), ("llama",), LLAMA_TABLE),
    Family("mistral", ("MistralForCausalLM",), ("mistral",), LLAMA_TABLE, sliding_window_default=True),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), LLAMA_TABLE, qkv_bias=True),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), QWEN3_TABLE, qk_norm=True),
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",), PHI3_TABLE, qkv_bias=False, sliding_window_default=True),
    Family("glm4", ("Glm4ForCausalLM",), ("glm4",), GLM4_TABLE, post_norms=True, rotary_interleaved=True),
)
_BY_NAME = {f.name: f for f in FAMILIES}


def family(name: str) -> Family:
    return _BY_NAME[name]


def find(architecture: str | None, model_type: str | None) -> Family | None:
    """The family of an HF config: by `architectures[0]` when given, else by `model_type`."""
    key, attr = (architecture, "architectures") if architecture else (model_type, "model_types")
    return next((f for f in FAMILIES if key in getattr(f, attr)), None)


def table_for(arch, table: tuple[Rule, ...] | list[Rule] | None = None) -> list[Rule]:
    """The rules that apply to this architecture: its family's table (or `table`, for tests' negative controls)."""
    return [r for r in (family(arch.family).table if table is None else table) if r.applies(arch)]


def packed_rule(arch, name: str) -> Rule | None:
    """The family's rule for an HF linear that packs several of Megatron's blocks into one tensor (Phi-3's qkv_proj,
    gate_up_proj; GLM-4's gate_up_proj), or None. Such a linear is one Linear in models/counts.py, and one adapter
    whose B is kept in Megatron's row order (the rule's own transform) for LoRA."""
    for rule in family(arch.family).table:
        if isinstance(rule, (PackedQKV, PackedGateUp)) and rule.hf[0][0].endswith(f".{name}.weight"):
            return rule
    return None


def supported_architectures() -> list[str]:
    return sorted(a for f in FAMILIES for a in f.architectures)


__all__ = ["Family", "FAMILIES", "LLAMA_TABLE", "QWEN3_TABLE", "PHI3_TABLE", "GLM4_TABLE", "family", "find",
           "table_for", "packed_rule", "supported_architectures"]
