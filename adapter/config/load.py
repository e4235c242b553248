"""Loading the run configuration: one validated object from a native, Axolotl or Accelerate YAML (plus env and CLI).

Three dialects are read so users can bring the file they already have:
  * native    -- this project's schema (`parallelism:` holds Accelerate's field names);
  * Axolotl   -- its top-level keys (`tensor_parallel_size`, `sequence_len`, `base_model`, ...);
  * Accelerate -- a launch config with a `parallelism_config:` block of `parallelism_config_*` keys.
Each dialect is mapped onto the native dict, which pydantic validates; a pydantic error becomes a `UserError`
naming the key, so no traceback reaches the user.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from adapter.config import accelerate, axolotl
from adapter.config.hub import looks_like_hub_id, resolve_hub_id
from adapter.config.schema import ENV_PREFIX, SIZE_KEYS, RunConfig, set_dotted
from adapter.config.schema_data import DatasetEntry
from adapter.config.values import MAX_WORLD, check_path, check_tree
from adapter.errors import UserError, bad

Dialect = Literal["native", "axolotl", "accelerate"]
# each dialect's mapping onto the native dict (a native file is that dict already)
_TO_NATIVE: dict[Dialect, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "native": dict, "axolotl": axolotl.from_axolotl, "accelerate": accelerate.from_accelerate}


def detect_dialect(raw: dict[str, Any]) -> Dialect:
    if "model" in raw and isinstance(raw.get("model"), dict):
        return "native"
    if raw.keys() & accelerate.MARKERS:
        return "accelerate"
    if raw.keys() & axolotl.MARKERS:
        return "axolotl"
    return "native"


def _env_sizes(env: dict[str, str]) -> dict[str, int]:
    out = {}
    for key in SIZE_KEYS:
        name = ENV_PREFIX + key.upper()
        if name in env:
            try:
                out[key] = int(env[name])
            except ValueError:
                raise bad(name, env[name], "must be an integer", f"export {name}=<n> with n ≥ 1")
    return out


def spell(cfg: RunConfig, native: str) -> str:
    """A native key as the run's config file spells it (Axolotl's name in an Axolotl file)."""
    return axolotl.spelled(native) if cfg.source == "axolotl" else native


# (native key, value) -> how an Axolotl file says the same
_AXOLOTL_SETTINGS = {("deepspeed.zero_stage", 2): "fsdp_config.reshard_after_forward: false",
                     ("deepspeed.zero_stage", 3): "fsdp_config.reshard_after_forward: true",
                     ("recompute", "full"): "gradient_checkpointing: true",
                     ("model.compile", False): "torch_compile: false", ("model.compile", True): "torch_compile: true"}


def setting(cfg: RunConfig, native: str, value: Any) -> str:
    """`key: value` as the run's config file would write it, for a fix in a message. A ZeRO stage an Axolotl file
    took from its `deepspeed:` JSON is changed there: fsdp_config beside a deepspeed JSON is refused as a conflict."""
    where = cfg.deepspeed.stage_from
    if cfg.source == "axolotl" and native == "deepspeed.zero_stage" and where:
        return (f"deepspeed.zero_optimization.stage: {value}" if where == "deepspeed:" else
                f"zero_optimization.stage: {value} in {where}")
    if cfg.source == "axolotl" and (native, value) in _AXOLOTL_SETTINGS:
        return _AXOLOTL_SETTINGS[(native, value)]
    shown = str(value).lower() if isinstance(value, bool) else value
    return f"{spell(cfg, native)}: {shown}"


def _first_error(err: ValidationError, dialect: str = "native") -> UserError:
    e = err.errors()[0]
    key = ".".join(str(p) for p in e["loc"]) or "config"
    if dialect == "axolotl":
        key = axolotl.spelled(key)
    value = e.get("input")
    kind = e["type"]
    if kind == "extra_forbidden":
        return bad(key, value, "unknown key", "remove it or check its spelling against docs/config.md")
    if kind == "missing":
        return UserError(f"{key}: missing. Fix: add `{key}` to the config")
    msg = e["msg"].rstrip(".")
    if kind in ("int_type", "int_parsing", "greater_than_equal") and key.split(".")[-1].endswith("_size"):
        return bad(key, value, f"{msg}", "give an integer ≥ 1 (1 disables the dimension)")
    if kind == "value_error":  # a field's own check names its value; a section's (a mapping) does not
        msg, _, fix = msg.removeprefix("Value error, ").partition(". Fix: ")
        fix = fix or "correct the value"
        return bad(key, value, msg, fix) if not isinstance(value, dict) else UserError(f"{key}: {msg}. Fix: {fix}")
    return bad(key, value, msg, _allowed(kind, e.get("ctx") or {}))


# what a value of each kind pydantic checks may be, for the fix of a message (the value itself is named before it)
_KINDS = {"string_type": "give a string", "bool_type": "write true or false", "bool_parsing": "write true or false",
          "int_type": "give a whole number", "int_parsing": "give a whole number", "int_from_float": "give a whole "
          "number", "float_type": "give a number", "float_parsing": "give a number", "dict_type": "write a mapping "
          "(its keys indented below it)", "list_type": "give a list", "tuple_type": "give a list"}


def _allowed(kind: str, ctx: dict[str, Any]) -> str:
    """The values a field takes, said in the fix: a choice's names, a bound, or the kind of value."""
    if kind in ("literal_error", "enum"):
        return f"use one of {ctx.get('expected', 'the values docs/config.md lists')}"
    for bound, word in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
        if bound in ctx:
            return f"give a value {word} {ctx[bound]}"
    return _KINDS.get(kind, "give a value of the kind docs/config.md lists for this key")


def _in_file_spelling(raw: dict[str, Any], dialect: Dialect, overrides: dict[str, Any]) -> dict[str, Any]:
    """`--set` in the file's own words: in an Axolotl file a key Axolotl names (`dp_shard_size`,
    `fsdp_config.reshard_after_forward`, `optimizer=adamw_8bit`) is set in the file before it is mapped, so it means
    what the same line in the file means; native keys (`precision`, `optimizer.lr`) still apply after the mapping.
    `optimizer`, `deepspeed` and `seed` are both: a bare value is Axolotl's, a dotted key the native section's.
    Returns the native overrides left."""
    if dialect != "axolotl":
        return overrides
    native = {}
    for dotted, value in overrides.items():
        head = dotted.split(".")[0]
        theirs = head in axolotl.KNOWN or head in axolotl.DATA_KEYS
        if theirs and (head not in RunConfig.model_fields or "." not in dotted):
            if value is not None:
                _set_in_file(raw, dotted, value)
        else:
            native[dotted] = value
    return native


def _set_in_file(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """set_dotted, where a number after a list's key picks its entry (`datasets.0.split`), as _first_error names it.
    Entries are copied on the way, so the caller's mapping is left as it was."""
    *path, last = dotted.split(".")
    node: Any = raw
    for i, k in enumerate(path):
        child = node[int(k)] if isinstance(node, list) and k.isdigit() and int(k) < len(node) else \
            node.get(k) if isinstance(node, dict) else None
        child = dict(child) if isinstance(child, dict) else list(child) if isinstance(child, list) else child
        if child is None:
            child = {}
        if not isinstance(child, (dict, list)):
            where = ".".join(path[: i + 1])
            raise bad(where, child, "must be a mapping", f"write `{where}:` with its keys indented below it")
        if isinstance(node, list):
            node[int(k)] = child
        else:
            node[k] = child
        node = child
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise bad("--set", dotted, f"{'.'.join(path)} has {len(node)} entries", "name one of them by its index")
        node[int(last)] = value
    else:
        node[last] = value


def build(raw: Any, *, env: dict[str, str] | None = None, overrides: dict[str, Any] | None = None,
          world_size: int | None = None, layout: bool = True) -> RunConfig:
    """Validate a raw mapping (any dialect) into a RunConfig with dp_shard resolved against `world_size`. `layout`
    False: the caller lays nothing out (`preprocess`, `merge-lora`: data and weights do not depend on the layout),
    so an unknown world size is no reason to refuse.

    Precedence: file < PARALLELISM_CONFIG_* env (only for keys the file leaves unset, as in Accelerate) < CLI overrides.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise bad("config", type(raw).__name__, "the YAML top level must be a mapping", "write `key: value` lines")
    check_tree(raw)  # keys are names, nesting is shallow, numbers are finite (config/values.py)
    for dotted, value in (overrides or {}).items():
        check_tree(value, dotted)
    dialect = detect_dialect(raw)
    if dialect == "native" and raw and not raw.keys() & RunConfig.model_fields.keys() and \
            (overrides or {}).get("model.path") is None:
        raise _not_a_run(raw)
    raw = dict(raw)  # the caller's mapping is left as it was
    overrides = _in_file_spelling(raw, dialect, overrides or {})
    native = _TO_NATIVE[dialect](raw)
    par = native.setdefault("parallelism", {})
    if not isinstance(par, dict):
        raise bad("parallelism", par, "must be a mapping", "write the sizes under `parallelism:`")
    for key, value in _env_sizes(dict(os.environ) if env is None else env).items():
        par.setdefault(key, value)
    for dotted, value in overrides.items():
        if value is not None:
            set_dotted(native, dotted, value)
    try:
        cfg = RunConfig.model_validate(native)
    except ValidationError as err:
        raise _first_error(err, dialect) from None
    if not cfg.model.path:
        raise UserError("model.path: missing. Fix: set model.path (or base_model) to an HF checkpoint dir, "
                        "or pass --model")
    if world_size is None and cfg.hardware.gpus_per_node is not None:
        world_size = cfg.hardware.nodes * cfg.hardware.gpus_per_node
    for key, world in (("world size", world_size), ("parallelism (dp_replicate × dp_shard × cp × tp)", cfg.world_size)):
        if world is not None and world > MAX_WORLD:  # the plan lists every rank and group: its work grows with them
            raise bad(key, world, f"nd-adapter plans and runs at most {MAX_WORLD:,} GPUs", "give a smaller world "
                      "(nodes × GPUs per node, --nproc) or layout (dp_replicate × dp_shard × cp × tp)")
    if layout and world_size is None and cfg.parallelism.dp_shard_size is None and cfg.parallelism.ep_size > 1:
        # dp_shard would fill a world of one, which holds no expert-parallel ranks (Axolotl's EP examples name no
        # layout, only `expert_parallel_size` and the launcher's process count)
        raise bad(spell(cfg, "parallelism.ep_size"), cfg.parallelism.ep_size, "the world size is not known here and "
                  f"{spell(cfg, 'parallelism.dp_shard_size')} is not set, so there is no data-parallel rank to lay "
                  "the experts over", "give the number of GPUs (plan --gpus-per-node N; train or rehearse --nproc N; "
                  f"deepspeed/torchrun set it), or set {spell(cfg, 'parallelism.dp_shard_size')}"
                  + (" (in an Axolotl file the GPUs are dp_shard_size × expert_parallel_size)"
                     if cfg.source == "axolotl" else ""))
    par_resolved = cfg.parallelism.resolve(world_size)
    cfg = cfg.model_copy(update={"parallelism": par_resolved})
    _check_world_and_batch(cfg, world_size)
    return _resolve_auto_compile(cfg) if cfg.model.compile in ("auto", "if_possible") else cfg


# keys of Axolotl's cloud launch configs (examples/cloud/*.yaml: where `axolotl train --cloud` runs, not what)
_CLOUD_KEYS = {"provider", "gpu_count", "node_count", "secrets", "volumes", "dockerfile_commands", "project_name"}


def _not_a_run(raw: dict[str, Any]) -> UserError:
    """A file none of whose keys any dialect reads: said as what it is, not as the first key it lacks."""
    shown = ", ".join(map(str, list(raw)[:6])) + (", ..." if len(raw) > 6 else "")
    what = ("Axolotl's cloud launch config (where `axolotl train CONFIG --cloud FILE` runs a job, not what it "
            "trains)" if raw.keys() & _CLOUD_KEYS else "not a training config")
    return UserError(f"--config: its keys ({shown}) are none that nd-adapter, Axolotl or Accelerate read for a run: "
                     f"{what}. Fix: pass the training YAML (native: model, ...; Axolotl: base_model, datasets, ...)")


def _resolve_auto_compile(cfg: RunConfig) -> RunConfig:
    """`model.compile: auto` (the default): compiled layers where they are correct and were measured faster on one
    GPU (docs/BENCHMARKS.md: Gemma-3-4B +26% and 30 GiB less, the 1B and 3B shapes +2-4%, Phi-4-mini equal, the MoE
    attention halves +6%, each a full fine-tune of fixed-shape batches at tp = cp = 1; LoRA DPO on the Llama-3.1-8B
    shape +26% at the same memory and QLoRA DPO +15% (H100), its stream's length a symbol of the graphs; the other
    objectives of COMPILED_FASTER). Off, with the reason in the run's first lines, where that is not so: ZeRO-3 (its
    parameter gathers), tp > 1 (a graph break at every Megatron linear: -8% measured), cp > 1 and recompute (graph
    breaks, not measured), QLoRA SFT (6% slower compiled), ORPO, KTO, reward models and unpacked SFT (not measured
    faster). The model's engine and
    the device are asked later (adapter/models/resolved.py: the transformers engine's compiled layers are not
    measured faster yet; a CPU is never compiled for), so the value is kept marked as auto's.

    `if_possible` (Axolotl's `torch_compile: true`): the user asked, so the layers compile wherever the layout lets
    them, on either engine and device: not under ZeRO-3, where compiled layers (the native engine's, with
    `model.compile: true`) are correct but not yet measured faster."""
    auto = cfg.model.compile == "auto"
    why = _qat_off(cfg) or (auto_compile_off(cfg) if auto else _zero3_off(cfg))
    if why is not None and cfg.model.compile_memory_budget is not None:
        raise bad("model.compile_memory_budget", cfg.model.compile_memory_budget, f"{_compile_key(cfg)} is off "
                  f"here ({why}), so there is nothing to budget",
                  f"remove it, or set {setting(cfg, 'model.compile', True)}")
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"compile": why is None}),
                                  "notes": (*cfg.notes, compile_note(cfg, why)), "compile_auto": auto})


def _qat_off(cfg: RunConfig) -> str | None:
    return "QAT's fake-quantised linears beside compiled layers are not checked" if cfg.qat is not None else None


def _zero3_off(cfg: RunConfig) -> str | None:
    """ZeRO-3 runs when anything is sharded (dp or cp > 1) and deepspeed.zero_stage is 3
    (adapter/parallel/deepspeed_config.zero_stage)."""
    if cfg.dp_size * cfg.parallelism.cp_size > 1 and cfg.deepspeed.zero_stage == 3:
        return f"ZeRO-3's parameter gathers: compiled layers under them are not measured faster yet " \
               f"({setting(cfg, 'deepspeed.zero_stage', 2)} would compile them)"
    return None


# Objectives measured faster with compiled layers on one H100, with adapters and of every weight (IPO is DPO's
# step with another loss on the same log-probabilities): full SFT of fixed-shape batches (+2-26%), LoRA SFT +2% at
# +0.3% memory (Llama-3.1-8B shape), LoRA DPO +26% and QLoRA DPO +15% (8B), full DPO +13% (1B shape), LoRA SimPO +22%
# (8B), full SimPO (1B), each at the same memory (docs/BENCHMARKS.md, 2026-12-06/07). ORPO, KTO and the reward
# models were not measured.
COMPILED_FASTER = ("sft", "dpo", "ipo", "simpo")


def auto_compile_off(cfg: RunConfig) -> str | None:
    """Why `model.compile: auto` leaves the layers eager from the config alone; None: compile them."""
    p, d = cfg.parallelism, cfg.data
    reasons = [
        (p.tp_size > 1, "tp > 1 breaks the graph at every Megatron linear (measured 8% slower)"),
        (p.cp_size > 1, "cp > 1 breaks the graph at the context-parallel attention (not measured faster)"),
        (cfg.recompute != "none", f"recompute {cfg.recompute} breaks or repeats the graphs (not measured faster)"),
        (cfg.lora is not None and cfg.lora.quantize_base is not None and cfg.objective not in ("dpo", "ipo"),
         "a quantised base: QLoRA SFT ran 6% slower compiled (QLoRA DPO ran 15% faster)"),
        (cfg.objective not in COMPILED_FASTER, f"{cfg.objective} was not measured faster compiled (SFT, DPO and "
                                                 "SimPO were)"),
        (cfg.objective == "sft" and bool(d.datasets) and not d.sample_packing,
         "unpacked SFT (micro-batches cut to their longest example) was not measured faster compiled"),
    ]
    return _zero3_off(cfg) or next((why for off, why in reasons if off), None)


def _compile_key(cfg: RunConfig) -> str:
    if cfg.source == "axolotl":
        return "torch_compile: true -> model.compile" if cfg.model.compile == "if_possible" else \
            "torch_compile unset -> model.compile: auto"
    return f"model.compile: {cfg.model.compile}"


def compile_note(cfg: RunConfig, why: str | None) -> str:
    """The first line that says what `model.compile: auto` / `if_possible` chose and why."""
    key = _compile_key(cfg if cfg.model.compile in ("auto", "if_possible") else
                       cfg.model_copy(update={"model": cfg.model.model_copy(update={"compile": "auto"})}))
    if why is None:
        again = "" if cfg.steady_lengths else ("; once more at the first micro-batch of another length, the length "
                                                "then a symbol of the graph")
        return f"{key}: on (each transformer layer compiled" + (
            " at the first step: measured faster on one GPU" if "auto" in key else "") + again + ")"
    fix = f"; {setting(cfg, 'model.compile', True)} compiles anyway" if "auto" in key and \
        not why.startswith("ZeRO-3") else ""
    return f"{key}: off: {why}{fix}"


def _check_world_and_batch(cfg: RunConfig, world_size: int | None) -> None:
    p = cfg.parallelism
    if world_size is not None and cfg.world_size != world_size:  # said with the file's keys and values
        shard = "dp_shard_size × expert_parallel_size" if cfg.source == "axolotl" and p.ep_size > 1 else \
            spell(cfg, "parallelism.dp_shard_size")
        sizes = [(spell(cfg, "parallelism.dp_replicate_size"), p.dp_replicate_size), (shard, p.dp_shard_size),
                 (spell(cfg, "parallelism.cp_size"), p.cp_size), (spell(cfg, "parallelism.tp_size"), p.tp_size)]
        shown = " × ".join(f"{k} {v}" for k, v in sizes)
        raise UserError(f"{shown} = {cfg.world_size} GPUs, but the world size is {world_size} (ParallelismConfig "
                        f"total_size does not match num_processes). Fix: make their product {world_size} (an unset "
                        f"{spell(cfg, 'parallelism.dp_shard_size')} takes the GPUs the others leave), or run on "
                        f"{cfg.world_size} GPUs (--gpus-per-node / --nproc)")
    b, dp = cfg.batch, cfg.dp_size
    if b.global_batch_size is not None:
        per_step = b.micro_batch_size * dp
        if b.gradient_accumulation_steps is None:
            if b.global_batch_size % per_step:
                raise bad("batch.global_batch_size", b.global_batch_size,
                          f"not divisible by micro_batch_size×dp = {b.micro_batch_size}×{dp}",
                          f"use a multiple of {per_step}")
        elif b.global_batch_size != per_step * b.gradient_accumulation_steps:
            raise bad("batch.global_batch_size", b.global_batch_size,
                      f"≠ micro_batch_size×gradient_accumulation_steps×(dp_replicate·dp_shard) = "
                      f"{b.micro_batch_size}×{b.gradient_accumulation_steps}×{dp} = "
                      f"{per_step * b.gradient_accumulation_steps}",
                      "drop one of the three batch keys or make them agree")


def with_grad_accum(cfg: RunConfig) -> RunConfig:
    """Derive gradient_accumulation_steps from global_batch_size when only the latter is given."""
    b = cfg.batch
    if b.gradient_accumulation_steps is None and b.global_batch_size is not None:
        ga = b.global_batch_size // (b.micro_batch_size * cfg.dp_size)
        return cfg.model_copy(update={"batch": b.model_copy(update={"gradient_accumulation_steps": ga})})
    return cfg


def read_yaml(path: str | Path) -> Any:
    check_path("--config", str(path))
    p = Path(path)
    if not p.is_file():
        raise bad("--config", str(path), "no such file", "pass the path of a YAML config (see configs/)")
    try:
        return yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise bad("--config", str(path), f"not valid YAML{where}", "fix the YAML syntax")
    except UnicodeDecodeError:
        raise bad("--config", str(path), "not a UTF-8 text file", "pass a YAML file")
    except RecursionError:  # PyYAML's parser recurses once per level of nesting
        raise bad("--config", str(path), "nested too deeply for the YAML parser (no config key nests more than a "
                  "few levels)", "correct the YAML's indentation or brackets")
    except ValueError as e:  # an integer beyond Python's 4,300-digit limit
        raise bad("--config", str(path), f"not a config: {e}", "fix the value")
    except OSError as e:
        raise bad("--config", str(path), f"cannot be read ({e.strerror})", "check its permissions")


def resolve_model_path(cfg: RunConfig, config_file: str | Path | None) -> RunConfig:
    """Relative model/data paths are relative to the config file, so configs/ works from any directory. A model
    path that exists nowhere but reads as a hub id (`meta-llama/Llama-3.1-8B`) is looked up in the local HF cache."""
    base = Path(config_file).resolve().parent if config_file is not None else None

    def fix(p: str) -> str:
        if not p or base is None or Path(p).is_absolute() or Path(p).exists():
            return p
        cand = base / p
        return str(cand) if cand.exists() else p

    def fix_optional(p: str | None) -> str | None:
        return None if p is None else fix(p)

    path = fix(cfg.model.path)
    if not Path(path).exists() and looks_like_hub_id(path):
        try:
            path = str(resolve_hub_id(path))
        except UserError:
            pass  # not cached: said where the model is first needed (load_arch), so a config can name a model that
            # does not exist yet (the demo's, before `make demo` builds it)
    model = cfg.model.model_copy(update={"path": path, "checkpoint": fix_optional(cfg.model.checkpoint)})

    def fix_jinja(t: str | None) -> str | None:  # a template string stays as it is; a file name is resolved
        return t if t is None or "{" in t else fix(t)

    def entries(es: list[DatasetEntry]) -> list[DatasetEntry]:
        return [e.model_copy(update={"path": fix(e.path), "chat_template_jinja": fix_jinja(e.chat_template_jinja)})
                for e in es]

    data = cfg.data.model_copy(update={"files": [fix(f) for f in cfg.data.files],
                                       "datasets": entries(cfg.data.datasets),
                                       "test_datasets": entries(cfg.data.test_datasets),
                                       "chat_template_jinja": fix_jinja(cfg.data.chat_template_jinja)})
    return cfg.model_copy(update={"model": model, "data": data})


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    """`--set key.path=value` command-line overrides (native key names; values read as YAML, so 1e-4, true, [4, 6])."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
            raise bad("--set", item, "expected key.path=value", "write e.g. --set optimizer.lr=1e-4")
        try:
            out[key.strip()] = yaml.safe_load(text) if text.strip() else None
        except (yaml.YAMLError, RecursionError, ValueError):
            raise bad("--set", item, "the value is not valid YAML", "quote it, e.g. --set 'logging.profile_dir=/tmp/p'")
    return out


def _beside(name: Any, path: str | Path, key: str) -> Any:
    """A file an Axolotl key names: relative to the working directory (as Axolotl reads it), else to the config
    file's directory."""
    if not isinstance(name, str) or not name:
        return name
    check_path(key, name)
    p = Path(name)
    beside = Path(path).resolve().parent / p
    return str(beside) if not p.is_absolute() and not p.exists() and beside.exists() else name


def _files_beside(raw: Any, path: str | Path) -> Any:
    """Axolotl's files read before the config is built (its `deepspeed:` JSON, a local `pretraining_dataset`)."""
    if not isinstance(raw, dict) or detect_dialect(raw) != "axolotl":
        return raw
    out = dict(raw)
    if isinstance(raw.get("deepspeed"), str):
        out["deepspeed"] = _beside(raw["deepspeed"], path, "deepspeed")
    pre = raw.get("pretraining_dataset")
    if isinstance(pre, str):
        out["pretraining_dataset"] = _beside(pre, path, "pretraining_dataset")
    elif isinstance(pre, list):
        out["pretraining_dataset"] = [{**e, "path": _beside(e.get("path"), path, f"pretraining_dataset[{i}].path")}
                                      if isinstance(e, dict) else _beside(e, path, f"pretraining_dataset[{i}]")
                                      for i, e in enumerate(pre)]
    return out


def model_path_of(path: str | Path, overrides: dict[str, Any] | None = None) -> Path | None:
    """The model directory (or config.json) a config file names, read from the raw YAML in any dialect, before
    anything else of it is checked; None when it names none that exists here."""
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        return None
    named = (overrides or {}).get("model.path")
    if named is None and detect_dialect(raw) == "axolotl":
        named = (overrides or {}).get("base_model")
    if named is None:
        dialect, model = detect_dialect(raw), raw.get("model")
        named = {"native": model.get("path") if isinstance(model, dict) else None, "axolotl": raw.get("base_model"),
                 "accelerate": model}[dialect]
    if not isinstance(named, str) or not named:
        return None
    check_path("--model (model.path)" if "model.path" in (overrides or {}) else
               {"native": "model.path", "axolotl": "base_model"}.get(detect_dialect(raw), "--model"), named)
    for cand in (Path(named), Path(path).resolve().parent / named):
        if cand.exists():
            return cand
    if looks_like_hub_id(named):
        try:
            return resolve_hub_id(named)
        except UserError:
            return None  # said where the model is first needed, with the rest of the config's checks
    return None


def load(path: str | Path, **kw: Any) -> RunConfig:
    return with_grad_accum(resolve_model_path(build(_files_beside(read_yaml(path), path), **kw), path))
