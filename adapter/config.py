"""The run configuration: one validated object from a native, Axolotl or Accelerate YAML (plus env and CLI).

Three dialects are read so users can bring the file they already have:
  * native    -- this project's schema (`parallelism:` holds Accelerate's field names);
  * Axolotl   -- its top-level keys (`tensor_parallel_size`, `sequence_len`, `base_model`, ...);
  * Accelerate -- a launch config with a `parallelism_config:` block of `parallelism_config_*` keys.
Each dialect is mapped onto the native dict, which pydantic validates; a pydantic error becomes a `UserError`
naming the key, so no traceback reaches the user.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from adapter.errors import UserError, bad

SIZE_KEYS = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")
ENV_PREFIX = "PARALLELISM_CONFIG_"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ParallelismConfig(_Strict):
    """Accelerate's `ParallelismConfig` fields. 1 disables a dimension; `dp_shard_size=None` means "fill the rest"."""

    dp_replicate_size: StrictInt = Field(1, ge=1)
    dp_shard_size: StrictInt | None = Field(None, ge=1)
    tp_size: StrictInt = Field(1, ge=1)
    cp_size: StrictInt = Field(1, ge=1)
    cp_comm_type: Literal["all_gather", "p2p"] = "all_gather"

    @property
    def fixed_product(self) -> int:
        return self.dp_replicate_size * (self.dp_shard_size or 1) * self.tp_size * self.cp_size

    def resolve(self, world_size: int | None) -> "ParallelismConfig":
        """Fill an unset dp_shard_size with the world left after tp, cp and dp_replicate (as Axolotl does)."""
        if self.dp_shard_size is not None:
            return self
        if world_size is None:
            return self.model_copy(update={"dp_shard_size": 1})
        rest = self.dp_replicate_size * self.tp_size * self.cp_size
        if world_size % rest:
            raise bad("parallelism.dp_shard_size", None,
                      f"cannot fill it: world size {world_size} is not divisible by dp_replicate×tp×cp={rest}",
                      "set dp_shard_size explicitly or change the world size")
        return self.model_copy(update={"dp_shard_size": world_size // rest})


class ModelSection(_Strict):
    path: str = Field(description="HF checkpoint directory or its config.json (architecture source)")
    checkpoint: str | None = Field(None, description="converted Megatron checkpoint (nd-adapter convert) to train from")
    attention: Literal["sdpa", "local", "te"] = "sdpa"
    vocab_divisible_by: StrictInt = Field(128, ge=1)
    fused_kernels: bool | None = Field(
        None, description="fused RoPE, SwiGLU and cross-entropy without TransformerEngine; default: on GPUs")
    compile: bool = Field(False, description="torch.compile each transformer layer (not with ZeRO-3)")


class BatchSection(_Strict):
    micro_batch_size: StrictInt = Field(1, ge=1)
    gradient_accumulation_steps: StrictInt | None = Field(None, ge=1)
    global_batch_size: StrictInt | None = Field(None, ge=1)


class OptimizerSection(_Strict):
    lr: float = Field(3e-4, gt=0)
    min_lr: float = Field(0.0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_steps: StrictInt = Field(0, ge=0)
    max_steps: StrictInt = Field(1000, ge=1)
    clip_grad: float = Field(1.0, ge=0)


class DataSection(_Strict):
    files: list[str] = Field(default_factory=list)
    synthetic: bool = Field(False, description="random tokens instead of files (benchmarks, rehearsals)")
    document_mask: bool = Field(False, description="attention stays inside each packed document (cp = 1 only)")
    text_key: str = "text"
    cache_dir: str | None = None
    seed: StrictInt = 1234


class CheckpointSection(_Strict):
    dir: str | None = None
    save_every: StrictInt = Field(0, ge=0, description="steps between saves; 0 saves only at the end")
    keep_last: StrictInt = Field(2, ge=1)
    export_hf: str | None = Field(None, description="write an HF checkpoint here at the end")


class DeepSpeedSection(_Strict):
    # 3 shards weights, gradients and optimizer states (FSDP FULL_SHARD). 2 keeps the 16-bit weights whole on every
    # rank and shards the rest (FSDP2 reshard_after_forward=False): no gathers at all, for models whose weights
    # fit; layouts with dp_replicate > 1 need 3. Layouts with nothing to shard run stage 1 either way.
    zero_stage: Literal[2, 3] = 3
    # How dp_replicate maps onto DeepSpeed: exact HSDP (shard over dp_shard×cp, average over replicas) or ZeRO++ hpZ.
    replicate_mode: Literal["hsdp", "hpz"] = "hsdp"
    reduce_bucket_size: StrictInt = Field(500_000_000, ge=1)
    prefetch_bucket_size: StrictInt = Field(500_000_000, ge=1)
    param_persistence_threshold: StrictInt = Field(1_000_000, ge=0)
    # ZeRO-3's gather unit: a whole transformer layer (FSDP's per-block wrapping: one fetch, release and gradient
    # reduce per layer) or every module (DeepSpeed's default: ~10 per layer, each paying Python hooks).
    gather_granularity: Literal["layer", "module"] = "layer"
    overlap_comm: bool = True
    overrides: dict[str, Any] = Field(default_factory=dict, description="merged into the generated DeepSpeed JSON")


class LoggingSection(_Strict):
    every: StrictInt = Field(1, ge=1)
    tensorboard: str | None = None
    wandb_project: str | None = None
    profile_steps: tuple[StrictInt, StrictInt] | None = Field(
        None, description="[first, last] step (inclusive) to record with the torch profiler")
    profile_dir: str = Field("profile", description="where profiler traces and op tables go")
    profile_ranks: list[StrictInt] = Field(default_factory=lambda: [0], description="global ranks to profile")

    @model_validator(mode="after")
    def _profile_window(self) -> "LoggingSection":
        if self.profile_steps and not 1 <= self.profile_steps[0] <= self.profile_steps[1]:
            raise ValueError("logging.profile_steps must be [first, last] with 1 <= first <= last")
        return self


class HardwareSection(_Strict):
    nodes: StrictInt = Field(1, ge=1)
    gpus_per_node: StrictInt | None = Field(None, ge=1)
    gpu: str = "h100-80gb"


class RunConfig(_Strict):
    model: ModelSection
    parallelism: ParallelismConfig = ParallelismConfig()
    batch: BatchSection = BatchSection()
    seq_len: StrictInt = Field(2048, ge=1)
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    sequence_parallel: bool | None = Field(None, description="Megatron sequence parallelism; default: on when tp > 1")
    recompute: Literal["none", "selective", "full"] = "none"
    optimizer: OptimizerSection = OptimizerSection()
    data: DataSection = DataSection()
    checkpoint: CheckpointSection = CheckpointSection()
    deepspeed: DeepSpeedSection = DeepSpeedSection()
    logging: LoggingSection = LoggingSection()
    hardware: HardwareSection = HardwareSection()
    seed: StrictInt = 1234
    source: str = Field("native", description="which dialect the file was written in")

    @model_validator(mode="after")
    def _lr_order(self) -> "RunConfig":
        if self.optimizer.min_lr > self.optimizer.lr:
            raise ValueError("optimizer.min_lr must not exceed optimizer.lr")
        return self

    @property
    def world_size(self) -> int:
        p = self.parallelism
        return p.dp_replicate_size * (p.dp_shard_size or 1) * p.tp_size * p.cp_size

    @property
    def dp_size(self) -> int:
        return self.parallelism.dp_replicate_size * (self.parallelism.dp_shard_size or 1)

    @property
    def use_sequence_parallel(self) -> bool:
        return self.parallelism.tp_size > 1 if self.sequence_parallel is None else self.sequence_parallel

    @property
    def grad_accum(self) -> int:
        return self.batch.gradient_accumulation_steps or 1

    @property
    def global_batch(self) -> int:
        return self.batch.micro_batch_size * self.grad_accum * self.dp_size


# ----------------------------------------------------------------------------------------------------------------
# Dialects
# ----------------------------------------------------------------------------------------------------------------

AXOLOTL_MARKERS = {"base_model", "sequence_len", "tensor_parallel_size", "context_parallel_size", "datasets",
                   "sequence_parallel_degree", "micro_batch_size", "learning_rate", "num_epochs"}
# Axolotl keys we understand; every other Axolotl key is reported once as ignored.
AXOLOTL_KNOWN = AXOLOTL_MARKERS | {
    "dp_shard_size", "dp_replicate_size", "gradient_accumulation_steps", "bf16", "fp16", "tf32", "max_steps",
    "warmup_steps", "lr_scheduler", "weight_decay", "max_grad_norm", "output_dir", "save_steps", "save_total_limit",
    "optimizer", "adam_beta1", "adam_beta2", "adam_epsilon", "seed", "gradient_checkpointing", "cosine_min_lr_ratio",
    "logging_steps", "use_tensorboard", "wandb_project", "ring_attn_func", "heads_k_stride", "base_model_config",
    "deepspeed", "model_type", "tokenizer_type", "sample_packing", "pad_to_sequence_len", "flash_attention",
    "sdp_attention", "strict", "load_in_8bit", "load_in_4bit",
}
ACCELERATE_MARKERS = {"parallelism_config", "compute_environment", "distributed_type", "num_processes", "num_machines"}


def detect_dialect(raw: dict[str, Any]) -> str:
    if "model" in raw and isinstance(raw.get("model"), dict):
        return "native"
    if raw.keys() & ACCELERATE_MARKERS:
        return "accelerate"
    if raw.keys() & AXOLOTL_MARKERS:
        return "axolotl"
    return "native"


def _set(d: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for i, k in enumerate(keys[:-1]):
        if d.get(k) is None:
            d[k] = {}
        if not isinstance(d[k], dict):
            where = ".".join(keys[: i + 1])
            raise bad(where, d[k], "must be a mapping", f"write `{where}:` with its keys indented below it")
        d = d[k]
    d[keys[-1]] = value


def from_axolotl(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"source": "axolotl"}
    mapping = {
        "base_model": "model.path", "dp_shard_size": "parallelism.dp_shard_size",
        "dp_replicate_size": "parallelism.dp_replicate_size", "tensor_parallel_size": "parallelism.tp_size",
        "context_parallel_size": "parallelism.cp_size", "micro_batch_size": "batch.micro_batch_size",
        "gradient_accumulation_steps": "batch.gradient_accumulation_steps", "sequence_len": "seq_len",
        "learning_rate": "optimizer.lr", "weight_decay": "optimizer.weight_decay", "warmup_steps":
        "optimizer.warmup_steps", "max_steps": "optimizer.max_steps", "max_grad_norm": "optimizer.clip_grad",
        "adam_epsilon": "optimizer.eps", "output_dir": "checkpoint.dir", "save_steps": "checkpoint.save_every",
        "save_total_limit": "checkpoint.keep_last", "seed": "seed", "logging_steps": "logging.every",
        "wandb_project": "logging.wandb_project",
    }
    for key, target in mapping.items():
        if raw.get(key) is not None:
            _set(out, target, raw[key])
    if raw.get("sequence_parallel_degree") is not None:
        if raw.get("context_parallel_size") is None:
            warnings.warn("sequence_parallel_degree is deprecated (Axolotl); read as context_parallel_size", stacklevel=3)
            _set(out, "parallelism.cp_size", raw["sequence_parallel_degree"])
        elif raw["sequence_parallel_degree"] != raw["context_parallel_size"]:
            raise bad("sequence_parallel_degree", raw["sequence_parallel_degree"],
                      f"conflicts with context_parallel_size={raw['context_parallel_size']}",
                      "drop the deprecated sequence_parallel_degree")
    if "adam_beta1" in raw or "adam_beta2" in raw:
        _set(out, "optimizer.betas", (raw.get("adam_beta1", 0.9), raw.get("adam_beta2", 0.95)))
    if raw.get("lr_scheduler") is not None:
        sched = raw["lr_scheduler"]
        if sched not in ("cosine", "constant", "constant_with_warmup"):
            raise bad("lr_scheduler", sched, "not supported", "use cosine or constant")
        _set(out, "optimizer.schedule", "cosine" if sched == "cosine" else "constant")
    if raw.get("cosine_min_lr_ratio") is not None and raw.get("learning_rate") is not None:
        _set(out, "optimizer.min_lr", raw["cosine_min_lr_ratio"] * raw["learning_rate"])
    out["precision"] = "bf16" if raw.get("bf16") in (True, "auto", "true") else "fp16" if raw.get("fp16") else "bf16"
    if raw.get("gradient_checkpointing"):
        out["recompute"] = "full"
    files = [d.get("path") for d in raw.get("datasets") or [] if isinstance(d, dict) and d.get("path")]
    if files:
        _set(out, "data.files", files)
    ignored = sorted(k for k in raw if k not in AXOLOTL_KNOWN)
    if ignored:
        warnings.warn(f"ignored Axolotl keys (not used by nd-adapter): {', '.join(ignored)}", stacklevel=3)
    return out


def from_accelerate(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"source": "accelerate", "model": {"path": raw.get("model", "")}}
    block = raw.get("parallelism_config") or {}
    if not isinstance(block, dict):
        raise bad("parallelism_config", block, "must be a mapping", "write `parallelism_config:` with its keys below")
    for key, value in block.items():
        name = key.removeprefix("parallelism_config_")
        if name in SIZE_KEYS:
            _set(out, f"parallelism.{name}", value)
        elif name == "cp_comm_strategy":
            if value not in ("allgather", "all_gather"):
                raise bad(key, value, "only the all-gather strategy maps onto this project (as all_gather)",
                          "use allgather, or set parallelism.cp_comm_type: p2p in a native config for the ring")
            _set(out, "parallelism.cp_comm_type", "all_gather")
        else:
            raise bad(f"parallelism_config.{key}", value, "unknown key", f"use parallelism_config_{{{','.join(SIZE_KEYS)}}}")
    nodes, procs = raw.get("num_machines", 1), raw.get("num_processes")
    _set(out, "hardware.nodes", nodes)
    if isinstance(procs, int) and isinstance(nodes, int) and nodes >= 1 and procs % nodes == 0:
        _set(out, "hardware.gpus_per_node", procs // nodes)
    elif procs is not None:
        raise bad("num_processes", procs, f"not divisible by num_machines={nodes}", "make num_processes a multiple")
    mp = raw.get("mixed_precision")
    if mp is not None:
        if mp not in ("bf16", "fp16", "no"):
            raise bad("mixed_precision", mp, "unsupported", "use bf16, fp16 or no")
        out["precision"] = "fp32" if mp == "no" else mp
    return out


# ----------------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------------

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


def _first_error(err: ValidationError) -> UserError:
    e = err.errors()[0]
    key = ".".join(str(p) for p in e["loc"]) or "config"
    value = e.get("input")
    kind = e["type"]
    if kind == "extra_forbidden":
        return bad(key, value, "unknown key", "remove it or check its spelling against docs/config.md")
    if kind == "missing":
        return UserError(f"{key}: missing. Fix: add `{key}` to the config")
    msg = e["msg"].rstrip(".")
    if kind in ("int_type", "int_parsing", "greater_than_equal") and key.split(".")[-1].endswith("_size"):
        return bad(key, value, f"{msg}", "give an integer ≥ 1 (1 disables the dimension)")
    if kind == "value_error":
        return UserError(f"{key}: {msg.removeprefix('Value error, ')}. Fix: correct the value")
    return bad(key, value, msg, "see docs/config.md for the allowed values")


def build(raw: Any, *, env: dict[str, str] | None = None, overrides: dict[str, Any] | None = None,
          world_size: int | None = None) -> RunConfig:
    """Validate a raw mapping (any dialect) into a RunConfig with dp_shard resolved against `world_size`.

    Precedence: file < PARALLELISM_CONFIG_* env (only for keys the file leaves unset, as in Accelerate) < CLI overrides.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise bad("config", type(raw).__name__, "the YAML top level must be a mapping", "write `key: value` lines")
    dialect = detect_dialect(raw)
    native = {"native": lambda r: dict(r), "axolotl": from_axolotl, "accelerate": from_accelerate}[dialect](raw)
    par = native.setdefault("parallelism", {})
    if not isinstance(par, dict):
        raise bad("parallelism", par, "must be a mapping", "write the sizes under `parallelism:`")
    for key, value in _env_sizes(dict(os.environ) if env is None else env).items():
        par.setdefault(key, value)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set(native, dotted, value)
    try:
        cfg = RunConfig.model_validate(native)
    except ValidationError as err:
        raise _first_error(err) from None
    if not cfg.model.path:
        raise UserError("model.path: missing. Fix: set model.path (or base_model) to an HF checkpoint dir, or pass --model")
    if world_size is None and cfg.hardware.gpus_per_node is not None:
        world_size = cfg.hardware.nodes * cfg.hardware.gpus_per_node
    par_resolved = cfg.parallelism.resolve(world_size)
    cfg = cfg.model_copy(update={"parallelism": par_resolved})
    _check_world_and_batch(cfg, world_size)
    return cfg


def _check_world_and_batch(cfg: RunConfig, world_size: int | None) -> None:
    p = cfg.parallelism
    if world_size is not None and cfg.world_size != world_size:
        raise bad("parallelism", f"{p.dp_replicate_size}×{p.dp_shard_size}×{p.cp_size}×{p.tp_size}",
                  f"ParallelismConfig total_size ({cfg.world_size}) does not match num_processes ({world_size})",
                  "adjust dp_replicate_size/dp_shard_size/tp_size/cp_size so their product is the world size")
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


def resolve_model_path(cfg: RunConfig, config_file: str | Path | None) -> RunConfig:
    """Relative model/data paths are relative to the config file, so configs/ works from any directory."""
    if config_file is None:
        return cfg
    base = Path(config_file).resolve().parent

    def fix(p: str | None) -> str | None:
        if not p or Path(p).is_absolute() or Path(p).exists():
            return p
        cand = base / p
        return str(cand) if cand.exists() else p

    model = cfg.model.model_copy(update={"path": fix(cfg.model.path), "checkpoint": fix(cfg.model.checkpoint)})
    data = cfg.data.model_copy(update={"files": [fix(f) for f in cfg.data.files]})
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
        except yaml.YAMLError:
            raise bad("--set", item, "the value is not valid YAML", "quote it, e.g. --set 'logging.profile_dir=/tmp/p'")
    return out


def load(path: str | Path, **kw: Any) -> RunConfig:
    return with_grad_accum(resolve_model_path(build(read_yaml(path), **kw), path))
