"""Mixture-of-experts records (issue 30), torch-free: what the configs say, what is refused in one line, `plan`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapter.errors import UserError
from adapter.models.arch import arch_from_hf_dict, load_arch
from tests.unit.test_plan_cli import run_cli

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "configs/models"


def test_routing_facts_of_the_flagships():
    q, m, o = (load_arch(MODELS / n) for n in ("qwen3-30b-a3b", "mixtral-8x7b-v0.1", "olmoe-1b-7b-0924"))
    assert (q.num_experts, q.experts_per_token, q.expert_ffn_hidden_size, q.norm_topk_prob) == (128, 8, 768, True)
    assert (m.num_experts, m.experts_per_token, m.expert_ffn_hidden_size, m.norm_topk_prob) == (8, 2, 14336, True)
    assert (o.num_experts, o.norm_topk_prob, o.qk_norm_whole, o.norm_eps) == (64, False, True, 1e-5)  # class default
    assert (q.router_aux_loss_coef, q.output_router_logits) == (0.001, False)
    assert not load_arch(MODELS / "qwen3-8b").moe


@pytest.mark.parametrize("change, match", [
    ({"mlp_only_layers": [0]}, r"^mlp_only_layers=\[0\]: a model mixing dense and mixture-of-experts layers"),
    ({"decoder_sparse_step": 2}, r"^decoder_sparse_step=2: a model mixing"),
    ({"num_experts_per_tok": 200}, r"^num_experts_per_tok=200: exceeds num_experts=128"),
    ({"router_aux_loss_coef": -1}, r"^router_aux_loss_coef=-1: must be a number >= 0"),
])
def test_bad_moe_configs_are_refused_in_one_line(change, match):
    cfg = json.loads((MODELS / "qwen3-30b-a3b/config.json").read_text())
    with pytest.raises(UserError, match=match):
        arch_from_hf_dict({**cfg, **change})
    mixtral = json.loads((MODELS / "mixtral-8x7b-v0.1/config.json").read_text())
    with pytest.raises(UserError, match=r"^router_jitter_noise=0.1: router jitter is not built"):
        arch_from_hf_dict({**mixtral, "router_jitter_noise": 0.1})


def _yaml(tmp_path, extra: str = "") -> str:
    p = tmp_path / "run.yaml"
    p.write_text(f"model:\n  path: {MODELS / 'qwen3-30b-a3b'}\ndata:\n  synthetic: true\nseq_len: 4096\n"
                 f"parallelism:\n  dp_shard_size: 8\n{extra}hardware:\n  gpus_per_node: 8\n")
    return str(p)


def test_plan_prints_the_experts_and_refuses_what_is_not_built(tmp_path):
    code, out, err = run_cli("plan", _yaml(tmp_path))
    assert code == 0, err
    assert "30.53B params" in out and "128 experts of ffn 768, top 8" in out
    assert "mixture of experts: the step time models the experts" in out + err
    code, _, err = run_cli("plan", _yaml(tmp_path, "sequence_parallel: false\nparallelism:\n  tp_size: 2\n")
                           .replace("parallelism:\n  dp_shard_size: 8\n", ""))
    assert code == 2 and "sequence_parallel=False: Megatron-Core's mixture-of-experts layer" in err
    code, _, err = run_cli("plan", _yaml(tmp_path, "lora:\n  r: 8\n"))
    assert code == 2 and "LoRA on a mixture-of-experts model (Qwen3MoeForCausalLM) is not built yet" in err
    assert len(err.strip().splitlines()) == 1


def test_axolotl_model_config_switches_the_load_balancing_loss(tmp_path):
    """Every Axolotl Mixtral example sets `model_config: {output_router_logits: true}` (Axolotl sets it on the HF
    config before loading): it maps to model.output_router_logits, which the architecture the run trains takes over
    config.json's; any other model_config key, and the key on a dense model, is refused in one line."""
    from adapter import config
    from adapter.models import source

    base = {"base_model": str(MODELS / "mixtral-8x7b-v0.1"), "sequence_len": 2048, "max_steps": 1,
            "learning_rate": 1e-5}
    cfg = config.build({**base, "model_config": {"output_router_logits": True}}, env={}, world_size=8)
    assert cfg.model.output_router_logits is True
    assert not load_arch(MODELS / "mixtral-8x7b-v0.1").output_router_logits
    assert source.arch_for(cfg).output_router_logits
    with pytest.raises(UserError, match=r"^model_config.rope_theta=1: overriding this config.json key changes"):
        config.build({**base, "model_config": {"output_router_logits": True, "rope_theta": 1}}, env={}, world_size=8)
    dense = config.build({**base, "base_model": str(MODELS / "qwen3-8b"), "model_config": {"output_router_logits":
                                                                                          True}}, env={}, world_size=8)
    with pytest.raises(UserError, match=r"^model_config.output_router_logits=True: Qwen3ForCausalLM is not a mixture"):
        source.arch_for(dense)
    yml = tmp_path / "dense.yml"
    yml.write_text(f"base_model: {MODELS / 'qwen3-8b'}\nsequence_len: 2048\nmax_steps: 1\nmodel_config:\n"
                   "  output_router_logits: true\nlearning_rate: 1e-5\n")
    code, _, err = run_cli("plan", str(yml))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "not a mixture of experts" in err
