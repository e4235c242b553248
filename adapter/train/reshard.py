"""Resume a checkpoint at another parallel layout: another world size, tp, cp, dp, ZeRO stage, or the flat AdamW
instead of ZeRO, and back (a preempted job requeued on fewer GPUs goes on from the same weights, moments and sample).

What a run changes is read from the saved files (adapter/patches/zero_files.py for DeepSpeed's, `FlatFiles` for
the flat AdamW's): for every trained parameter its fp32 master weights and both AdamW moments, whole on each of
the saved tensor-parallel ranks. They are merged over those ranks into the layout-free tensor (per Megatron
key: the axis TP splits and how many independently split blocks it holds, adapter/models/mapping.py), the
vocabulary padding of the old tp trimmed and that of the new one added, then cut for this rank and handed to
the optimizer through DeepSpeed's own setters (`safe_set_full_fp32_param`, `safe_set_full_optimizer_state`),
which place each rank's ZeRO partition. The moments are elementwise, so the same cut applies to them as to the
weights: the optimizer resumes exactly where it stopped. What is frozen is not in the checkpoint; it comes from
the converted weights, as at the start.

The step counter, the optimizer's step count (bias correction), the LR scheduler and the data sampler (it counts
samples globally) carry over; the RNG streams do not (they are per rank), which only matters with dropout.
Experts (expert parallelism) are matched by their global index, whichever ranks held them: the native engine's
one tensor per expert by name, the transformers engine's stacked experts tensors by their blocks along dim 0.
Refused in one line: 8/4-bit optimizer states (quantised in blocks of the saved partitions), another model (a
trained parameter missing or of another size), vocabulary padding rows that are not zero.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path

import deepspeed
import torch
from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

from adapter.errors import bad
from adapter.models.families import family, packed_rule
from adapter.models.mapping import LAYER, LOCAL_EXPERT, Vocab, cut_blocks, global_expert_name, merge_blocks
from adapter.patches.zero import adam_states
from adapter.patches.zero_files import MOMENTS, ZeroFiles, client_state, written_by_zero
from adapter.train.optim import FORMAT, FlatAdamW, check_state_dtype, quantized

WHAT = ("fp32", *MOMENTS)
_LAYER = re.compile(r"^" + re.escape(LAYER) + r"\d+\.")
_EXPERT = re.compile(r"\." + re.escape(LOCAL_EXPERT) + r"\d+\.")  # SequentialMLP's expert e: the table's expert key
_LORA_B = re.compile(r"\.lora\.B\.(\w+)$")  # adapter/modeling/lora.py names an adapter's B <linear>.lora.B.<hf name>
class FlatFiles:
    """A checkpoint of nd-adapter's flat AdamW (`mp_rank_{m:02d}_model_states.pt`: the module and the optimizer's
    flat masters and moments, with each group's parameter names)."""

    def __init__(self, ckpt: Path, key: str, value: str):
        files = sorted(ckpt.glob("mp_rank_*_model_states.pt"))
        if not files:
            raise bad(key, value, f"{ckpt} holds no model-states files", "resume from a complete checkpoint")
        self.tp = len(files)
        self.model = [torch.load(ckpt / f"mp_rank_{m:02d}_model_states.pt", map_location="cpu", weights_only=False,
                                 mmap=True) for m in range(self.tp)]
        opt = self.model[0].get("optimizer")
        if not isinstance(opt, dict) or opt.get("format") != FORMAT:
            raise bad(key, value, "it holds no optimizer state nd-adapter can reshard", "resume at the layout it "
                      "was saved with")
        if opt.get("state_bits", 32) != 32:
            raise bad(key, value, f"its {opt['state_bits']}-bit moments are quantised in blocks of the saved "
                      "layout's tensors", "resume at the layout it was saved with")
        if any("names" not in g for g in opt["param_groups"]):
            raise bad(key, value, "it was written before nd-adapter could reshard checkpoints (no parameter names)",
                      "resume at the layout it was saved with")
        self.step = int(opt["steps"])
        self.state_dtype = opt.get("state_dtype", "fp32")
        self._where = []  # per TP rank: name -> (group, offset)
        for m in range(self.tp):
            o = self.model[m]["optimizer"]
            where, module = OrderedDict(), self.model[m]["module"]
            for g, group in enumerate(o["param_groups"]):
                off = 0
                for name in group["names"]:
                    where[name] = (g, off)
                    off += module[name].numel()
            self._where.append(where)

    def trained(self, m: int) -> OrderedDict:
        return OrderedDict((n, self.model[m]["module"][n].shape) for n in self._where[m])

    def read(self, m: int, name: str, what: str) -> torch.Tensor:
        g, off = self._where[m][name]
        weight = self.model[m]["module"][name]
        group = self.model[m]["optimizer"]["groups"][g]
        flat = group["master" if what == "fp32" else what]
        if flat is None:  # fp32 weights are their own master
            return weight.float()
        return flat[off:off + weight.numel()].view(weight.shape).float()

    def engine_state(self) -> dict:
        return self.model[0]


def stacked_name(name: str, ep_rank: int) -> str:
    """The name of ep rank `ep_rank`'s block of a stacked experts tensor (the transformers engine's, split along
    dim 0: adapter/modeling/hf_ep.py) in a checkpoint saved at ep > 1."""
    return f"{name}@ep{ep_rank}"


def open_saved(ckpt: Path, key: str, value: str, ep: int = 1, experts: int = 0, stacked: frozenset = frozenset()):
    """`ep`: the expert-parallel size it was saved with (its record says; the flat AdamW never runs with ep), over
    `experts` experts per layer (the native engine's, one tensor per expert); `stacked`: the transformers engine's
    stacked experts tensors, each rank's block read under `stacked_name`."""
    if written_by_zero(ckpt):
        local = experts // ep

        def expert_name(name: str, ep_rank: int) -> str | None:
            if name in stacked:
                return stacked_name(name, ep_rank) if ep > 1 else None
            return global_expert_name(name, ep_rank, local) if LOCAL_EXPERT in name else None

        return ZeroFiles(ckpt, key, value, ep, expert_name)
    return FlatFiles(ckpt, key, value)


def tp_split(name: str, p, arch) -> tuple[int | None, int]:
    """(axis TP splits, independently split blocks along it) for one parameter: the family table's rule for its
    Megatron key, else (adapters) the TP attributes it was built with; None: replicated."""
    key = _EXPERT.sub(".mlp.experts.experts.", _LAYER.sub(LAYER, name))
    for rule in family(arch.family).table:
        if rule.megatron == key:
            return rule.tp_axis, rule.parts
    dim = getattr(p, "partition_dim", -1)
    axis = dim if dim is not None and dim >= 0 else None
    if hasattr(p, "nd_tp_parts"):  # the transformers engine's split (adapter/modeling/hf_tp.py)
        return axis, p.nd_tp_parts
    adapter = _LORA_B.search(name)  # a packed HF linear's B is in Megatron's order: its rule's blocks
    packed = packed_rule(arch, adapter.group(1)) if adapter else None
    return axis, packed.parts if packed is not None and axis == 0 else 1


def vocab_names(arch) -> set[str]:
    return {r.megatron for r in family(arch.family).table if isinstance(r, Vocab)}


def repad(t: torch.Tensor, rows: int, real: int, name: str, key: str, value: str) -> torch.Tensor:
    """Vocabulary rows padded for the saved tp, re-padded for this one: the rows past the real vocabulary never
    train (the loss leaves them out), so they must be zero to be dropped."""
    if t.shape[0] == rows:
        return t
    if t[real:].count_nonzero():
        raise bad(key, value, f"{name} has non-zero rows in its vocabulary padding ({real}:{t.shape[0]}), which "
                  "another tp cannot hold", "resume at the tp it was saved with")
    out = t.new_zeros(rows, *t.shape[1:])
    out[:real] = t[:real]
    return out


def _local_shape(p) -> torch.Size:
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape


def _per_group(sched_state: dict, groups: int) -> dict:
    """The LR scheduler's per-group lists for this run's optimizer groups: another layout may group parameters
    otherwise (ZeRO-2 keeps experts in groups of their own); every group follows the one schedule."""
    out = dict(sched_state)
    for key in ("lr_lambdas", "base_lrs", "_last_lr"):
        if isinstance(out.get(key), list) and out[key] and len(out[key]) != groups:
            out[key] = [out[key][0]] * groups
    return out


def load(engine, ckpt: Path, arch, *, tp_rank: int, tp: int, key: str, value: str, ep: int = 1, ep_rank: int = 0,
         saved_ep: int = 1) -> dict:
    """Collective. The checkpoint `ckpt` (any layout) into this freshly built engine; returns the client state
    the run saved with it (as DeepSpeed's load_checkpoint does). Experts are matched by their global index: this
    rank holds `num_experts / ep` of them from `ep_rank` on; the checkpoint was saved at `saved_ep`."""
    stacked = frozenset(n for n, p in engine.module.named_parameters() if hasattr(p, "nd_ep_rows"))
    saved = open_saved(ckpt, key, value, saved_ep, arch.num_experts if arch.moe else 0, stacked)
    opt = engine.optimizer
    if quantized(opt):
        raise bad(key, value, "this run keeps 8/4-bit moments, quantised in blocks of its own tensors; a "
                  "checkpoint of another layout cannot be placed into them exactly", "resume at the layout it was "
                  "saved with, or with optimizer.name: adamw")
    check_state_dtype(getattr(saved, "state_dtype", "fp32"), opt, key, value)
    if not isinstance(saved, FlatFiles) and saved.state_dtype == "bf16":
        raise bad(key, value, "its bf16 ZeRO partitions (optimizer.state_dtype: bf16) are not resharded yet",
                  "resume at the layout it was saved with")
    local = arch.num_experts // ep if arch.moe else 0
    trained = [(global_expert_name(n, ep_rank, local), p) for n, p in engine.module.named_parameters()
               if p.requires_grad]
    saved_names = set(saved.trained(0))
    here = {stacked_name(n, r) if n in stacked and saved_ep > 1 else global_expert_name(n, r, local)
            for n, p in engine.module.named_parameters() if p.requires_grad
            for r in range(saved_ep if n in stacked else ep)}  # what the run trains over its ep ranks
    if here != saved_names:
        diff = sorted(here - saved_names)[:1] or sorted(saved_names - here)[:1]
        where = "this run trains it, the checkpoint lacks it" if diff[0] in here else "the checkpoint holds it, " \
            "this run does not train it"
        raise bad(key, value, f"another model or another set of trained parameters: {diff[0]} ({where})",
                  "resume with the model and trained parameters it was saved with")
    vocab, zero3 = vocab_names(arch), hasattr(trained[0][1], "ds_id") if trained else False
    if isinstance(opt, FlatAdamW):
        opt.steps = saved.step
    else:
        adam_states(opt, saved.step)
    for name, p in trained:
        axis, parts = tp_split(name, p, arch)
        shape = _local_shape(p)
        values = {}
        for what in WHAT:
            if name in stacked:  # every saved ep rank's block of experts, in order; then this rank's block
                blocks = [stacked_name(name, e) for e in range(saved_ep)] if saved_ep > 1 else [name]
                whole = torch.cat([merge_blocks([saved.read(m, b, what) for m in range(saved.tp)], axis, parts)
                                   for b in blocks]).chunk(ep)[ep_rank]
            else:
                whole = merge_blocks([saved.read(m, name, what) for m in range(saved.tp)], axis, parts)
            if name in vocab:
                whole = repad(whole, shape[0] * tp, arch.vocab_size, name, key, value)
            values[what] = cut_blocks(whole, axis, parts, tp, tp_rank).contiguous()
        if values["fp32"].shape != shape:
            raise bad(key, value, f"another model: {name} is {tuple(values['fp32'].shape)} there (for this tp), "
                      f"{tuple(shape)} here", "resume with the model it was saved with")
        values = {k: v.to(p.device) for k, v in values.items()}
        if isinstance(opt, FlatAdamW):
            opt.set_state(p, values["fp32"], values["exp_avg"], values["exp_avg_sq"])
            continue
        safe_set_full_fp32_param(p, values["fp32"])
        for what in MOMENTS:
            safe_set_full_optimizer_state(p, values[what], what)
        if zero3:  # the 16-bit partitions: every rank writes the same whole; DeepSpeed re-partitions it on exit
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                p.data.copy_(values["fp32"])
        else:
            p.data.copy_(values["fp32"])
    state = saved.engine_state()
    sched = engine.lr_scheduler
    if sched is not None and state.get("lr_scheduler") is not None:
        sched.load_state_dict(_per_group(state["lr_scheduler"], len(sched.optimizer.param_groups)))
        for group, lr in zip(sched.optimizer.param_groups, sched.get_last_lr()):  # the rates it last set
            group["lr"] = lr
    engine.global_steps = int(state.get("global_steps", 0))
    engine.global_samples = int(state.get("global_samples", 0))
    engine.skipped_steps = int(state.get("skipped_steps", 0))
    return client_state(state)


__all__ = ["load", "open_saved", "repad", "stacked_name", "tp_split", "FlatFiles"]
