"""`nd-adapter plan`: JSON schema, table output, and no traceback for any input (hypothesis)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapter.plan.build import Plan
from tests.helpers.cli import run_cli
from tests.helpers.hub import add_to_hub_cache

ROOT = Path(__file__).resolve().parents[2]
CFG16 = str(ROOT / "configs/llama-3.1-8b-hsdp-tp.yaml")
SCHEMA = ROOT / "docs/plan-schema.json"


def test_plan_json_matches_documented_schema():
    code, out, err = run_cli("plan", CFG16, "--nodes", "2", "--gpus-per-node", "8", "--format", "json")
    assert code == 0, err
    doc = Plan.model_validate_json(out)  # extra="forbid": every key is documented
    assert json.loads(SCHEMA.read_text()) == Plan.model_json_schema(), "regenerate docs/plan-schema.json"
    assert doc.mesh.world == 16 and doc.mesh.nodes == 2
    groups = {g.name: g for g in doc.groups}
    assert groups["dp_replicate"].crosses_nodes and not groups["tp"].crosses_nodes
    assert groups["dp_shard"].groups[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert doc.deepspeed.config["train_batch_size"] == 32 and doc.deepspeed.partition_size == 4
    assert doc.megatron.kwargs["tensor_model_parallel_size"] == 2
    assert set(doc.replicate_modes) == {"hsdp", "hpz"}
    assert doc.replicate_modes["hpz"].model_states < doc.replicate_modes["hsdp"].model_states
    assert doc.launch.deepspeed.startswith("deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 8 launch/train.py")


def test_plan_table_on_16_gpu_config():
    code, out, err = run_cli("plan", CFG16, "--nodes", "2", "--gpus-per-node", "8")
    assert code == 0, err
    for needle in ("dp_replicate=2 × dp_shard=4 × cp=1 × tp=2 = 16 GPUs on 2 node(s) × 8",
                   "initialize_model_parallel(tensor_model_parallel_size=2", '"stage": 3', "predicted peak",
                   "inter-node", "hsdp (chosen)", "torchrun --nnodes 2 --nproc-per-node 8", "Process groups"):
        assert needle in out, needle
    rank15 = [line for line in out.splitlines() if line.startswith("│   15 │")]
    assert rank15 and rank15[0].split("│")[2].strip() == "1"  # rank 15 on node 1


def test_plan_warnings_tp_across_nodes_and_memory():
    code, out, err = run_cli("plan", CFG16, "--nodes", "4", "--gpus-per-node", "4", "--format", "json",
                             "--gpu-mem-gib", "10")
    assert code == 0, err
    warnings = json.loads(out)["warnings"]
    assert any("exceeds the GPU" in w for w in warnings)
    code, out, err = run_cli("plan", str(ROOT / "configs/qwen3-8b-cp-tp.yaml"), "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["mesh"]["cp"] == 2 and any(t["group"] == "cp" for t in doc["traffic"])


def test_plan_is_fast_and_exits_2_in_a_real_process():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run([sys.executable, "-m", "adapter", "plan", CFG16, "--nodes", "2", "--gpus-per-node", "8"],
                        capture_output=True, text=True, env=env, timeout=60)
    assert ok.returncode == 0 and "torch" not in ok.stderr
    bad = subprocess.run([sys.executable, "-m", "adapter", "plan", CFG16, "--nodes", "3", "--gpus-per-node", "8"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().count("\n") == 0 and "= 16 GPUs, but the world size is 24" in bad.stderr


# ---- property test: no traceback, ever ---------------------------------------------------------------------------

def _assert_clean(code: int, err: str) -> None:
    assert code in (0, 2), err
    assert "Traceback" not in err and "internal error" not in err, err
    if code == 2:
        lines = [ln for ln in err.splitlines() if ln.startswith("nd-adapter: error:")]
        assert len(lines) == 1 and "Fix" in lines[0], err


junk = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.floats(allow_nan=True), st.text(max_size=6),
                 st.lists(st.integers(0, 4), max_size=3))
size = st.one_of(st.integers(-1, 8), junk)


@st.composite
def configs(draw):
    """Mostly plausible native/Axolotl/Accelerate configs, with random values in random places."""
    dialect = draw(st.sampled_from(["native", "axolotl", "accelerate"]))
    model = str(ROOT / "configs/models/llama-3.1-8b")
    if dialect == "native":
        raw = {"model": {"path": draw(st.sampled_from([model, "/nonexistent", 3]))},
               "parallelism": {k: draw(size) for k in draw(st.sets(st.sampled_from(
                   ["dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "cp_comm_type", "tpsize"])))},
               "batch": {k: draw(size) for k in draw(st.sets(st.sampled_from(
                   ["micro_batch_size", "gradient_accumulation_steps", "global_batch_size"])))},
               "seq_len": draw(st.one_of(st.sampled_from([2048, 4096, 2050]), junk))}
        if draw(st.booleans()):
            raw[draw(st.sampled_from(["precision", "recompute", "deepspeed", "optimizer", "hardware"]))] = draw(junk)
    elif dialect == "axolotl":
        raw = {"base_model": model, **{k: draw(size) for k in draw(st.sets(st.sampled_from(
            ["dp_shard_size", "dp_replicate_size", "tensor_parallel_size", "context_parallel_size",
             "sequence_parallel_degree", "micro_batch_size", "sequence_len", "some_unknown_key"])))}}
    else:
        raw = {"num_processes": draw(size), "num_machines": draw(size), "mixed_precision": draw(junk),
               "parallelism_config": {f"parallelism_config_{k}": draw(size) for k in draw(st.sets(st.sampled_from(
                   ["dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "cp_comm_strategy"])))}}
    return raw


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=configs(), nodes=st.sampled_from([None, 1, 2]), gpn=st.sampled_from([None, 4, 8]),
       gpu=st.sampled_from([None, "h100-80gb", "tpu"]), fmt=st.sampled_from(["json", "table"]))
def test_no_traceback_for_random_configs(tmp_path_factory, raw, nodes, gpn, gpu, fmt):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    argv = ["plan", str(path), "--format", fmt]
    if nodes is not None:
        argv += ["--nodes", str(nodes)]
    if gpn is not None:
        argv += ["--gpus-per-node", str(gpn)]
    if gpu is not None:
        argv += ["--gpu", gpu]
    if "accelerate" in str(raw) or "num_processes" in raw:
        argv += ["--model", str(ROOT / "configs/models/llama-3.1-8b")]
    code, _, err = run_cli(*argv)
    _assert_clean(code, err)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(st.text(max_size=200), st.binary(max_size=100).map(lambda b: b.decode("latin-1"))))
def test_no_traceback_for_random_yaml_text(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    code, _, err = run_cli("plan", str(path))
    _assert_clean(code, err)


@settings(max_examples=60, deadline=None)
@given(argv=st.lists(st.sampled_from(["plan", "convert", "--nodes", "-1", "x", "--format", "xml", "--gpus-per-node",
                                      "0", CFG16, "--gpu-mem-gib", "nan", "--bogus"]), max_size=6))
def test_no_traceback_for_random_argv(argv):
    code, _, err = run_cli(*argv)
    assert code in (0, 2) and "Traceback" not in err and "internal error" not in err, (argv, err)


def test_set_overrides_zero_stage_and_hint():
    dp2 = str(ROOT / "bench/configs/llama-3.2-1b-dp2-zero3.yaml")
    code, out, err = run_cli("plan", dp2, "--format", "json", "--gpu", "h200")
    assert code == 0, err
    z3 = json.loads(out)
    assert z3["deepspeed"]["config"]["zero_optimization"]["stage"] == 3
    assert any(w.startswith("hint: whole 16-bit weights fit") for w in z3["warnings"])
    code, out, err = run_cli("plan", dp2, "--format", "json", "--gpu", "h200", "--set", "deepspeed.zero_stage=2",
                             "--set", "seq_len=2048")
    assert code == 0, err
    z2 = json.loads(out)
    assert z2["deepspeed"]["config"]["zero_optimization"]["stage"] == 2 and z2["seq_len"] == 2048
    assert z2["memory"]["gathered_params"] == 0 and z2["memory"]["weights"] == 2 * z3["memory"]["weights"]
    assert not any(w.startswith("hint:") for w in z2["warnings"])
    code, out, err = run_cli("plan", dp2, "--format", "json", "--gpu", "h200", "--set",
                             f"model.path={ROOT / 'configs/models/llama-3.1-8b'}")  # no --model flag to undo it
    assert code == 0 and json.loads(out)["model"]["num_layers"] == 32, err
    gathered = {}
    for unit in ("module", "layer"):  # a small prefetch bucket holds part of a layer; a layer unit is gathered whole
        code, out, err = run_cli("plan", dp2, "--format", "json", "--gpu", "h200", "--set",
                                 f"deepspeed.gather_granularity={unit}", "--set", "deepspeed.prefetch_bucket_size=1000")
        gathered[unit] = json.loads(out)["memory"]["gathered_params"]
    assert 0 < gathered["module"] < gathered["layer"] == z3["memory"]["gathered_params"], gathered
    for argv, needle in ((("--set", "deepspeed.zero_stage=2"), "deepspeed.zero_stage=2: dp_replicate_size > 1"),
                         (("--set", "nonsense"), "--set='nonsense': expected key.path=value"),
                         (("--set", "deepspeed.zero_stage=1"), "deepspeed.zero_stage"),
                         (("--set", "logging.profile_steps=[3, 2]"), "logging.profile_steps"),
                         (("--set", "model.compile=true", "--set", "deepspeed.gather_granularity=module"),
                          "model.compile=True: compiled layers under ZeRO-3 need each layer gathered whole")):
        code, out, err = run_cli("plan", CFG16, "--nodes", "2", "--gpus-per-node", "8", *argv)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_every_plan_predicts_its_step_time():
    code, out, err = run_cli("plan", CFG16, "--nodes", "2", "--gpus-per-node", "8", "--format", "json")
    assert code == 0, err
    pr = json.loads(out)["predicted"]
    assert set(pr["breakdown"]) == {"compute", "tp_comm", "dp_comm", "cp_comm", "ep_comm", "optimizer", "host"}
    assert abs(sum(pr["breakdown"].values()) - pr["step_time_s"]) < 1e-9 and pr["profile"] == "h100"
    assert abs(pr["tokens_per_s_per_gpu"] * pr["step_time_s"] * 16 - 32 * 2048) < 1e-3 and pr["bottleneck"]
    code, out, err = run_cli("plan", CFG16, "--nodes", "2", "--gpus-per-node", "8")
    assert code == 0 and "Predicted" in out and "tokens/s/GPU" in out and "(profile h100)" in out, err
    code, out, err = run_cli("plan", CFG16, "--nodes", "2", "--gpus-per-node", "8", "--format", "json", "--gpu",
                             "l40s")
    doc = json.loads(out)
    assert code == 0 and doc["predicted"] is None and any("no hardware profile" in w for w in doc["warnings"])
    code, out, err = run_cli("plan", CFG16, "--nodes", "2", "--gpus-per-node", "8", "--format", "json", "--set",
                             "hardware.profile=h200", "--set", "hardware.inter_node_gb_per_s=5")
    slow = json.loads(out)
    assert code == 0 and slow["predicted"]["profile"] == "h200"
    assert any("made for h200; memory is checked against hardware.gpu=h100-80gb" in w for w in slow["warnings"])
    assert slow["predicted"]["breakdown"]["dp_comm"] > pr["breakdown"]["dp_comm"]   # HSDP all-reduce over 5 GB/s
    code, _, err = run_cli("plan", CFG16, "--nodes", "2", "--gpus-per-node", "8", "--set", "hardware.profile=x.json")
    assert code == 2 and "hardware.profile='x.json': no such hardware profile" in err


# --- every hint plan prints, applied: it must be valid for the config it is printed for ----------------------------

FIXTURES = ROOT / "tests/fixtures/axolotl"
# what plan advises setting, wherever it says it: (pattern, the part it names)
ADVICE = (r"\): (.+?) skips ZeRO-3's per-layer gathers", r"\((.+?) would compile them\)", r", or set (.+?)$",
          r"keep 8-bit moments \((.+?)\)")


def _advice(doc: dict) -> list[str]:
    import re
    return [m.group(1) for line in doc["warnings"] + doc["notes"] for pat in ADVICE if (m := re.search(pat, line))]


def _apply(setting: str, config: Path) -> None:
    """Do what the advice says, as a user would: `key.path: value` in the YAML, or `key: value in FILE` in the JSON
    it names."""
    from adapter.config import set_dotted

    key, _, rest = setting.partition(": ")
    value, _, where = rest.partition(" in ")
    target = Path(where) if where else config
    doc = json.loads(target.read_text()) if where else yaml.safe_load(target.read_text())
    set_dotted(doc, key, yaml.safe_load(value))
    target.write_text(json.dumps(doc) if where else yaml.safe_dump(doc, sort_keys=False))


def _native(tmp_path: Path) -> dict:
    return {"model": {"path": str(ROOT / "configs/models/llama-3.1-8b")}, "seq_len": 8192,
            "batch": {"micro_batch_size": 4}, "optimizer": {"max_steps": 10}}


@pytest.mark.parametrize("name, edit, flags", [
    ("lora-1b-ray.yml", None, ("--gpus-per-node", "8")),  # a deepspeed: JSON (it once got fsdp_config advice)
    ("lora-1b-ray.yml", "inline", ("--gpus-per-node", "8")),  # the same JSON as a mapping in the YAML
    ("fft-8b.yaml", None, ("--gpus-per-node", "8")),  # fsdp_config
    ("qwen3-8b-lora-fused-attn-compile.yaml", None, ("--gpus-per-node", "8")),  # torch_compile under ZeRO-3
    ("fft-8b.yaml", "no recompute", ("--gpus-per-node", "1")),  # memory: does not fit
    ("native", {"seq_len": 2048, "batch": {"micro_batch_size": 1}}, ("--gpus-per-node", "8")),
    ("native", None, ("--gpus-per-node", "1")),  # the activations do not fit
    ("native", {"seq_len": 512, "recompute": "full", "deepspeed": {"zero_stage": 2}},  # the optimizer step does not
     ("--gpus-per-node", "2")),
    ("fft-8b.yaml", "ZeRO-2", ("--gpus-per-node", "2")),  # (in the Axolotl file's words)
])
def test_every_hint_plan_prints_is_accepted_when_applied(tmp_path, monkeypatch, name, edit, flags):
    """Axolotl's llama-3/lora-1b-ray.yml (deepspeed: deepspeed_configs/zero3.json) was told to set
    fsdp_config.reshard_after_forward: false, which is refused as a conflict with the JSON."""
    for repo, shipped in (("NousResearch/Llama-3.2-1B", "llama-3.2-1b"),
                          ("NousResearch/Meta-Llama-3.1-8B", "llama-3.1-8b"), ("Qwen/Qwen3-8B", "qwen3-8b")):
        add_to_hub_cache(tmp_path / "hf", repo, ROOT / "configs/models" / shipped)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # Axolotl reads deepspeed_configs/ from the working directory
    (tmp_path / "deepspeed_configs").mkdir()
    (tmp_path / "deepspeed_configs/zero3.json").write_text((FIXTURES / "zero3.json").read_text())
    config = tmp_path / "run.yaml"
    raw = {**_native(tmp_path), **(edit or {})} if name == "native" else yaml.safe_load((FIXTURES / name).read_text())
    if edit == "inline":
        raw["deepspeed"] = json.loads((FIXTURES / "zero3.json").read_text())
    if edit == "no recompute":
        raw["gradient_checkpointing"] = False
    if edit == "ZeRO-2":
        raw.update(sequence_len=512, fsdp_config={"reshard_after_forward": False}, optimizer="adamw_torch_fused")
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    code, out, err = run_cli("plan", str(config), *flags, "--format", "json")
    assert code == 0, err
    advice = _advice(json.loads(out))
    assert advice, "this config was chosen for a hint plan prints"
    original = config.read_text()
    for setting in advice:
        config.write_text(original)
        (tmp_path / "deepspeed_configs/zero3.json").write_text((FIXTURES / "zero3.json").read_text())
        _apply(setting, config)
        code, out, err = run_cli("plan", str(config), *flags, "--format", "json")
        assert code == 0, (setting, err)
        assert setting not in _advice(json.loads(out)), setting  # followed, it is not advised again
