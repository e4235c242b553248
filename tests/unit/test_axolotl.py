"""Axolotl keys: precision, context parallelism (block and flat keys), FSDP -> ZeRO, kernel notes, refusals, and
Axolotl's own ND-parallel example configs passing `plan` unchanged with their hub ids in a local HF cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from adapter import config
from adapter.config import axolotl
from adapter.errors import UserError
from adapter.models.resolved import resolve_run
from tests.helpers.cli import run_cli
from tests.helpers.hub import add_to_hub_cache

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests/fixtures/axolotl"
LLAMA8B = ROOT / "configs/models/llama-3.1-8b"
BASE = {"base_model": str(LLAMA8B), "sequence_len": 2048, "max_steps": 10, "learning_rate": 2e-5}


def build(world=1, **keys):
    return config.build({**BASE, **keys}, env={}, world_size=world)


@pytest.mark.parametrize("keys, want", [({"bf16": True}, "bf16"), ({"bf16": "auto"}, "bf16"),
                                        ({"bf16": "full"}, "bf16"), ({"fp16": True}, "fp16"),
                                        ({"bf16": False}, "fp32"), ({}, "fp32"),
                                        ({"bf16": False, "fp16": False}, "fp32")])
def test_precision(keys, want):
    cfg = build(**keys)
    assert cfg.precision == want and any(n.startswith(f"precision: {want}") for n in cfg.notes)


def test_schedule_keys_and_output_dir():
    cfg = build(num_epochs=2, warmup_ratio=0.1, evals_per_epoch=4, saves_per_epoch=2, output_dir="out",
                **{"max_steps": None})
    o = cfg.optimizer
    assert (o.num_epochs, o.warmup_ratio, o.max_steps, o.warmup_steps) == (2.0, 0.1, None, None)
    assert cfg.eval.per_epoch == 4 and cfg.checkpoint.saves_per_epoch == 2
    assert cfg.checkpoint.dir == "out" and cfg.checkpoint.export_hf == "out" and cfg.checkpoint.keep_last == 4
    cfg = build(max_steps=None)  # neither max_steps nor num_epochs: Axolotl's one epoch, said
    assert cfg.optimizer.num_epochs == 1.0 and any("Axolotl's default" in n for n in cfg.notes)
    assert build(eval_steps=0.25).eval.every == 0.25 and build(save_steps=50).checkpoint.save_every == 50


def test_save_strategy_as_axolotl_passes_it_to_hf():
    """"no": no checkpoint, the model still exported to output_dir; "steps" alone: HF's 500; "epoch": one per
    epoch; Axolotl's own mismatch checks refused in one line."""
    out = {"output_dir": "out", "datasets": [{"path": "x.jsonl", "type": "alpaca"}]}
    for no in ("no", False):  # an unquoted `no` is YAML's false
        c = build(save_strategy=no, **out).checkpoint
        assert (c.dir, c.export_hf, c.save_every, c.saves_per_epoch) == (None, "out", 0, None)
    assert build(save_strategy="steps", **out).checkpoint.save_every == 500
    assert build(save_strategy="epoch", output_dir="out").checkpoint.saves_per_epoch == 1
    assert build(save_strategy="steps", save_steps=20, **out).checkpoint.save_every == 20
    for keys, needle in (({"save_strategy": "no", "save_steps": 20}, "^save_strategy='no': save_steps=20"),
                         ({"save_strategy": "epoch", "save_steps": 20}, "set save_strategy: steps"),
                         ({"save_strategy": "no", "saves_per_epoch": 2}, "saves_per_epoch=2 asks for saves"),
                         ({"save_strategy": "sometimes"}, "^save_strategy='sometimes': not one of HF's")):
        with pytest.raises(UserError, match=needle):
            build(**keys, **out)


def test_context_parallel_block_and_flat_keys():
    cfg = build(world=8, context_parallel={"size": 8, "backend": "auto", "rotate_method": "allgather",
                                           "load_balance": "head_tail", "ring_impl": "auto"})
    assert cfg.parallelism.cp_size == 8 and cfg.parallelism.cp_comm_type == "all_gather"
    assert any(n.startswith("context parallel: size 8") for n in cfg.notes)
    cfg = build(world=4, context_parallel={"size": 4, "backend": "ring", "rotate_method": "alltoall"})
    assert cfg.parallelism.cp_comm_type == "p2p"
    for func, comm in (("varlen_llama3", "all_gather"), ("batch_ring", "p2p"), ("batch_zigzag", "p2p")):
        cfg = build(world=2, context_parallel_size=2, ring_attn_func=func)
        assert cfg.parallelism.cp_size == 2 and cfg.parallelism.cp_comm_type == comm
    cfg = build(world=2, context_parallel_size=2, heads_k_stride=1)
    assert any("heads_k_stride 1 has no effect" in n for n in cfg.notes)


@pytest.mark.parametrize("keys, needle", [
    ({"context_parallel": {"size": 8, "backend": "ulysses"}}, "context_parallel.backend='ulysses': Ulysses"),
    ({"context_parallel": {"size": 8, "backend": "usp"}}, "context_parallel.backend='usp'"),
    ({"context_parallel": {"size": 8, "ulysses_size": 2, "ring_size": 4}}, "context_parallel.ulysses_size=2: Ulysses"),
    ({"context_parallel": {"size": 8, "load_balance": "ptrr"}}, "context_parallel.load_balance='ptrr'"),
    ({"context_parallel": {"size": 8, "sizee": 2}}, "context_parallel.sizee=2: unknown key"),
    ({"context_parallel": {"size": 8}, "context_parallel_size": 4}, "conflicts with context_parallel_size=4"),
    ({"context_parallel": 8}, "context_parallel=8: must be a mapping"),
    ({"context_parallel_size": 2, "ring_attn_func": "batch_stripe"}, "ring_attn_func='batch_stripe'"),
    ({"optimizer": "lion_8bit"}, "optimizer='lion_8bit': nd-adapter trains with AdamW (fp32, 8-bit or 4-bit moments) "
                                 "only"),
    # transformers reads the 4-bit AdamW's block_size from optim_args: the 256 here is its default
    ({"optimizer": "adamw_torch_4bit", "optim_args": {"block_size": 128}}, "optim_args={'block_size': 128}: "),
    ({"bf16": True, "fp16": True}, "fp16=True: conflicts with bf16=True"),
    ({"bfloat16": True, "fp16": True}, "fp16=True: conflicts with bfloat16=True"),
    ({"warmup_steps": 10, "warmup_ratio": 0.1}, "warmup_ratio=0.1: Axolotl takes warmup_steps or warmup_ratio"),
    ({"evals_per_epoch": 2, "eval_steps": 10}, "evals_per_epoch=2: Axolotl takes eval_steps or evals_per_epoch"),
])
def test_refusals_are_one_line(keys, needle):
    with pytest.raises(UserError) as e:
        build(world=8, **keys)
    assert needle in str(e.value) and "Fix:" in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_bnb_8bit", "adamw_torch_8bit", "paged_adamw_8bit"])
def test_8bit_optimizer_names_run_bitsandbytes_adamw8bit(name):
    cfg = build(world=8, optimizer=name)
    said = [n for n in cfg.notes if n.startswith("optimizer:")]
    assert cfg.optimizer.name == "adamw_8bit" and said == [
        f"optimizer: {name} -> bitsandbytes' AdamW8bit (block-wise 8-bit moments, fp32 master weights)"
        + ("; paging is not used: the states stay on the GPU (`nd-adapter plan` says whether they fit)"
           if name.startswith("paged") else "")]
    assert build(world=8, optimizer="adamw_torch_fused").optimizer.name == "adamw"


def test_4bit_optimizer_name_runs_torchaos_adamw4bit(tmp_path):
    cfg = build(world=8, optimizer="adamw_torch_4bit")
    said = [n for n in cfg.notes if n.startswith("optimizer:")]
    assert cfg.optimizer.name == "adamw_4bit" and said == [
        "optimizer: adamw_torch_4bit -> torchao's AdamW4bit (4-bit moments in blocks of 256, fp32 master weights)"]
    yml = tmp_path / "run.yaml"
    yml.write_text(yaml.safe_dump({**BASE, "optimizer": "adamw_torch_4bit", "dp_shard_size": 8}))
    code, out, err = run_cli("plan", str(yml), "--gpus-per-node", "8")  # its first lines name it
    assert code == 0 and "optimizer: DeepSpeed's ZeRO-3 stepping torchao's AdamW4bit (fp32 master partitions, 4-bit " \
        "moments in their whole blocks of 256)" in out, (out, err)
    # beside a DeepSpeed JSON's bf16 moments (optimizer.state_dtype bf16): one line, exit status 2
    ds = tmp_path / "bf16_states.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 1}, "bf16": {
        "enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}))
    yml.write_text(yaml.safe_dump({**BASE, "optimizer": "adamw_torch_4bit", "deepspeed": str(ds)}))
    code, _, err = run_cli("plan", str(yml), "--gpus-per-node", "1")
    assert code == 2 and err.count("\n") == 1 and err.startswith(
        "nd-adapter: error: optimizer: optimizer.state_dtype: bf16 keeps bf16 moments, optimizer.name: adamw_4bit "
        "4-bit ones: choose one. Fix: "), err


def test_paged_adamw_32bit_is_adamw_with_fp32_moments():
    """Axolotl's llama-2/qlora.yml, llama-3/qlora.yml: bitsandbytes' paged 32-bit AdamW takes AdamW's update (checked
    here against torch's AdamW on the same gradients); paging is where the states live, said and not used."""
    import bitsandbytes as bnb
    import torch

    cfg = build(world=8, optimizer="paged_adamw_32bit")
    assert cfg.optimizer.name == "adamw" and any(n.startswith("optimizer: paged_adamw_32bit -> AdamW with fp32 "
                                                             "moments") for n in cfg.notes)
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(4096))
    b = torch.nn.Parameter(a.detach().clone())
    start = a.detach().clone()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours, theirs = torch.optim.AdamW([a], **kw), bnb.optim.AdamW32bit([b], **kw)
    for _ in range(5):
        a.grad = torch.randn(4096)
        b.grad = a.grad.clone()
        ours.step(), theirs.step()
    assert (a - start).abs().max() > 1e-2 and (a - b).abs().max() < 1e-6


def test_fsdp_maps_onto_zero_stages():
    cfg = build(world=2, dp_shard_size=2, fsdp_version=2, fsdp_config={
        "reshard_after_forward": False, "offload_params": False, "state_dict_type": "FULL_STATE_DICT",
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "activation_checkpointing": True, "sync_module_states": True})
    assert cfg.deepspeed.zero_stage == 2 and cfg.recompute == "full"
    note = next(n for n in cfg.notes if n.startswith("FSDP -> DeepSpeed"))
    assert "reshard_after_forward: false -> deepspeed.zero_stage 2" in note
    assert any("fsdp_config.sync_module_states" in n for n in cfg.notes if n.startswith("ignored"))
    assert build(world=2, fsdp_config={"fsdp_reshard_after_forward": True}).deepspeed.zero_stage == 3  # old prefix
    assert build(world=2, fsdp=["shard_grad_op", "auto_wrap"]).deepspeed.zero_stage == 2
    assert not any(n.startswith("FSDP") for n in build().notes)  # no FSDP keys: nothing said
    # dp_shard_size: 1 (and dp_replicate_size: 1) beside FSDP: Axolotl shards over the GPUs left (falcon-e's DPO)
    fill = build(world=4, dp_shard_size=1, dp_replicate_size=1, fsdp_version=2, fsdp_config={"reshard_after_forward":
                                                                                             True})
    assert fill.parallelism.dp_shard_size == 4 and any("dp_shard_size: 1 beside FSDP" in n for n in fill.notes)
    with pytest.raises(UserError, match="but the world size is 4"):  # without FSDP Axolotl refuses it too
        build(world=4, dp_shard_size=1, dp_replicate_size=1)


def test_kernel_keys_get_one_line_and_other_plugins_are_ignored_or_refused():
    cfg = build(plugins=["axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin",
                         "axolotl.integrations.liger.LigerPlugin", "axolotl.integrations.lm_eval.LMEvalPlugin",
                         "axolotl.integrations.context_parallel.ContextParallelPlugin"],
                attn_implementation="flash_attention_2", liger_rms_norm=True, flash_attention=False)
    kernels = [n for n in cfg.notes if n.startswith("kernels:")]
    assert len(kernels) == 1 and "nd-adapter's own are used" in kernels[0]
    for name in ("CutCrossEntropyPlugin", "LigerPlugin", "attn_implementation: flash_attention_2", "liger_rms_norm"):
        assert name in kernels[0], kernels
    assert "flash_attention:" not in kernels[0]  # false selects nothing
    ignored = [n for n in cfg.notes if n.startswith("ignored")]
    assert len(ignored) == 1 and "LMEvalPlugin" in ignored[0] and "ContextParallel" not in ignored[0]
    for plugin in ("axolotl.integrations.kd.KDPlugin", "axolotl.integrations.spectrum.SpectrumPlugin",
                   "my_company.plugins.Custom"):  # distillation, freezing, unknown: they may change what is trained
        with pytest.raises(UserError, match="may change what is trained"):
            build(plugins=[plugin])


# --- keys that change what is trained: honoured, or refused in one line (never dropped) -------------------------

@pytest.mark.parametrize("keys, needle", [
    ({"adapter": "llama-adapter"}, "adapter='llama-adapter': only LoRA and QLoRA adapters are supported"),
    ({"load_in_8bit": True}, "load_in_8bit=True: a LoRA setting without `adapter` would train every weight"),
    ({"rl": "grpo"}, "rl='grpo': GRPO is an online method: it generates completions"),
    ({"neftune_noise_alpha": 5}, "neftune_noise_alpha=5: NEFTune"),
    ({"tokens": {"pad_token": "<pad>"}}, "tokens={'pad_token': '<pad>'}: must be a list of the tokens to add"),
    ({"added_tokens_overrides": {5: "<x>"}}, "added_tokens_overrides={5: '<x>'}: renaming tokens"),
    ({"pretraining_dataset": [{"path": "allenai/c4", "name": "en", "type": "pretrain"}]},
     "pretraining_dataset[0].path='allenai/c4': not a local file or directory: nd-adapter does not stream hub"),
    ({"embedding_lr_scale": 0.5}, "embedding_lr_scale=0.5"),
    ({"resume_from_checkpoint": "out/checkpoint-100"}, "resume_from_checkpoint"),
    ({"tokenizer_config": "other/tokenizer"}, "tokenizer_config='other/tokenizer'"),
    ({"batch_size": 16, "gradient_accumulation_steps": 2}, "batch_size=16: Axolotl takes"),
    ({"batch_size": 1, "micro_batch_size": 2}, "batch_size=1: smaller than micro_batch_size=2"),
    ({"deepspeed": "no/such/zero3.json"}, "deepspeed='no/such/zero3.json': no such file"),
    ({"test_datasets": [{"path": "t.jsonl", "type": "completion"}], "val_set_size": 0.1,
      "datasets": [{"path": "d.jsonl", "type": "completion"}]}, "val_set_size=0.1: Axolotl takes test_datasets"),
])
def test_keys_that_change_what_is_trained_are_refused_in_one_line(keys, needle):
    with pytest.raises(UserError) as e:
        build(**keys)
    assert needle in str(e.value) and "Fix:" in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_off_values_and_keys_without_effect_pass():
    cfg = build(adapter=None, lora_r=None, load_in_4bit=False, rl=None, neftune_noise_alpha=0, tokens=[],
                auto_resume_from_checkpoints=True, model_revision="main", tokenizer_config=str(LLAMA8B))
    assert cfg.lora is None  # (a lora_* key set without an adapter is refused: tests/unit/test_lora.py)
    cfg = build(default_system_message="You are terse.", chat_template="chatml")
    assert any(n.startswith("default_system_message has no effect") for n in cfg.notes)


def test_auto_resume_from_checkpoints_is_honoured(tmp_path):
    """Axolotl continues from output_dir's newest checkpoint with auto_resume_from_checkpoints: true, and starts
    afresh without it; nd-adapter resumes so too (adapter/train/ckpt_info.resumes), not only with --resume."""
    from adapter.train.ckpt_info import resumes

    out = tmp_path / "out"
    on, off = (build(output_dir=str(out), auto_resume_from_checkpoints=v) for v in ("true", False))
    assert on.checkpoint.auto_resume and not off.checkpoint.auto_resume
    assert not resumes(on, False)  # nothing to continue yet: a fresh start
    (out / "global_step3").mkdir(parents=True)
    assert resumes(on, False) and not resumes(off, False) and resumes(off, True)
    assert "auto_resume_from_checkpoints" not in " ".join(on.notes)  # honoured, not reported as ignored


def test_batch_size_sets_gradient_accumulation_as_axolotl_does():
    cfg = build(batch_size=32, micro_batch_size=4)
    assert cfg.batch.gradient_accumulation_steps == 8
    assert any("gradient_accumulation_steps = 32 // micro_batch_size 4 = 8" in n for n in cfg.notes)


def test_deepspeed_json_stage_precision_and_offload(tmp_path):
    z3 = tmp_path / "zero3_bf16.json"
    z3.write_text(json.dumps({"zero_optimization": {"stage": 3, "overlap_comm": True}, "bf16": {"enabled": True},
                              "gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": "auto"}))
    cfg = build(world=2, dp_shard_size=2, deepspeed=str(z3))
    assert cfg.deepspeed.zero_stage == 3 and cfg.precision == "bf16"
    assert any(n == "precision: bf16 (zero3_bf16.json: bf16.enabled true)" for n in cfg.notes), cfg.notes
    z2 = tmp_path / "zero2.json"
    z2.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    cfg = build(world=2, dp_shard_size=2, deepspeed=str(z2), bf16=True)
    note = next(n for n in cfg.notes if n.startswith("deepspeed zero2.json"))
    assert cfg.deepspeed.zero_stage == 2 and "offload_optimizer not used" in note
    z1 = tmp_path / "zero1.json"
    z1.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 4}))
    assert build(world=2, deepspeed=str(z1), gradient_accumulation_steps=4).deepspeed.zero_stage == 2
    with pytest.raises(UserError, match="gradient_accumulation_steps=4 disagrees"):
        build(world=2, deepspeed=str(z1), gradient_accumulation_steps=2)
    with pytest.raises(UserError, match="bf16.enabled true conflicts"):
        build(world=2, deepspeed=str(z3), bf16=False)
    with pytest.raises(UserError, match="conflicts with the FSDP keys"):
        build(world=2, deepspeed=str(z3), fsdp_config={"reshard_after_forward": True})
    # DeepSpeed's bf16 master weights and optimizer states change what is trained: honoured as a pair, else refused
    pure = tmp_path / "pure_bf16.json"
    pure.write_text(json.dumps({"zero_optimization": {"stage": 1}, "bf16": {
        "enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}))
    cfg = build(world=1, deepspeed=str(pure))
    assert cfg.optimizer.state_dtype == "bf16" and cfg.precision == "bf16"
    assert any("-> optimizer.state_dtype bf16" in n for n in cfg.notes), cfg.notes
    half = tmp_path / "half.json"
    half.write_text(json.dumps({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}))
    with pytest.raises(UserError, match=r"^deepspeed='half.json': bf16.bf16_master_weights_and_grads without "
                                        r"bf16_optimizer_states.*Fix: set bf16_optimizer_states: true too"):
        build(world=1, deepspeed=str(half))
    # read beside the config file when the working directory has no such file
    yml = tmp_path / "run.yaml"
    yml.write_text(yaml.safe_dump({**BASE, "deepspeed": "zero3_bf16.json", "dp_shard_size": 2}))
    assert config.load(yml, env={}, world_size=2).deepspeed.zero_stage == 3


# --- Axolotl's own ND-parallel examples, unchanged ----------------------------------------------------------------

@pytest.fixture()
def hf_home(tmp_path, monkeypatch):
    """The three examples' base models in a local HF cache: Llama-3.1-8B with a (sparse) 16 GB of weights, the
    other two as bare configs; the run must not look anywhere else."""
    home = tmp_path / "hf"
    add_to_hub_cache(home, "meta-llama/Llama-3.1-8B", LLAMA8B, sparse_weights=16_060_522_496)
    add_to_hub_cache(home, "Qwen/Qwen3-8B", ROOT / "configs/models/qwen3-8b")
    add_to_hub_cache(home, "NousResearch/Meta-Llama-3.1-8B", LLAMA8B)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("ND_ADAPTER_CACHE", str(tmp_path / "nd-cache"))
    return home


EXAMPLES = {  # file: (layout dp_replicate, dp_shard, cp, tp; cp_comm_type; weights source)
    "llama-3_1-8b-hsdp-tp.yaml": ((2, 4, 1, 2), "all_gather", "pretrained"),
    "qwen3-8b-fsdp-tp-cp.yaml": ((1, 2, 2, 2), "all_gather", "random"),
    "llama3-8b-ringmaster-cp.yaml": ((1, 1, 8, 1), "all_gather", "random"),
}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_axolotl_nd_parallel_examples_pass_plan_unchanged(hf_home, name):
    raw = yaml.safe_load((FIXTURES / name).read_text())
    assert "/" in raw["base_model"] and not Path(raw["base_model"]).exists()  # a hub id, as written
    code, out, err = run_cli("plan", str(FIXTURES / name), "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    layout, comm, source = EXAMPLES[name]
    m = doc["mesh"]
    assert (m["dp_replicate"], m["dp_shard"], m["cp"], m["tp"]) == layout
    assert doc["deepspeed"]["config"]["zero_optimization"]["stage"] == 3 and doc["precision"] == "bf16"
    assert doc["weights"]["source"] == source and doc["weights"]["model_dir"].startswith(str(hf_home))
    notes = "\n".join(doc["notes"])
    assert "reshard_after_forward: true -> deepspeed.zero_stage 3" in notes and "nd-adapter's own are used" in notes
    if source == "pretrained":
        assert doc["weights"]["to_convert"] and doc["weights"]["convert_bytes"] == 16_060_522_496
        assert "converting them once" in doc["weights"]["description"]
    if m["cp"] > 1:
        assert any(t["group"] == "cp" for t in doc["traffic"])
    code, table, err = run_cli("plan", str(FIXTURES / name))
    assert code == 0 and table.count("ignored Axolotl keys") <= 1, err
    assert "Weights " in table


def test_example_plan_in_a_real_process_says_each_note_once(hf_home):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "300"}
    p = subprocess.run([sys.executable, "-m", "adapter", "plan", str(FIXTURES / "llama-3_1-8b-hsdp-tp.yaml")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0 and not p.stderr.strip(), p.stderr
    assert "ignored Axolotl keys" not in p.stdout  # dataset_prepared_path is read by the data side
    assert p.stdout.count("kernels: nd-adapter's own are used") == 1
    assert "16.06 GB" in p.stdout and "converting them once" in p.stdout


def test_hub_id_not_cached_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    code, _, err = run_cli("plan", str(FIXTURES / "llama-3_1-8b-hsdp-tp.yaml"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "base_model)='meta-llama/Llama-3.1-8B': not a local directory, and not in the local Hugging Face cache" \
        in lines[0] and "hf download meta-llama/Llama-3.1-8B" in lines[0]


def test_init_pretrained_without_weights_is_one_line(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": str(LLAMA8B), "init": "pretrained"}}))
    code, _, err = run_cli("plan", str(cfg))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "model.init='pretrained': " in lines[0] and "holds no weights" in lines[0]
    cfg.write_text(yaml.safe_dump({"model": {"path": str(LLAMA8B)}}))  # auto: random init, and plan says so
    code, out, err = run_cli("plan", str(cfg), "--format", "json")
    assert code == 0 and json.loads(out)["weights"]["description"].startswith("weights: RANDOM initialisation")


junk = st.one_of(st.none(), st.booleans(), st.integers(-2, 9), st.floats(allow_nan=True), st.text(max_size=8),
                 st.lists(st.sampled_from(["full_shard", "offload", "x", 1]), max_size=3),
                 st.dictionaries(st.sampled_from(["size", "backend", "ulysses_size", "reshard_after_forward",
                                                  "offload_params", "load_balance", 1]),
                                 st.one_of(st.integers(-1, 9), st.text(max_size=5), st.booleans()), max_size=3))


@settings(max_examples=300, deadline=None)
@given(keys=st.dictionaries(st.sampled_from(sorted(axolotl.KEYS | {"context_parallel_size"})), junk, max_size=4))
def test_any_value_of_these_keys_is_a_config_or_a_one_line_error(keys):
    try:
        build(world=None, **keys)
    except UserError as e:
        assert "\n" not in str(e) and "Fix:" in str(e), str(e)


def test_axolotl_defaults_where_ours_differ():
    """An Axolotl YAML that leaves them out gets Axolotl's betas (HF's 0.9/0.999), sequence_len 512 and seed 42;
    without learning_rate (Axolotl requires it) it is refused rather than trained at some default."""
    cfg = config.build({"base_model": str(LLAMA8B), "learning_rate": 1e-5, "max_steps": 1}, env={}, world_size=1)
    assert cfg.optimizer.betas == (0.9, 0.999) and cfg.seq_len == 512 and cfg.seed == cfg.data.seed == 42
    assert any(n == "sequence_len: 512 (Axolotl's default)" for n in cfg.notes)
    assert any(n.startswith("adam betas 0.9/0.999 (Axolotl's default") for n in cfg.notes)
    assert any(n.startswith("seed: 42 (Axolotl's default)") for n in cfg.notes)
    assert build(adam_beta2=0.95).optimizer.betas == (0.9, 0.95) and build(seed=3).data.seed == 3
    assert cfg.dist_timeout_s == 1800 and build(ddp_timeout=7200).dist_timeout_s == 7200  # HF's / Axolotl's
    lg = build(wandb_project="p", wandb_name="run-1", wandb_entity="team", wandb_mode="offline").logging
    assert (lg.wandb_project, lg.wandb_name, lg.wandb_entity, lg.wandb_mode) == ("p", "run-1", "team", "offline")
    with pytest.raises(UserError, match=r"^learning_rate=None: missing: Axolotl requires it\. Fix: "):
        config.build({"base_model": str(LLAMA8B), "max_steps": 1}, env={}, world_size=1)


def test_numbers_as_axolotl_reads_them():
    """YAML 1.1 reads `2e-5` (no dot) as a string; Axolotl's schema turns it into a number, and so does this (it
    crashed with cosine_min_lr_ratio on Axolotl's examples)."""
    cfg = build(learning_rate="2e-5", cosine_min_lr_ratio="0.1", lr_scheduler="cosine", micro_batch_size="2",
                sequence_len="4_096", weight_decay="1e-2", warmup_steps="10")
    assert cfg.optimizer.lr == 2e-5 and abs(cfg.optimizer.min_lr - 2e-6) < 1e-18 and cfg.batch.micro_batch_size == 2
    assert cfg.seq_len == 4096 and cfg.optimizer.weight_decay == 0.01 and cfg.optimizer.warmup_steps == 10
    with pytest.raises(UserError, match=r"^learning_rate='fast': .* Fix:"):
        build(learning_rate="fast")


def test_evals_per_epoch_zero_means_no_evaluation():
    from adapter.train import schedule

    cfg = build(evals_per_epoch=0, max_steps=None, num_epochs=1, val_set_size=0.1)
    s = schedule.resolve(cfg, 1000, has_val=True)
    assert s.eval_every is None and not s.eval_at_start and not s.eval_at_end
    assert "eval: none (evals_per_epoch: 0)" in schedule.describe(cfg, s)


@pytest.mark.parametrize("keys, needle", [
    ({"warmup_steps": 1.5}, "warmup_steps=1.5: "),
    ({"evals_per_epoch": -1}, "evals_per_epoch=-1: "),
    ({"micro_batch_size": 0}, "micro_batch_size=0: "),
])
def test_errors_name_the_key_as_the_file_spells_it(keys, needle):
    with pytest.raises(UserError) as e:
        build(world=8, **keys)
    assert str(e.value).startswith(needle) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("keys, said", [
    ({"fsdp_version": 2, "fsdp_config": {"fsdp_offload_params": True}}, "fsdp_config.fsdp_offload_params"),
    ({"fsdp_config": {"offload_params": True}}, "fsdp_config.offload_params"),
    ({"fsdp": ["full_shard", "offload"]}, "fsdp: offload"),
])
def test_fsdp_offload_is_memory_placement_said_in_one_line(keys, said):
    """FSDP's CPU offload moves where shards live, not what is computed: as a DeepSpeed JSON's offload_param, it is
    named as not used and `plan` says whether the run fits without it (Axolotl's phi/phi3-ft-fsdp.yml)."""
    notes = [n for n in build(world=8, **keys).notes if "offload" in n]
    assert len(notes) == 1 and notes[0].startswith(f"{said}: not used (memory placement only"), notes


def test_memory_advice_in_the_file_s_words_and_only_what_applies():
    from adapter.plan.build import build_plan

    big = {"base_model": str(LLAMA8B), "learning_rate": 1e-5, "max_steps": 1, "sequence_len": 8192,
           "micro_batch_size": 8}
    warn = [w for w in build_plan(resolve_run(config.build(big, env={}, world_size=1))).warnings if "exceeds" in w]
    assert warn and "gradient_checkpointing: true" in warn[0] and "recompute" not in warn[0], warn
    assert "tensor_parallel_size/dp_shard_size" in warn[0] and "micro_batch_size" in warn[0]
    warn = [w for w in build_plan(resolve_run(config.build({**big, "gradient_checkpointing": True,
                                                            "micro_batch_size": 64}, env={}, world_size=1))).warnings
            if "exceeds" in w]
    assert warn and "gradient_checkpointing" not in warn[0] and "recompute" not in warn[0], warn


def test_model_type_must_be_a_causal_lm():
    assert build(model_type="AutoModelForCausalLM").model.path and build(model_type="LlamaForCausalLM")
    with pytest.raises(UserError, match=r"^model_type='AutoModelForSequenceClassification': nd-adapter trains causal"):
        build(model_type="AutoModelForSequenceClassification")
    for image_text in ("Llama4ForConditionalGeneration", "AutoModelForImageTextToText", "AutoModelForVision2Seq"):
        assert build(model_type=image_text).model.path  # the language model of an image-text checkpoint, on text
    with pytest.raises(UserError, match=r"^model_type='AutoModelForTokenClassification': nd-adapter trains causal"):
        build(model_type="AutoModelForTokenClassification")


def test_rehearsal_keeps_examples_and_says_its_own_precision(tmp_path):
    """ALST's min_sample_len 200000 against the rehearsal's 512-token sequences dropped every example; the first
    lines said bf16 while the rehearsal runs fp32."""
    from adapter.train.rehearse import rehearsal

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "hello"}) + "\n")
    cfg = build(bf16="auto", sequence_len=500_000, min_sample_len=200_000, context_parallel_size=8, world=8,
                datasets=[{"path": str(data), "type": "completion"}])
    small = rehearsal(resolve_run(cfg), 4, None, str(tmp_path / "w")).cfg
    assert small.seq_len == 512 and small.data.min_sample_len == 512 and small.data.excess_length_strategy == "truncate"
    assert [n for n in small.notes if n.startswith("precision")] == [
        "precision: fp32 (the rehearsal's, on CPU; the run itself: bf16)"]


def test_plan_says_what_preprocess_would_refuse_of_the_data(tmp_path):
    """A chat template neither Axolotl nor nd-adapter ships and processor_type on a text-only checkpoint (no tower
    for its images) are refused by plan in one line, as preprocess refuses them; the names Axolotl ships
    (qwen_25, qwen3, ...) plan, and preprocess renders them (tests/unit/test_chat_templates.py)."""
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    chat = {"path": str(data), "type": "chat_template"}
    for keys, err in (({"datasets": [{**chat, "chat_template": "qwen9"}]},
                       "datasets[0].chat_template='qwen9': not a chat template Axolotl or nd-adapter ships"),
                      ({"datasets": [chat], "chat_template": "llama9"},
                       "chat_template='llama9': not a chat template Axolotl or nd-adapter ships"),
                      ({"datasets": [chat], "processor_type": "AutoProcessor", "skip_prepare_dataset": True},
                       "processor_type='AutoProcessor': LlamaForCausalLM has no vision or audio tower"),
                      ({"datasets": [chat], "chat_template": "qwen_25"}, None),
                      ({"datasets": [{**chat, "chat_template": "qwen3"}]}, None)):
        yml = tmp_path / "run.yaml"
        yml.write_text(yaml.safe_dump({**BASE, **keys}))
        code, out, said = run_cli("plan", str(yml))
        if err is None:
            assert code == 0 and "predicted peak" in out, said
        else:
            assert code == 2 and said.startswith(f"nd-adapter: error: {err}") and said.count("\n") == 1, said


def test_an_unknown_architecture_is_said_first(tmp_path):
    """A QLoRA example (then Gemma 3) took five rounds of fixes before `unknown model architecture`: the
    model is checked before any key of the file (now: an architecture transformers itself cannot load)."""
    model = tmp_path / "gemma"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["FalcoForCausalLM"], "model_type": "falco"}))
    cfg = tmp_path / "qlora.yaml"
    cfg.write_text(yaml.safe_dump({"base_model": str(model), "adapter": "qlora", "load_in_4bit": True,
                                   "optimizer": "paged_adamw_8bit", "learning_rate": "2e-4", "lora_r": 32,
                                   "unfrozen_parameters": ["^lm_head.weight$"], "sequence_len": 2048}))
    for argv in (["plan", str(cfg)], ["plan", str(cfg), "--search", "--gpus-per-node", "8"],
                 ["preprocess", "--config", str(cfg)]):
        code, _, err = run_cli(*argv)
        assert code == 2 and err.startswith("nd-adapter: error: model_type='falco': transformers "), (argv, err)
        assert "cannot load this architecture (FalcoForCausalLM)" in err


def test_unfrozen_parameters_map_and_bad_patterns_are_refused_at_plan(tmp_path):
    assert build(unfrozen_parameters="^lm_head.weight$").model.unfrozen_parameters == ["^lm_head.weight$"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**BASE, "unfrozen_parameters": ["^model.layers.0.self_attn.q_proj.weight$"]}))
    code, _, err = run_cli("plan", str(cfg))
    assert code == 2 and err.startswith("nd-adapter: error: unfrozen_parameters='^model.layers.0.self_attn.q_proj"
                                        ".weight$': trains model.layers.0.self_attn.q_proj.weight but not"), err
    cfg.write_text(yaml.safe_dump({**BASE, "unfrozen_parameters": ["^model.layers.3[01].", "^lm_head.weight$"]}))
    code, out, err = run_cli("plan", str(cfg), "--format", "json")
    notes = json.loads(out)["notes"]
    said = "unfrozen_parameters: 13 of 195 tensors trained (961.56 M of 8030.26 M"  # 2 layers + lm_head of 8B
    assert code == 0 and any(n.startswith(said) for n in notes), notes


def test_pretraining_dataset_from_local_files(tmp_path):
    """Axolotl's continued pretraining (its examples' `pretraining_dataset`, type pretrain) from local files, read
    relative to the config file, onto the pretraining data path."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "part-0.jsonl").write_text(json.dumps({"content": "In the beginning."}) + "\n")
    cfg_file = tmp_path / "pretrain.yaml"
    cfg_file.write_text(yaml.safe_dump({**BASE, "pretraining_dataset": [
        {"path": "corpus", "name": "en", "type": "pretrain", "split": "train", "text_column": "content"},
        {"path": "other"}]}))
    cfg = config.load(cfg_file)
    assert cfg.data.files == [str(corpus)] and cfg.data.text_key == "content" and not cfg.data.datasets
    assert any(n.startswith("pretraining_dataset: ") and n.endswith("only the first entry is read, as in Axolotl")
               for n in cfg.notes), cfg.notes
    with pytest.raises(UserError, match=r"^pretraining_dataset=.*given with datasets"):
        build(pretraining_dataset=str(corpus), datasets=[{"path": "x", "type": "alpaca"}])
    with pytest.raises(UserError, match=r"^pretraining_dataset\[0\]\.skip=10: skipping rows"):
        build(pretraining_dataset=[{"path": str(corpus), "skip": 10}])


def test_save_only_model_is_said_not_silently_dropped():
    """HF Trainer's save_only_model writes checkpoints that cannot resume; ours keep the optimizer state (any layout
    resumes them), and the first lines say so instead of listing the key as ignored."""
    notes = build(save_only_model=True).notes
    said = [n for n in notes if n.startswith("save_only_model:")]
    assert len(said) == 1 and "optimizer state" in said[0] and "--resume" in said[0], notes
    assert not any("save_only_model" in n for n in notes if n.startswith("ignored")), notes
    assert not any(n.startswith("save_only_model:") for n in build(save_only_model=False).notes)


@pytest.mark.parametrize("keys, on, said", [
    # Axolotl's rule (core/builders/causal.py): unset counts as on, given an eval set and save_steps a multiple of
    # eval_steps in its own units (fractions of the run from saves/evals_per_epoch)
    ({"val_set_size": 0.1, "evals_per_epoch": 4, "saves_per_epoch": 2}, True, "unset counts as on"),
    ({"val_set_size": 0.1, "eval_steps": 5, "save_steps": 10}, True, "unset counts as on"),
    ({"val_set_size": 0.1, "eval_steps": 5, "save_steps": 10, "load_best_model_at_end": False}, False, None),
    ({"val_set_size": 0.1, "evals_per_epoch": 4, "saves_per_epoch": 1}, False, None),  # one save per epoch
    ({"val_set_size": 0.1, "evals_per_epoch": 4, "saves_per_epoch": 1, "early_stopping_patience": 3}, False,
     "no save_steps"),
    ({"val_set_size": 0.1, "eval_steps": 3, "save_steps": 10, "load_best_model_at_end": True}, False,
     "save_steps 10 is not a multiple of eval_steps 3"),
    ({"eval_steps": 5, "save_steps": 10, "load_best_model_at_end": True}, False, "there is no eval set"),
    ({"val_set_size": 0.1, "eval_steps": 5, "save_steps": 10, "load_best_model_at_end": False,
      "early_stopping_patience": 2}, True, "early stopping"),
])
def test_load_best_model_at_end_follows_axolotls_rule(keys, on, said):
    cfg = build(**keys, output_dir="out")
    assert cfg.checkpoint.load_best is on
    notes = [n for n in cfg.notes if n.startswith("load_best_model_at_end")]
    assert (said is None and not notes) or (said is not None and said in notes[0]), notes


def test_early_stopping_and_best_checkpoint_refusals():
    from adapter.train import schedule

    cfg = build(early_stopping_patience=2, output_dir="out")
    with pytest.raises(UserError, match=r"^early_stopping_patience=2: early stopping needs an eval set"):
        schedule.resolve(cfg, 1000, has_val=False)
    s = schedule.resolve(build(early_stopping_patience=2, val_set_size=0.1, eval_steps=2, output_dir="out"), 1000,
                         has_val=True)
    assert s.patience == 2 and s.eval_every == 2
    for key, value, needle in (("metric_for_best_model", "accuracy", "chosen by the eval loss"),
                               ("greater_is_better", True, "keep the worst checkpoint"),
                               ("save_strategy", "best", "saving only on a new best")):
        with pytest.raises(UserError, match=f"^{key}="):
            build(**{key: value})
        with pytest.raises(UserError, match=needle):
            build(**{key: value})
    assert build(metric_for_best_model="eval_loss").checkpoint.load_best is False


# --- Axolotl's expert-parallel examples: every command, the same overrides in the file's words ----------------------

@pytest.fixture()
def ep_example(tmp_path, monkeypatch):
    """qwen3_30ba3b_ep_lora_4gpu.yaml, unchanged but for its dataset (a local alpaca file), run from its directory,
    with Qwen3-30B-A3B's config.json and a small tokenizer in a local HF cache."""
    from adapter.demo.build import ALPACA_DATA
    from tests.helpers.axolotl_home import localised
    from tests.helpers.sft_data import tiny_model

    src = tiny_model(tmp_path / "tok")
    (src / "config.json").write_text((ROOT / "configs/models/qwen3-30b-a3b/config.json").read_text())
    add_to_hub_cache(tmp_path / "hf", "Qwen/Qwen3-30B-A3B-Instruct-2507", src)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return localised(FIXTURES / "qwen3_30ba3b_ep_lora_4gpu.yaml", tmp_path / "ep.yaml", {0: ALPACA_DATA})


def test_preprocess_needs_no_world_size_for_an_expert_parallel_example(ep_example):
    """Data preparation does not depend on the layout: it was refused for a missing world size, with a fix naming
    flags `preprocess` does not have."""
    code, out, err = run_cli("preprocess", "--config", str(ep_example))
    assert code == 0, err
    assert "prepared data: " in out and "train: " in out


def test_every_command_takes_overrides_in_the_file_s_spelling(ep_example):
    """`--set dp_shard_size=4` was "unknown key" on an Axolotl file: keys Axolotl names are set in the file before
    it is mapped, on plan, preprocess, train and rehearse alike (native keys still apply after the mapping)."""
    code, out, err = run_cli("plan", str(ep_example), "--set", "dp_shard_size=1", "--set",
                             "fsdp_config.reshard_after_forward=false", "--set", "precision=bf16", "--format", "json")
    assert code == 0, err
    doc = json.loads(out)  # as in the file: Axolotl's ep axis beside dp_shard, 1 × 4 = 4 data-parallel ranks
    assert (doc["mesh"]["dp_shard"], doc["deepspeed"]["config"]["zero_optimization"]["stage"]) == (4, 2)
    assert "expert_parallel_size: 4 -> parallelism.ep_size: 4" in "\n".join(doc["notes"])
    assert run_cli("preprocess", "--config", str(ep_example), "--set", "sequence_len=1024")[0] == 0
    for verb in ("train", "rehearse"):  # read before any process starts: 3 does not divide 128 experts
        code, _, err = run_cli(verb, "--config", str(ep_example), "--set", "expert_parallel_size=3", "--nproc", "4")
        assert code == 2 and "expert_parallel_size=3: does not divide num_experts=128" in err, (verb, err)
    code, _, err = run_cli("plan", str(ep_example), "--set", "dp_shard_sizee=4")
    assert code == 2 and "dp_shard_sizee=4: unknown key" in err, err


def test_mistral_common_tokenizer_is_mapped_as_axolotl_uses_it():
    """Axolotl tokenises with mistral-common when tokenizer_use_mistral_common is true, and turns it on itself for a
    Magistral model (tests/unit/test_mistral_common.py: what it encodes); false keeps the HF tokenizer."""
    assert build(tokenizer_use_mistral_common=True).data.mistral_common
    cfg = build(base_model_config="mistralai/Magistral-Small-2509")
    assert cfg.data.mistral_common and any("Axolotl turns it on for a Magistral model" in n for n in cfg.notes)
    cfg = build(base_model_config="mistralai/Magistral-Small-2509", tokenizer_use_mistral_common=False)
    assert not cfg.data.mistral_common and not any("ignored" in n for n in cfg.notes)


def test_keys_that_change_the_loss_the_order_or_the_experts_are_refused_not_dropped():
    """group_by_length without packing (HF's length-grouped sampler) was dropped as an ignored key; it changes what
    trains. use_eaft and llama4_linearized_experts, once refused here, are honoured (tests/unit/test_eaft.py,
    tests/unit/test_linearized.py)."""
    with pytest.raises(UserError, match=r"^group_by_length=True: HF's length-grouped sampler"):
        build(group_by_length=True)
    assert build(use_eaft=True, eaft_alpha=1.0).eaft is not None
    assert build(llama4_linearized_experts=True).model.linearized_experts
    assert not build(llama4_linearized_experts=False).model.linearized_experts
    cfg = build(group_by_length=True, sample_packing=True)  # Axolotl's trainer ignores it beside packing
    assert not any("group_by_length" in n for n in cfg.notes)
    assert not any("group_by_length" in n for n in build(group_by_length=False).notes)
