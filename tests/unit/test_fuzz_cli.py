"""`nd-adapter plan` on generated bad input, through the CLI in-process: native and Axolotl configs with wrong types,
quoted booleans, non-finite and huge numbers, deep nesting, unknown and non-string keys; corrupt model config.json
files and weight indexes; bad flags. Each run ends with exit 0, or exit 2 and exactly one `nd-adapter: error:`
line, never an internal error; and a quoted boolean ("false", "yes", "0", ...) plans exactly as the real one.
Bounded (fixed example counts, no deadline): about 30 s on a loaded 2-core machine."""
from __future__ import annotations

import contextlib
import functools
import io
import json
import typing
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from adapter.cli import main
from adapter.config import axolotl, axolotl_values
from adapter.config.schema import RunConfig

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "configs/models/llama-3.2-1b"
NATIVE = {"model": {"path": str(LLAMA)}, "seq_len": 1024}
AXOLOTL = {"base_model": str(LLAMA), "learning_rate": 2e-5, "sequence_len": 1024, "micro_batch_size": 1,
           "max_steps": 10}
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# what pydantic (lax, as Axolotl's schema and DeepSpeed's config read them) takes for true and for false
SPELLED = {True: ["true", "True", "TRUE", "yes", "on", "1", "t", "Y"], False: ["false", "False", "no", "off", "0",
                                                                            "f", "N"]}
ODD = [float("nan"), float("inf"), -float("inf"), 10**400, 2**53 + 1, -1, 0, 65_537, "nan", ".inf", "1e400",
       "1" + "0" * 400, "2e-5", "1_000", "16.0", "maybe", "", " true", "auto", "full", "offload"]


def _deep(n: int) -> list:
    return functools.reduce(lambda inner, _: [inner], range(n), 0)


values = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70_000), st.floats(-1e6, 1e6, allow_nan=False),
    st.sampled_from(ODD), st.sampled_from(SPELLED[True] + SPELLED[False]), st.text(max_size=6),
    st.lists(st.integers(0, 3), max_size=2),
    st.recursive(st.integers(0, 3) | st.none(), lambda inner: st.lists(inner, max_size=2) |
                 st.dictionaries(st.sampled_from(["a", "stage", "enabled"]), inner, max_size=2), max_leaves=4),
    st.integers(20, 60).map(_deep),  # nesting deeper than any key's
    st.dictionaries(st.one_of(st.integers(0, 9), st.booleans(), st.none()), st.integers(0, 3), min_size=1,
                    max_size=2),  # keys YAML reads as numbers, booleans, null
)


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of the native schema (a section's fields, recursively)."""
    out = []
    for name, field in model.model_fields.items():
        section = [a for a in (field.annotation, *typing.get_args(field.annotation))
                   if isinstance(a, type) and issubclass(a, BaseModel)]
        out += _leaf_keys(section[0], f"{prefix}{name}.") if section else [prefix + name]
    return out


NATIVE_KEYS = sorted(_leaf_keys(RunConfig) + ["deepspeed.overrides.zero_optimization", "deepspeed.overrides.bf16",
                                              "deepspeed.overrides.bf16.check_grad_overflow", "model.bogus"])
AXOLOTL_KEYS = sorted(axolotl.KNOWN | set(axolotl_values.TYPES) | {
    "fsdp_config.reshard_after_forward", "fsdp_config.fsdp_offload_params", "deepspeed.zero_optimization",
    "deepspeed.bf16", "context_parallel.size", "datasets", "val_set_size", "bogus_key"})


def _put(raw: dict, dotted: str, value) -> None:
    *heads, last = dotted.split(".")
    for k in heads:
        if not isinstance(raw.get(k), dict):
            raw[k] = {}
        raw = raw[k]
    raw[last] = value


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def plan_ok_or_one_line(*argv: str) -> tuple[int, str, str]:
    code, out, err = run_cli("plan", *argv)
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("nd-adapter: error: ")]
    assert code in (0, 2) and "internal error" not in err and "Traceback" not in err, err
    assert all(line.startswith(("nd-adapter: error: ", "nd-adapter: warning: ")) for line in lines), err
    assert len(errors) == (1 if code == 2 else 0), err
    return code, out, err


def _write(tmp_path_factory, raw) -> str:
    path = tmp_path_factory.mktemp("fuzz") / "c.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


@settings(FUZZ, max_examples=120)
@given(changes=st.lists(st.tuples(st.sampled_from(NATIVE_KEYS), values), min_size=1, max_size=3))
def test_native_configs_plan_or_refuse_in_one_line(tmp_path_factory, changes):
    raw = json.loads(json.dumps(NATIVE))
    for key, value in changes:
        _put(raw, key, value)
    plan_ok_or_one_line(_write(tmp_path_factory, raw), "--gpus-per-node", "8", "--format", "json")


@settings(FUZZ, max_examples=200)
@given(changes=st.lists(st.tuples(st.sampled_from(AXOLOTL_KEYS), values), min_size=1, max_size=3),
       adapter=st.sampled_from([None, "lora"]))
def test_axolotl_configs_plan_or_refuse_in_one_line(tmp_path_factory, changes, adapter):
    raw = {**AXOLOTL, **({"adapter": adapter} if adapter else {})}
    for key, value in changes:
        _put(raw, key, value)
    plan_ok_or_one_line(_write(tmp_path_factory, raw), "--gpus-per-node", "8", "--format", "json")


CONFIG_JSON = json.loads((LLAMA / "config.json").read_text())
ARCH_KEYS = sorted(set(CONFIG_JSON) | {"rope_scaling.factor", "rope_scaling.rope_type", "rope_parameters",
                                       "partial_rotary_factor", "sliding_window", "layer_types", "text_config"})


@st.composite
def model_dirs(draw):
    """A model directory as (config.json text or None for a directory in its place, weight index or None)."""
    cfg = json.loads(json.dumps(CONFIG_JSON))
    for key, value in draw(st.lists(st.tuples(st.sampled_from(ARCH_KEYS), values | st.just("<drop>")), max_size=2)):
        if value == "<drop>":
            cfg.pop(key.split(".")[0], None)
        else:
            _put(cfg, key, value)
    text = draw(st.sampled_from(["json", "json", "json", "garbage", "null", "[]", "deep", "dir"]))
    text = {"json": json.dumps(cfg), "garbage": "{\"hidden_size\": 20", "null": "null", "[]": "[]",
            "deep": "[" * 100_000 + "]" * 100_000, "dir": None}[text]
    index = draw(st.one_of(st.none(), st.builds(lambda m: json.dumps({"weight_map": m}), st.one_of(
        st.none(), st.dictionaries(st.sampled_from(["model.embed_tokens.weight", "lm_head.weight"]),
                                   st.one_of(st.none(), st.integers(0, 3), st.sampled_from(["", "a" * 300, "x.bin"])),
                                   max_size=2)))))
    return text, index


@settings(FUZZ, max_examples=80)
@given(model=model_dirs())
def test_corrupt_model_configs_plan_or_refuse_in_one_line(tmp_path_factory, model):
    text, index = model
    root = tmp_path_factory.mktemp("model")
    if text is None:
        (root / "config.json").mkdir()
    else:
        (root / "config.json").write_text(text)
    if index is not None:
        (root / "model.safetensors.index.json").write_text(index)
    config = _write(tmp_path_factory, {**AXOLOTL, "base_model": str(root)})
    plan_ok_or_one_line(config, "--gpus-per-node", "8", "--format", "json")


@settings(FUZZ, max_examples=50)
@given(gpus=st.sampled_from(["8", "0", "-1", "x", "1000003", "65537", "3"]),
       mem=st.sampled_from([None, "80", "nan", "inf", "-1", "0", "1e400", "x"]),
       nodes=st.sampled_from([None, "1", "0", "70000", "2"]),
       setting=st.one_of(st.none(), st.tuples(st.sampled_from(NATIVE_KEYS), values)))
def test_flags_plan_or_refuse_in_one_line(tmp_path_factory, gpus, mem, nodes, setting):
    argv = [_write(tmp_path_factory, NATIVE), "--gpus-per-node", gpus, "--format", "json"]
    argv += ["--gpu-mem-gib", mem] if mem else []
    argv += ["--nodes", nodes] if nodes else []
    if setting:
        text = yaml.safe_dump(setting[1], default_flow_style=True, sort_keys=False).strip()
        argv += ["--set", f"{setting[0]}={text}"]
    plan_ok_or_one_line(*argv)


AXOLOTL_FLAGS = sorted(k for k, kind in axolotl_values.TYPES.items()
                       if kind in (axolotl_values.FLAG, axolotl_values.AUTO_FLAG, axolotl_values.RECOMPUTE))
FLAG_KEYS = ([("axolotl", k) for k in AXOLOTL_FLAGS]
             + [("axolotl", f"fsdp_config.{k}") for k in ("reshard_after_forward", "offload_params",
                                                          "activation_checkpointing")]
             + [("native", k) for k in ("sequence_parallel", "model.fused_linear_ce", "model.compile",
                                        "model.moe_grouped_gemm", "deepspeed.overlap_comm", "data.train_on_inputs",
                                        "data.sample_packing", "deepspeed.overrides.bf16.check_grad_overflow")])


@settings(FUZZ, max_examples=50)
@given(which=st.sampled_from(FLAG_KEYS), real=st.booleans(), data=st.data(), adapter=st.sampled_from([None, "lora"]))
def test_a_quoted_boolean_plans_as_the_real_one(tmp_path_factory, which, real, data, adapter):
    """`gradient_checkpointing: "false"`, `load_in_8bit: "false"`, `fsdp_config.reshard_after_forward: "false"`,
    `fp16: "true"`, ...: the same plan, notes and errors as the unquoted boolean."""
    dialect, key = which
    quoted = data.draw(st.sampled_from(SPELLED[real]))
    base = NATIVE if dialect == "native" else {**AXOLOTL, **({"adapter": adapter} if adapter else {})}
    path = tmp_path_factory.mktemp("quoted") / "c.yaml"
    runs = []
    for value in (real, quoted):
        raw = json.loads(json.dumps(base))
        _put(raw, key, value)
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        runs.append(plan_ok_or_one_line(str(path), "--gpus-per-node", "8", "--format", "json"))
    assert runs[0] == runs[1], (key, real, quoted)
