"""One record per model family: which HF checkpoints it covers, what differs between its members, its weight table.

Adding a family means adding a `Family` here (HF architecture names and model_type, its flags, its table of typed
rules from adapter/models/mapping.py) and nothing else; docs/adding-a-model.md walks through it. `load_arch`
(adapter/models/arch.py) reads the flags, the converter reads the table, and everything refused is refused by the
record's checks in one place. The table's linear rules are also the layer's linears (names, packing, TP axis,
experts, which are `nn.Linear` in transformers): counts, LoRA and the quantised base read them through
`counts.linears`, never a list of their own. Declarative: `plan` imports this without torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapter.models.mapping import (
    EXPERTS,
    LAYER,
    Rule,
    copy,
    fused_qkv,
    gated_mlp,
    has_qkv_bias,
    linear_name,
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
    norm_offset: bool = False            # RMSNorm scales by (1 + weight) (Gemma)
    embed_scale: bool = False            # embeddings multiplied by √hidden (Gemma)
    window_every: int | None = None      # without `layer_types`: every n-th layer global, the rest sliding (Gemma)
    local_rope: bool = False             # sliding layers rotate with their own base, rope_local_base_freq (Gemma 3)
    text_config: bool = False            # an image-text checkpoint: the language model's config is `text_config`
    # an image-text checkpoint's other towers (HF name prefixes): not converted, not trained; exports are the text
    # family `export_as` (its own HF names and config), which transformers loads as a text model
    hf_skip: tuple[str, ...] = ()
    export_as: str | None = None
    # the HF config class's defaults for keys a config.json may omit (Gemma 3's hub configs leave out most of its
    # text model's): (key, value) pairs, checked against transformers' classes in tests/unit/test_families.py
    defaults: tuple[tuple[str, Any], ...] = ()
    # a mixture of experts: the config key of an expert's MLP width; whether routing renormalises the chosen experts'
    # probabilities (None: the config's `norm_topk_prob`; Mixtral always does); q/k norms over the whole projection
    moe: bool = False
    expert_ffn_key: str = "intermediate_size"
    norm_topk_prob: bool | None = None
    qk_norm_whole: bool = False


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

# Gemma 2 / Gemma 3: Llama's linears, "sandwich" norms (HF's post_attention_layernorm is the attention's post-norm;
# the MLP has its own pre- and post-norm), Gemma 3 adds q/k norms. Norm weights are stored centred on zero (the
# model scales by 1 + w), so they copy unchanged.
GEMMA2_TABLE: tuple[Rule, ...] = tuple(
    r for r in LLAMA_TABLE if r.megatron != LAYER + "mlp.linear_fc1.layer_norm_weight") + (
    copy(LAYER + "self_attention.linear_proj.post_norm.weight", _L + "post_attention_layernorm.weight", "h"),
    copy(LAYER + "mlp.linear_fc1.layer_norm_weight", _L + "pre_feedforward_layernorm.weight", "h"),
    copy(LAYER + "mlp.linear_fc2.post_norm.weight", _L + "post_feedforward_layernorm.weight", "h"),
)
GEMMA3_TABLE = GEMMA2_TABLE + QWEN3_TABLE[len(LLAMA_TABLE):]
# Gemma3ForConditionalGeneration: the same language model under `model.language_model.` (transformers 5's names;
# the hub's original files say `language_model.model.`, which adapter/convert/hf_io.py reads as these)
GEMMA3_VL_TABLE = tuple(r.renamed("model.", "model.language_model.") for r in GEMMA3_TABLE)

# Mixture of experts: Llama's attention (Qwen3-MoE's with q/k norms), each layer's MLP a router and per-expert gated
# MLPs (HF names carry the expert index {e}); the pre-MLP norm keeps its dense name. transformers holds the router
# and the experts in modules of its own (the experts as 3-D tensors), not nn.Linear: PEFT and bitsandbytes skip them
def _moe_table(attention: tuple[Rule, ...], mlp: str, gate: str, up: str, down: str, router: str = "gate"
               ) -> tuple[Rule, ...]:
    dense = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
    return tuple(r for r in attention if r.megatron not in tuple(LAYER + d for d in dense)) + (
        copy(LAYER + "mlp.router.weight", _L + f"{mlp}.{router}.weight", "E h", nn_linear=False),
        gated_mlp(EXPERTS + "linear_fc1.weight", _L + f"{mlp}.experts.{{e}}.{gate}.weight",
                  _L + f"{mlp}.experts.{{e}}.{up}.weight", ffn="g", nn_linear=False),
        copy(EXPERTS + "linear_fc2.weight", _L + f"{mlp}.experts.{{e}}.{down}.weight", "h g", tp_axis=1,
             nn_linear=False),
    )


QWEN3_MOE_TABLE = _moe_table(QWEN3_TABLE, "mlp", "gate_proj", "up_proj", "down_proj")
MIXTRAL_TABLE = _moe_table(LLAMA_TABLE, "block_sparse_moe", "w1", "w3", "w2")
# OLMoE: q_norm / k_norm over the whole q and k projections (all heads at once)
OLMOE_TABLE = _moe_table(LLAMA_TABLE, "mlp", "gate_proj", "up_proj", "down_proj") + (
    copy(LAYER + "self_attention.q_layernorm.weight", _L + "self_attn.q_norm.weight", "q"),
    copy(LAYER + "self_attention.k_layernorm.weight", _L + "self_attn.k_norm.weight", "kv"),
)

_GEMMA: dict[str, Any] = dict(qkv_bias=False, post_norms=True, norm_offset=True, embed_scale=True,
                              sliding_window_default=True)
_GEMMA_DEFAULTS = (("hidden_activation", "gelu_pytorch_tanh"), ("head_dim", 256), ("num_attention_heads", 8),
                   ("num_key_value_heads", 4), ("hidden_size", 2304), ("intermediate_size", 9216),
                   ("num_hidden_layers", 26), ("rms_norm_eps", 1e-6), ("tie_word_embeddings", True),
                   ("pad_token_id", 0), ("query_pre_attn_scalar", 256), ("sliding_window", 4096))
GEMMA2_DEFAULTS = _GEMMA_DEFAULTS + (("vocab_size", 256000), ("max_position_embeddings", 8192),
                                     ("rope_theta", 10000.0), ("attn_logit_softcapping", 50.0),
                                     ("final_logit_softcapping", 30.0))
GEMMA3_DEFAULTS = _GEMMA_DEFAULTS + (("vocab_size", 262208), ("max_position_embeddings", 131072),
                                     ("rope_theta", 1_000_000.0), ("rope_local_base_freq", 10000.0))

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM",), ("llama",), LLAMA_TABLE),
    Family("mistral", ("MistralForCausalLM",), ("mistral",), LLAMA_TABLE, sliding_window_default=True),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), LLAMA_TABLE, qkv_bias=True),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), QWEN3_TABLE, qk_norm=True),
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",), PHI3_TABLE, qkv_bias=False, sliding_window_default=True),
    Family("glm4", ("Glm4ForCausalLM",), ("glm4",), GLM4_TABLE, post_norms=True, rotary_interleaved=True),
    Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), GEMMA2_TABLE, window_every=2, defaults=GEMMA2_DEFAULTS,
           **_GEMMA),
    Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), GEMMA3_TABLE, qk_norm=True, window_every=6,
           local_rope=True, defaults=GEMMA3_DEFAULTS, **_GEMMA),
    Family("gemma3_vl", ("Gemma3ForConditionalGeneration",), ("gemma3",), GEMMA3_VL_TABLE, qk_norm=True,
           window_every=6, local_rope=True, text_config=True, defaults=GEMMA3_DEFAULTS,
           hf_skip=("model.vision_tower.", "model.multi_modal_projector."), export_as="gemma3", **_GEMMA),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), QWEN3_MOE_TABLE, qk_norm=True, moe=True,
           expert_ffn_key="moe_intermediate_size"),
    Family("mixtral", ("MixtralForCausalLM",), ("mixtral",), MIXTRAL_TABLE, qkv_bias=False, moe=True,
           norm_topk_prob=True),
    Family("olmoe", ("OlmoeForCausalLM",), ("olmoe",), OLMOE_TABLE, qk_norm=True, moe=True, qk_norm_whole=True,
           defaults=(("rms_norm_eps", 1e-5),)),
)
# The transformers engine's models (adapter/models/generic.py): no mapping, never found by `find`; Llama's table
# stands in for the shape of a layer in `plan`'s per-layer formulas (the totals are the meta-device model's)
TRANSFORMERS = Family("transformers", (), (), LLAMA_TABLE)
_BY_NAME = {f.name: f for f in (*FAMILIES, TRANSFORMERS)}


def family(name: str) -> Family:
    return _BY_NAME[name]


def find(architecture: str | None, model_type: str | None) -> Family | None:
    """The family of an HF config: by `architectures[0]` when given, else by `model_type`."""
    key, attr = (architecture, "architectures") if architecture else (model_type, "model_types")
    return next((f for f in FAMILIES if key in getattr(f, attr)), None)


def table_for(arch, table: tuple[Rule, ...] | list[Rule] | None = None) -> list[Rule]:
    """The rules that apply to this architecture: its family's table (or `table`, for tests' negative controls)."""
    return [r for r in (family(arch.family).table if table is None else table) if r.applies(arch)]


def linear_rule(arch, fused: str) -> Rule:
    """The family's rule building Megatron's linear `fused` (linear_qkv, linear_proj, linear_fc1, linear_fc2, router)
    of this architecture's layers, the experts' aside: its type says how the HF linears in it are packed."""
    for rule in table_for(arch):
        if rule.linear and not rule.per_expert and rule.module.rpartition(".")[2] == fused:
            return rule
    raise KeyError(f"{arch.family} has no {fused} outside its experts")


def packed_rule(arch, name: str) -> Rule | None:
    """The family's rule for an HF linear that packs several of Megatron's blocks into one tensor (Phi-3's qkv_proj,
    gate_up_proj; GLM-4's gate_up_proj), or None. Such a linear is one Linear in models/counts.py, and one adapter
    whose B is kept in Megatron's row order (the rule's own transform) for LoRA."""
    for rule in family(arch.family).table:
        if rule.packed and rule.linear and linear_name(rule.hf[0][0]) == name:
            return rule
    return None


def text_config_json(cfg: dict[str, Any], fam: Family) -> dict[str, Any]:
    """The config.json of the text model `fam` exports as (`export_as`): an image-text checkpoint's text_config
    over the family's defaults, named as transformers' text-only class. `load_arch` reads the same."""
    if fam.export_as is None:
        raise ValueError(f"{fam.name} exports as itself: it has no text model's config.json to write")
    text = family(fam.export_as)
    out = {**dict(fam.defaults), **{k: v for k, v in (cfg.get("text_config") or {}).items() if v is not None}}
    for key in ("torch_dtype", "dtype", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        if cfg.get(key) is not None:
            out[key] = cfg[key]
    return {**out, "architectures": [text.architectures[0]], "model_type": text.model_types[0]}


def supported_architectures() -> list[str]:
    return sorted(a for f in FAMILIES for a in f.architectures)


__all__ = ["Family", "FAMILIES", "LLAMA_TABLE", "QWEN3_TABLE", "PHI3_TABLE", "GLM4_TABLE", "GEMMA2_TABLE",
           "GEMMA3_TABLE", "GEMMA3_VL_TABLE", "QWEN3_MOE_TABLE", "MIXTRAL_TABLE", "OLMOE_TABLE", "family", "find",
           "table_for", "linear_rule", "packed_rule", "text_config_json", "supported_architectures"]
