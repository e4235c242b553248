"""`unfrozen_parameters` (adapter/models/freeze.py): Axolotl's pattern rules over HF names, mapped onto Megatron's
tensors; what splits a fused tensor or matches nothing is refused; plan counts only the trained tensors' states."""
from __future__ import annotations

import pytest

from adapter import config
from adapter.errors import UserError
from adapter.models import counts, freeze
from adapter.models.arch import arch_from_hf_dict
from adapter.plan import memory
from tests.helpers.runs import planned

TINY = arch_from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 12,
                          "vocab_size": 1000, "tie_word_embeddings": False})


def trained(patterns):
    return {t.name for t in freeze.resolve(TINY, patterns) if t.trained}


def test_every_tensor_is_trained_without_patterns_and_counts_agree():
    tensors = freeze.resolve(TINY, None)
    assert all(t.trained for t in tensors) and len(tensors) == 12 * 6 + 3
    for tp in (1, 2):
        assert freeze.trained_local(freeze.resolve(TINY, None), TINY, tp) == counts.local_params(TINY, tp).total(12)


def test_axolotl_pattern_rules():
    # re.match from the start; a dot is a dot: layer 1, not 10 or 11
    assert trained(["model.layers.1.", "lm_head.weight"]) == {
        f"decoder.layers.1.{n}" for n in ("input_layernorm.weight", "self_attention.linear_qkv.weight",
                                          "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight",
                                          "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")} | {"output_layer.weight"}
    assert trained([r"model.layers.1[01].mlp.down_proj"]) == {"decoder.layers.10.mlp.linear_fc2.weight",
                                                               "decoder.layers.11.mlp.linear_fc2.weight"}


def test_refusals_name_the_pattern_and_the_fix():
    with pytest.raises(UserError, match=r"trains model.layers.0.self_attn.q_proj.weight but not model.layers.0."
                       r"self_attn.k_proj.weight, model.layers.0.self_attn.v_proj.weight.*linear_qkv"):
        freeze.resolve(TINY, ["^model.layers.0.self_attn.q_proj"])
    with pytest.raises(UserError, match=r"matches no parameter of LlamaForCausalLM"):
        freeze.resolve(TINY, ["layers.1."])  # re.match: names start with model.
    # a pattern found only further into names it is harmless where those are trained anyway (Axolotl skips it) ...
    assert "embedding.word_embeddings.weight" in trained(["model.embed", "embed_tokens"])
    with pytest.raises(UserError, match=r"embed_tokens'?: matches no parameter"):  # ... refused where they are not
        freeze.resolve(TINY, ["model.layers.0.", "embed_tokens"])
    with pytest.raises(UserError, match=r"row ranges are honoured on embed_tokens and lm_head only"):
        freeze.resolve(TINY, ["^model.layers.0.mlp.down_proj.weight$[:32]"])
    with pytest.raises(UserError, match=r"leaves nothing to train"):
        freeze.resolve(TINY, [])
    tied = arch_from_hf_dict({**TINY.to_dict(), "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                              "num_hidden_layers": 2, "vocab_size": 1000, "tie_word_embeddings": True})
    with pytest.raises(UserError, match=r"lm_head is tied to embed_tokens"):
        freeze.resolve(tied, ["^lm_head.weight$"])


def test_embedding_rows():
    (emb,) = [t for t in freeze.resolve(TINY, ["^model.embed_tokens.weight$[:256]"]) if t.trained]
    assert emb.name == "embedding.word_embeddings.weight" and emb.rows == (0, 256)
    (emb,) = [t for t in freeze.resolve(TINY, ["^model.embed_tokens.weight$[900:]"]) if t.trained]
    assert emb.rows == (900, 1000)  # to the vocabulary's end, not into the padding


def test_plan_keeps_gradients_and_states_for_trained_tensors_only():
    raw = {"model": {"path": "unused", "unfrozen_parameters": ["^model.layers.1."]},
           "parallelism": {"dp_shard_size": 2, "tp_size": 2}, "seq_len": 32}
    cfg = config.build(raw, env={})
    full = config.build({**raw, "model": {"path": "unused"}}, env={})
    est, all_ = (memory.estimate(planned(c, TINY), partition_size=2, gpu_capacity=10**12) for c in (cfg, full))
    layer = counts.local_params(TINY, 2).layer
    assert est.weights == all_.weights and est.gradients == 2 * -(-layer // 2)
    assert est.optimizer == 12 * -(-layer // 2) < all_.optimizer
    said = freeze.describe(freeze.resolve(TINY, ["^model.layers.1."]), TINY, "unfrozen_parameters")
    assert said.startswith("unfrozen_parameters: 6 of 75 tensors trained (0.04 M of ")
