"""The transformers engine's choice, facts and refusals: which engine a checkpoint gets and why, exact parameter
counts from the meta-device model, and one line (exit 2, nothing written) for what it does not run."""
from __future__ import annotations

import json

import pytest
import yaml

from adapter.errors import UserError
from adapter.models.arch import load_arch
from tests.helpers.archs import tiny_config
from tests.helpers.cli import run_cli


def _write(tmp_path, model_type: str, **over):
    d = tmp_path / model_type
    d.mkdir(exist_ok=True)
    cfg = tiny_config(model_type)
    for k, v in over.items():
        setattr(cfg, k, v)
    cfg.save_pretrained(d)
    return d


def _meta_params(model_type: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(tiny_config(model_type)).parameters())


@pytest.mark.parametrize("model_type", ["gpt_oss", "qwen3_next", "phi"])
def test_an_architecture_without_a_native_family_gets_the_transformers_engine_with_exact_counts(tmp_path, model_type):
    arch = load_arch(_write(tmp_path, model_type))
    assert arch.engine == "transformers" and not arch.native and "no native family" in arch.engine_reason
    assert arch.param_count == _meta_params(model_type)
    assert arch.tp_shares  # transformers ships a plan for each of these
    with pytest.raises(UserError, match="no native family .* Fix: train it on the transformers engine"):
        load_arch(_write(tmp_path, model_type), "megatron")


def test_a_native_family_can_be_forced_onto_the_transformers_engine(tmp_path):
    from transformers import LlamaConfig

    d = tmp_path / "llama"
    LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=300, architectures=["LlamaForCausalLM"]).save_pretrained(d)
    assert load_arch(d).native and load_arch(d).family == "llama"
    forced = load_arch(d, "transformers")
    assert forced.engine == "transformers" and forced.engine_reason == "model.engine: transformers"
    from adapter.models.counts import num_params

    assert forced.param_count == num_params(load_arch(d))  # the meta model's count is the native formula's


def _plan(tmp_path, model_dir, **top):
    gpus, sets = str(top.pop("_gpus", 2)), top.pop("_set", None)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"base_model": str(model_dir), "learning_rate": 1e-5, "sequence_len": 256,
                                   "micro_batch_size": 1, "num_epochs": 1, "dp_shard_size": 2, **top}))
    return run_cli("plan", str(cfg), "--gpus-per-node", gpus, "--format", "json", *(("--set", sets) if sets else ()))


def test_plan_names_the_engine_and_counts_the_meta_model(tmp_path):
    d = _write(tmp_path, "gpt_oss")
    code, out, err = _plan(tmp_path, d)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["num_params"] == _meta_params("gpt_oss")
    assert any(n.startswith("engine: transformers' own GptOssForCausalLM (GptOssForCausalLM has no native family")
               for n in plan["notes"]), plan["notes"]


@pytest.mark.parametrize("top, says", [
    ({"tensor_parallel_size": 4, "dp_shard_size": 1, "_gpus": 4},
     "tensor_parallel_size=4: each rank must hold whole heads, and Qwen3NextForCausalLM has 4 attention and 2 "
     "key/value heads"),
    ({"tensor_parallel_size": 2, "dp_shard_size": 1, "adapter": "qlora", "load_in_4bit": True, "lora_r": 8,
      "lora_alpha": 16, "lora_target_linear": True}, "tensor_parallel_size=2: a 4/8-bit base split over "
                                                     "tensor-parallel ranks is not built"),
    ({"context_parallel_size": 2, "dp_shard_size": 1}, "context_parallel_size=2: its linear_attention layers cannot "
                                                       "be split over the sequence"),
    ({"liger_cross_entropy": True, "tensor_parallel_size": 2, "dp_shard_size": 1},
     "Liger's cross-entropy needs the whole vocabulary, which tensor parallelism splits"),
    ({"unfrozen_parameters": ["^model.no_such"]}, "unfrozen_parameters='^model.no_such': matches no parameter of "
                                                   "Qwen3NextForCausalLM"),
    ({"adapter": "lora", "lora_r": 8, "lora_alpha": 16, "lora_target_modules": ["no_such_proj"]},
     "lora_target_modules=['no_such_proj']: PEFT cannot apply it to Qwen3NextForCausalLM"),
])
def test_what_the_transformers_engine_does_not_run_is_one_line(tmp_path, top, says):
    code, out, err = _plan(tmp_path, _write(tmp_path, "qwen3_next"), **top)
    assert code == 2 and err.count("\n") == 1 and says in err and "Fix:" in err, err


def test_qlora_under_zero3_partitions_nf4_codes_and_keeps_int8_whole(tmp_path):
    """plan: NF4 codes partitioned by ZeRO-3 (a rank holds a share plus one layer's gather), int8 whole on every
    rank (LLM.int8() keeps its own reference), said in the notes."""
    held = {}
    for bits, world in (("4bit", 2), ("4bit", 4), ("8bit", 2), ("8bit", 4)):
        code, out, err = _plan(tmp_path, _write(tmp_path, "qwen3_next"), adapter="qlora" if bits == "4bit" else "lora",
                               lora_r=8, lora_alpha=16,
                               lora_target_linear=True, **{f"load_in_{bits}": True}, dp_shard_size=world,
                               _gpus=world, deepspeed={"zero_optimization": {"stage": 3}})
        assert code == 0, err
        plan = json.loads(out)
        held[bits, world] = plan["memory"]["weights"]
        said = "partitions the NF4 base's codes" if bits == "4bit" else "the int8 base stays whole on every rank"
        assert any(said in n for n in plan["notes"]), plan["notes"]
    assert held["4bit", 4] < held["4bit", 2] and held["8bit", 2] - held["8bit", 4] < held["4bit", 2] - held["4bit", 4]


def test_packing_over_recurrent_layers_says_each_document_runs_alone(tmp_path):
    code, out, err = _plan(tmp_path, _write(tmp_path, "qwen3_next"), sample_packing=True,
                           datasets=[{"path": "x.jsonl", "type": "completion"}])
    assert code == 0, err
    assert any("packed documents: Qwen3NextForCausalLM's linear_attention layers carry state along the sequence, "
               "so each document runs as its own row" in n for n in json.loads(out)["warnings"]), out


@pytest.mark.parametrize("model_type, says", [
    ("gpt2", "transformers ships no tensor-parallel plan (base_model_tp_plan) for GPT2LMHeadModel"),
    ("llama4_text", "its plan splits model.layers.0.feed_forward.experts as moe_tp_experts, a tensor-parallel "
                    "style nd-adapter does not build")])
def test_tensor_parallelism_without_a_plan_or_with_a_style_not_built_is_one_line(tmp_path, model_type, says):
    if model_type == "gpt2":
        from transformers import GPT2Config

        d = tmp_path / "gpt2"
        GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1024,
                   architectures=["GPT2LMHeadModel"]).save_pretrained(d)
    else:
        d = _write(tmp_path, model_type)
    code, out, err = _plan(tmp_path, d, tensor_parallel_size=2, dp_shard_size=1)
    assert code == 2 and err.count("\n") == 1 and says in err and "Fix:" in err, err


@pytest.mark.parametrize("model_type, top, says", [  # Axolotl's ep is an axis beside dp_shard: ep × dp_shard GPUs
    ("llama4_text", {}, "expert_parallel_size=2: Llama4ForCausalLM ships no expert-parallel plan (base_model_ep_plan)"),
    ("gpt_oss", {"expert_parallel_size": 8, "_gpus": 8}, "expert_parallel_size=8: does not divide the 4 experts of "
                                                         "each layer"),
    ("gpt_oss", {"tensor_parallel_size": 2, "_gpus": 4}, "expert_parallel_size=2: tensor parallelism beside it"),
    ("gpt_oss", {"lora_target_parameters": ["experts.gate_up_proj"], "adapter": "lora", "lora_r": 4,
                 "lora_alpha": 8}, "expert_parallel_size=2: LoRA on the experts' own parameters")])
def test_expert_parallelism_without_a_plan_or_beside_what_it_does_not_run_is_one_line(tmp_path, model_type, top,
                                                                                      says):
    top = {"expert_parallel_size": 2, "dp_shard_size": 1, **top}
    code, _, err = _plan(tmp_path, _write(tmp_path, model_type), **top)
    assert code == 2 and err.count("\n") == 1 and says in err and "Fix:" in err, err


def test_expert_parallelism_from_the_models_plan_holds_a_share_of_the_experts(tmp_path):
    """gpt-oss's own EP plan: the engine line says how many experts a rank holds, and under ZeRO-2 (weights whole on
    every rank) a rank's weights shrink by the experts it no longer holds, exactly."""
    from adapter.models.generic import meta_model

    d = _write(tmp_path, "gpt_oss")
    weights = {}
    for ep in (1, 2):
        code, out, err = _plan(tmp_path, d, expert_parallel_size=ep, dp_shard_size=2 // ep,
                               deepspeed={"zero_optimization": {"stage": 2}})
        assert code == 0, err
        plan = json.loads(out)
        weights[ep] = plan["memory"]["weights"]
        said = [n for n in plan["notes"] if n.startswith("engine:")]
        assert ("ep=2 from its own expert-parallel plan (base_model_ep_plan): each rank holds 2 of the 4 experts of "
                "each layer" in said[0]) == (ep == 2), said
    model, _ = meta_model(json.loads((d / "config.json").read_text()))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert weights[1] - weights[2] == 4 * experts // 2  # fp32 here: 4 bytes a parameter, half the experts gone


@pytest.mark.parametrize("model_type, top, says", [
    ("gpt_oss", {}, "context_parallel_size=2: GptOssForCausalLM: its attention sinks (per-head sink logits in the "
                    "softmax) are not in nd-adapter's context-parallel kernels"),
    ("llama4_text", {}, "context_parallel_size=2: Llama4ForCausalLM: its chunked attention (attention_chunk_size)"),
    ("starcoder2", {"ring_attn_func": "batch_ring"}, "cp_comm_type='p2p': Starcoder2ForCausalLM has sliding-window "
                                                     "layers (8 tokens), and a window on the ring is not built"),
    ("bloom", {}, "context_parallel_size=2: BloomForCausalLM: it does not declare that its attention runs through "
                  "transformers' attention interface"),  # ALiBi inside its own attention module
    ("llama", {}, "context_parallel_size=2: LlamaForCausalLM's RoPE picks its frequencies by the largest position in "
                  "the forward once past 128 positions")])  # dynamic NTK: not native, so transformers' model
def test_context_parallel_attention_the_kernels_cannot_do_exactly_is_one_line(tmp_path, model_type, top, says):
    """What adapter/modeling/hf_cp.py's function would get wrong, or would never see, is refused before any process
    starts."""
    from transformers import BloomConfig, LlamaConfig

    d = tmp_path / model_type
    if model_type == "bloom":
        BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=1024,
                    architectures=["BloomForCausalLM"]).save_pretrained(d)
    elif model_type == "llama":  # sequence_len 256 > 128
        LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=300, max_position_embeddings=128,
                    rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                    architectures=["LlamaForCausalLM"]).save_pretrained(d)
    else:
        d = _write(tmp_path, model_type)
    code, _, err = _plan(tmp_path, d, context_parallel_size=2, dp_shard_size=1, **top)
    assert code == 2 and err.count("\n") == 1 and says in err and "Fix:" in err, err


def test_context_parallel_attention_raises_on_what_it_would_get_wrong_at_run_time():
    """The net behind plan's refusals (adapter/modeling/hf_cp.py): a model that hands the function a mask of its own
    or sink logits, or whose attention never reaches it, stops the run instead of training on other attention."""
    import torch

    from adapter.modeling import hf_cp

    q, module = torch.zeros(1, 2, 4, 8), torch.nn.Module()
    for extra, says in (({"attention_mask": torch.ones(1, 1, 4, 4, dtype=torch.bool)}, "a mask the model built"),
                        ({"s_aux": torch.zeros(2)}, "s_aux")):
        with pytest.raises(RuntimeError, match=says), hf_cp.forward(None, "all_gather"):
            hf_cp.attention(module, q, q, q, **{"attention_mask": None, **extra})
    with pytest.raises(RuntimeError, match="never called nd-adapter's context-parallel attention"), \
            hf_cp.forward(None, "all_gather"):
        pass


def test_plan_runs_context_parallelism_on_the_transformers_engine_and_divides_activations(tmp_path):
    d = _write(tmp_path, "phi")
    code, out, err = _plan(tmp_path, d, context_parallel_size=2, dp_shard_size=1)
    assert code == 0, err
    plan = json.loads(out)
    assert any("cp=2 through transformers' attention interface" in n for n in plan["notes"]), plan["notes"]
    code, out, err = _plan(tmp_path, d, dp_shard_size=2)
    assert code == 0, err
    flat = json.loads(out)["memory"]
    for part in ("activations_no_recompute", "logits"):  # a rank's share of the sequence (K/V all-gathered: more
        assert plan["memory"][part] < 0.6 * flat[part], (part, plan["memory"], flat)  # than half of attention's)


def test_plan_counts_a_tensor_parallel_rank_s_share_of_the_model(tmp_path):
    """At tp=2 a rank holds what the plan splits halved and the rest whole: the meta model, split as
    adapter/modeling/hf_tp.py splits it, holds that many."""
    import torch
    from transformers import AutoModelForCausalLM

    from adapter.models.tp_plan import model_plan, plan_matches

    d = _write(tmp_path, "qwen3_next")
    code, out, err = _plan(tmp_path, d, tensor_parallel_size=2, dp_shard_size=1)
    assert code == 0, err
    plan = json.loads(out)
    assert any("tp=2 from its own tensor-parallel plan" in n for n in plan["notes"]), plan["notes"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3_next"))
    split = {id(m.weight): m.weight.numel() + (m.bias.numel() if getattr(m, "bias", None) is not None
                                               and not style.startswith("rowwise") else 0)
             for _, style, m in plan_matches(model, model_plan(model)) if style != "replicated_with_grad_allreduce"}
    total = sum(p.numel() for p in model.parameters())
    from adapter.models.arch import load_arch as arch_of
    from adapter.models.counts import local_params

    arch = arch_of(d)
    assert local_params(arch, 2).total(arch.num_layers) == total - sum(split.values()) // 2


def test_axolotl_s_liger_keys_are_the_kernels_the_transformers_engine_applies():
    from adapter import config

    cfg = config.build({"base_model": "x", "learning_rate": 1e-5, "sequence_len": 256, "micro_batch_size": 1,
                        "num_epochs": 1, "liger_rope": True, "liger_rms_norm": True, "liger_glu_activation": True,
                        "liger_fused_linear_cross_entropy": True, "liger_layer_norm": False}, env={})
    assert cfg.model.liger == ("rope", "rms_norm", "glu_activation", "fused_linear_cross_entropy")
    note = next(n for n in cfg.notes if n.startswith("kernels:"))
    assert note.endswith("on the transformers engine Liger's named kernels are applied (model.liger)"), note


def test_plan_counts_peft_s_adapters_on_the_meta_model(tmp_path):
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    code, out, err = _plan(tmp_path, _write(tmp_path, "gpt_oss"), adapter="lora", lora_r=8, lora_alpha=16,
                           lora_target_linear=True)
    assert code == 0, err
    with torch.device("meta"):
        model = peft.get_peft_model(AutoModelForCausalLM.from_config(tiny_config("gpt_oss")),
                                    peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    line = next(n for n in json.loads(out)["notes"] if n.startswith("adapter: LoRA r 8"))
    assert f"{trained:,} trained parameters" in line and "(PEFT on transformers' model)" in line, line


EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def _qwen3_moe(tmp_path):
    """A native family's mixture of experts (Qwen3-MoE), config.json alone."""
    from transformers import Qwen3MoeConfig

    d = tmp_path / "qwen3_moe"
    Qwen3MoeConfig(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   architectures=["Qwen3MoeForCausalLM"]).save_pretrained(d)
    return d


def test_lora_target_parameters_maps_to_peft_and_plan_counts_its_adapters(tmp_path):
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from adapter import config

    d = _write(tmp_path, "gpt_oss")
    cfg = config.build({"base_model": str(d), "learning_rate": 1e-5, "micro_batch_size": 1, "num_epochs": 1,
                        "adapter": "lora", "lora_target_parameters": EXPERTS}, env={}, world_size=1)
    assert cfg.lora.target_parameters == EXPERTS and config.spell(cfg, "lora.target_parameters") == \
        "lora_target_parameters"
    for extra, kw in (({}, {"target_modules": []}), ({"lora_target_linear": True}, {"target_modules": "all-linear"})):
        code, out, err = _plan(tmp_path, d, adapter="lora", lora_r=8, lora_alpha=16, lora_target_parameters=EXPERTS,
                               **extra)
        assert code == 0, err
        with torch.device("meta"):  # Axolotl's LoraConfig: lora_target_modules or [] beside the parameters
            model = peft.get_peft_model(AutoModelForCausalLM.from_config(tiny_config("gpt_oss")),
                                        peft.LoraConfig(r=8, lora_alpha=16, target_parameters=EXPERTS, **kw))
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        line = next(n for n in json.loads(out)["notes"] if n.startswith("adapter: LoRA r 8"))
        assert f"{trained:,} trained parameters" in line and "experts.down_proj, experts.gate_up_proj" in line, line


def test_lora_target_parameters_takes_a_native_family_to_the_transformers_engine_or_is_refused(tmp_path):
    d = _qwen3_moe(tmp_path)
    code, out, err = _plan(tmp_path, d, adapter="lora", lora_target_parameters=EXPERTS)
    assert code == 0, err
    said = next(n for n in json.loads(out)["notes"] if n.startswith("engine:"))
    assert said.startswith("engine: transformers' own Qwen3MoeForCausalLM (the native engine does not reproduce it: "
                           "lora_target_parameters=['experts.gate_up_proj', 'experts.down_proj']: LoRA on parameters "
                           "(PEFT's target_parameters) is built on the transformers engine only"), said
    code, _, err = _plan(tmp_path, d, adapter="lora", lora_target_modules=["q_proj"])
    assert code == 0 and load_arch(d).native, err  # without it the native engine trains the family
    code, _, err = _plan(tmp_path, d, adapter="lora", lora_target_parameters=EXPERTS, _set="model.engine=megatron")
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "lora_target_parameters=" in err and \
        "Fix: set model.engine: auto (or transformers)" in err, err


@pytest.mark.parametrize("top, says", [
    ({"lora_target_parameters": ["experts.nope"]},
     "lora_target_parameters='experts.nope': matches no parameter of GptOssForCausalLM. Fix: name one it has, e.g. "
     "experts.down_proj, experts.gate_up_proj"),
    ({"lora_target_parameters": EXPERTS, "lora_dropout": 0.05}, "lora_dropout=0.05: PEFT adds the adapters"),
    ({"lora_target_parameters": EXPERTS, "peft_layers_to_transform": [1]},
     "peft_layers_to_transform=[1]: PEFT applies it to target_modules only, so lora_target_parameters would still "
     "adapt every layer. Fix: name those layers' parameters in full in lora_target_parameters (e.g. "
     "model.layers.1.mlp.experts.gate_up_proj)"),
    ({"lora_target_parameters": "experts.down_proj"}, "lora_target_parameters='experts.down_proj'"),
    ({"lora_target_parameters": EXPERTS, "lora_target_modules": ["q_proj"], "tensor_parallel_size": 2,
      "dp_shard_size": 1}, "tensor_parallel_size=2: LoRA on parameters (lora_target_parameters) split over "
                           "tensor-parallel ranks is not built"),
])
def test_lora_target_parameters_refusals_are_one_line(tmp_path, top, says):
    code, _, err = _plan(tmp_path, _write(tmp_path, "gpt_oss"), adapter="lora", **top)
    assert code == 2 and says in err, err
    assert "internal error" not in err and len(err.strip().splitlines()) == 1, err


def test_qlora_without_fsdp_or_deepspeed_keys_runs_zero2_and_says_so(tmp_path):
    code, out, err = _plan(tmp_path, _write(tmp_path, "phi"), adapter="qlora", load_in_4bit=True, lora_r=8,
                           lora_alpha=16, lora_target_linear=True)
    assert code == 0, err
    plan = json.loads(out)
    said = "deepspeed.zero_stage: 2 (a 4/8-bit base on the transformers engine"
    assert any(n.startswith(said) for n in plan["notes"]), plan["notes"]
    assert plan["deepspeed"]["config"]["zero_optimization"]["stage"] == 2


def test_remote_code_needs_trust_remote_code_and_an_unknown_model_type_is_one_line(tmp_path):
    d = tmp_path / "remote"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["MyForCausalLM"], "model_type": "my_model",
                                               "auto_map": {"AutoModelForCausalLM": "modeling_my.MyForCausalLM"},
                                               "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 300}))
    code, _, err = _plan(tmp_path, d)
    assert code == 2 and "trust_remote_code=False: MyForCausalLM is built by code in its checkpoint" in err, err
    (d / "config.json").write_text(json.dumps({"architectures": ["MyForCausalLM"], "model_type": "my_model"}))
    code, _, err = _plan(tmp_path, d)
    assert code == 2 and "model_type='my_model': transformers" in err and "cannot load this architecture" in err


def test_remote_code_whose_files_are_absent_is_one_line(tmp_path):
    d = tmp_path / "remote"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["MyForCausalLM"], "model_type": "my_model",
                                               "auto_map": {"AutoConfig": "configuration_my.MyConfig",
                                                            "AutoModelForCausalLM": "modeling_my.MyForCausalLM"}}))
    code, _, err = _plan(tmp_path, d, trust_remote_code=True)
    assert code == 2 and "trust_remote_code=True: " in err and "configuration_my.py" in err, err
    assert "internal error" not in err and len(err.strip().splitlines()) == 1, err


def test_a_config_transformers_reads_but_cannot_build_is_one_line(tmp_path):
    from transformers import Lfm2MoeConfig

    d = tmp_path / "lfm2_moe"  # layer_types unset: its layers index it
    Lfm2MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                  num_experts_per_tok=2, num_dense_layers=1).save_pretrained(d)
    code, _, err = _plan(tmp_path, d)
    assert code == 2 and "transformers cannot build Lfm2MoeForCausalLM from this config.json (TypeError" in err, err
    assert "internal error" not in err and len(err.strip().splitlines()) == 1, err


def test_a_library_transformers_needs_to_build_the_model_is_named_in_one_line(tmp_path, monkeypatch):
    import transformers

    def needs_timm(*a, **k):
        raise ImportError("\nTimmWrapperModel requires the timm library but it was not found in your environment.")

    monkeypatch.setattr(transformers.PhiForCausalLM, "_from_config", needs_timm)
    with pytest.raises(UserError, match=r"transformers needs a library to build PhiForCausalLM: TimmWrapperModel "
                                        r"requires the timm library"):
        load_arch(_write(tmp_path, "phi"), "transformers")


def test_packed_rows_cut_into_documents_with_a_trained_token():
    import torch

    from adapter.modeling.hf_unpack import documents_of, repack, unpack

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 0, 1, 2, 3, 0, 1]])  # last two of row 1: the padded tail
    mask = torch.tensor([[0, 1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 1, 1, 1, 0, 0]], dtype=torch.float)
    index, valid = documents_of(pos, mask)  # row 0's third document and row 1's tail have nothing trained
    assert index[valid].tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13]
    assert valid.sum(1).tolist() == [3, 2, 2, 4]
    x = torch.arange(16.).view(2, 8)
    assert torch.equal(repack(index, valid, unpack(index, x), x.shape), x * torch.tensor(
        [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]]))
    index, valid = documents_of(pos, torch.zeros_like(mask))  # nothing trained: still one forward
    assert valid.sum().item() == 3


def test_the_rehearsals_tiny_mla_model_keeps_a_key_per_head():
    """DeepSeek-V2-Lite's and GLM-4.7-Flash's multi-head latent attention computes a key per attention head
    (num_key_value_heads = num_attention_heads): the rehearsal's tiny config capped the KV heads at 2 of 4, and
    transformers' model then repeated its keys into twice the heads (their examples' rehearsals crashed)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from adapter.models import tiny as tiny_mod

    for model_type, over in (("deepseek_v2", {"num_experts_per_tok": 6}), ("glm4_moe_lite", {})):
        raw = {**AutoConfig.for_model(model_type).to_dict(), **over}
        assert raw["num_key_value_heads"] == raw["num_attention_heads"]
        tiny = tiny_mod.tiny_config(raw, 256)
        assert tiny["num_key_value_heads"] == tiny["num_attention_heads"] == 4, tiny
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny))
        assert model(input_ids=torch.randint(0, 256, (1, 8))).logits.shape == (1, 8, 256)
    gqa = tiny_mod.tiny_config({**AutoConfig.for_model("llama").to_dict(), "num_key_value_heads": 8}, 256)
    assert (gqa["num_attention_heads"], gqa["num_key_value_heads"]) == (4, 2)  # grouped stays grouped


def test_the_rehearsals_tiny_dbrx_cuts_its_sub_configs():
    """DBRX keeps its heads in `n_heads` and its KV heads and experts in attn_config / ffn_config: the tiny config
    cut its width but not those, and the rehearsal of Axolotl's DBRX examples crashed in the first attention."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from adapter.models import tiny as tiny_mod
    from tests.helpers.axolotl_home import model_config

    tiny = tiny_mod.tiny_config(model_config("LnL-AI/dbrx-base-converted-v2"), 256)  # archived/dbrx's base
    assert tiny["n_heads"] == 4 and tiny["attn_config"]["kv_n_heads"] <= 2, tiny
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny))
    assert model(input_ids=torch.randint(0, 256, (1, 8))).logits.shape == (1, 8, 256)


def test_a_depth_given_only_by_the_layer_pattern_is_read_and_cut_as_transformers_reads_it(tmp_path):
    """transformers 5's Nemotron-H config keeps `num_hidden_layers` None beside its `layers_block_type`, and older
    checkpoints give a `hybrid_override_pattern` string: Axolotl's three Nemotron-H examples were refused with
    "num_hidden_layers=None: must be a positive integer", and a rehearsal's tiny model kept every layer."""
    from transformers import AutoConfig

    from adapter.models import tiny as tiny_mod

    raw = AutoConfig.for_model("nemotron_h").to_dict()
    assert raw.get("num_hidden_layers") is None and len(raw["layers_block_type"]) == 4
    d = tmp_path / "nemotron"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    arch = load_arch(d)
    assert arch.engine == "transformers" and arch.num_layers == 4
    old = {**raw, "layers_block_type": None, "num_hidden_layers": 12, "hybrid_override_pattern": "MEM*EMEM*EME"}
    old.pop("layers_block_type")
    tiny = tiny_mod.tiny_config(old, 256)
    assert tiny["hybrid_override_pattern"] == "ME*" and tiny["num_hidden_layers"] == 3, tiny
    assert AutoConfig.for_model(**tiny).layers_block_type == ["linear_attention", "moe", "full_attention"]


def test_peft_s_dropout_refusal_on_fused_experts_names_lora_dropout(tmp_path):
    """PEFT 0.21 maps lora_target_linear's expert projections of an Afmoe (Trinity) onto its fused expert weights,
    which refuse dropout: the line named lora_target_linear and told the user to set it, which it already was."""
    from transformers import AutoConfig

    from tests.helpers.archs import TINY

    d = tmp_path / "afmoe"
    AutoConfig.for_model("afmoe", **TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         num_dense_layers=1, head_dim=16, layer_types=["sliding_attention", "full_attention"],
                         architectures=["AfmoeForCausalLM"]).save_pretrained(d)
    code, _, err = _plan(tmp_path, d, adapter="lora", lora_target_linear=True, lora_dropout=0.05)
    assert code == 2 and err.startswith("nd-adapter: error: lora_dropout=0.05: PEFT cannot apply it to "
                                        "AfmoeForCausalLM") and "Fix: set lora_dropout: 0" in err, err
    code, _, err = _plan(tmp_path, d, adapter="lora", lora_target_linear=True, lora_dropout=0)
    assert code == 0, err


def test_recompute_the_transformers_engine_cannot_do_is_one_line(tmp_path, monkeypatch):
    """gradient_checkpointing: true runs transformers' own checkpointing on this engine (it was silently not applied
    before: tests/distributed/test_transformers_engine.py checks the run says it and the losses stay exact); what
    it cannot do is refused, naming the key."""
    import transformers

    code, _, err = _plan(tmp_path, _write(tmp_path, "phi"), gradient_checkpointing=True)
    assert code == 0, err
    code, _, err = _plan(tmp_path, _write(tmp_path, "phi"), _set="recompute=selective")
    assert code == 2 and "gradient_checkpointing='selective': recomputing the attention alone" in err, err
    monkeypatch.setattr(transformers.PhiForCausalLM, "supports_gradient_checkpointing", False)
    code, _, err = _plan(tmp_path, _write(tmp_path, "phi", resid_pdrop=0.0625), gradient_checkpointing=True)
    assert code == 2 and err.startswith("nd-adapter: error: gradient_checkpointing=") and \
        "does not support transformers' gradient checkpointing" in err and \
        "Fix: turn it off (gradient_checkpointing: false)" in err, err


def test_the_rehearsals_tiny_moe_keeps_top_k_within_its_experts():
    """Kimi-Linear names its top-k `num_experts_per_token`: the tiny config cut its 256 experts to 4 but kept top 8,
    and the rehearsal of Axolotl's kimi-linear example failed in the router's topk (found by the examples sweep)."""
    from adapter.models import tiny as tiny_mod
    from tests.helpers.axolotl_home import model_config

    tiny = tiny_mod.tiny_config(model_config("moonshotai/Kimi-Linear-48B-A3B-Instruct"), 256)
    assert tiny["num_experts_per_token"] <= tiny["num_experts"], tiny


def test_axolotl_torch_compile_compiles_this_engines_layers_where_the_layout_lets_it(tmp_path):
    """torch_compile: true (the llama-4 scout-qlora-single-h100-flex example) compiles transformers' decoder layers
    as it does the native engine's (adapter/modeling/hf_build.compile_layers), said in the first lines; under ZeRO-3
    it stays off and says why; an explicit model.compile: true plans too (it once was refused on this engine), but
    not under ZeRO-3."""
    code, out, err = _plan(tmp_path, _write(tmp_path, "phi"), torch_compile=True, dp_shard_size=1, _gpus=1)
    assert code == 0, err
    notes = " ".join(json.loads(out)["notes"])
    assert "torch_compile: true -> model.compile: on (each transformer layer compiled)" in notes, notes
    code, out, err = _plan(tmp_path, _write(tmp_path, "phi"), torch_compile=True, dp_shard_size=2, _gpus=2)
    assert code == 0, err
    assert "model.compile: off: ZeRO-3's parameter gathers" in " ".join(json.loads(out)["notes"])
    code, out, err = _plan(tmp_path, _write(tmp_path, "phi"), dp_shard_size=1, _gpus=1, _set="model.compile=true")
    assert code == 0 and json.loads(out)["compiled_layers"] is True, err
    # under ZeRO-3 an explicit true is the native engine's only (here a frozen layer gathers module by module)
    code, out, err = _plan(tmp_path, _write(tmp_path, "phi"), dp_shard_size=2, _gpus=2, _set="model.compile=true")
    assert code == 2 and "compiled layers under ZeRO-3 are built on the native engine only" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_a_config_value_of_the_wrong_type_for_transformers_is_one_line():
    """transformers 5 types its config fields (huggingface_hub's strict dataclasses): a null where a bool belongs
    (found by tests/unit/test_fuzz_cli.py) is the config's error, not an internal one."""
    from adapter.models.generic import hf_config

    raw = {**tiny_config("gpt_oss").to_dict(), "attention_bias": None}
    with pytest.raises(UserError, match="^model='gpt_oss': transformers cannot read this config.json"):
        hf_config(raw, trust_remote_code=False, model_dir=None)


@pytest.mark.parametrize("model, top, says", [
    ("gpt_oss", {}, None),  # dp_shard=2: built (tests/distributed/test_moe_sft.py checks it against transformers)
    ("gpt_oss", {"tensor_parallel_size": 2, "dp_shard_size": 1},
     "the load-balancing loss beside tensor or context parallelism"),
    ("deepseek_v3", {"context_parallel_size": 2, "dp_shard_size": 1},
     "the load-balancing loss beside tensor or context parallelism"),
    ("deepseek_v3", {}, "a load-balancing loss for DeepseekV3ForCausalLM (transformers' own model defines none)"),
])
def test_the_load_balancing_loss_on_the_transformers_engine(tmp_path, model, top, says):
    """Axolotl's Mixtral examples set model_config: {output_router_logits: true}: on transformers' gpt-oss the run
    adds its own load_balancing_loss_func per forward and says so; where a statistic over the micro-batch's tokens
    would be each rank's own (tp, cp), or the model has none (DeepSeek-V3), one line."""
    code, out, err = _plan(tmp_path, _write(tmp_path, model, router_aux_loss_coef=0.02),
                           model_config={"output_router_logits": True}, **top)
    if says is None:
        assert code == 0, err
        assert any(n.startswith("mixture of experts: transformers' own modules, load-balancing loss × "
                                "router_aux_loss_coef 0.02") for n in json.loads(out)["notes"]), out
    else:
        assert code == 2 and err.count("\n") == 1 and f"model_config.output_router_logits=True: {says}" in err, err


def test_own_attention_at_cp1_where_the_kernels_compute_the_models_attention(tmp_path):
    """At cp = 1 the transformers engine runs its attention on nd-adapter's kernels (flash with sliding windows,
    packed documents by their boundaries: checks.own_attention) where they compute what the model asks; attention
    sinks (gpt-oss), compiled layers or another model.attention keep transformers' own, and the engine line says
    which."""
    from adapter import config
    from adapter.models import announce, checks
    from tests.helpers.runs import planned

    def run(model_type, **model):
        d = _write(tmp_path, model_type)
        cfg = config.build({"model": {"path": str(d), **model}, "seq_len": 64, "data": {"synthetic": True}},
                           env={}, world_size=1)
        return planned(cfg, load_arch(d))

    olmo = run("olmo3")
    assert olmo.own_attention and "nd-adapter's kernels" in announce.engine(olmo)
    assert checks.own_attention(run("olmo3", compile=True).cfg, olmo.arch) == "compiled layers (model.compile)"
    sinks = run("gpt_oss")
    assert not sinks.own_attention and "sinks" in checks.own_attention(sinks.cfg, sinks.arch)
    assert "nd-adapter's kernels" not in announce.engine(sinks)


def test_a_checkpoint_missing_weights_is_refused_not_started_random(tmp_path):
    """transformers only warns when a checkpoint lacks some of the model's weights and starts them random (a save in
    another module layout loads that way); the transformers engine refuses it in one line naming model.path."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from adapter.modeling.hf_build import build_model

    d = tmp_path / "phi"
    AutoModelForCausalLM.from_config(tiny_config("phi")).save_pretrained(d)
    assert build_model(str(d), weights=True, dtype=torch.float32, seed=0, trust_remote_code=False) is not None
    f = d / "model.safetensors"
    tensors = load_file(f)
    dropped = next(k for k in tensors if "layers.1.mlp" in k)
    save_file({k: v for k, v in tensors.items() if k != dropped}, f, metadata={"format": "pt"})
    with pytest.raises(UserError, match=rf"^model.path='{d}': the checkpoint lacks 1 of the weights of "
                       rf"PhiForCausalLM \(e.g. {dropped}\), which would start random"):
        build_model(str(d), weights=True, dtype=torch.float32, seed=0, trust_remote_code=False)


@pytest.mark.parametrize("model_type, plain", [("olmo3", True), ("llama", True), ("gemma3_text", True),
                                               ("phi", False), ("gpt_neox", False), ("granite", False),
                                               ("cohere", False)])
def test_the_fused_linear_ce_takes_models_whose_logits_are_lm_head_over_their_body(model_type, plain):
    """generic.plain_head reads the model's forward: lm_head (bias-free) over `self.model`'s last hidden state, with
    at most Gemma's final soft-capping, takes nd-adapter's fused linear CE; Phi's biased lm_head, GPT-NeoX's other
    body, Granite's logits scaling and Cohere's logit scale keep their own loss."""
    import transformers

    from adapter.models import generic
    from tests.helpers.archs import TINY

    conf = transformers.CONFIG_MAPPING[model_type](**TINY, pad_token_id=None, bos_token_id=1, eos_token_id=2).to_dict()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    conf["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    assert generic.meta_facts(json.dumps(conf, sort_keys=True), False, None)["plain_head"] is plain


def test_unfrozen_patterns_in_the_checkpoints_names_train_the_tensors_transformers_fuses_them_into(tmp_path):
    """Axolotl's Mixtral 8x22B examples name `block_sparse_moe.gate` / `.experts`, the checkpoint's names, which
    transformers 5 loads as mlp.gate and the fused mlp.experts.gate_up_proj / down_proj: trained there, said in the
    first lines; a pattern taking some of a fused tensor's experts, or rows of one, is one line."""
    from transformers import MixtralConfig

    from adapter.config import load
    from adapter.models.generic_freeze import resolve_unfrozen

    d = tmp_path / "mixtral"
    MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, num_local_experts=4, num_experts_per_tok=2,
                  architectures=["MixtralForCausalLM"]).save_pretrained(d)
    code, out, err = _plan(tmp_path, d, unfrozen_parameters=[
        "^lm_head.weight$", "model.layers.1.block_sparse_moe.gate", "model.layers.1.block_sparse_moe.experts"])
    assert code == 0, err
    assert any("3 of MixtralForCausalLM's tensors matched by the checkpoint's names" in n and
               "model.layers.1.block_sparse_moe" in n for n in json.loads(out)["notes"]), out
    cfg = load(tmp_path / "run.yaml")
    tensors, _ = resolve_unfrozen(cfg.model_copy(update={"model": cfg.model.model_copy(update={
        "unfrozen_parameters": ["model.layers.1.block_sparse_moe.experts", "^lm_head"]})}),
        json.loads((d / "config.json").read_text()), trust_remote_code=False, model_dir=str(d))
    assert {t.name for t in tensors if t.trained} == {
        "lm_head.weight", "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"}
    for pattern, says in (("model.layers.1.block_sparse_moe.experts.0.", "which MixtralForCausalLM holds in one "
                                                                          "tensor (model.layers.1.mlp.experts."),
                          ("model.layers.1.block_sparse_moe.gate.weight[0:2]", "a row range on the checkpoint's "
                                                                                "name of model.layers.1.mlp.gate")):
        code, out, err = _plan(tmp_path, d, unfrozen_parameters=[pattern])
        assert code == 2 and err.count("\n") == 1 and says in err and "Fix:" in err, err


def test_the_rehearsals_tiny_image_text_models_take_an_image():
    """The rehearsal's tiny copies of image-text checkpoints keep their towers' layer-indexed settings consistent:
    Qwen2-VL's merger (hidden_size beside embed_dim) and Qwen2.5-VL's (out_hidden_size) give the tiny language
    model's width, M-RoPE's sections sum to the tiny head's rotary half (Qwen2-VL, Qwen2.5-VL and GLM-4.6V split
    it: [16, 24, 24] against 8 failed), Mllama's tower hands on a layer it has (intermediate_layers_indices 3..30 of
    one layer failed) and its language model keeps a cross-attention layer. Each takes an image and a text."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from adapter.models import tiny as tiny_mod
    from tests.helpers.axolotl_home import model_config

    for repo in ("Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct", "zai-org/GLM-4.6V-Flash"):
        raw = model_config(repo)
        conf = AutoConfig.for_model(**tiny_mod.tiny_config(raw, raw["text_config"]["vocab_size"]))
        model = AutoModelForImageTextToText.from_config(conf)
        v = conf.vision_config
        grid = torch.tensor([[1, 4, 4]])
        img = getattr(conf, "image_token_id", None) or conf.image_token_index
        start = getattr(conf, "vision_start_token_id", None) or conf.image_start_token_id
        end = getattr(conf, "vision_end_token_id", None) or conf.image_end_token_id
        ids = torch.tensor([[5, 6, start, *[img] * (16 // v.spatial_merge_size ** 2), end, 7, 8]])
        pixels = torch.randn(16, 3 * v.temporal_patch_size * v.patch_size ** 2)
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels, image_grid_thw=grid,
                    mm_token_type_ids=(ids == img).long())
        assert out.logits.shape[:2] == ids.shape, repo
    raw = model_config("alpindale/Llama-3.2-11B-Vision-Instruct")
    tiny = tiny_mod.tiny_config(raw, 128256)
    assert tiny["text_config"]["cross_attention_layers"] == [1] and tiny["text_config"]["num_hidden_layers"] == 2
    conf = AutoConfig.for_model(**tiny)
    model = AutoModelForImageTextToText.from_config(conf)
    v = conf.vision_config
    ids = torch.tensor([[128000, conf.image_token_index, 5, 6, 7]])
    tile = [1] + [0] * (v.max_num_tiles - 1)  # one tile of the image
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                pixel_values=torch.randn(1, 1, v.max_num_tiles, 3, v.image_size, v.image_size),
                aspect_ratio_ids=torch.tensor([[1]]), aspect_ratio_mask=torch.tensor([[tile]]),
                cross_attention_mask=torch.tensor([[[tile]] * 5]))
    assert out.logits.shape[:2] == ids.shape
