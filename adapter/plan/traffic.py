"""Bytes each GPU sends per optimizer step, per process group, with ring-algorithm costs.

all-gather / reduce-scatter of a full buffer of M bytes over n ranks: each rank sends M·(n−1)/n;
all-reduce: 2·M·(n−1)/n. A group that spans nodes is counted as inter-node traffic (its ring is bound by the
slowest link), the rest as intra-node.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from adapter.models.counts import expert_params
from adapter.models.footprint import held_and_trained, quantized_base
from adapter.models.resolved import ResolvedRun


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


@dataclass(frozen=True)
class GroupTraffic:
    group: str
    size: int
    what: str
    bytes_per_step: int
    crosses_nodes: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate(run: ResolvedRun) -> list[GroupTraffic]:
    cfg, arch, layout = run.cfg, run.arch, run.layout
    p = cfg.parallelism
    tp, cp, ga, L = layout.tp, layout.cp, cfg.grad_accum, arch.num_layers
    pb = 2 if cfg.param_precision in ("bf16", "fp16") else 4
    P, trained = held_and_trained(run, tp)  # gathers move every held parameter, reductions the trained
    P -= quantized_base(run, tp)[0]  # a 4/8-bit base is not ZeRO's: never gathered
    s, b, h = cfg.seq_len // cp, cfg.batch.micro_batch_size, arch.hidden_size
    rows: list[GroupTraffic] = []

    def add(group: str, what: str, nbytes: float) -> None:
        if nbytes > 0:
            rows.append(GroupTraffic(group, layout.size(group), what, int(nbytes), layout.crosses_nodes(group)))

    hsdp = cfg.deepspeed.replicate_mode == "hsdp" or layout.dp_replicate == 1
    zgroup = "dp_shard_cp" if hsdp else "dp_cp"
    z = layout.size(zgroup)
    ep = layout.ep
    experts = 0  # expert parallelism: a rank's experts are partitioned over the ranks holding the same experts
    if ep > 1:
        experts = expert_params(arch, tp)
        P, trained = P - experts, trained - experts
    gather, reduce = pb * P * _ring(z), pb * trained * _ring(z)
    if run.zero_stage == 2:
        add(zgroup, "ZeRO-2 grad reduce-scatter per micro-batch, updated-param all-gather once per step",
            reduce * (ga + 1))
    elif hsdp:
        add(zgroup, "ZeRO-3 param all-gather (fwd + bwd) and grad reduce-scatter, per micro-batch",
            (2 * gather + reduce) * ga)
        held = trained / z + (experts / ep) / layout.size("expt_dp_shard") if ep > 1 else trained / z
        add("dp_replicate", "HSDP grad-partition all-reduce, once per step",
            2 * pb * held * _ring(layout.dp_replicate))
    else:
        k = layout.size("dp_shard_cp")
        add("dp_cp", "ZeRO-3 fwd param all-gather + grad reduce-scatter (hpZ primary), per micro-batch",
            (gather + reduce) * ga)
        add("dp_shard_cp", "hpZ secondary param all-gather in backward, per micro-batch", pb * P * _ring(k) * ga)

    recompute = 1.5 if cfg.recompute == "full" else 1.0   # full recompute replays the forward's collectives
    if ep > 1:
        egroup = "expt_dp_shard" if hsdp and layout.dp_replicate > 1 else "expt_dp"  # exact HSDP: inside a replica
        e, ze = experts // ep, layout.size(egroup)
        if run.zero_stage == 3:
            add(egroup, "ZeRO-3 experts' param all-gather (fwd + bwd) and grad reduce-scatter over the ranks "
                "holding the same experts, per micro-batch", pb * e * (3 * _ring(ze)) * ga)
        else:
            add(egroup, "experts' grad reduce-scatter over the ranks holding the same experts, per micro-batch, "
                "their updated weights' all-gather once per step", pb * e * _ring(ze) * (ga + 1))
        tokens = s * b // (tp if cfg.use_sequence_parallel and tp > 1 else 1)
        add("ep", "MoE token all-to-all: each token's top-k copies to their experts and back, fwd + bwd, per layer",
            4 * L * tokens * arch.experts_per_token * h * pb * _ring(ep) * ga * recompute)
    act = pb * s * b * h
    add("tp", "TP activations: 2 collectives fwd + 2 bwd per layer (all-reduce, or all-gather/reduce-scatter with SP)",
        (4 * L + 2) * 2 * act * _ring(tp) * ga * recompute)
    if cp > 1:
        kv = pb * s * b * 2 * arch.head_dim * max(1, arch.num_kv_heads // tp)   # this rank's K and V
        what = "packed documents, every document split over the CP ranks: " if cfg.document_attention else ""
        add("cp", f"CP K/V exchange ({p.cp_comm_type}) per layer, fwd + bwd, {what}"
            + ("all-gather fwd, reduce-scatter bwd" if p.cp_comm_type == "all_gather" else
               "ring: K/V blocks fwd and bwd, their fp32 gradients home in bwd"),
            L * cp_layer_bytes(kv, cp, p.cp_comm_type, pb) * ga * recompute)
    return rows


def cp_layer_bytes(kv: float, cp: int, comm: str, bytes_per: int) -> float:
    """Bytes a CP rank sends per layer, forward + backward, for `kv` bytes of its own K and V. The same with packed
    documents: each rank holds 1/cp of every document, so of the K/V too (the split's padding is not counted).
    all_gather: (cp−1)·kv in the all-gather, (cp−1)·kv in the backward's reduce-scatter. p2p ring: cp−1 block hops
    forward and backward, and cp hops of the block gradients, which travel in fp32."""
    if comm == "all_gather":
        return 2 * (cp - 1) * kv
    return 2 * (cp - 1) * kv + cp * kv * 4 / bytes_per
