"""DeepSpeed ZeRO internals nd-adapter changes or reads, checked against TESTED_DEEPSPEED_VERSIONS and refused on
others:

* the ZeRO-1/2 gradient epilogue and optimizer step, minus their host waits (`install_zero12_step`);
* the hpZ secondary-partition group, which DeepSpeed would otherwise build from consecutive global ranks, mixing TP
  ranks (`set_hpz_group`);
* exact HSDP's replica all-reduce of ZeRO-3's flat gradient partition buffer (`average_over_replicas`);
* the engine around nd-adapter's flat AdamW: no data-parallel all-reduce (`drive_flat_optimizer`);
* AdamW's state created before the first step, so a resharded resume can place its moments (`adam_states`);
* expert parallelism under ZeRO-1/2 (`zero12_expert_groups`): DeepSpeed's stage-1/2 optimizer partitions a
  parameter group marked `moe` over its expert-data-parallel group, divides its gradients by the whole
  data-parallel world like the others (Megatron's expert arithmetic too) and all-reduces the group's norm over the
  ranks holding those experts; it is handed the expert groups only when the engine found one of DeepSpeed's own MoE
  layers, so the engine's flag is raised for the optimizer's construction alone (raised for the whole run, the
  engine would also save checkpoints in DeepSpeed-MoE's per-expert layout, which needs those layers);
* expert parallelism under ZeRO-3 (`place_experts`): DeepSpeed 0.19.8's ZeRO-3 partitions a parameter over
  `ds_zero_partition_process_group` when it is set, groups parameters by that group, averages an "autoep_expert"
  parameter's gradient over the whole data-parallel world and adds its norm over the expert-parallel group; that is
  Megatron-Core's expert arithmetic, so the experts of its MoE layer are marked so, with Megatron's groups
  registered under DeepSpeed's expert group name. Its norm skips the TP sum for such parameters (it assumes AutoEP's
  experts span the TP ranks); Megatron's experts are TP-sharded like the dense linears, so that choice is undone.

The ZeRO-1/2 step. Why: DeepSpeed 0.19.8's stage-1/2 optimizer makes the host wait for the GPU several times per
step: a device-wide synchronize at the end of every backward (with `overlap_comm`), a scalar built with
`torch.tensor(-1.0, device=...)` (a blocking host->device copy) in the grad norm, `bool(tensor)` on that norm before
clipping. Each wait drains the GPU's queue, and the ~15 ms of Python that DeepSpeed's step then runs per step on the
host leaves the GPU idle (docs/BENCHMARKS.md, session 5). The replacements below do the same arithmetic, in the same
order, on the device: an invalid (inf/NaN/negative) norm still clips with an infinite norm, i.e. the gradients
become zeros, exactly as DeepSpeed does; the loop's own non-finite check then stops the run.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero import stage_1_and_2
from deepspeed.utils import groups

from adapter.patches import require

TESTED_DEEPSPEED_VERSIONS = ("0.19.8",)


def mask_nonfinite_(norm: torch.Tensor, device=None, val: float = -1.0) -> None:
    """DeepSpeed's `mask_nan_or_inf_with_val_inplace`, filling with a Python scalar (no host->device copy)."""
    norm.masked_fill_(~torch.isfinite(norm), val)


def unscale_and_clip_grads(self, grad_groups_flat, total_norm) -> None:
    """`DeepSpeedZeroOptimizer.unscale_and_clip_grads` without `bool(tensor)`: the clip factor stays on the device."""
    if self.clip_grad == 0.0 and self.loss_scale == 1.0:
        return
    combined = self.loss_scale
    if self.clip_grad > 0.0:
        ref = next(g for g in _flat(grad_groups_flat))
        norm = torch.as_tensor(total_norm, dtype=torch.float32, device=ref.device)
        norm = torch.where(torch.isfinite(norm) & (norm >= 0), norm, torch.full_like(norm, math.inf))
        combined = torch.clamp((norm / self.loss_scale + 1e-6) / self.clip_grad, min=1.0) * self.loss_scale
    for g in _flat(grad_groups_flat):
        g.data.mul_(1.0 / combined)


def _flat(groups):
    for g in groups:
        yield from (g if isinstance(g, list) else [g])


def _epilogue_ordered_on_device(optimizer):
    """The end-of-backward epilogue synchronises the device so that the host may drop the buckets the side-stream
    reduction read. Making the compute stream wait for the reduction stream instead orders every later kernel (and
    every reuse of that memory, all on the compute stream) after the reduction, without stopping the host."""
    original = type(optimizer).independent_gradient_partition_epilogue
    acc = get_accelerator()

    def epilogue():
        if not (optimizer.overlap_comm and torch.cuda.is_available()):
            return original(optimizer)
        acc.synchronize = lambda *a, **k: torch.cuda.current_stream().wait_stream(optimizer.reduction_stream)
        try:
            return original(optimizer)
        finally:
            del acc.synchronize  # back to the class's method

    return epilogue


def install_zero12_step(optimizer) -> None:
    """Patch a stage-1/2 `DeepSpeedZeroOptimizer` (the instance, and the one module-level helper it calls); any other
    optimizer DeepSpeed chose is left as it is."""
    if not isinstance(optimizer, stage_1_and_2.DeepSpeedZeroOptimizer):
        return
    require("deepspeed", TESTED_DEEPSPEED_VERSIONS, "ZeRO-1/2 step without host waits (adapter/patches/zero.py)")
    stage_1_and_2.mask_nan_or_inf_with_val_inplace = mask_nonfinite_
    optimizer.unscale_and_clip_grads = unscale_and_clip_grads.__get__(optimizer)
    optimizer.independent_gradient_partition_epilogue = _epilogue_ordered_on_device(optimizer)


def drive_flat_optimizer(engine, optimizer) -> None:
    """DeepSpeed around nd-adapter's FlatAdamW (stage 0, no DeepSpeed precision): there is nothing to all-reduce
    over a data-parallel group of one, and its bucketed fallback would copy every gradient into a flat buffer and
    back. Its `zero_grad` (every gradient to None) runs over a list of the parameters made once."""
    require("deepspeed", TESTED_DEEPSPEED_VERSIONS, "DeepSpeed driving the flat AdamW (adapter/patches/zero.py)")
    if engine.optimizer is not optimizer:
        raise RuntimeError(f"DeepSpeed wrapped the flat AdamW in {type(engine.optimizer).__name__}")
    engine.enable_backward_allreduce = False
    params = list(engine.module.parameters())

    def zero_grad():  # the engine's walks every module's named_parameters() each step (a MoE has thousands)
        for p in params:
            p.grad = None

    engine.zero_grad = zero_grad


def set_hpz_group(group) -> None:
    """ZeRO++ hpZ partitions its secondary parameter copy inside this group (ours: dp_shard×cp); None resets it."""
    if group is not None:
        require("deepspeed", TESTED_DEEPSPEED_VERSIONS, "hpZ group set-up (adapter/patches/zero.py)")
    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = group


def average_over_replicas(engine, replica_group, replicas: int) -> None:
    """Exact HSDP: average ZeRO-3's flat gradient partitions over dp_replicate, once per optimizer step, after the
    last backward (docs/internals.md: matched plain ZeRO-3 to 3e-8 with clipping). Relies on ZeRO-3's internal flat
    buffer."""
    require("deepspeed", TESTED_DEEPSPEED_VERSIONS, "exact HSDP replica averaging (adapter/patches/zero.py)")
    buf = engine.optimizer.grad_partitions_flat_buffer
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=replica_group)
    buf.div_(replicas)


def adam_states(zero_optimizer, step: int) -> None:
    """Give ZeRO's AdamW its state before its first step (torch creates it lazily in `step`), at step count `step`
    with zero moments, and link each parameter's fragment to it, so that DeepSpeed's `safe_set_full_optimizer_state`
    can place moments resharded from a checkpoint of another layout (adapter/train/reshard.py)."""
    require("deepspeed", TESTED_DEEPSPEED_VERSIONS, "AdamW state set-up for resharding (adapter/patches/zero.py)")
    base = zero_optimizer.optimizer
    zero12 = isinstance(zero_optimizer, stage_1_and_2.DeepSpeedZeroOptimizer)
    flats = zero_optimizer.single_partition_of_fp32_groups if zero12 else zero_optimizer.fp32_partitioned_groups_flat
    on_device = any(g.get("fused") or g.get("capturable") for g in base.param_groups)  # as torch's AdamW keeps it
    for flat in flats:
        state = base.state[flat]
        state["step"] = torch.tensor(float(step), dtype=torch.float32, device=flat.device if on_device else "cpu")
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = torch.zeros_like(flat, memory_format=torch.preserve_format)
    if zero12:  # ZeRO-3 reads the state through its flats
        zero_optimizer._hp_optimizer_states_linked = False
        zero_optimizer._lazy_init_hp_params_optimizer_state()


def expert_group_name(ep: int) -> str:
    return f"ep_size_{ep}"  # DeepSpeed's naming of its expert groups


def place_experts(model, ep_group, edp_group, ep: int, zero3: bool = True) -> int:
    """Before deepspeed.initialize: each local expert's weights kept within the ranks that hold the same experts
    (`edp_group`: the start-up broadcast; ZeRO-3 also partitions them there), their gradients averaged over the whole
    data-parallel world, their norm summed over `ep_group`. Returns how many parameters were marked."""
    require("deepspeed", TESTED_DEEPSPEED_VERSIONS, "expert parallelism under ZeRO (adapter/patches/zero.py)")
    name = expert_group_name(ep)
    groups._EXPERT_PARALLEL_GROUP[name] = ep_group
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(ep_group)
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = edp_group
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(edp_group)
    marked = 0
    for pname, p in model.named_parameters():
        if ".mlp.experts." in pname or getattr(p, "nd_expert", False):  # the transformers engine's: hf_ep.shard
            p.nd_expert = True
            p.allreduce, p.group_name = False, name  # DeepSpeed's MoE mark: the engine's start-up broadcast of the
            # weights then stays within the ranks holding the same experts (not rank 0's experts everywhere)
            marked += 1
            if not zero3:
                continue
            p.ds_zero_placement_family = "autoep_expert"
            p.ds_zero_partition_group_name = name
            p.ds_zero_partition_process_group = edp_group
            p.ds_zero_partition_rank = dist.get_rank(edp_group)
            p.ds_zero_partition_world_size = dist.get_world_size(edp_group)
    return marked


def zero12_expert_groups(param_groups: list[dict], ep: int) -> list[dict]:
    """ZeRO-1/2: each optimizer group's trained experts (marked by `place_experts`) moved into a group of their own
    that DeepSpeed partitions over the ranks holding them (module docstring)."""
    out, experts = [], []
    for group in param_groups:
        mine = [p for p in group["params"] if getattr(p, "nd_expert", False)]
        rest = [p for p in group["params"] if not getattr(p, "nd_expert", False)]
        out += [{**group, "params": rest}] if rest else []
        experts += [{**group, "params": mine, "moe": True, "name": expert_group_name(ep)}] if mine else []
    return out + experts


def experts_from_master(zero_optimizer) -> None:
    """After DeepSpeed loads a ZeRO-1/2 checkpoint with expert groups: its non-MoE save path writes the module's
    weights from data-parallel rank 0 only, so every rank has just loaded rank 0's experts; the fp32 master partitions
    each rank loaded are its own. The 16-bit weights are rebuilt from them, as the step builds them (bit-exact)."""
    if isinstance(zero_optimizer, stage_1_and_2.DeepSpeedZeroOptimizer) and zero_optimizer.has_moe_layers:
        require("deepspeed", TESTED_DEEPSPEED_VERSIONS, "expert parallelism under ZeRO-1/2 (adapter/patches/zero.py)")
        zero_optimizer.update_lp_params()


@contextmanager
def zero12_with_experts(enabled: bool = True):
    """Around deepspeed.initialize: the ZeRO-1/2 optimizer is built with the expert groups (module docstring)."""
    if not enabled:
        yield
        return
    require("deepspeed", TESTED_DEEPSPEED_VERSIONS, "expert parallelism under ZeRO-1/2 (adapter/patches/zero.py)")
    original = DeepSpeedEngine._configure_zero_optimizer

    def configure(engine, optimizer):
        engine.has_moe_layers = True
        try:
            return original(engine, optimizer)
        finally:
            engine.has_moe_layers = False

    DeepSpeedEngine._configure_zero_optimizer = configure
    try:
        yield
    finally:
        DeepSpeedEngine._configure_zero_optimizer = original


def expert_norm_with_tp(zero3_optimizer) -> None:
    """ZeRO-3's norm of the experts' gradients: summed over TP as for any TP-sharded parameter (module docstring)."""
    require("deepspeed", TESTED_DEEPSPEED_VERSIONS, "expert parallelism under ZeRO-3 (adapter/patches/zero.py)")
    original = zero3_optimizer._grad_norm_counts_every_rank

    def counts_every_rank(params, process_group):
        if params and all(getattr(p, "nd_expert", False) for p in params):
            return False  # each TP rank's shard counts, then the TP all-reduce; then DeepSpeed's EP all-reduce
        return original(params, process_group)

    zero3_optimizer._grad_norm_counts_every_rank = counts_every_rank


__all__ = ["TESTED_DEEPSPEED_VERSIONS", "install_zero12_step", "drive_flat_optimizer", "unscale_and_clip_grads",
           "mask_nonfinite_", "set_hpz_group", "average_over_replicas", "adam_states", "place_experts",
           "expert_norm_with_tp", "expert_group_name", "zero12_expert_groups", "zero12_with_experts",
           "experts_from_master"]
