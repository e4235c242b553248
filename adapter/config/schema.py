"""The run configuration's schema: one frozen, validated pydantic object (`RunConfig`) every dialect maps onto.

`parallelism:` holds Accelerate's `ParallelismConfig` field names; every other section is this project's. Unknown
keys are refused (`extra="forbid"`), so a typo never silently changes a run. Reference: docs/config.md.
"""
from __future__ import annotations

import signal
from typing import Any, Literal

from pydantic import Field, StrictFloat, field_validator, model_validator

from adapter.config.schema_data import DataSection
from adapter.config.schema_qat import QATFields
from adapter.config.schema_rl import RLFields
from adapter.config.values import Float, Int, PathStr, Size, lax_bool
from adapter.config.values import Strict as _Strict
from adapter.errors import bad

SIZE_KEYS = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")
ENV_PREFIX = "PARALLELISM_CONFIG_"


def set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
    """Write `value` at a dotted key (`optimizer.lr`) of a native config dict: what every dialect mapping and `--set`
    build before validation."""
    keys = dotted.split(".")
    for i, k in enumerate(keys[:-1]):
        if d.get(k) is None:
            d[k] = {}
        if not isinstance(d[k], dict):
            where = ".".join(keys[: i + 1])
            raise bad(where, d[k], "must be a mapping", f"write `{where}:` with its keys indented below it")
        d = d[k]
    d[keys[-1]] = value



class ParallelismConfig(_Strict):
    """Accelerate's `ParallelismConfig` fields. 1 disables a dimension; `dp_shard_size=None` means "fill the rest"."""

    dp_replicate_size: Size = Field(1, ge=1)
    dp_shard_size: Size | None = Field(None, ge=1)
    tp_size: Size = Field(1, ge=1)
    cp_size: Size = Field(1, ge=1)
    cp_comm_type: Literal["all_gather", "p2p"] = "all_gather"
    # Expert parallelism (Megatron-Core's): a mixture of experts' experts split over ep_size ranks, laid over the
    # data-parallel × cp ranks (not a fifth factor of the world size); tokens travel to their experts all-to-all
    ep_size: Size = Field(1, ge=1, description="expert-parallel ranks (mixtures of experts): each holds "
                               "num_experts / ep_size experts; must divide dp_replicate × dp_shard × cp")

    @property
    def world_size(self) -> int:
        """Processes the layout needs: the product of the four sizes (an unset dp_shard counts 1 until `resolve`).
        The one definition of it: the config, plan and launchers all read this."""
        return self.dp_replicate_size * (self.dp_shard_size or 1) * self.tp_size * self.cp_size

    def resolve(self, world_size: int | None) -> ParallelismConfig:
        """Fill an unset dp_shard_size with the world left after tp, cp and dp_replicate (as Axolotl does)."""
        if self.dp_shard_size is not None:
            return self
        if world_size is None:
            return self.model_copy(update={"dp_shard_size": 1})
        rest = self.model_copy(update={"dp_shard_size": 1}).world_size
        if world_size % rest:
            raise bad("parallelism.dp_shard_size", None,
                      f"cannot fill it: world size {world_size} is not divisible by dp_replicate×tp×cp={rest}",
                      "set dp_shard_size explicitly or change the world size")
        return self.model_copy(update={"dp_shard_size": world_size // rest})


LigerKernel = Literal["rope", "rms_norm", "rms_norm_gated", "layer_norm", "glu_activation", "cross_entropy",
                      "fused_linear_cross_entropy"]  # Axolotl's liger_<name> keys (docs/config.md: model.liger)


class ModelSection(_Strict):
    path: PathStr = Field(description="HF checkpoint directory, its config.json, or a hub id in the local HF cache")
    checkpoint: PathStr | None = Field(None, description="converted Megatron checkpoint (nd-adapter convert) to "
                                       "train from")
    # The first weights without a converted checkpoint: `auto` those in `path` if any (random for a bare config.json),
    # `pretrained` insists on them, `random` ignores them; converted once into `cache_dir` (adapter/convert/cache.py)
    init: Literal["auto", "pretrained", "random"] = "auto"
    cache_dir: PathStr | None = Field(None, description="converted-weights cache; default $ND_ADAPTER_CACHE or "
                                  "~/.cache/nd-adapter")
    cache_node_local: bool = Field(False, description="the cache dir is local to each node (built by local rank 0)")
    attention: Literal["sdpa", "local", "te"] = "sdpa"
    engine: Literal["auto", "megatron", "transformers"] = Field(
        "auto", description="what trains the model: megatron (a native family on Megatron-Core layers), "
        "transformers (transformers' own model: any architecture it loads), auto (megatron where a native family "
        "reproduces the checkpoint exactly, else transformers; said in the run's first lines)")
    trust_remote_code: bool = Field(False, description="run the checkpoint's own modelling code (config.json's "
                                    "auto_map), as transformers' trust_remote_code; else such a checkpoint is refused")
    dequantize: bool = Field(False, description="a pre-quantised MXFP4 or FP8 checkpoint loaded as 16-bit weights "
                             "that train (transformers' Mxfp4Config / FineGrainedFP8Config(dequantize=True))")
    linearized_experts: bool = Field(False, description="the checkpoint holds a mixture's experts as one linear per "
                                     "expert and projection (Axolotl's llama4_linearized_experts, its *-Linearized "
                                     "Llama 4 checkpoints): built so, and exported in transformers' fused layout")
    liger: tuple[LigerKernel, ...] = Field((), description="Liger's kernels on the transformers engine (Axolotl's "
                                           "liger_* keys); the native engine runs its own")
    vocab_divisible_by: Int = Field(128, ge=1)
    fused_kernels: bool | None = Field(
        None, description="fused RoPE, SwiGLU and cross-entropy without TransformerEngine; default: on GPUs")
    fused_linear_ce: bool | Literal["auto"] = Field(
        "auto", description="output layer + cross-entropy fused in token chunks (no [tokens x vocab] logits); auto: "
        "nd-adapter's kernel wherever it applies (the native engine, a token-level loss), said at run start")
    fused_linear_ce_chunk: Int | None = Field(
        None, ge=16, description="tokens per chunk of the fused linear CE (then nd-adapter's kernel, also at tp = 1); "
        "unset: true takes Liger's kernel at tp = 1 on GPUs, else ours at ~1k tokens per chunk")
    compile: bool | Literal["auto", "if_possible"] = Field(
        "auto", description="torch.compile each transformer layer: true (ZeRO-3: native engine), auto (where "
        "measured faster: config/load.py), if_possible (Axolotl's torch_compile: true: where the layout lets it)")
    # precision: fp8 only (adapter/kernels/fp8.py): the fp8 operands' scaling (torchao's recipes), the fp8 linears
    fp8_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    fp8_linears: tuple[Literal["qkv", "proj", "fc1", "fc2"], ...] = Field(("fc1", "fc2"), min_length=1)
    unfrozen_parameters: list[str] | None = Field(
        None, description="train only the parameters whose HF names these regexes match (Axolotl's "
        "unfrozen_parameters; `[start:end]` rows on embed_tokens / lm_head); the rest frozen: no gradients, no "
        "optimizer states (adapter/models/freeze.py). Unset: every parameter", min_length=1)
    freeze_mm_modules: bool = Field(False, description="an image-text model's vision / audio towers and projector "
                                    "frozen (Axolotl's freeze_mm_modules); else they train as every weight does")
    num_labels: Int | None = Field(None, ge=2, description="a token-classification head with this many classes in "
                                   "place of the LM head, trained on each labelled token's class (a process reward "
                                   "model: Axolotl's process_reward_model, TRL's PRMTrainer); unset: the LM head")
    moe_grouped_gemm: bool = Field(
        True, description="mixture of experts: each expert linear as one grouped GEMM over the local experts "
        "(torch._grouped_mm: bf16 on Hopper or newer, and on CPU; adapter/modeling/moe.py), where it applies; false: "
        "Megatron's per-expert loop (SequentialMLP). Same weights and checkpoints either way")
    output_router_logits: bool | None = Field(
        None, description="mixture of experts: add the load-balancing loss (router_aux_loss_coef x transformers' "
        "load_balancing_loss_func) to every micro-batch's loss, or not, whatever config.json says (Axolotl's "
        "model_config: {output_router_logits: ...}); unset: as config.json says")
    mean_resizing_embeddings: bool = Field(False, description="data.tokens' new rows from the old rows' mean and "
                                           "covariance; false: normal(0, initializer_range) (adapter/models/vocab.py)")
    compile_memory_budget: Float | None = Field(
        None, gt=0, le=1, description="compiled layers keep this fraction of their activations and recompute the "
        "rest in backward (AOTAutograd's activation_memory_budget; 1 or unset: keep all). One H200, 1B shape: 0.5 "
        "cut activations from 11.7 to 6.2 GiB at -9% tokens/s (docs/BENCHMARKS.md)")

    @model_validator(mode="after")
    def _budget_needs_compile(self) -> ModelSection:
        if self.compile_memory_budget is not None and not self.compile:
            raise ValueError("model.compile_memory_budget applies to compiled layers only: set model.compile: true "
                             "or remove it")
        if self.fused_linear_ce_chunk is not None and self.fused_linear_ce is False:
            raise ValueError("model.fused_linear_ce_chunk applies to the fused linear CE only: set "
                             "model.fused_linear_ce: true or remove it")
        return self


class BatchSection(_Strict):
    micro_batch_size: Int = Field(1, ge=1)
    gradient_accumulation_steps: Int | None = Field(None, ge=1)
    global_batch_size: Int | None = Field(None, ge=1)


class OptimizerSection(_Strict):
    lr: Float = Field(3e-4, gt=0)
    min_lr: Float = Field(0.0, ge=0)
    weight_decay: Float = Field(0.0, ge=0)
    betas: tuple[Float, Float] = (0.9, 0.95)
    eps: Float = Field(1e-8, gt=0)
    schedule: Literal["cosine", "constant", "linear", "cosine_quadratic_warmup"] = "cosine"
    # Schedule length: `max_steps` wins; else `num_epochs` over the training set (known at run start, see
    # adapter/train/schedule.py); neither means DEFAULT_MAX_STEPS. Warm-up: `warmup_steps` or `warmup_ratio`;
    # `warmup_steps` below 1 is a fraction of the run, rounded up, as transformers' TrainingArguments reads it.
    warmup_steps: Int | StrictFloat | None = Field(None, ge=0)
    warmup_ratio: Float | None = Field(None, ge=0, lt=1)
    max_steps: Int | None = Field(None, ge=1)
    num_epochs: Float | None = Field(None, gt=0)
    clip_grad: Float = Field(1.0, ge=0)
    # flat: nd-adapter's AdamW (adapter/train/optim.py) where nothing is sharded; deepspeed: ZeRO's; auto: flat if so
    impl: Literal["auto", "flat", "deepspeed"] = "auto"
    # AdamW's moments: fp32 (8 bytes of state per parameter), 8-bit (2: bitsandbytes' AdamW8bit) or 4-bit (1.03:
    # torchao's AdamW4bit), on every layout (adapter/train/optim.py; Axolotl's names: config/axolotl_train.py)
    name: Literal["adamw", "adamw_8bit", "adamw_4bit"] = "adamw"
    # What the optimizer keeps of a 16-bit weight: fp32 master and moments (12 bytes per trained parameter, DeepSpeed's
    # and Megatron's mixed precision), or bf16 (the weight its own master, bf16 moments: torch's AdamW on a bf16
    # model, as transformers and Axolotl train; updates under half a bf16 step are lost); bf16 on the flat AdamW only.
    state_dtype: Literal["fp32", "bf16"] = "fp32"

    @field_validator("warmup_steps")
    @classmethod
    def _steps_or_fraction(cls, v: int | float | None) -> int | float | None:
        if isinstance(v, float):
            if v.is_integer():
                return int(v)
            if not 0 < v < 1:
                raise ValueError("a whole number of steps, or a fraction of the run below 1 (0.1: the first tenth)")
        return v

    @model_validator(mode="after")
    def _one_warmup(self) -> OptimizerSection:
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            raise ValueError("give optimizer.warmup_steps or optimizer.warmup_ratio, not both")
        if self.state_dtype == "bf16" and self.name != "adamw":
            raise ValueError(f"optimizer.state_dtype: bf16 keeps bf16 moments, optimizer.name: {self.name} "
                             f"{self.name[-4]}-bit ones: choose one. Fix: keep one of the two settings")
        return self


def _check_cadence(value: float | None, key: str) -> None:
    """A cadence: a whole number of steps, or a fraction in (0, 1) of the run's total steps (Axolotl, HF)."""
    if value is None or isinstance(value, int) or 0 < value < 1:
        return
    raise ValueError(f"{key} must be a whole number of steps or a fraction in (0, 1) of the total steps")


class CheckpointSection(_Strict):
    dir: PathStr | None = None
    save_every: Int | Float = Field(0, ge=0, description="steps between saves (or a fraction of the total "
                                          "steps); 0 saves only at the end")
    saves_per_epoch: Int | None = Field(None, ge=1)
    keep_last: Int = Field(2, ge=1)
    load_best: bool = Field(False, description="at the end, reload the saved checkpoint with the lowest eval loss "
                            "and export that (HF's load_best_model_at_end); it is never pruned by keep_last")
    export_hf: PathStr | None = Field(None, description="write an HF checkpoint here at the end (files are replaced, "
                                  "anything else in the directory is kept)")
    auto_resume: bool = Field(False, description="continue from the newest checkpoint in dir when it holds one, as "
                              "--resume does (Axolotl's auto_resume_from_checkpoints); a fresh start otherwise")
    exit_signals: list[str] = Field(["SIGTERM", "SIGUSR1"], description="signals that end the run at the end of the "
                                    "current step with a checkpoint and exit status 75 (requeue); [] for none")

    @field_validator("exit_signals")
    @classmethod
    def _signals(cls, value: list[str]) -> list[str]:
        """Spelled once, as the signal module names them (TERM, sigterm -> SIGTERM)."""
        names = []
        for name in value:
            n = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
            if n not in signal.Signals.__members__ or n in ("SIGKILL", "SIGSTOP"):
                raise ValueError(f"{name!r} is not a signal a process can handle (use e.g. "
                                 "SIGTERM, SIGUSR1, SIGUSR2)")
            names.append(n)
        return names

    @model_validator(mode="after")
    def _cadence(self) -> CheckpointSection:
        _check_cadence(self.save_every, "checkpoint.save_every")

        if self.saves_per_epoch is not None and self.save_every:
            raise ValueError("give checkpoint.save_every or checkpoint.saves_per_epoch, not both")
        return self


class EvalSection(_Strict):
    """Loss over the whole eval set (data side: `val_set_size` or `test_datasets`), same masking and normalisation as
    training. Neither key: one evaluation at the end when there is an eval set."""
    every: Int | Float | None = Field(None, gt=0, description="steps between evaluations, or a fraction")
    per_epoch: Int | None = Field(None, ge=0, description="evaluations per epoch; 0: none at all (Axolotl)")
    early_stopping_patience: Int | None = Field(None, ge=1, description="stop when this many evaluations in "
                                                      "a row have not lowered the eval loss (HF's EarlyStopping)")

    @model_validator(mode="after")
    def _cadence(self) -> EvalSection:
        _check_cadence(self.every, "eval.every")
        if self.every is not None and self.per_epoch is not None:
            raise ValueError("give eval.every or eval.per_epoch, not both")
        return self


# DeepSpeed config keys whose value is a section (a mapping) of their own
DS_SECTIONS = {"zero_optimization", "bf16", "fp16", "optimizer", "scheduler", "activation_checkpointing",
               "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comms_logger", "aio", "timers", "checkpoint",
               "data_efficiency", "compression_training", "elasticity", "autotuning", "torch_autocast"}


class DeepSpeedSection(_Strict):
    # 3 shards weights, gradients and optimizer states (FSDP FULL_SHARD); 2 keeps the 16-bit weights whole (FSDP2
    # reshard_after_forward=False: no gathers), dp_replicate > 1 needs 3; nothing to shard runs stage 1 either way
    zero_stage: Literal[2, 3] = 3
    # How dp_replicate maps onto DeepSpeed: exact HSDP (shard over dp_shard×cp, average over replicas) or ZeRO++ hpZ.
    replicate_mode: Literal["hsdp", "hpz"] = "hsdp"
    reduce_bucket_size: Int = Field(500_000_000, ge=1)
    prefetch_bucket_size: Int = Field(500_000_000, ge=1)
    param_persistence_threshold: Int = Field(1_000_000, ge=0)
    # ZeRO-3's gather unit: a whole transformer layer (FSDP's per-block wrapping: one fetch, release and gradient
    # reduce per layer) or every module (DeepSpeed's default: ~10 per layer, each paying Python hooks).
    gather_granularity: Literal["layer", "module"] = "layer"
    overlap_comm: bool = True
    overrides: dict[str, Any] = Field(default_factory=dict, description="merged into the generated DeepSpeed JSON")
    stage_from: str | None = Field(None, description="an Axolotl file's `deepspeed:` JSON (its path, or 'deepspeed:' "
                                   "for a mapping) that zero_stage came from: where a hint says to change it")

    @field_validator("overrides")
    @classmethod
    def _sections(cls, value: dict[str, Any]) -> dict[str, Any]:
        """DeepSpeed's sections are mappings; the flags nd-adapter reads too are read as DeepSpeed's pydantic config
        reads them ("false" is false), and handed on as booleans."""
        for key in DS_SECTIONS & value.keys():
            if not isinstance(value[key], dict):
                raise ValueError(f"{key}={value[key]!r}: DeepSpeed reads {key} as a section (a mapping). Fix: give "
                                 "its keys below it, or remove it")
        value = {**value}
        for section, key in (("bf16", "enabled"), ("fp16", "enabled"), ("bf16", "check_grad_overflow")):
            flag = value.get(section, {}).get(key)
            if flag is not None and flag != "auto":
                if lax_bool(flag) is None:
                    raise ValueError(f"{section}.{key}={flag!r}: not a boolean. Fix: write true or false")
                value[section] = {**value[section], key: lax_bool(flag)}
        return value


class LoggingSection(_Strict):
    every: Int = Field(1, ge=1)
    tensorboard: PathStr | None = None
    wandb_project: str | None = None
    wandb_name: str | None = Field(None, description="the W&B run's name (Axolotl's wandb_name)")
    wandb_entity: str | None = Field(None, description="W&B team or user (Axolotl's wandb_entity)")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode (Axolotl's wandb_mode); default: W&B's own ($WANDB_MODE)")
    profile_steps: tuple[Int, Int] | None = Field(
        None, description="[first, last] step (inclusive) to record with the torch profiler")
    profile_dir: PathStr = Field("profile", description="where profiler traces and op tables go")
    profile_ranks: list[Int] = Field(default_factory=lambda: [0], description="global ranks to profile")

    @model_validator(mode="after")
    def _profile_window(self) -> LoggingSection:
        if self.profile_steps and not 1 <= self.profile_steps[0] <= self.profile_steps[1]:
            raise ValueError("logging.profile_steps must be [first, last] with 1 <= first <= last")
        return self


class HardwareSection(_Strict):
    nodes: Size = Field(1, ge=1)
    gpus_per_node: Size | None = Field(None, ge=1)
    gpu: str = "h100-80gb"
    # `plan`'s step-time model: a shipped profile (h100, h200, a100) or a JSON from `nd-adapter calibrate`;
    # unset = the profile of `gpu`. The two bandwidths (GB/s, nccl-tests' bus bandwidth) override the profile's.
    profile: PathStr | None = Field(None, description="hardware profile: h100, h200, a100 or a calibrate JSON path")
    intra_node_gb_per_s: Float | None = Field(None, gt=0, description="NCCL bus bandwidth inside a node (NVLink)")
    inter_node_gb_per_s: Float | None = Field(None, gt=0, description="network bandwidth per GPU between nodes")


class LoraSection(_Strict):
    """Train LoRA adapters on a frozen base instead of every weight (Axolotl's `adapter: lora|qlora` and `lora_*`
    keys; PEFT's semantics: adapter/models/lora.py). Ranges are checked there, naming the key as the file spells it."""
    r: Int = Field(8, description="adapter rank (lora_r); PEFT's defaults: r 8, alpha 8")
    alpha: Float = Field(8.0, description="scale numerator: s = alpha / r, or alpha / sqrt(r) with rslora")
    dropout: Float = Field(0.0, description="dropout on the adapters' input (lora_dropout)")
    target_modules: list[str] | str | None = Field(
        None, description="HF linear names (q_proj, ..., down_proj), a regex over module names, or 'all-linear'; "
        "unset: PEFT's default (q_proj, v_proj)")
    target_linear: bool = Field(False, description="every linear of the layers (lora_target_linear)")
    target_parameters: list[str] | None = Field(None, description="PEFT's target_parameters, e.g. experts.gate_up_proj "
                                                "(Axolotl's lora_target_parameters; the transformers engine)")
    modules_to_save: list[str] = Field(default_factory=list, description="embed_tokens / lm_head, trained in full")
    layers: list[Int] | None = Field(None, description="only these layer indices (peft_layers_to_transform)")
    rslora: bool = Field(False, description="rank-stabilised scale alpha / sqrt(r) (peft_use_rslora)")
    use_dora: bool = Field(False, description="DoRA: PEFT's weight-decomposed LoRA, a trained magnitude per output "
                           "row of each adapted weight (peft_use_dora; the transformers engine)")
    rank_pattern: dict[str, Int] | None = Field(None, description="per-module ranks, PEFT's rank_pattern {module "
                                               "name or regex: r} (lora_rank_pattern; the transformers engine)")
    alpha_pattern: dict[str, Float] | None = Field(None, description="per-module alphas, PEFT's alpha_pattern "
                                                   "(lora_alpha_pattern; the transformers engine)")
    trainable_token_indices: list[Int] | dict[str, list[Int]] | None = Field(
        None, description="token rows of embed_tokens trained beside the adapters (a list), or per embedding layer "
                          "(a dict): PEFT's trainable_token_indices (peft_trainable_token_indices; the transformers "
                          "engine)")
    init_weights: Literal["default", "gaussian"] = Field(
        "default", description="PEFT's init_lora_weights: default (A Kaiming-uniform, B zero) or gaussian (A normal "
                               "with std 1/r, B zero; peft_init_lora_weights; gaussian on the transformers engine)")
    plus_lr_ratio: Float | None = Field(None, gt=0, description="LoRA+: each B (and each 1-D trained tensor) at lr × "
                                        "this, as PEFT's create_loraplus_optimizer groups them (loraplus_lr_ratio)")
    plus_lr_embedding: Float = Field(1e-6, ge=0, description="LoRA+: the learning rate of LoRA adapters on embedding "
                                     "layers (loraplus_lr_embedding; PEFT's and Axolotl's default 1e-6)")
    init_from: PathStr | None = Field(None, description="a PEFT adapter directory to start from (lora_model_dir)")
    quantize_base: Literal["nf4", "int8"] | None = Field(
        None, description="the frozen base's decoder linears quantised: nf4 (QLoRA, Axolotl's load_in_4bit) or int8 "
                          "(load_in_8bit); null keeps them 16-bit")
    quantize_experts: bool = Field(False, description="a mixture's 3-D expert weights quantised too, in the base's "
                                   "format, as Axolotl's quantize_moe_experts does it")


class RunConfig(RLFields, QATFields, _Strict):
    model: ModelSection
    lora: LoraSection | None = Field(None, description="LoRA adapters on a frozen base; unset: every weight trains")
    parallelism: ParallelismConfig = ParallelismConfig()
    batch: BatchSection = BatchSection()
    seq_len: Int = Field(2048, ge=1)
    # fp8: bf16 training, model.fp8_linears' matmuls in fp8 (adapter/kernels/fp8.py; tp = 1, CC 8.9+ or CPU emulated)
    precision: Literal["bf16", "fp16", "fp32", "fp8"] = "bf16"
    sequence_parallel: bool | None = Field(None, description="Megatron sequence parallelism; default: on when tp > 1")
    recompute: Literal["none", "selective", "full"] = "none"
    # ranks wait in a collective while rank 0 prepares data or converts weights (ddp_timeout; DeepSpeed: 10 min)
    dist_timeout_s: Int = Field(1800, ge=1, description="process-group timeout in seconds (ddp_timeout)")
    optimizer: OptimizerSection = OptimizerSection()
    data: DataSection = DataSection()
    checkpoint: CheckpointSection = CheckpointSection()
    eval: EvalSection = EvalSection()
    deepspeed: DeepSpeedSection = DeepSpeedSection()
    logging: LoggingSection = LoggingSection()
    hardware: HardwareSection = HardwareSection()
    seed: Int = 1234
    source: str = Field("native", description="which dialect the file was written in")
    notes: tuple[str, ...] = Field((), description="what the dialect mapping must tell the user at run start "
                                   "(ignored keys, mapped keys); printed once, by global rank 0 (and by `plan`)")
    compile_auto: bool = Field(False, description="set by the loader: model.compile came from auto")

    @model_validator(mode="after")
    def _lr_order(self) -> RunConfig:
        if self.optimizer.min_lr > self.optimizer.lr:
            raise ValueError("optimizer.min_lr must not exceed optimizer.lr")
        if self.optimizer.state_dtype == "bf16" and self.param_precision != "bf16":
            raise ValueError(f"optimizer.state_dtype: bf16 applies to bf16 weights, and precision is "
                             f"{self.precision}: set precision: bf16, or optimizer.state_dtype: fp32")
        return self

    @property
    def world_size(self) -> int:
        return self.parallelism.world_size

    @property
    def dp_size(self) -> int:
        return self.parallelism.dp_replicate_size * (self.parallelism.dp_shard_size or 1)

    @property
    def document_attention(self) -> bool:
        """Attention confined to each example of a packed sample: asked for, or implied by packed SFT data (train or
        eval; harmless on unpacked samples, whose one example comes before its padding) or padding-free pairs."""
        d, pairs = self.data, self.padding_free_pairs()
        return d.document_mask or bool(d.datasets and (d.sample_packing or d.eval_sample_packing)) or pairs

    @property
    def steady_lengths(self) -> bool:
        """Whether every micro-batch has one length: packed (or synthetic, or streamed pretraining) SFT. Preference
        micro-batches and unpacked SFT ones are cut to their longest sequence (or run as a stream of their real
        tokens), a new length nearly every step: compiled layers then take the length as a symbol
        (adapter/modeling/compile.py). So does an unpacked eval beside packed training (`eval_sample_packing: false`):
        its batches would otherwise recompile the static graphs at each new length."""
        d = self.data
        if self.objective != "sft" or (d.datasets and not d.sample_packing):
            return False
        evaluated = bool(d.test_datasets or d.val_set_size)
        return not (evaluated and d.eval_sample_packing is False)

    @property
    def param_precision(self) -> str:
        """The weights' and activations' precision: fp8 runs keep bf16 everywhere outside the fp8 matmuls."""
        return "bf16" if self.precision == "fp8" else self.precision

    @property
    def use_sequence_parallel(self) -> bool:
        return self.parallelism.tp_size > 1 if self.sequence_parallel is None else self.sequence_parallel

    @property
    def grad_accum(self) -> int:
        return self.batch.gradient_accumulation_steps or 1

    @property
    def global_batch(self) -> int:
        return self.batch.micro_batch_size * self.grad_accum * self.dp_size
