"""`nd-adapter plan --search`: every valid layout for a world, ranked by predicted tokens/s/GPU.

A layout is the four sizes (dp_replicate × dp_shard × cp × tp = world; for a mixture of experts also ep over
dp_shard × cp), the ZeRO stage (2 or 3; 1 where nothing is
sharded), hsdp or hpz when there are replicas, recompute, the micro-batch (with the gradient accumulation that
keeps the config's global batch), sequence parallelism (tp > 1) and compiled layers. Validity is the project's
own: models/checks (tp against the heads, seq against cp and SP), deepspeed_config.zero_stage's refusals; a
refused layout is counted under its one-line reason, never ranked. Layouts that do not fit in memory are ranked
after those that do and marked, not hidden. `--set KEY=VALUE` on one of SEARCH_KEYS pins that part.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from adapter.config import RunConfig
from adapter.errors import UserError, bad
from adapter.models import source
from adapter.models.arch import ModelArch
from adapter.models.resolved import resolve_run
from adapter.parallel.layout import Layout
from adapter.plan import hardware, memory, timing, traffic
from adapter.plan.build import gpu_capacity
from adapter.plan.hardware import Profile

SCHEMA_VERSION = 2  # 2: rows carry ep (expert parallelism)
SIZES = ("dp_replicate_size", "dp_shard_size", "cp_size", "tp_size")
SEARCH_KEYS = (*(f"parallelism.{k}" for k in SIZES), "parallelism.ep_size", "deepspeed.zero_stage",
               "deepspeed.replicate_mode", "recompute", "batch.micro_batch_size", "batch.gradient_accumulation_steps",
               "sequence_parallel", "model.compile")
RECOMPUTE = ("none", "selective", "full")
# where a candidate's weights come from does not change its memory or speed: not looked up once per candidate
RANDOM = source.WeightsSource("random", "", reason="plan --search")


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SearchRow(_Doc):
    rank: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    zero_stage: int
    replicate_mode: str | None
    recompute: str
    micro_batch_size: int
    gradient_accumulation_steps: int
    sequence_parallel: bool
    compiled_layers: bool
    tokens_per_s_per_gpu: float
    step_time_s: float
    mfu: float
    breakdown: dict[str, float]
    bottleneck: str
    peak_memory: int
    peak_phase: str
    fits: bool
    sets: list[str]


class Search(_Doc):
    schema_version: int
    config_path: str | None
    model: str
    world: int
    nodes: int
    gpus_per_node: int
    gpu: str
    capacity: int
    profile: str
    global_batch_size: int
    seq_len: int
    tokens_per_step: int
    pinned: dict[str, Any]
    searched: list[str]
    candidates: int
    ranked: int
    fitting: int
    config_rank: int | None
    skipped: dict[str, int]
    rows: list[SearchRow]
    warnings: list[str]


@dataclass(frozen=True)
class Candidate:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    zero_stage: int            # the requested stage; the row reports the effective one
    replicate_mode: str
    recompute: str
    micro: int
    ga: int
    sp: bool | None            # None at tp = 1 (no sequence parallelism to choose)
    compile: bool
    ep: int = 1                # expert-parallel ranks (mixtures of experts), over dp_shard × cp

    def sets(self) -> list[str]:
        out = [f"parallelism.{k}={v}" for k, v in zip(SIZES, (self.dp_replicate, self.dp_shard, self.cp, self.tp))]
        if self.ep > 1:
            out.append(f"parallelism.ep_size={self.ep}")
        out += [f"deepspeed.zero_stage={self.zero_stage}", f"recompute={self.recompute}",
                f"batch.micro_batch_size={self.micro}", f"batch.gradient_accumulation_steps={self.ga}",
                f"model.compile={str(self.compile).lower()}"]
        if self.dp_replicate > 1:
            out.append(f"deepspeed.replicate_mode={self.replicate_mode}")
        if self.sp is not None:
            out.append(f"sequence_parallel={str(self.sp).lower()}")
        return out


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(world: int) -> list[tuple[int, int, int, int]]:
    """Every (dp_replicate, dp_shard, cp, tp) whose product is `world`."""
    out = []
    for r in divisors(world):
        for s in divisors(world // r):
            for c in divisors(world // (r * s)):
                out.append((r, s, c, world // (r * s * c)))
    return out


def _allowed(pins: dict[str, Any], key: str, values: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(v for v in values if v == pins[key]) if key in pins else values


def enumerate_candidates(world: int, global_batch: int, pins: dict[str, Any],
                         experts: int = 0) -> tuple[list[Candidate], Counter[str]]:
    """The search space before the model's own checks: every combination the knobs allow, with redundant ones
    (a ZeRO stage where nothing is sharded, hsdp/hpz without replicas, SP at tp = 1) counted once. `experts`: a
    mixture of experts' count; every expert-parallel size dividing it and dp_shard × cp is a candidate too."""
    skipped: Counter[str] = Counter()
    out = []
    for r, s, c, t in meshes(world):
        mesh = dict(zip(SIZES, (r, s, c, t)))
        if any(f"parallelism.{k}" in pins and pins[f"parallelism.{k}"] != v for k, v in mesh.items()):
            continue
        dp = r * s
        if global_batch % dp:
            skipped[f"global batch {global_batch} not divisible by dp_replicate×dp_shard"] += 1
            continue
        sharded = s * c > 1 or r > 1
        stages = _allowed(pins, "deepspeed.zero_stage", (2, 3)) if sharded else (pins.get("deepspeed.zero_stage", 3),)
        modes = _allowed(pins, "deepspeed.replicate_mode", ("hsdp", "hpz")) if r > 1 else ("hsdp",)
        sps = _allowed(pins, "sequence_parallel", (True, False)) if t > 1 else (None,)
        micros = _allowed(pins, "batch.micro_batch_size", tuple(divisors(global_batch // dp)))
        eps = _allowed(pins, "parallelism.ep_size", tuple(e for e in divisors(s * c) if experts and experts % e == 0)
                       or (1,))
        for m, stage, mode, rc, sp, comp, e in product(micros, stages, modes, _allowed(pins, "recompute", RECOMPUTE),
                                                       sps, _allowed(pins, "model.compile", (False, True)), eps):
            ga = global_batch // (dp * m)
            if "batch.gradient_accumulation_steps" in pins and pins["batch.gradient_accumulation_steps"] != ga:
                continue
            out.append(Candidate(r, s, c, t, stage, mode, rc, m, ga, sp, comp, e))
    return out, skipped


def candidate_config(base: RunConfig, cand: Candidate, nodes: int, gpus_per_node: int | None) -> RunConfig:
    """`base` with the candidate's knobs; model_copy skips validation, the checks below are the project's own."""
    return base.model_copy(update={
        "parallelism": base.parallelism.model_copy(update={**dict(zip(SIZES, (cand.dp_replicate, cand.dp_shard,
                                                                              cand.cp, cand.tp))),
                                                           "ep_size": cand.ep}),
        "batch": base.batch.model_copy(update={"micro_batch_size": cand.micro, "gradient_accumulation_steps": cand.ga,
                                               "global_batch_size": None}),
        "deepspeed": base.deepspeed.model_copy(update={"zero_stage": cand.zero_stage,
                                                       "replicate_mode": cand.replicate_mode}),
        "model": base.model.model_copy(update={"compile": cand.compile}),
        "hardware": base.hardware.model_copy(update={"nodes": nodes, "gpus_per_node": gpus_per_node}),
        "recompute": cand.recompute, "sequence_parallel": cand.sp, "compile_auto": False})  # the candidate's own


def evaluate(base: RunConfig, arch: ModelArch, cand: Candidate, layout: Layout, prof: Profile, capacity: int,
             nodes: int) -> SearchRow:
    """One candidate's row; raises UserError when the project refuses the layout."""
    run = resolve_run(candidate_config(base, cand, nodes, layout.gpus_per_node), arch=arch, weights=RANDOM,
                      layout=layout, gpu=True)
    stage = run.zero_stage
    mem = memory.estimate(run, partition_size=run.partition_size, gpu_capacity=capacity, stage=stage)
    st = timing.predict(run, prof, stage=stage, rows=traffic.estimate(run))
    return SearchRow(rank=0, dp_replicate=cand.dp_replicate, dp_shard=cand.dp_shard, cp=cand.cp, tp=cand.tp, ep=cand.ep,
                     zero_stage=stage, replicate_mode=cand.replicate_mode if cand.dp_replicate > 1 else None,
                     recompute=cand.recompute, micro_batch_size=cand.micro, gradient_accumulation_steps=cand.ga,
                     sequence_parallel=bool(cand.sp), compiled_layers=cand.compile,
                     tokens_per_s_per_gpu=st.tokens_per_s_per_gpu, step_time_s=st.step_time_s, mfu=st.mfu,
                     breakdown=st.breakdown, bottleneck=st.bottleneck, peak_memory=mem.peak,
                     peak_phase=mem.peak_phase, fits=mem.fits, sets=cand.sets())


def search(base: RunConfig, arch: ModelArch, prof: Profile, *, nodes: int, gpus_per_node: int, capacity: int,
           pins: dict[str, Any], config_path: str | None = None, warnings: list[str] | None = None) -> Search:
    world = nodes * gpus_per_node
    G = base.global_batch
    cands, skipped = enumerate_candidates(world, G, pins, arch.num_experts or arch.ep_experts)  # 0: no experts
    total = len(cands) + sum(skipped.values())
    layouts: dict[tuple[int, int, int, int, int], Layout] = {}
    rows: list[SearchRow] = []
    for cand in cands:
        key = (cand.dp_replicate, cand.dp_shard, cand.cp, cand.tp, cand.ep)
        if key not in layouts:
            layouts[key] = Layout(*key[:4], gpus_per_node=gpus_per_node, ep=cand.ep)
        try:
            rows.append(evaluate(base, arch, cand, layouts[key], prof, capacity, nodes))
        except UserError as e:
            skipped[str(e)] += 1
    # ties (e.g. compiled layers where they change nothing): the smaller footprint, then the plainer setting
    rows.sort(key=lambda r: (not r.fits, -r.tokens_per_s_per_gpu, r.peak_memory, r.compiled_layers,
                             RECOMPUTE.index(r.recompute)))
    for i, r in enumerate(rows, 1):
        r.rank = i
    own = (base.parallelism.dp_replicate_size, base.parallelism.dp_shard_size, base.parallelism.cp_size,
           base.parallelism.tp_size, base.parallelism.ep_size, base.recompute, base.batch.micro_batch_size,
           base.model.compile)
    config_rank = next((r.rank for r in rows if (r.dp_replicate, r.dp_shard, r.cp, r.tp, r.ep, r.recompute,
                                                 r.micro_batch_size, r.compiled_layers) == own
                        and (r.sequence_parallel == base.use_sequence_parallel or r.tp == 1)
                        and (r.zero_stage == base.deepspeed.zero_stage or r.zero_stage == 1)
                        and r.replicate_mode in (None, base.deepspeed.replicate_mode)), None)
    searched = [k for k in SEARCH_KEYS if k not in pins and k != "batch.gradient_accumulation_steps"]
    return Search(schema_version=SCHEMA_VERSION, config_path=config_path, model=arch.architecture, world=world,
                  nodes=nodes, gpus_per_node=gpus_per_node, gpu=base.hardware.gpu, capacity=capacity,
                  profile=prof.source_path or prof.name, global_batch_size=G, seq_len=base.seq_len,
                  tokens_per_step=G * base.seq_len, pinned=pins, searched=searched,
                  candidates=total,
                  ranked=len(rows), fitting=sum(r.fits for r in rows), config_rank=config_rank,
                  skipped=dict(skipped.most_common()),
                  rows=rows, warnings=warnings or [])


PIN_VALUES = {"deepspeed.zero_stage": (2, 3), "deepspeed.replicate_mode": ("hsdp", "hpz"), "recompute": RECOMPUTE,
              "sequence_parallel": (True, False), "model.compile": (True, False)}


def check_pins(pins: dict[str, Any]) -> None:
    for key, value in pins.items():
        if key in PIN_VALUES:
            if value not in PIN_VALUES[key] or isinstance(value, bool) != isinstance(PIN_VALUES[key][0], bool):
                raise bad(f"--set {key}", value, "not a value the search can pin",
                          f"use one of {', '.join(str(v).lower() for v in PIN_VALUES[key])}")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(f"--set {key}", value, "must be an integer ≥ 1", f"e.g. --set {key}=2")


def run(config_path: str, sets: dict[str, Any], flags: dict[str, Any], world: int | None,
        gpu_mem_gib: float | None = None) -> Search:
    """`plan --search`: load the config (its global batch is kept), then search the world the flags give. A
    config whose own layout is for another world is loaded as written and its batch carried over, said once."""
    pins = {k: v for k, v in sets.items() if k in SEARCH_KEYS}
    rest = {k: v for k, v in sets.items() if k not in SEARCH_KEYS}
    notes: list[str] = []
    try:
        cfg = source.load_config(config_path, overrides={**rest, **flags}, world_size=world)
    except UserError as first:
        own = {k: v for k, v in flags.items() if k not in ("hardware.nodes", "hardware.gpus_per_node")}
        try:
            cfg = source.load_config(config_path, overrides={**rest, **own})
        except UserError:
            raise first from None
        notes.append(f"the config's layout is for {cfg.world_size} GPUs; searching {world} at its global batch of "
                     f"{cfg.global_batch} sequences")
    gpn = flags.get("hardware.gpus_per_node") or cfg.hardware.gpus_per_node
    nodes = flags.get("hardware.nodes", 1 if "hardware.gpus_per_node" in flags else cfg.hardware.nodes)
    if gpn is None:                      # no placement given: every rank on one node, as plain `plan` assumes
        nodes, gpn = 1, cfg.world_size
    arch = source.arch_for(cfg)
    prof = hardware.resolve(cfg.hardware, Path(config_path).resolve().parent)
    if prof is None:
        raise bad("hardware.profile", None, f"no hardware profile for gpu {cfg.hardware.gpu!r}, so no step time to "
                  "rank by", f"set hardware.profile to one of {', '.join(hardware.shipped())} or a calibrate JSON")
    if cfg.precision == "fp32":
        raise bad("precision", "fp32", "the step-time model's rates are bf16/fp16", "search with precision: bf16")
    check_pins(pins)
    capacity = gpu_capacity(cfg.hardware.gpu, gpu_mem_gib)
    return search(cfg, arch, prof, nodes=nodes, gpus_per_node=gpn, capacity=capacity, pins=pins,
                  config_path=config_path, warnings=notes)
