"""Input users sent that changed what was trained or ended in a traceback: quoted booleans and numbers read as
Axolotl's schema reads them, non-finite and absurd numbers, non-string keys, deep nesting, malformed DeepSpeed
overrides, flags, model config.json files and weight indexes. Each plans as meant or is one line (exit 2) naming
the key. (test_fuzz_cli.py generates many more.)"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from adapter import config
from adapter.cli import main
from adapter.errors import UserError
from tests.helpers.cli import run_cli
from tests.helpers.hub import add_to_hub_cache

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "configs/models/llama-3.2-1b"
AXOLOTL = {"base_model": str(LLAMA), "learning_rate": 2e-5, "sequence_len": 1024, "max_steps": 10}
NATIVE = {"model": {"path": str(LLAMA)}, "seq_len": 1024}


def run_plan(tmp_path, raw, *flags: str) -> tuple[int, str]:
    path = tmp_path / "c.yaml"
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw, sort_keys=False))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", str(path), "--gpus-per-node", "8", "--format", "json", *flags])
    return code, err.getvalue()


@pytest.mark.parametrize("quoted, real, check", [
    ({"gradient_checkpointing": "false"}, {"gradient_checkpointing": False}, lambda c: c.recompute == "none"),
    ({"gradient_checkpointing": "True"}, {"gradient_checkpointing": True}, lambda c: c.recompute == "full"),
    ({"adapter": "lora", "load_in_8bit": "false"}, {"adapter": "lora", "load_in_8bit": False},
     lambda c: c.lora.quantize_base is None),
    ({"adapter": "lora", "load_in_8bit": "yes"}, {"adapter": "lora", "load_in_8bit": True},
     lambda c: c.lora.quantize_base == "int8"),
    ({"fsdp_config": {"reshard_after_forward": "false"}}, {"fsdp_config": {"reshard_after_forward": False}},
     lambda c: c.deepspeed.zero_stage == 2),
    ({"fsdp_config": {"fsdp_reshard_after_forward": "0"}}, {"fsdp_config": {"fsdp_reshard_after_forward": False}},
     lambda c: c.deepspeed.zero_stage == 2),
    ({"fp16": "true"}, {"fp16": True}, lambda c: c.precision == "fp16"),
    ({"bf16": "off", "fp16": "on"}, {"bf16": False, "fp16": True}, lambda c: c.precision == "fp16"),
    ({"peft_use_dora": "false"}, {"peft_use_dora": False}, lambda c: c.lora is None),  # off: not refused
    ({"deepspeed": {"bf16": {"enabled": "true"}}}, {"deepspeed": {"bf16": {"enabled": True}}},
     lambda c: c.precision == "bf16"),
    ({"micro_batch_size": "16.0", "learning_rate": "2e-5"}, {"micro_batch_size": 16, "learning_rate": 2e-5},
     lambda c: c.batch.micro_batch_size == 16 and c.optimizer.lr == 2e-5),
])
def test_quoted_booleans_and_numbers_plan_as_the_real_ones(quoted, real, check):
    """As Axolotl's schema (pydantic, lax) reads them: `gradient_checkpointing: "false"` turned recompute on,
    `load_in_8bit: "false"` quantised the base, `reshard_after_forward: "false"` picked ZeRO-3, `fp16: "true"`
    trained in fp32."""
    cfg = config.build({**AXOLOTL, **quoted}, env={}, world_size=8)
    assert check(cfg) and cfg == config.build({**AXOLOTL, **real}, env={}, world_size=8)


@pytest.mark.parametrize("raw, needle", [
    ({**AXOLOTL, "learning_rate": True}, "learning_rate=True: a number is expected, not true/false"),
    ({**AXOLOTL, "adapter": "lora", "lora_alpha": float("nan")}, "lora_alpha=nan: not a finite number"),
    ({**AXOLOTL, "max_steps": None, "num_epochs": float("inf")}, "num_epochs=inf: not a finite number"),
    ({**AXOLOTL, "weight_decay": "nan"}, "weight_decay='nan': not a finite number"),
    ({**AXOLOTL, "adapter": "lora", "lora_alpha": 16.5}, "lora_alpha=16.5: "),  # Axolotl's lora_alpha is an int
    ({**AXOLOTL, "gradient_checkpointing": "maybe"}, "gradient_checkpointing='maybe': "),
    ({**AXOLOTL, "adam_beta2": [0.95]}, "adam_beta2=[0.95]: Input should be a valid number"),
    ({**NATIVE, "optimizer": {"lr": True}}, "optimizer.lr=True: a number is expected, not true/false"),
    ({**NATIVE, "optimizer": {"lr": float("nan")}}, "optimizer.lr=nan: "),
    ({**NATIVE, "deepspeed": {"overrides": {"bf16": {"x": float("inf")}}}}, "deepspeed.overrides.bf16.x=inf: not a"),
    ({**NATIVE, "seq_len": 10**400}, "larger than any setting can be"),
    ({**AXOLOTL, "sequence_len": 10**400}, "larger than any setting can be"),
    ({**AXOLOTL, 7: 1}, "7=1: a key must be a name"),
    ({**NATIVE, "data": {None: 1}}, "data.None=1: a key must be a name"),
    ({**AXOLOTL, "added_tokens_overrides": {128011: "<x>"}}, "added_tokens_overrides={128011: '<x>'}: renaming"),
])
def test_what_no_setting_means_is_one_line_naming_the_key(raw, needle):
    with pytest.raises(UserError) as e:
        config.build(raw, env={}, world_size=8)
    assert needle in str(e.value) and "Fix:" in str(e.value) and "\n" not in str(e.value), str(e.value)


def _model(tmp_path, change=None, index=None) -> str:
    root = tmp_path / "model"
    root.mkdir()
    cfg = json.loads((LLAMA / "config.json").read_text())
    if change == "dir":
        (root / "config.json").mkdir()
    else:
        (root / "config.json").write_text(json.dumps({**cfg, **(change or {})}))
    if index is not None:
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(root)


@pytest.mark.parametrize("make, flags, needle", [
    (lambda t: {**AXOLOTL, 7: 1}, (), "error: 7=1: a key must be a name"),
    (lambda t: {**AXOLOTL, "base_model": "a" * 300}, (), "error: base_model='aaa"),
    (lambda t: {**AXOLOTL, "sequence_len": 10**400}, (), "error: sequence_len=1000"),
    (lambda t: yaml.safe_dump(AXOLOTL) + "deep: " + "[" * 1000 + "]" * 1000 + "\n", (), "nested too deeply"),
    (lambda t: {**NATIVE, "deep": json.loads("[" * 40 + "]" * 40)}, (), "nested deeper than 32 levels"),
    (lambda t: {**NATIVE, "deepspeed": {"overrides": {"zero_optimization": "x"}}}, (),
     "DeepSpeed reads zero_optimization as a section"),
    (lambda t: {**NATIVE, "deepspeed": {"overrides": {"gradient_clipping": {"a": 1}}}}, (),
     "deepspeed.overrides.gradient_clipping={'a': 1}: DeepSpeed reads this key as a value"),
    (lambda t: {**AXOLOTL, "adam_beta2": [0.95]}, (), "error: adam_beta2=[0.95]"),
    (lambda t: AXOLOTL, ("--gpu-mem-gib", "nan"), "argument --gpu-mem-gib: nan is not a positive, finite number"),
    (lambda t: AXOLOTL, ("--gpus-per-node", "1000003"), "at most 65,536 GPUs"),
    (lambda t: {**NATIVE, "parallelism": {"tp_size": 32, "cp_size": 4096}}, (), "at most 65,536 GPUs"),
    (lambda t: {**AXOLOTL, "base_model": _model(t, index={"weight_map": {"model.embed_tokens.weight": None}})}, (),
     "its weight_map names a weight file as None"),
    (lambda t: {**AXOLOTL, "base_model": _model(t, {"rope_scaling": "x"})}, (), "rope_scaling='x': must be a mapping"),
    (lambda t: {**AXOLOTL, "base_model": _model(t, {"max_position_embeddings": None})}, (),
     "max_position_embeddings=None: must be a whole number"),
    (lambda t: {**AXOLOTL, "base_model": _model(t, {"rope_theta": "1e4"})}, (), "rope_theta='1e4': must be a finite"),
    (lambda t: {**AXOLOTL, "base_model": _model(t, "dir")}, (), "a directory, not a config.json file"),
])
def test_inputs_that_crashed_are_one_line(tmp_path, make, flags, needle):
    code, err = run_plan(tmp_path, make(tmp_path), *flags)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("nd-adapter: error: ") and needle in lines[0], err


def test_a_large_world_plans_with_its_groups_shortened(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(NATIVE))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", str(path), "--nodes", "128", "--gpus-per-node", "8"]) == 0
    assert "[0, 1, 2, 3, …, 1023: 1024 ranks]" in out.getvalue()


# --- pre-quantised bases: a config.json's quantization_config ------------------------------------------------------

FIXTURES = ROOT / "tests/fixtures/axolotl"
BNB_NF4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
           "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16",
           "bnb_4bit_quant_storage": "bfloat16"}  # hugging-quants/Meta-Llama-3.1-405B-BNB-NF4-BF16's


def _cached(tmp_path, monkeypatch, repo: str, quant: dict | None) -> None:
    """`repo` in a local HF cache as config.json alone: Llama-3.2-1B's shape with `quant` as its quantization_config
    (the weights are never read: the refusal comes first)."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    conf = json.loads((LLAMA / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**conf, **({"quantization_config": quant} if quant else {})}))
    add_to_hub_cache(tmp_path / "hf", repo, src)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_bitsandbytes_nf4_base_is_a_qlora_base_on_the_transformers_engine(tmp_path, monkeypatch):
    """Axolotl's llama-3/qlora-fsdp-405b.yaml names a BNB-NF4 checkpoint: `plan` exited 0 and `train` failed later
    with "shape disagrees with config.json". Its codes are what load_in_4bit makes: transformers' model loads them
    as the QLoRA base, and `plan` says which engine and why."""
    _cached(tmp_path, monkeypatch, "hugging-quants/Meta-Llama-3.1-405B-BNB-NF4-BF16", BNB_NF4)
    code, out, err = run_cli("plan", str(FIXTURES / "llama3-qlora-fsdp-405b.yaml"), "--format", "json")
    assert code == 0, err
    notes = json.loads(out)["notes"]
    assert any(n.startswith("engine: transformers' own LlamaForCausalLM") and "quantization_config='bitsandbytes "
               "nf4': a pre-quantised checkpoint: its stored codes load into transformers' own model" in n
               for n in notes), notes


@pytest.mark.parametrize("quant, top, says", [
    (BNB_NF4, {}, "load_in_4bit=None: the checkpoint holds bitsandbytes nf4 codes (pre-quantised): only adapters "
                  "train on them"),
    ({"load_in_8bit": True}, {"adapter": "lora", "lora_r": 8, "lora_alpha": 16, "lora_target_linear": True},
     "the checkpoint holds bitsandbytes int8 codes (pre-quantised)")])
def test_a_pre_quantised_bitsandbytes_base_trains_only_adapters_of_its_codes(tmp_path, monkeypatch, quant, top,
                                                                             says):
    _cached(tmp_path, monkeypatch, "org/quantised", quant)
    conf = tmp_path / "run.yaml"
    conf.write_text(yaml.safe_dump({"base_model": "org/quantised", "learning_rate": 1e-5, "sequence_len": 256,
                                    "micro_batch_size": 1, "num_epochs": 1, **top}))
    code, out, err = run_cli("plan", str(conf), "--gpus-per-node", "1")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and says in lines[0] and "Fix: use adapter: qlora with " in lines[0], err


@pytest.mark.parametrize("quant, method", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "gptq"),
    ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "awq"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "modelopt NVFP4"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, "compressed-tensors nvfp4-pack"),
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}, "bitsandbytes fp4"),  # before transformers stored its method
])
def test_every_pre_quantised_base_is_refused_naming_its_method(tmp_path, monkeypatch, quant, method):
    """Axolotl's llama-2/gptq-lora.yml (a GPTQ base), with the other methods' checkpoints as its base_model."""
    _cached(tmp_path, monkeypatch, "TheBloke/Llama-2-7B-GPTQ", quant)
    code, out, err = run_cli("plan", str(FIXTURES / "llama2-gptq-lora.yml"), "--gpus-per-node", "1")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"quantization_config='{method}" in lines[0], err
    assert "Fix: point base_model (model.path) at the 16-bit checkpoint" in lines[0]


FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}  # DeepSeek-V3's
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}  # gpt-oss's
DEQUANTIZE = {"model_quantization_config_kwargs": {"dequantize": True}}


@pytest.mark.parametrize("quant, top, code, says", [
    (MXFP4, {}, 2, "quantization_config='mxfp4': {src} is a pre-quantised checkpoint (mxfp4 codes, not 16-bit weights"
                   "), which trains dequantized. Fix: set model.dequantize: true (Axolotl: model_quantization_config: "
                   "Mxfp4Config with model_quantization_config_kwargs: {{dequantize: true}})"),
    (MXFP4, {"model_quantization_config": "Mxfp4Config", **DEQUANTIZE}, 0,
     "quantization_config='mxfp4': a pre-quantised checkpoint: transformers' loader dequantizes its codes"),
    (FP8, {"model_quantization_config": "FineGrainedFP8Config", **DEQUANTIZE}, 0, "quantization_config='fp8'"),
    (MXFP4, {"model_quantization_config": "Mxfp4Config"}, 2, "model_quantization_config_kwargs=None: Mxfp4Config "
                                                             "without dequantize: true keeps the checkpoint's"),
    (MXFP4, {"model_quantization_config": "BitsAndBytesConfig", **DEQUANTIZE}, 2,
     "model_quantization_config='BitsAndBytesConfig': Axolotl builds Mxfp4Config or FineGrainedFP8Config only"),
    (None, {"model_quantization_config": "Mxfp4Config", **DEQUANTIZE}, 2,
     "model_quantization_config=True: {src} is not a pre-quantised checkpoint"),
    (BNB_NF4, {"model_quantization_config": "Mxfp4Config", **DEQUANTIZE}, 2,
     "model_quantization_config=True: {src} is a bitsandbytes nf4 checkpoint, which transformers does not "
     "dequantize"),
    (MXFP4, {"model_quantization_config": "Mxfp4Config", **DEQUANTIZE, "adapter": "qlora", "load_in_4bit": True,
             "lora_r": 8, "lora_alpha": 16, "lora_target_linear": True}, 2,
     "load_in_4bit='nf4': the checkpoint is dequantized as it loads"),
])
def test_mxfp4_and_fp8_checkpoints_train_dequantized_where_the_config_asks(tmp_path, monkeypatch, quant, top, code,
                                                                          says):
    """Axolotl's gpt-oss examples load openai/gpt-oss-20b (MXFP4 experts) with model_quantization_config:
    Mxfp4Config and dequantize: true; without those keys, or where they cannot apply, one line."""
    _cached(tmp_path, monkeypatch, "org/quantised", quant)
    conf = tmp_path / "run.yaml"
    conf.write_text(yaml.safe_dump({"base_model": "org/quantised", "learning_rate": 1e-5, "sequence_len": 256,
                                    "micro_batch_size": 1, "num_epochs": 1, **top}))
    got, out, err = run_cli("plan", str(conf), "--gpus-per-node", "1", "--format", "json")
    if code:
        src = next(Path(tmp_path / "hf").rglob("config.json"))
        lines = err.strip().splitlines()
        assert got == 2 and len(lines) == 1 and says.format(src=src) in lines[0], err
        return
    assert got == 0, err
    notes = json.loads(out)["notes"]
    assert any(n.startswith("engine: transformers' own LlamaForCausalLM") and says in n for n in notes), notes


def test_gptq_true_over_a_16_bit_base_says_to_use_a_16_bit_base_model(tmp_path, monkeypatch):
    _cached(tmp_path, monkeypatch, "TheBloke/Llama-2-7B-GPTQ", None)
    code, out, err = run_cli("plan", str(FIXTURES / "llama2-gptq-lora.yml"), "--gpus-per-node", "1")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("nd-adapter: error: gptq=True: "), err
    assert "Fix: remove it and point base_model at the 16-bit checkpoint" in lines[0]


# --- messages in the user's words ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["cloud-modal.yaml", "cloud-baseten.yaml"])
def test_a_cloud_launch_file_is_said_to_be_one(name):
    """Axolotl's examples/cloud/*.yaml were told `model: missing`: they say where a job runs, not what it trains."""
    code, out, err = run_cli("plan", str(FIXTURES / name), "--gpus-per-node", "8")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Axolotl's cloud launch config" in lines[0], err
    assert "model: missing" not in err and "Fix: pass the training YAML" in err


def test_the_layout_mismatch_names_the_file_s_keys(tmp_path, monkeypatch):
    """Axolotl's distributed-parallel/llama-3_1-8b-hsdp-tp.yaml on 8 GPUs (it lays out 16) was told
    `parallelism='2×4×1×2'`, nd-adapter's internal section."""
    _cached(tmp_path, monkeypatch, "meta-llama/Llama-3.1-8B", None)
    code, out, err = run_cli("plan", str(FIXTURES / "llama-3_1-8b-hsdp-tp.yaml"), "--gpus-per-node", "8")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "parallelism=" not in err, err
    assert ("dp_replicate_size 2 × dp_shard_size 4 × context_parallel_size 1 × tensor_parallel_size 2 = 16 GPUs, "
            "but the world size is 8") in err and "Fix: make their product 8" in err


@pytest.mark.parametrize("flags, needle", [
    (("--set", "recompute=some"), "gradient_checkpointing='some': Input should be 'none', 'selective' or 'full'. "
     "Fix: use one of 'none', 'selective' or 'full'"),
    (("--set", "datasets.0.split=3"), "Input should be a valid string. Fix: give a string"),
    (("--set", "logging.wandb_mode=loud"), "Fix: use one of 'online', 'offline' or 'disabled'"),
])
def test_value_errors_say_the_allowed_values(tmp_path, monkeypatch, flags, needle):
    """Axolotl's llama-3/lora-1b-ray.yml with a wrong value: the fix was "see docs/config.md for the allowed
    values"."""
    _cached(tmp_path, monkeypatch, "NousResearch/Llama-3.2-1B", None)
    (tmp_path / "deepspeed_configs").mkdir()  # Axolotl reads it from the working directory
    (tmp_path / "deepspeed_configs/zero3.json").write_text((FIXTURES / "zero3.json").read_text())
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli("plan", str(FIXTURES / "lora-1b-ray.yml"), "--gpus-per-node", "8", *flags)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0] and "docs/config.md" not in err, err
