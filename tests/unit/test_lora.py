"""LoRA's record (adapter/models/lora.py): PEFT's target matching, the placement of each HF linear's rows in
Megatron's fused outputs, PEFT's names and config; Axolotl's LoRA keys and their one-line refusals."""
from __future__ import annotations

import pytest
import torch

from adapter import config
from adapter.errors import UserError
from adapter.models import lora
from adapter.models.arch import arch_from_hf_dict
from adapter.models.families import table_for
from adapter.models.mapping import Ctx, FusedQKV, GatedMLP
from adapter.models.resolved import resolve_run
from tests.helpers.runs import planned

TINY = arch_from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 8,
                          "num_key_value_heads": 2, "intermediate_size": 96, "num_hidden_layers": 3,
                          "vocab_size": 500, "tie_word_embeddings": True})


def spec(**kw):
    return lora.resolve(TINY, **{"r": 4, "alpha": 8, **kw})


def names(s):
    return {(t.layer, t.linear.name) for t in s.targets}


def test_peft_target_matching():
    assert names(spec()) == {(i, n) for i in range(3) for n in ("q_proj", "v_proj")}  # PEFT's default
    every = {(i, n) for i in range(3) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj")}
    assert names(spec(target_linear=True)) == names(spec(target_modules="all-linear")) == every
    assert names(spec(target_modules=["self_attn.o_proj", "down_proj"])) == {(i, n) for i in range(3)
                                                                               for n in ("o_proj", "down_proj")}
    # a string is a regex over the whole module name (re.fullmatch)
    s = spec(target_modules=r"model\.layers\.[02]\.mlp\.(gate|up)_proj")
    assert names(s) == {(0, "gate_proj"), (0, "up_proj"), (2, "gate_proj"), (2, "up_proj")}
    assert lora.peft_config(s, None)["target_modules"] == r"model\.layers\.[02]\.mlp\.(gate|up)_proj"
    assert names(spec(target_modules=["q_proj"], layers=[1])) == {(1, "q_proj")}
    assert spec(target_modules=["q_proj"]).targets[0].hf_module == "model.layers.0.self_attn.q_proj"


def test_scale_shapes_and_tp_split():
    s = spec(target_linear=True, rslora=True, r=16, alpha=32)
    assert s.scale == 32 / 4
    assert spec(r=16, alpha=32).scale == 2
    q = next(t for t in s.targets if t.linear.name == "q_proj")
    o = next(t for t in s.targets if t.linear.name == "o_proj")
    assert (q.a_shape(16, 2), q.b_shape(16, 2)) == ((16, 64), (32, 16))   # column-parallel: B's rows split
    assert (o.a_shape(16, 2), o.b_shape(16, 2)) == ((16, 32), (64, 16))   # row-parallel: A's columns split
    assert s.params(1) == 3 * 16 * sum(t.linear.inp + t.linear.out for t in s.targets[:7])
    assert s.params(2) < s.params(1)


def test_placement_is_where_the_converter_puts_each_hf_linear():
    """Fuse distinct HF weights with the converter's own rules and read them back through `placement`, per TP
    rank: the rows each placement names must be that HF linear's rows of this rank."""
    ctx = Ctx(TINY, 512, 2)
    rules = {type(r): r for r in table_for(TINY) if isinstance(r, (FusedQKV, GatedMLP)) and r.megatron.endswith(
        "weight")}
    q, k, v = (torch.arange(n * 64, dtype=torch.float32).view(n, 64) + 1e4 * i
               for i, n in enumerate((64, 16, 16)))
    gate, up = (torch.arange(96 * 64, dtype=torch.float32).view(96, 64) + 1e5 * (i + 1) for i in range(2))
    for tp in (1, 2):
        fused = {"linear_qkv": rules[FusedQKV].to_megatron([q, k, v], ctx),
                 "linear_fc1": rules[GatedMLP].to_megatron([gate, up], ctx)}
        for rank in range(tp):
            for name, hf, parts in (("linear_qkv", {"q_proj": q, "k_proj": k, "v_proj": v}, 1),
                                    ("linear_fc1", {"gate_proj": gate, "up_proj": up}, 2)):
                w = fused[name]
                local = (w.chunk(tp)[rank] if parts == 1 else
                         torch.cat([c.chunk(tp)[rank] for c in w.chunk(2)]))
                p = lora.placement(TINY, name, tp)
                assert local.shape[0] == p.groups * p.width
                grouped = local.view(p.groups, p.width, 64)
                for piece, (start, size) in ((n, p.piece(n)) for n in hf):
                    got = grouped[:, start:start + size].reshape(-1, 64)
                    assert torch.equal(got, hf[piece].chunk(tp)[rank]), (name, tp, rank, piece)


@pytest.mark.parametrize("kw, match", [
    ({"r": 0}, r"lora.r=0: the adapter rank must be a positive integer"),
    ({"target_modules": ["q_proj", "c_attn"]}, r"c_attn.*matches no linear.*use names it has: q_proj, k_proj"),
    ({"target_modules": ["lm_head"]}, r"LoRA on lm_head is not supported.*lora.modules_to_save"),
    ({"target_modules": "nothing.*here"}, r"matches no linear"),
    ({"modules_to_save": ["norm"]}, r"only embed_tokens and lm_head"),
    ({"layers": [3]}, r"layer indices run from 0 to 2"),
    ({"dropout": 1.0}, r"lora.dropout"),
])
def test_refusals_are_one_line(kw, match):
    with pytest.raises(UserError, match=match) as e:
        spec(**kw)
    assert "\n" not in str(e.value)


def test_names_a_family_packs_are_skipped_as_peft_skips_them():
    """Axolotl's glm4/qlora-32b.yaml lists gate_proj and up_proj, which GLM-4 packs into gate_up_proj: PEFT (what
    Axolotl runs) adapts the names that exist and none of these; so does nd-adapter, and says so. A name no family
    packs (a typo) is still refused, and so is a list that matches nothing (PEFT raises too)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Glm4Config, Glm4ForCausalLM

    hf = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, vocab_size=256, pad_token_id=0)
    arch = arch_from_hf_dict({"architectures": ["Glm4ForCausalLM"], "model_type": "glm4", **hf})
    listed = ["gate_proj", "down_proj", "up_proj", "q_proj"]
    s = lora.resolve(arch, r=4, alpha=8, target_modules=listed)
    peft = get_peft_model(Glm4ForCausalLM(Glm4Config(**hf)), LoraConfig(r=4, target_modules=listed))
    adapted = {n.split(".")[-2] for n, _ in peft.named_modules() if n.endswith(".lora_A")}
    assert adapted == {"down_proj", "q_proj"} and set(s.target_names) == adapted, (adapted, s.target_names)
    assert s.skipped == ("gate_proj", "up_proj")
    assert "; gate_proj, up_proj match no linear: glm4 packs them into gate_up_proj" in lora.describe(s, arch)
    with pytest.raises(UserError, match=r"c_attn.*matches no linear"):
        lora.resolve(arch, r=4, alpha=8, target_modules=["q_proj", "c_attn"])
    with pytest.raises(UserError, match=r"matches no linear"):
        lora.resolve(arch, r=4, alpha=8, target_modules=["gate_proj", "up_proj"])


def test_peft_names_and_config():
    s = spec(target_modules=["q_proj"], modules_to_save=["lm_head", "embed_tokens"])
    assert lora.peft_key(s.targets[0], "A") == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert lora.saved_key(TINY, "lm_head") == "base_model.model.lm_head.weight"
    assert lora.saved_key(TINY, "embed_tokens") == "base_model.model.model.embed_tokens.weight"
    c = lora.peft_config(s, "/m")
    assert (c["peft_type"], c["r"], c["lora_alpha"], c["target_modules"], c["modules_to_save"]) == (
        "LORA", 4, 8.0, ["q_proj"], ["lm_head", "embed_tokens"])


AXOLOTL = {"base_model": "configs/models/llama-3.2-1b", "learning_rate": 2e-4, "micro_batch_size": 1,
           "sequence_len": 128, "max_steps": 2}


def build(extra):
    return config.build({**AXOLOTL, **extra}, env={}, world_size=1)


def test_axolotl_lora_keys():
    cfg = build({"adapter": "lora", "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "lora_target_linear": True,
                 "lora_modules_to_save": ["embed_tokens"], "peft_use_rslora": True, "lora_mlp_kernel": True})
    assert cfg.lora.model_dump(exclude_defaults=True) == {"r": 16, "alpha": 32, "dropout": 0.05,
                                                          "target_linear": True, "modules_to_save": ["embed_tokens"],
                                                          "rslora": True}
    assert any("nd-adapter's own" in n and "lora_mlp_kernel" in n for n in cfg.notes)
    assert config.spell(cfg, "lora.r") == "lora_r"
    q = build({"adapter": "qlora", "load_in_4bit": True, "lora_target_modules": ["q_proj"]})
    assert (q.lora.quantize_base, q.lora.r, q.lora.alpha) == ("nf4", 8, 8)
    assert any("lora_alpha: 8 (PEFT's default" in n for n in q.notes)
    assert build({"adapter": "lora", "load_in_8bit": True, "load_in_4bit": False}).lora.quantize_base == "int8"
    # FSDP's parameter offload (Axolotl's qwen2/qlora-fsdp.yaml): an adapter run does not need it, and says so
    off = build({"adapter": "qlora", "load_in_4bit": True, "fsdp_config": {"fsdp_offload_params": True}})
    assert any(n.startswith("fsdp_config.fsdp_offload_params: not used: an adapter run") for n in off.notes)
    assert build({}).lora is None


def test_lora_fan_in_fan_out_is_taken_and_changes_nothing_as_in_peft():
    """Axolotl's Pythia examples set lora_fan_in_fan_out: true; PEFT resets it from each layer's type (a warning),
    so the adapters are the same either way: accepted with a note, not refused."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers.archs import tiny_config

    cfg = build({"adapter": "lora", "lora_target_modules": ["query_key_value"], "lora_fan_in_fan_out": True})
    assert any(n.startswith("lora_fan_in_fan_out: true changes nothing") for n in cfg.notes)
    ids = torch.arange(12).view(1, 12)
    logits = []
    for fan in (True, False):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("gpt_neox"))
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["query_key_value"],
                                                           fan_in_fan_out=fan, init_lora_weights=False))
        logits.append(model(input_ids=ids).logits)
    assert torch.equal(*logits)


@pytest.mark.parametrize("extra, match", [
    ({"adapter": "qlora"}, r"adapter='qlora': .*needs load_in_4bit: true"),
    ({"load_in_4bit": True}, r"load_in_4bit.*without `adapter`"),
    ({"load_in_8bit": True}, r"load_in_8bit=True: a LoRA setting without `adapter`"),
    ({"adapter": "qlora", "load_in_4bit": True, "load_in_8bit": True}, r"load_in_8bit=True: conflicts"),
    ({"adapter": "ia3"}, r"adapter='ia3': only LoRA and QLoRA"),
    ({"adapter": "lora", "peft_init_lora_weights": "pissa"}, r"peft_init_lora_weights='pissa': only PEFT's default "
                                                             r"\(A Kaiming-uniform, B zero\) and gaussian"),
    ({"adapter": "qlora", "load_in_4bit": True, "bnb_config_kwargs": {"bnb_4bit_quant_type": "fp4"}},
     r"bnb_4bit_quant_type='fp4'"),
])
def test_axolotl_lora_refusals(extra, match):
    with pytest.raises(UserError, match=match) as e:
        build(extra)
    assert "\n" not in str(e.value)


def test_lora_keys_without_an_adapter_are_a_full_fine_tune_as_in_axolotl():
    """Axolotl's full fine-tune examples (falcon config-7b, mpt-7b, redpajama) keep lora_* keys beside an empty
    `adapter:`; Axolotl ignores them and trains every weight, and so does nd-adapter, saying so."""
    cfg = build({"adapter": None, "lora_r": 64, "lora_alpha": 32, "lora_target_linear": True})
    assert cfg.lora is None
    assert any(n.startswith("lora_r, lora_alpha, lora_target_linear: unused, as in Axolotl: `adapter` is unset, so "
                            "this is a full fine-tune") for n in cfg.notes), cfg.notes


def test_plan_counts_what_a_lora_run_holds_and_trains():
    """plan's memory for LoRA, QLoRA (NF4) and the 8-bit base on the 8B shape: the base holds no gradient or optimizer
    state; a quantised base costs its bytes per weight on every rank (ZeRO neither shards nor gathers it); LoRA's
    step skips the frozen weight gradients and a quantised base pays its dequantisation."""
    from pathlib import Path

    from adapter.models import footprint
    from adapter.models.arch import load_arch
    from adapter.models.counts import linears, num_params
    from adapter.plan import memory, traffic
    from adapter.plan.build import build_plan

    model = Path(__file__).resolve().parents[2] / "configs/models/llama-3.1-8b"
    arch = load_arch(model)
    base = {"model": {"path": str(model)}, "seq_len": 4096, "precision": "bf16", "data": {"synthetic": True},
            "batch": {"micro_batch_size": 1}, "optimizer": {"max_steps": 10}}

    def cfg(fmt=None, lora_on=True, shard=1):
        raw = {**base, "parallelism": {"dp_shard_size": shard}, "deepspeed": {"zero_stage": 3}}
        if lora_on:
            raw["lora"] = {"r": 16, "alpha": 32, "target_linear": True, "quantize_base": fmt}
        return config.build(raw, env={}, world_size=shard)

    s = lora.resolve(arch, r=16, alpha=32, target_linear=True)
    adapters = s.params()
    assert adapters == 16 * sum(t.linear.inp + t.linear.out for t in s.targets) == 41_943_040
    held, trained = footprint.held_and_trained(planned(cfg(), arch), 1)
    assert (held, trained) == (num_params(arch) + adapters, adapters)
    q_count = arch.num_layers * sum(lin.weights for lin in linears(arch))
    assert footprint.quantized_base(planned(cfg("nf4"), arch), 1)[:2] == (q_count, 0.5625)
    assert footprint.quantized_base(planned(cfg("int8"), arch), 1)[:2] == (q_count, 1.0)
    assert footprint.quantized_base(planned(cfg(), arch), 1)[0] == 0
    est = {f: memory.estimate(planned(cfg(f), arch), partition_size=1, gpu_capacity=1 << 40, stage=3)
           for f in (None, "nf4", "int8")}
    assert est[None].weights == 2 * held and est[None].gradients == 2 * trained
    assert est[None].optimizer == (4 + 8) * trained
    assert est["nf4"].weights == 2 * (held - q_count) + int(0.5625 * q_count)
    assert est["int8"].weights == 2 * (held - q_count) + q_count
    two = memory.estimate(planned(cfg("nf4", shard=2), arch), partition_size=2, gpu_capacity=1 << 40, stage=3)
    assert two.weights == 2 * -(-(held - q_count) // 2) + int(0.5625 * q_count)  # only the 16-bit part sharded
    from adapter.parallel.layout import Layout

    moved = {f: sum(r.bytes_per_step for r in traffic.estimate(planned(cfg(f, shard=2), arch, Layout.from_config(
        cfg(f, shard=2).parallelism, 8)))) for f in (None, "nf4")}
    assert moved["nf4"] < 0.3 * moved[None]  # ZeRO-3 gathers the 16-bit rest, not the 4-bit linears
    steps = {name: build_plan(resolve_run(c, arch=arch)).predicted.step_time_s
             for name, c in (("full", cfg(lora_on=False)), ("lora", cfg()), ("qlora", cfg("nf4")))}
    assert steps["lora"] < 0.8 * steps["full"] and steps["lora"] < steps["qlora"] < 1.3 * steps["lora"]


def test_dora_runs_on_the_transformers_engine_and_is_refused_elsewhere_in_one_line(tmp_path):
    """Axolotl's peft_use_dora is PEFT's DoRA (lora.use_dora): on a native family `model.engine: auto` takes the
    transformers engine and says why; `megatron` and tensor parallelism refuse it in one line. So do
    lora_rank_pattern / lora_alpha_pattern, peft_init_lora_weights: gaussian and peft_trainable_token_indices, passed
    to PEFT's LoraConfig as they are (their tests against PEFT: tests/distributed/test_transformers_engine.py)."""
    from tests.helpers.sft_data import tiny_model

    model = tiny_model(tmp_path)
    cfg = build({"adapter": "lora", "peft_use_dora": True, "base_model": str(model)})
    assert cfg.lora is not None and cfg.lora.use_dora
    run = resolve_run(cfg, gpu=False)
    assert not run.arch.native and "DoRA (PEFT's weight-decomposed LoRA) is built on the transformers engine only" \
        in run.arch.engine_reason and run.peft is not None and run.peft.lora_config()["use_dora"] is True
    assert run.peft.describe(run.arch, "lora").startswith("lora: DoRA r 8")
    native = cfg.model_copy(update={"model": cfg.model.model_copy(update={"engine": "megatron"})})
    with pytest.raises(UserError, match=r"peft_use_dora=True: DoRA \(PEFT's weight-decomposed LoRA\) is built on the "
                                        r"transformers engine only") as e:
        resolve_run(native, gpu=False)
    assert "\n" not in str(e.value)
    patterns = build({"adapter": "lora", "lora_rank_pattern": {"q_proj": 16}, "lora_alpha_pattern": {"v_proj": 4},
                      "peft_init_lora_weights": "gaussian", "base_model": str(model)})
    got = resolve_run(patterns, gpu=False)
    assert not got.arch.native and "(PEFT's rank_pattern / alpha_pattern) are built on the transformers engine only" \
        in got.arch.engine_reason, got.arch.engine_reason
    assert {k: got.peft.lora_config()[k] for k in ("rank_pattern", "alpha_pattern", "init_lora_weights")} == {
        "rank_pattern": {"q_proj": 16}, "alpha_pattern": {"v_proj": 4}, "init_lora_weights": "gaussian"}
    tokens = resolve_run(build({"adapter": "lora", "peft_trainable_token_indices": {"embed_tokens": [5, 9]},
                                "base_model": str(model)}), gpu=False)
    assert "(PEFT's trainable_token_indices) is built on the transformers engine only" in tokens.arch.engine_reason
    assert tokens.peft.lora_config()["trainable_token_indices"] == {"embed_tokens": [5, 9]}
    assert tokens.peft.trained == tokens.peft.added + 2 * tokens.arch.hidden_size, tokens.peft  # the two rows
    gaussian = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"use_dora": False,
                                                                          "init_weights": "gaussian"})})
    assert "PEFT's gaussian initialisation is built on the transformers engine only" in \
        resolve_run(gaussian, gpu=False).arch.engine_reason
    tp = config.build({**AXOLOTL, "adapter": "lora", "peft_use_dora": True, "base_model": str(model),
                       "tensor_parallel_size": 2}, env={}, world_size=2)
    with pytest.raises(UserError, match=r"tensor_parallel_size=2: DoRA \(peft_use_dora\) split over tensor-parallel"):
        resolve_run(tp, gpu=False)


def test_lora_plus_groups_are_peft_create_loraplus_optimizers():
    """Axolotl's loraplus_lr_ratio / loraplus_lr_embedding (lora.plus_lr_ratio / plus_lr_embedding): on a PEFT
    model (the transformers engine's adapters, DoRA's magnitudes and an embedding's adapters among them) each
    parameter gets the learning rate and weight decay PEFT's create_loraplus_optimizer gives it; without `adapter`
    Axolotl would still regroup a full fine-tune, so it is refused in one line."""
    import peft
    from peft.optimizers import create_loraplus_optimizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from adapter.train.engine import param_groups

    cfg = build({"adapter": "lora", "loraplus_lr_ratio": 16, "loraplus_lr_embedding": 1e-5, "weight_decay": 0.1})
    assert (cfg.lora.plus_lr_ratio, cfg.lora.plus_lr_embedding) == (16, 1e-5)
    with pytest.raises(UserError, match=r"loraplus_lr_ratio=16: LoRA\+ without `adapter`") as e:
        build({"loraplus_lr_ratio": 16})
    assert "\n" not in str(e.value)
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj", "embed_tokens"],
                                                      use_dora=True, modules_to_save=["lm_head"]))
    ref = create_loraplus_optimizer(model, torch.optim.AdamW, lr=1e-3, loraplus_lr_ratio=16,
                                    loraplus_lr_embedding=1e-5)
    want = {id(p): (g["lr"], g["weight_decay"]) for g in ref.param_groups for p in g["params"]}
    ours = param_groups(model, 0.1, plus=(1e-3, 16, 1e-5))
    got = {id(p): (g["lr"], g["weight_decay"]) for g in ours for p in g["params"]}
    assert got == want and len({lr for lr, _ in got.values()}) == 3, (sorted(got.values()), sorted(want.values()))
    assert [g["lora_plus"] for g in ours] == ["a", "embedding", "b"]
