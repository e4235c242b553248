"""Config dialects, env fallbacks, auto-fill, and one test per validation rule (message checked)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from adapter import config
from adapter.errors import UserError
from adapter.models import checks
from adapter.models.arch import arch_from_hf_dict, load_arch

ROOT = Path(__file__).resolve().parents[2]
LLAMA8B = ROOT / "configs/models/llama-3.1-8b"


def native(**over):
    raw = {"model": {"path": str(LLAMA8B)}, "parallelism": {}}
    for k, v in over.items():
        config.set_dotted(raw, k, v)
    return raw


def test_defaults_and_autofill_like_axolotl():
    cfg = config.build(native(**{"parallelism.tp_size": 2, "parallelism.dp_replicate_size": 2}), env={}, world_size=16)
    assert cfg.parallelism.dp_shard_size == 4 and cfg.world_size == 16
    cfg = config.build(native(), env={})
    assert cfg.parallelism.dp_shard_size == 1 and cfg.world_size == 1


def test_env_fallbacks_fill_only_unset_keys():
    env = {"PARALLELISM_CONFIG_TP_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "4"}
    cfg = config.build(native(**{"parallelism.dp_shard_size": 2}), env=env)
    assert cfg.parallelism.tp_size == 2 and cfg.parallelism.dp_shard_size == 2
    with pytest.raises(UserError, match="PARALLELISM_CONFIG_CP_SIZE='x': must be an integer"):
        config.build(native(), env={"PARALLELISM_CONFIG_CP_SIZE": "x"})


def test_axolotl_yaml_unchanged(recwarn):
    cfg = config.load(ROOT / "configs/axolotl-llama-3.1-8b.yaml", env={}, world_size=16)
    p = cfg.parallelism
    assert (p.dp_replicate_size, p.dp_shard_size, p.cp_size, p.tp_size) == (2, 4, 1, 2)
    assert cfg.source == "axolotl" and cfg.seq_len == 2048 and cfg.grad_accum == 4
    assert not [w for w in recwarn if "Axolotl" in str(w.message)]  # notes for the run's first lines, not warnings
    assert not [n for n in cfg.notes if n.startswith("ignored Axolotl keys")]  # special_tokens is read
    assert any(n.startswith("kernels: nd-adapter's own are used") and "flash_attention" in n for n in cfg.notes)
    assert cfg.data.special_tokens.pad_token == "<|end_of_text|>"


def test_axolotl_dataset_keys_map_onto_data(recwarn):
    raw = {"base_model": str(LLAMA8B), "sequence_len": 512, "seed": 7, "train_on_inputs": True, "learning_rate": 1e-5,
           "sample_packing": True, "pad_to_sequence_len": True, "excess_length_strategy": "truncate",
           "dataset_prepared_path": "last_run_prepared", "val_set_size": 0.05, "shuffle_merged_datasets": False,
           "chat_template": "chatml", "special_tokens": None, "dataset_processes": 4, "datasets": [
               {"path": "tatsu-lab/alpaca", "type": "alpaca"},
               {"path": "chat.jsonl", "type": "chat_template", "field_messages": "conversations",
                "message_field_role": "from", "message_field_content": "value", "roles_to_train": ["gpt"],
                "train_on_eos": "all", "split": "train[:90%]"}]}
    cfg = config.build(raw, env={})
    d = cfg.data
    assert (d.train_on_inputs, d.sample_packing, d.excess_length_strategy, d.prepared_path, d.val_set_size,
            d.shuffle_merged_datasets, d.chat_template, d.num_proc, d.seed, d.files) == (
        True, True, "truncate", "last_run_prepared", 0.05, False, "chatml", 4, 7, [])
    first, chat = d.datasets
    assert (first.path, first.type, first.split) == ("tatsu-lab/alpaca", "alpaca", "train")
    assert chat.message_property_mappings == {"role": "from", "content": "value"}  # Axolotl's legacy spellings
    assert (chat.field_messages, chat.roles_to_train, chat.train_on_eos) == ("conversations", ["gpt"], "all")
    assert cfg.document_attention and not [w for w in recwarn if "ignored" in str(w.message)]
    with pytest.raises(UserError, match=r"^datasets\[1\]\.shards=2: a dataset key nd-adapter does not support"):
        config.build({**raw, "datasets": [raw["datasets"][0], {"path": "x", "type": "alpaca", "shards": 2}]}, env={})
    with pytest.raises(UserError, match=r"^datasets\[0\]\.type=.*user-defined prompt formats are not supported"):
        config.build({**raw, "datasets": [{"path": "x", "type": {"field_instruction": "q"}}]}, env={})
    with pytest.raises(UserError, match=r"data: data\.datasets \(SFT\) cannot be combined with data\.files"):
        config.build(native(**{"data.files": ["a.txt"], "data.datasets": [{"path": "b.jsonl"}]}), env={})
    assert not config.build(native(**{"data.document_mask": False}), env={}).document_attention


def test_axolotl_sequence_parallel_degree_alias():
    raw = {"base_model": str(LLAMA8B), "sequence_parallel_degree": 2, "sequence_len": 64, "learning_rate": 1e-5}
    cfg = config.build(raw, env={}, world_size=4)
    assert any("sequence_parallel_degree is deprecated" in n for n in cfg.notes)
    assert cfg.parallelism.cp_size == 2 and cfg.parallelism.dp_shard_size == 2
    with pytest.raises(UserError, match="sequence_parallel_degree=4: conflicts with context_parallel_size=2"):
        config.build({**raw, "sequence_parallel_degree": 4, "context_parallel_size": 2}, env={})


def test_accelerate_launch_config():
    cfg = config.load(ROOT / "configs/accelerate-fsdp-tp.yaml", env={}, overrides={"model.path": str(LLAMA8B)})
    p = cfg.parallelism
    assert (p.dp_shard_size, p.tp_size) == (4, 2) and cfg.hardware.gpus_per_node == 8 and cfg.precision == "bf16"
    with pytest.raises(UserError, match="model.path: missing"):
        config.load(ROOT / "configs/accelerate-fsdp-tp.yaml", env={})


def test_relative_model_path_resolves_next_to_the_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config.load(ROOT / "configs/llama-3.1-8b-hsdp-tp.yaml", env={})
    assert Path(cfg.model.path) == LLAMA8B


# ---- validation rules -------------------------------------------------------------------------------------------

def test_rule_product_not_world():
    with pytest.raises(UserError) as e:
        config.build(native(**{"parallelism.dp_shard_size": 2, "parallelism.tp_size": 2}), env={}, world_size=8)
    assert "parallelism.dp_replicate_size 1 × parallelism.dp_shard_size 2 × parallelism.cp_size 1 × " \
        "parallelism.tp_size 2 = 4 GPUs, but the world size is 8" in \
        str(e.value)
    assert "Fix:" in str(e.value)


def test_rule_sizes_below_one_and_non_integers():
    with pytest.raises(UserError,
                       match=r"parallelism.tp_size=0: .*greater than or equal to 1.*Fix: give an integer ≥ 1"):
        config.build(native(**{"parallelism.tp_size": 0}), env={})
    with pytest.raises(UserError, match=r"parallelism.cp_size='two'.*Fix: give an integer ≥ 1"):
        config.build(native(**{"parallelism.cp_size": "two"}), env={})
    with pytest.raises(UserError, match=r"parallelism.dp_shard_size=2.5"):
        config.build(native(**{"parallelism.dp_shard_size": 2.5}), env={})


def test_rule_unknown_key():
    with pytest.raises(UserError, match="parallelism.tp=2: unknown key"):
        config.build(native(**{"parallelism.tp": 2}), env={})


def test_rule_global_batch():
    raw = native(**{"parallelism.dp_shard_size": 4, "batch.micro_batch_size": 2,
                    "batch.gradient_accumulation_steps": 2, "batch.global_batch_size": 12})
    with pytest.raises(UserError, match=r"batch.global_batch_size=12: ≠ .* = 2×2×4 = 16"):
        config.build(raw, env={})
    raw["batch"].pop("gradient_accumulation_steps")
    with pytest.raises(UserError, match="not divisible by micro_batch_size×dp"):
        config.build(raw, env={})
    raw["batch"]["global_batch_size"] = 16
    assert config.with_grad_accum(config.build(raw, env={})).grad_accum == 2


def _cfg_arch(tp=1, cp=1, seq=2048, heads=32, kv=8, sp=None):
    raw = native(**{"parallelism.tp_size": tp, "parallelism.cp_size": cp, "seq_len": seq})
    if sp is not None:
        raw["sequence_parallel"] = sp
    hf = json.loads((LLAMA8B / "config.json").read_text())
    hf.update(num_attention_heads=heads, num_key_value_heads=kv)
    return config.build(raw, env={}), arch_from_hf_dict(hf)


def test_rule_tp_divides_heads():
    with pytest.raises(UserError, match=r"parallelism.tp_size=3: does not divide num_attention_heads=32 .*"
                                        r"Fix: use a tp_size that divides 32 \(1, 2, 4, 8, 16, 32\)"):
        checks.check(*_cfg_arch(tp=3))


def test_rule_kv_heads_vs_tp():
    with pytest.raises(UserError, match="incompatible with num_key_value_heads=6"):
        checks.check(*_cfg_arch(tp=4, heads=24, kv=6))
    checks.check(*_cfg_arch(tp=16, kv=8, seq=4096))  # tp a multiple of kv heads: allowed (KV replicated)


def test_rule_seq_vs_cp():
    with pytest.raises(UserError, match=r"seq_len=2050: not divisible by 2·cp_size = 4"):
        checks.check(*_cfg_arch(cp=2, seq=2050))
    with pytest.raises(UserError, match=r"seq_len=2052: the per-cp-rank sequence 1026 is not divisible by tp_size=4"):
        checks.check(*_cfg_arch(cp=2, tp=4, seq=2052))
    checks.check(*_cfg_arch(cp=2, tp=4, seq=2052, sp=False))


def test_rule_document_mask_with_cp_needs_sdpa():
    cfg, arch = _cfg_arch(cp=2)
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"document_mask": True})})
    checks.check(cfg, arch)  # packed documents with context parallelism: supported
    local = cfg.model_copy(update={"model": cfg.model.model_copy(update={"attention": "local"})})
    with pytest.raises(UserError, match="model.attention='local': packed documents .* Fix: set model.attention: sdpa"):
        checks.check(local, arch)


def test_rule_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UserError, match="architectures='GPT2LMHeadModel': no native family .* Fix: train it on the "
                       "transformers engine"):
        load_arch(tmp_path, "megatron")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT9LMHeadModel"], "model_type": "gpt9"}))
    with pytest.raises(UserError, match=r"model_type='gpt9': transformers \S+ cannot load this architecture"):
        load_arch(tmp_path)


def test_rule_sliding_window_and_rope(tmp_path):
    """Mistral v0.1's window (4096 of 32768 positions) is attention's own (adapter/kernels): sequences
    longer than it run, packed or not; the ring (cp_comm_type p2p) does not run windows and is refused in one line."""
    from adapter.models import checks

    hf = json.loads((LLAMA8B / "config.json").read_text())
    v01 = {**hf, "architectures": ["MistralForCausalLM"], "sliding_window": 4096, "max_position_embeddings": 32768}
    arch = arch_from_hf_dict(v01)
    assert arch.sliding_window == 4096 and arch.window(0) == 4096 and arch.window_layers is None
    assert arch_from_hf_dict({**v01, "sliding_window": None}).sliding_window is None
    assert arch_from_hf_dict({**v01, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False}
                             ).sliding_window is None
    axolotl = {"base_model": str(LLAMA8B), "learning_rate": 1e-5, "max_steps": 1}
    assert checks.check(config.build({**axolotl, "sequence_len": 8192}, env={}), arch) == []
    packed = config.build({**axolotl, "sequence_len": 8192, "sample_packing": True,
                           "datasets": [{"path": "d.jsonl", "type": "alpaca"}]}, env={})
    assert checks.check(packed, arch) == []
    cp = config.build({"model": {"path": str(LLAMA8B)}, "seq_len": 8192,
                       "parallelism": {"cp_size": 2, "cp_comm_type": "p2p"}}, env={})
    with pytest.raises(UserError, match=r"^parallelism.cp_comm_type='p2p': MistralForCausalLM's sliding window "
                       r"\(4096 tokens\) on the ring is not built.*Fix: use cp_comm_type: all_gather"):
        checks.check(cp, arch)
    with pytest.raises(UserError, match="rope_scaling.rope_type='yarn'"):
        arch_from_hf_dict({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_bad_yaml_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: [unclosed\n")
    with pytest.raises(UserError, match=r"--config=.*not valid YAML at line"):
        config.load(p)
    p.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(UserError, match="the YAML top level must be a mapping"):
        config.load(p)
    with pytest.raises(UserError, match="no such file"):
        config.load(tmp_path / "missing.yaml")


def test_rule_fp8_and_linear_ce_keys():
    with pytest.raises(UserError, match=r"model.fused_linear_ce_chunk applies to the fused linear CE only.*"
                                        r"set model.fused_linear_ce: true"):
        config.build(native(**{"model.fused_linear_ce": False, "model.fused_linear_ce_chunk": 2048}), env={})
    with pytest.raises(UserError, match=r"model.fp8_linears.*'attn'"):
        config.build(native(**{"precision": "fp8", "model.fp8_linears": ["attn"]}), env={})
    with pytest.raises(UserError, match=r"model.fp8_recipe='delayed'"):
        config.build(native(**{"precision": "fp8", "model.fp8_recipe": "delayed"}), env={})
    cfg = config.build(native(**{"precision": "fp8", "model.fp8_linears": ["qkv", "fc1"],
                                 "model.fused_linear_ce": True, "model.fused_linear_ce_chunk": 2048}), env={})
    assert cfg.model.fp8_linears == ("qkv", "fc1") and cfg.model.fused_linear_ce_chunk == 2048


def test_axolotl_torch_compile_compiles_where_the_layout_allows():
    base = {"base_model": str(LLAMA8B), "torch_compile": True, "micro_batch_size": 1, "learning_rate": 1e-5}
    for world, extra, on in ((1, {}, True), (2, {"tensor_parallel_size": 2}, True), (2, {}, False),
                             (2, {"fsdp_version": 2, "fsdp_config": {"reshard_after_forward": False}}, True)):
        cfg = config.build({**base, **extra}, env={}, world_size=world)
        assert cfg.model.compile is on, (world, extra)
        said = [n for n in cfg.notes if n.startswith("torch_compile: true -> model.compile")]
        assert said == [f"torch_compile: true -> model.compile: {'on' if on else 'off'}" + (
            " (each transformer layer compiled)" if on else ": ZeRO-3's parameter gathers: compiled layers under "
            "them are not measured faster yet (fsdp_config.reshard_after_forward: false would compile them)")], \
            cfg.notes  # the file's own words
        assert not any("ignored" in n and "torch_compile," in n + "," for n in cfg.notes)
    with pytest.raises(UserError, match=r"compile_memory_budget=0.5: model.compile: auto is off here \(ZeRO-3's"):
        config.build(native(**{"model.compile": "auto", "model.compile_memory_budget": 0.5}), env={}, world_size=2)


def test_compiled_layers_by_default_where_measured_faster():
    """`model.compile: auto`, the default: on for SFT of fixed-shape batches (full or LoRA), DPO and SimPO at
    tp = cp = 1 outside ZeRO-3 on a GPU and the native engine; off, with the reason in one first line, everywhere
    else. Axolotl's file without torch_compile gets auto, `torch_compile: false` gets false (no line)."""
    from types import SimpleNamespace

    def said(cfg):
        return [n for n in cfg.notes if "model.compile: auto" in n]

    one = {"parallelism.dp_shard_size": 1, "data.synthetic": True}
    cfg = config.build(native(**one), env={}, world_size=1)
    assert cfg.model.compile is True and cfg.compile_auto
    assert said(cfg) == ["model.compile: auto: on (each transformer layer compiled at the first step: measured "
                         "faster on one GPU)"]
    packed = {"data.synthetic": False, "data.datasets": [{"path": "x.jsonl", "type": "chat_template"}]}
    pairs = {**packed, "objective": "dpo", "data.datasets": [{"path": "x.jsonl", "type": "chat_template.default"}]}
    for over, why in (({"parallelism.tp_size": 2}, "tp > 1 breaks the graph"), ({"recompute": "full"}, "recompute"),
                      ({"lora": {"r": 4, "quantize_base": "nf4"}}, "a quantised base: QLoRA SFT"),
                      ({**pairs, "objective": "orpo", "lora": {"r": 4}},
                       "orpo was not measured faster compiled (SFT, DPO and SimPO were)"),
                      (packed, "unpacked SFT (micro-batches cut to their longest example)"),
                      ({"parallelism.dp_shard_size": 2, "deepspeed.zero_stage": 3}, "ZeRO-3's parameter gathers")):
        world = over.get("parallelism.tp_size", 1) * over.get("parallelism.dp_shard_size", 1)
        cfg = config.build(native(**{**one, **over}), env={}, world_size=world)
        assert cfg.model.compile is False and len(said(cfg)) == 1 and why in said(cfg)[0], (over, cfg.notes)
        assert said(cfg)[0].endswith("model.compile: true compiles anyway") != ("ZeRO-3" in why), said(cfg)
    packed_on = config.build(native(**{**one, **packed, "data.sample_packing": True}), env={}, world_size=1)
    assert packed_on.model.compile is True and packed_on.steady_lengths
    unpacked_eval = config.build(native(**{**one, **packed, "data.sample_packing": True, "data.val_set_size": 0.1,
                                           "data.eval_sample_packing": False}), env={}, world_size=1)
    assert unpacked_eval.model.compile is True and not unpacked_eval.steady_lengths
    assert said(unpacked_eval)[0].endswith("the length then a symbol of the graph)"), said(unpacked_eval)
    # measured faster compiled on one H100: LoRA SFT, full and QLoRA DPO, SimPO with and without adapters
    for over in ({"lora": {"r": 4}}, pairs, {**pairs, "lora": {"r": 4, "quantize_base": "nf4"}},
                 {**pairs, "objective": "simpo"}, {**pairs, "objective": "simpo", "lora": {"r": 4}}):
        on = config.build(native(**{**one, **over}), env={}, world_size=1)
        assert on.model.compile is True and "on (" in said(on)[0], (over, on.notes)
    lora_dpo = config.build(native(**{**one, **pairs, "lora": {"r": 4}}), env={}, world_size=1)
    assert lora_dpo.model.compile is True and said(lora_dpo) == [
        "model.compile: auto: on (each transformer layer compiled at the first step: measured faster on one GPU; once "
        "more at the first micro-batch of another length, the length then a symbol of the graph)"], lora_dpo.notes
    # the model's engine and the device: only auto's value is taken back
    for gpu, native_engine, on, why in ((True, True, True, None), (False, True, False, "no GPU is visible"),
                                        (True, False, False, "the transformers engine's compiled layers")):
        got = checks.compile_where_it_runs(packed_on, SimpleNamespace(native=native_engine, moe=False), gpu)
        assert got.model.compile is on and len(said(got)) == 1, said(got)
        assert (why is None and "on (" in said(got)[0]) or why in said(got)[0], said(got)
    for moe in (False, True):  # LoRA DPO was measured on a dense model
        got = checks.compile_where_it_runs(lora_dpo, SimpleNamespace(native=True, moe=moe), True)
        assert got.model.compile is not moe and len(said(got)) == 1, said(got)
        assert not moe or "dpo on a mixture of experts was not measured faster" in said(got)[0], said(got)
    asked = config.build(native(**{**one, "model.compile": True}), env={}, world_size=1)
    assert checks.compile_where_it_runs(asked, SimpleNamespace(native=False), False).model.compile is True
    base = {"base_model": str(LLAMA8B), "micro_batch_size": 1, "learning_rate": 1e-5, "sample_packing": True,
            "datasets": [{"path": "x.jsonl", "type": "chat_template"}]}
    cfg = config.build(base, env={}, world_size=1)
    assert cfg.model.compile is True and cfg.compile_auto and said(cfg)[0].startswith(
        "torch_compile unset -> model.compile: auto: on"), cfg.notes
    cfg = config.build({**base, "torch_compile": False}, env={}, world_size=1)
    assert cfg.model.compile is False and not said(cfg) and not cfg.compile_auto


def test_fused_linear_ce_by_default_where_it_applies():
    """`model.fused_linear_ce: auto`, the default: on for a token-level loss on the native engine, in chunks of a
    multiple of 128 tokens of the padded vocabulary per tp rank (or the chunk asked), said in one first line; off,
    with the reason, on the transformers engine (where it applies, models whose logits are lm_head over their body's
    output, until measured on a GPU; other heads, beside Liger's cross-entropy), for a preference objective and in
    fp16. `true` and `false` stay; `true` where it does not apply is one line."""
    from types import SimpleNamespace

    def said(cfg):
        return [n for n in cfg.notes if n.startswith("model.fused_linear_ce: auto")]

    arch = SimpleNamespace(native=True, vocab_size=128256)
    hf = SimpleNamespace(native=False, vocab_size=100278, plain_head=True, architecture="Olmo3ForCausalLM")
    got = checks.linear_ce_where_it_applies(config.build(native(**{"data.synthetic": True}), env={}), hf)
    assert got.model.fused_linear_ce is False and said(got)[0].endswith(checks.HF_LINEAR_CE_NO_FASTER)
    assert checks.hf_linear_ce_off(got, hf) is None  # it applies: `true` runs it
    cfg = checks.linear_ce_where_it_applies(config.build(native(**{"data.synthetic": True}), env={}), arch)
    assert cfg.model.fused_linear_ce is True and cfg.model.fused_linear_ce_chunk == 1024
    assert said(cfg) == ["model.fused_linear_ce: auto: on (output layer + cross-entropy in chunks of 1024 tokens: "
                         "no [tokens x vocab] logits)"]
    tp2 = config.build(native(**{"data.synthetic": True, "parallelism.tp_size": 2}), env={}, world_size=2)
    assert checks.linear_ce_where_it_applies(tp2, arch).model.fused_linear_ce_chunk == 2048  # half the rows a rank
    asked = config.build(native(**{"data.synthetic": True, "model.fused_linear_ce_chunk": 300}), env={})
    assert checks.linear_ce_where_it_applies(asked, arch).model.fused_linear_ce_chunk == 300
    pairs = {"objective": "dpo", "data.synthetic": False,
             "data.datasets": [{"path": "x.jsonl", "type": "chat_template.default"}]}
    scaled = SimpleNamespace(native=False, vocab_size=300, plain_head=False, architecture="GraniteForCausalLM")
    for over, engine, why in (({}, scaled, "GraniteForCausalLM's forward does more than lm_head"),
                              ({"model.liger": ["fused_linear_cross_entropy"]}, hf, "Liger's cross-entropy kernel"),
                              ({"lora.r": 8, "lora.modules_to_save": ["lm_head"]}, hf, "lm_head is an adapter's"),
                              (pairs, arch, "dpo needs each token's log-probability"),
                              ({"precision": "fp16"}, arch, "fp16: the kernel's output-weight gradient")):
        got = checks.linear_ce_where_it_applies(config.build(native(**{"data.synthetic": True, **over}), env={}),
                                                engine)
        assert got.model.fused_linear_ce is False and got.model.fused_linear_ce_chunk is None
        assert len(said(got)) == 1 and said(got)[0].startswith(f"model.fused_linear_ce: auto: off: {why}"), got.notes
    for value in (True, False):
        kept = config.build(native(**{"data.synthetic": True, "model.fused_linear_ce": value}), env={})
        got = checks.linear_ce_where_it_applies(kept, hf)
        assert got.model.fused_linear_ce is value and not said(got)
    with pytest.raises(UserError, match="model.fused_linear_ce=True: the fused linear cross-entropy is not built on "
                       "the transformers engine here .GraniteForCausalLM's forward does more"):
        checks.linear_ce_where_it_applies(kept.model_copy(update={"model": kept.model.model_copy(
            update={"fused_linear_ce": True})}), scaled)


def test_longrope_is_read_as_transformers_reads_it():
    """Phi-3.5-mini / Phi-4-mini: the short and long factors, the default attention factor sqrt(1 + ln(max/orig) /
    ln(orig)); a seq_len past original_max_position_embeddings runs (the long factors per micro-batch:
    tests/distributed/test_longrope.py); a factor list of the wrong length is refused."""
    import math

    from adapter.models import checks

    phi = json.loads((ROOT / "configs/models/phi-3-mini-4k/config.json").read_text())
    short = [1.0 + i / 48 for i in range(48)]  # 96 / 2 frequencies
    hf = {**phi, "max_position_embeddings": 131072, "sliding_window": 262144,
          "rope_scaling": {"type": "longrope", "short_factor": short, "long_factor": [2.0] * 48}}
    arch = arch_from_hf_dict(hf)
    assert arch.rope_short_factor == tuple(short) and arch.rope_original_max == 4096
    assert arch.rope_long_factor == (2.0,) * 48
    assert arch.rope_attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert arch_from_hf_dict({**hf, "rope_scaling": {**hf["rope_scaling"], "attention_factor": 1.5}}
                             ).rope_attention_factor == 1.5
    run = {"model": {"path": str(ROOT / "configs/models/phi-3-mini-4k")}}
    assert checks.check(config.build({**run, "seq_len": 4096}, env={}), arch) == []
    assert checks.check(config.build({**run, "seq_len": 8192}, env={}), arch) == []
    with pytest.raises(UserError, match=r"rope_scaling.short_factor=.*needs 48 positive factors"):
        arch_from_hf_dict({**hf, "rope_scaling": {**hf["rope_scaling"], "short_factor": short[:4]}})
    with pytest.raises(UserError, match=r"rope_scaling.long_factor=None: LongRoPE needs 48 positive factors"):
        arch_from_hf_dict({**hf, "rope_scaling": {k: v for k, v in hf["rope_scaling"].items() if k != "long_factor"}})
