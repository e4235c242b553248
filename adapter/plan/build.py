"""`nd-adapter plan`: everything a run will do, computed from the config and config.json alone (no GPU, no weights).

The plan is one pydantic document (`Plan`), so `--format json` has a schema (`Plan.model_json_schema()`, written
to docs/plan-schema.json) and the table view is just a rendering of the same object.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from adapter.config import RunConfig, setting, spell
from adapter.errors import bad
from adapter.models import counts, footprint, source
from adapter.models.announce import announce
from adapter.models.arch import ModelArch
from adapter.models.resolved import ResolvedRun
from adapter.parallel import deepspeed_config, mcore_call
from adapter.parallel.layout import GROUPS, ORDER, Layout
from adapter.plan import hardware, memory, timing, traffic

SCHEMA_VERSION = 2  # 2: notes, weights


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Mesh(_Doc):
    order: list[str]
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    world: int
    nodes: int
    gpus_per_node: int


class RankRow(_Doc):
    rank: int
    node: int
    local_rank: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int


class GroupInfo(_Doc):
    name: str
    axes: list[str]
    size: int
    count: int
    crosses_nodes: bool
    groups: list[list[int]]


class Megatron(_Doc):
    call: str
    kwargs: dict[str, Any]


class DeepSpeed(_Doc):
    replicate_mode: str
    partition_group: str
    partition_size: int
    explanation: str
    config: dict[str, Any]


class Batch(_Doc):
    micro_batch_size: int
    gradient_accumulation_steps: int
    data_parallel_size: int
    global_batch_size: int
    tokens_per_step: int


class Memory(_Doc):
    gpu: str
    recompute: str
    weights: int
    gradients: int
    optimizer: int
    gathered_params: int
    comm_buffers: int
    activations: int
    activations_no_recompute: int
    activations_full_recompute: int
    logits: int
    peak: int
    capacity: int
    partition_size: int
    runtime_reserve: int
    peak_phase: str
    fits: bool


class AttentionCost(_Doc):
    packed_documents: bool
    kernel: str
    doc_len: int               # tokens per document the FLOPs assume
    doc_len_source: str
    flops_per_gpu_step: float  # attention matmuls, fwd + bwd, causal (plan/memory.attention_flops)


class Traffic(_Doc):
    group: str
    size: int
    what: str
    bytes_per_step: int
    crosses_nodes: bool


class ModeCost(_Doc):
    peak_memory: int
    model_states: int
    intra_node_bytes: int
    inter_node_bytes: int


class Predicted(_Doc):
    """The step-time model's answer (adapter/plan/timing.py): seconds are per optimizer step, per GPU."""

    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    breakdown: dict[str, float]
    compute_detail: dict[str, float]
    bottleneck: str
    profile: str


class Weights(_Doc):
    """Which weights the run starts from (adapter/models/source.resolve) and what conversion is still to do."""
    source: str                # "checkpoint", "pretrained" or "random"
    model_dir: str
    checkpoint: str | None     # the converted directory the run loads (model.checkpoint or the cache entry)
    to_convert: bool           # pre-trained weights not converted yet: the run's start converts them once
    convert_bytes: int         # HF weight bytes the conversion reads (and about what it writes)
    description: str


class Launch(_Doc):
    deepspeed: str
    torchrun: str


class Plan(_Doc):
    schema_version: int
    config_path: str | None
    config_dialect: str
    notes: list[str]
    weights: Weights
    model: dict[str, Any]
    num_params: int
    mesh: Mesh
    ranks: list[RankRow]
    groups: list[GroupInfo]
    megatron: Megatron
    deepspeed: DeepSpeed
    batch: Batch
    seq_len: int
    precision: str
    sequence_parallel: bool
    attention: str
    attention_cost: AttentionCost
    compiled_layers: bool
    memory: Memory
    traffic: list[Traffic]
    traffic_totals: dict[str, int]
    predicted: Predicted | None
    replicate_modes: dict[str, ModeCost]
    launch: Launch
    warnings: list[str]


EXPLAIN = {
    "hsdp": "exact HSDP: ZeRO-3 shards params, grads and optimizer states over dp_shard×cp; after each backward the "
            "gradient partitions are averaged over dp_replicate (one all-reduce per step, inter-replica)",
    "hpz": "ZeRO++ hpZ: grads and optimizer states shard over all dp×cp ranks (less memory); a secondary copy of the "
           "params is partitioned inside each dp_shard×cp group so backward all-gathers stay local (more traffic "
           "per micro-batch over the full dp group)",
}


def _totals(rows: list[traffic.GroupTraffic]) -> dict[str, int]:
    inter = sum(r.bytes_per_step for r in rows if r.crosses_nodes)
    intra = sum(r.bytes_per_step for r in rows if not r.crosses_nodes)
    return {"intra_node": intra, "inter_node": inter}


def launch_commands(config_path: str | None, layout: Layout) -> Launch:
    cfg = config_path or "CONFIG.yaml"
    g, n = layout.gpus_per_node or layout.world, layout.nodes
    if n == 1:
        ds = f"deepspeed --num_gpus {g} launch/train.py --config {cfg}"
        tr = f"torchrun --standalone --nproc-per-node {g} launch/train.py --config {cfg}"
    else:
        ds = f"deepspeed --hostfile hostfile --num_nodes {n} --num_gpus {g} launch/train.py --config {cfg}"
        tr = (f"torchrun --nnodes {n} --nproc-per-node {g} --node-rank $NODE_RANK --rdzv-backend c10d "
              f"--rdzv-endpoint $MASTER_ADDR:29500 launch/train.py --config {cfg}")
    return Launch(deepspeed=ds, torchrun=tr)


def gpu_capacity(name: str, override_gib: float | None = None) -> int:
    if override_gib is not None:
        if override_gib <= 0:
            raise bad("--gpu-mem-gib", override_gib, "must be positive", "give the usable GPU memory in GiB")
        return int(override_gib * memory.GIB)
    if name not in memory.GPUS:
        raise bad("hardware.gpu", name, "unknown GPU", f"use one of {', '.join(memory.GPUS)} or pass --gpu-mem-gib")
    return memory.GPUS[name][0]


def attention_cost(cfg: RunConfig, arch: ModelArch) -> AttentionCost:
    """Packed documents attend within themselves (no s×s term): their FLOPs scale with the document length, which
    plan knows only for synthetic data; for real data seq_len is the upper bound (one document per sequence)."""
    p, packed = cfg.parallelism, cfg.document_attention
    if packed and cfg.data.synthetic:
        ell = min(cfg.data.synthetic_doc_len or cfg.seq_len, cfg.seq_len)
        source = "data.synthetic_doc_len" if cfg.data.synthetic_doc_len else "synthetic: one document per sequence"
    else:
        ell = cfg.seq_len
        source = ("seq_len (upper bound: plan does not read the data)" if packed else
                  "seq_len (upper bound: unpacked SFT micro-batches are cut after their last trained token)"
                  if cfg.data.datasets else "seq_len (no document mask)")
    if packed:
        kernel = "varlen over cu_seqlens (FlashAttention-2 on GPUs)" + (
            f", each document split over cp={p.cp_size} ({p.cp_comm_type})" if p.cp_size > 1 else "")
    else:
        kernel = {"sdpa": "SDPA causal", "local": "Megatron local (S×S scores)", "te": "TransformerEngine"}[
            cfg.model.attention] + (f", cp={p.cp_size} ({p.cp_comm_type})" if p.cp_size > 1 else "")
    flops = memory.attention_flops(arch, seq=cfg.seq_len, micro=cfg.batch.micro_batch_size, tp=p.tp_size,
                                   cp=p.cp_size, doc_len=ell) * cfg.grad_accum
    return AttentionCost(packed_documents=packed, kernel=kernel, doc_len=ell, doc_len_source=source,
                         flops_per_gpu_step=flops)


def _saves(cfg: RunConfig) -> int:
    """Checkpoints the run writes, as far as the config says (epochs: the data decides; assume the retention)."""
    c, total = cfg.checkpoint, cfg.optimizer.max_steps
    if total is None or not isinstance(c.save_every, int) or c.saves_per_epoch:
        return c.keep_last + 1
    return footprint.saves(total, c.save_every)


def preference_sequences(run: ResolvedRun) -> tuple[ResolvedRun, int]:
    """(the run as plan's memory and step-time models see it: a micro-batch of the sequences that train with
    gradients, both answers of each pair; the forward-only passes over them a step also runs: the reference with
    the LoRA adapters disabled (a full fine-tune's reference log-probabilities are computed once, before step 1),
    and KTO's KL rows through the policy without gradients)."""
    cfg = run.cfg
    if cfg.objective == "sft":
        return run, 0
    grad, forwards = cfg.preference_passes()  # adapter/config/schema_rl.py
    b = cfg.batch
    batch = b.model_copy(update={"micro_batch_size": b.micro_batch_size * grad,
                                 "global_batch_size": b.global_batch_size and b.global_batch_size * grad})
    return dataclasses.replace(run, cfg=cfg.model_copy(update={"batch": batch})), forwards


def _with_forwards(step: timing.StepTime, forwards: int, lora: bool) -> timing.StepTime:
    """`step` with `forwards` more forward-only passes over its micro-batches: a forward is a third of a full
    fine-tune's forward+backward compute and half of LoRA's (its frozen weights get no weight gradient)."""
    if not forwards:
        return step
    extra = forwards * step.breakdown["compute"] * (0.5 if lora else 1 / 3)
    new = step.step_time_s + extra
    scale = step.step_time_s / new
    return dataclasses.replace(step, step_time_s=new, tokens_per_s_per_gpu=step.tokens_per_s_per_gpu * scale,
                               mfu=step.mfu * scale, breakdown={**step.breakdown,
                                                                "compute": step.breakdown["compute"] + extra})


def build_plan(run: ResolvedRun, *, config_path: str | None = None, gpu_mem_gib: float | None = None) -> Plan:
    shown = run  # the config's own batch (pairs) in the plan's batch line
    run, forwards = preference_sequences(run)
    cfg, arch, layout = run.cfg, run.arch, run.layout
    warnings = list(run.warnings)
    capacity = gpu_capacity(cfg.hardware.gpu, gpu_mem_gib)

    def cost(mode: str) -> tuple[memory.MemoryEstimate, list[traffic.GroupTraffic]]:
        r = run if mode == cfg.deepspeed.replicate_mode else run.with_config(cfg.model_copy(update={
            "deepspeed": cfg.deepspeed.model_copy(update={"replicate_mode": mode})}))
        return (memory.estimate(r, partition_size=r.partition_size, gpu_capacity=capacity, stage=r.zero_stage),
                traffic.estimate(r))

    mem, rows = cost(cfg.deepspeed.replicate_mode)
    prof = hardware.resolve(cfg.hardware, Path(config_path).resolve().parent if config_path else None)
    predicted = None
    if prof is None:
        warnings.append(f"no hardware profile for gpu {cfg.hardware.gpu!r}: no step time predicted (set "
                        f"hardware.profile to one of {', '.join(hardware.shipped())} or a `nd-adapter calibrate` JSON)")
    elif cfg.precision == "fp32":
        warnings.append("no step time predicted for fp32: the step-time model's rates are bf16/fp16")
    else:
        if prof.gpu != cfg.hardware.gpu:
            warnings.append(f"step time from the {prof.name} profile, made for {prof.gpu}; memory is checked "
                            f"against hardware.gpu={cfg.hardware.gpu}")
        attn = attention_cost(cfg, arch)  # packed documents attend within themselves: pass their length
        step = timing.predict(run, prof, stage=run.zero_stage, rows=rows,
                              doc_len=attn.doc_len if attn.packed_documents else None)
        predicted = Predicted(**_with_forwards(step, forwards, run.peft is not None or run.lora is not None
                                               ).to_dict())
    modes = {}
    both = layout.dp_replicate > 1 and layout.ep == 1  # expert parallelism runs beside exact HSDP only
    for mode in ("hsdp", "hpz") if both else (cfg.deepspeed.replicate_mode,):
        m, r = cost(mode)
        t = _totals(r)
        modes[mode] = ModeCost(peak_memory=m.peak, model_states=m.weights + m.gradients + m.optimizer,
                               intra_node_bytes=t["intra_node"], inter_node_bytes=t["inter_node"])

    for name in ("tp", "cp"):
        if layout.size(name) > 1 and layout.crosses_nodes(name):
            warnings.append(f"{name} groups cross nodes (size {layout.size(name)} > gpus_per_node "
                            f"{layout.gpus_per_node}): {name.upper()} traffic is per layer and will be slow")
    z, stage = run.partition_size, run.zero_stage
    if stage == 3 and layout.dp_replicate == 1 and z > 1:
        z2 = memory.estimate(run, partition_size=z, gpu_capacity=capacity, stage=2)
        if z2.peak <= 0.8 * capacity:
            warnings.append(f"hint: whole 16-bit weights fit here (ZeRO-2 peak {z2.peak / memory.GIB:.1f} of "
                            f"{capacity / memory.GIB:.1f} GiB): {setting(cfg, 'deepspeed.zero_stage', 2)} skips "
                            "ZeRO-3's per-layer gathers (1.04-1.2x tokens/s at dp_shard=2 on 2xH200, "
                            "docs/BENCHMARKS.md)")
    if not mem.fits:
        sizes = f"{spell(cfg, 'parallelism.tp_size')}/{spell(cfg, 'parallelism.dp_shard_size')}"
        if mem.peak_phase == "optimizer_step":
            # 8-bit moments are not offered where 8/4-bit ones are already used, or refused (beside bf16 moments)
            eight = cfg.optimizer.name != "adamw" or cfg.optimizer.state_dtype == "bf16"
            fix = (f"the optimizer step peaks (model states and its gradient copies): shard them over more GPUs "
                   f"({sizes})" + ("" if eight else
                                   f", or keep 8-bit moments ({setting(cfg, 'optimizer.name', 'adamw_8bit')})"))
        else:
            fix = f"raise {sizes}, lower {spell(cfg, 'batch.micro_batch_size')}" + (
                "" if cfg.recompute == "full" else f", or set {setting(cfg, 'recompute', 'full')}")
        warnings.append(f"predicted peak {mem.peak / memory.GIB:.1f} GiB (+{100 * memory.MARGIN:.0f}% model margin) + "
                        f"{mem.runtime_reserve / memory.GIB:.1f} GiB runtime reserve exceeds the GPU's "
                        f"{capacity / memory.GIB:.1f} GiB: {fix}")
    if cfg.hardware.gpus_per_node is None:
        warnings.append("gpus_per_node not given: all ranks assumed on one node (pass --nodes/--gpus-per-node)")
    zgroup = "dp_shard_cp" if (cfg.deepspeed.replicate_mode == "hsdp" or layout.dp_replicate == 1) else "dp_cp"
    dp = layout.dp
    groups = [GroupInfo(name=n, axes=[a.value for a in axes], size=layout.size(n), count=len(layout.groups(n)),
                        crosses_nodes=layout.crosses_nodes(n), groups=[list(g) for g in layout.groups(n)])
              for n, axes in GROUPS.items()]
    if layout.ep > 1:  # laid over dp × cp (adapter/parallel/layout.py), not mesh axes of their own
        groups += [GroupInfo(name=n, axes=[what], size=layout.size(n), count=len(layout.groups(n)),
                             crosses_nodes=layout.crosses_nodes(n), groups=[list(g) for g in layout.groups(n)])
                   for n, what in (("ep", "ep within dp×cp"), ("expt_dp", "dp×cp / ep"),
                                   ("expt_dp_shard", "dp_shard×cp / ep (exact HSDP partitions experts there)"))
                   if n != "expt_dp_shard" or layout.dp_replicate > 1]
    w = run.weights
    if cfg.optimizer.max_steps is None and cfg.optimizer.num_epochs is not None:
        warnings.append(f"optimizer steps come from num_epochs={cfg.optimizer.num_epochs:g} and the training set's "
                        "size, known at run start (the run's first lines give the total and the warm-up)")
    return Plan(
        schema_version=SCHEMA_VERSION,
        config_path=config_path,
        config_dialect=cfg.source,
        notes=announce(run) + [line for line in [footprint.check_disk(run, stage=stage, saves=_saves(cfg),
                                                                      refuse=False)] if line],
        weights=Weights(source=w.kind, model_dir=w.model_dir, checkpoint=w.checkpoint, to_convert=w.to_convert,
                        convert_bytes=w.source_bytes if w.to_convert else 0,
                        description=source.describe(w, cfg.seed, arch.native, cfg.model.dequantize)),
        model=arch.to_dict(),
        num_params=counts.num_params(arch),
        mesh=Mesh(order=[a.value for a in ORDER], dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard,
                  cp=layout.cp, tp=layout.tp, world=layout.world, nodes=layout.nodes,
                  gpus_per_node=layout.gpus_per_node or layout.world),
        ranks=[RankRow(**r) for r in layout.rank_table()],
        groups=groups,
        megatron=Megatron(call=mcore_call.call_string(layout), kwargs=mcore_call.initialize_kwargs(layout)),
        deepspeed=DeepSpeed(replicate_mode=cfg.deepspeed.replicate_mode if layout.dp_replicate > 1 else "none",
                            partition_group=zgroup, partition_size=layout.size(zgroup),
                            explanation=EXPLAIN[cfg.deepspeed.replicate_mode] if layout.dp_replicate > 1 else
                            "ZeRO-3 shards params, grads and optimizer states over dp_shard×cp; gathers "
                            f"{'a whole layer' if cfg.deepspeed.gather_granularity == 'layer' else 'each module'} "
                            "at a time" if stage == 3 else
                            "ZeRO-2: whole 16-bit weights on every rank (no gathers); grads and "
                            "optimizer states sharded over dp_shard×cp"
                            if stage == 2 else
                            "nothing to shard (dp_shard×cp = 1): nd-adapter's flat AdamW (" + (
                                "bf16 weights as their own master, bf16 moments" if cfg.optimizer.state_dtype == "bf16"
                                else "fp32 master weights") + ", "
                            "one fused update per parameter group on GPUs, clipping across TP on the device) under "
                            "DeepSpeed's loop "
                            "at stage 0 (optimizer.impl)" if run.flat_optimizer else
                            "nothing to shard (dp_shard×cp = 1): ZeRO stage 1 over a group of one, which skips "
                            "ZeRO-3's gather hooks; gradient clipping across TP",
                            config=deepspeed_config.build(cfg, layout)),
        batch=Batch(micro_batch_size=shown.cfg.batch.micro_batch_size, gradient_accumulation_steps=cfg.grad_accum,
                    data_parallel_size=dp, global_batch_size=shown.cfg.global_batch,
                    tokens_per_step=cfg.global_batch * cfg.seq_len),  # every sequence (both answers of a pair)
        seq_len=cfg.seq_len,
        precision=cfg.precision,
        sequence_parallel=cfg.use_sequence_parallel and layout.tp > 1,
        attention=cfg.model.attention,
        attention_cost=attention_cost(cfg, arch),
        compiled_layers=bool(cfg.model.compile),  # "auto" is resolved by config.build; truthy as in plan/memory
        memory=Memory.model_validate({"gpu": cfg.hardware.gpu if gpu_mem_gib is None else f"{gpu_mem_gib} GiB",
                                      "recompute": cfg.recompute, **mem.to_dict()}),
        traffic=[Traffic(**r.to_dict()) for r in rows],
        traffic_totals=_totals(rows),
        predicted=predicted,
        replicate_modes=modes,
        launch=launch_commands(config_path, layout),
        warnings=warnings,
    )
