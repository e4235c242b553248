"""Tensor parallelism on the transformers engine, from the model's own plan (transformers' `tp_plan`: the class's
`_tp_plan` with its base model's `base_model_tp_plan`, e.g. `model.layers.*.self_attn.q_proj: colwise`).

Why plain local shards with Megatron's communication, not transformers' own TP (DTensor parameters) or DeepSpeed's
AutoTP: the parameters stay ordinary tensors, so DeepSpeed's ZeRO-1/2/3 partitions them over the data-parallel
ranks exactly as it does the native engine's (ZeRO does not take DTensor parameters), the checkpoint files, the
resharding at another layout (`partition_dim`, as Megatron's layers mark theirs) and the gradient norm over the TP
group (`tensor_model_parallel`) are the native engine's, and the communication is Megatron-Core's autograd
functions (adapter/parallel/mcore_groups.py's TP group). transformers' attention reshapes its projections with
`-1` heads, so a layer whose q/k/v keep whole heads per rank runs its share of the heads unchanged -- the property
transformers' own TP relies on.

The invariant (Megatron's): outside a colwise → rowwise pair every rank holds the same activations and the same
gradients of them. Styles:

* `colwise`: weight and bias split by output rows; the input enters through copy-to (identity forward, gradient
  summed over TP). `colwise_gather_output`/`colwise_rep`: then the outputs gathered (gradient split back).
* `rowwise`: weight split by input columns, the input already this rank's slice; the partial products summed over
  TP, the (replicated) bias added once after. `rowwise_split_input`/`rowwise_rep`: the replicated input split first
  (its gradient gathered back).
* `embedding_rowwise`: the vocabulary split; each rank looks up its rows, the lookups summed. Left replicated when
  tp does not divide the vocabulary (it is correct either way: only memory differs), and so is the output layer.
* `replicated_with_grad_allreduce`: a replicated parameter that sees only this rank's heads (Qwen3's q/k norms):
  its gradient is summed over TP before ZeRO reduces it.
* `mla_kv_a_proj` (DeepSeek's MLA): the rope part of the compressed key bypasses the colwise kv_b_proj, so its
  gradient is summed over TP on the way back.
* `packed_colwise`: a fused gate/up linear, each half split by rows so a rank keeps [gate_r; up_r].

Any other style (expert tensor parallelism `moe_tp_experts`, `sequence_parallel`, ...) is refused at plan time in
one line naming it (adapter/models/generic_run.check_run). PEFT's LoRA layers follow their base: on a colwise base
B is split by rows (its input gradient summed over TP), on a rowwise base A is split by columns (its output summed
over TP); where the base's input or output is whole (the gather/split variants) the adapter stays replicated.
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region as copy_to,
)
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region as gather_from,
)
from megatron.core.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region as reduce_from,
)
from megatron.core.tensor_parallel.mappings import (
    scatter_to_tensor_model_parallel_region as scatter_to,
)

from adapter.models.tp_plan import COLWISE, ROWWISE, VOCAB, is_vocab, model_plan, plan_matches
from adapter.patches.mcore import install_cpu_shims


def _split(p: torch.nn.Parameter, dim: int, tp: int, rank: int, parts: int = 1) -> torch.nn.Parameter:
    """This rank's slice of `p` along `dim` (`parts` independently split blocks: a packed gate/up), marked as
    Megatron marks a TP-split parameter (the checkpoint resharding and the gradient norm read the marks)."""
    dim = dim % p.ndim
    blocks = p.data.chunk(parts, dim=dim)
    local = torch.cat([b.chunk(tp, dim=dim)[rank] for b in blocks], dim=dim).contiguous()
    new = torch.nn.Parameter(local, requires_grad=p.requires_grad)
    new.tensor_model_parallel, new.partition_dim, new.partition_stride = True, dim, 1
    new.nd_tp_parts = parts
    return new


def _linear_forward(gathered: bool, split_input: bool, rowwise: bool, group):
    def forward(self, x):
        if rowwise:
            if split_input:
                x = scatter_to(x, group)
            out = reduce_from(F.linear(x, self.weight), group)
            return out if self.bias is None else out + self.bias
        out = F.linear(copy_to(x, group), self.weight, self.bias)
        return gather_from(out, group) if gathered else out
    return forward


def _embedding_forward(start: int, rows: int, group):
    def forward(self, ids):
        outside = (ids < start) | (ids >= start + rows)
        local = torch.where(outside, 0, ids - start)
        out = self._nd_forward(local)
        return reduce_from(out.masked_fill(outside.unsqueeze(-1), 0.0), group)
    return forward


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; the gradient summed over TP (one slice of an activation whose consumers are split)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _sum_grads_hook(group):
    def hook(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad
    return hook


def shard(model, tp: int, rank: int, group, rope_dim: int | None = None) -> int:
    """Split `model` (a transformers model, possibly inside PEFT) for this TP rank as its plan says; returns how many
    modules were split. Call on the whole model with its weights (every rank builds the same one) before DeepSpeed
    wraps it."""
    install_cpu_shims()  # Megatron's gathers allocate on "the current CUDA device"; CPU runs need the shim
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    plan = model_plan(base)
    done: dict[int, torch.nn.Parameter] = {}  # tied tensors (embedding = output layer) split once

    def split(mod, attr: str, dim: int, parts: int = 1) -> None:
        p = getattr(mod, attr)
        if p is None:
            return
        new = done.get(id(p)) or _split(p, dim, tp, rank, parts)
        done[id(p)] = new
        setattr(mod, attr, new)

    count = 0
    for name, style, mod in plan_matches(base, plan):
        if mod is None:
            raise RuntimeError(f"{name}: a plan entry for a bare parameter is not built (generic_run.check_run "
                               "refuses it at plan time)")
        target = getattr(mod, "base_layer", mod)  # PEFT's LoRA layer wraps the plan's linear
        lora = getattr(mod, "lora_A", None)
        if is_vocab(name, style):
            if target.weight.shape[0] % tp:
                continue  # replicated: correct, only memory differs (module docstring)
            if style == VOCAB:
                rows = target.weight.shape[0] // tp
                split(target, "weight", 0)
                if getattr(target, "padding_idx", None) is not None:
                    pad = target.padding_idx - rank * rows
                    target.padding_idx = pad if 0 <= pad < rows else None
                target._nd_forward = target.forward
                target.forward = types.MethodType(_embedding_forward(rank * rows, rows, group), target)
                count += 1
                continue
        if style in COLWISE or style == "packed_colwise":
            parts = 2 if style == "packed_colwise" else 1
            split(target, "weight", 0, parts)
            split(target, "bias", 0, parts)
            gathered = COLWISE.get(style, False)
            target.forward = types.MethodType(_linear_forward(gathered, False, False, group), target)
            if lora is not None and not gathered:
                for b in mod.lora_B.values():
                    split(b, "weight", 0, parts)
                    b.register_forward_pre_hook(lambda m, args: (copy_to(args[0], group), *args[1:]))
        elif style in ROWWISE:
            split(target, "weight", 1)
            target.forward = types.MethodType(_linear_forward(False, ROWWISE[style], True, group), target)
            if lora is not None and not ROWWISE[style]:
                for a in lora.values():
                    split(a, "weight", 1)
                    a.register_forward_hook(lambda m, args, out: reduce_from(out, group))
        elif style == "replicated_with_grad_allreduce":
            for p in mod.parameters():
                if p.requires_grad:
                    p.register_hook(_sum_grads_hook(group))
        elif style == "mla_kv_a_proj":
            if rope_dim is None:
                raise RuntimeError(f"{name}: mla_kv_a_proj needs the config's qk_rope_head_dim")

            def split_rope(m, args, out, rope_dim=rope_dim):
                keep, rope = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
                return torch.cat([keep, _SumGradOverTP.apply(rope, group)], dim=-1)
            mod.register_forward_hook(split_rope)
        else:
            raise RuntimeError(f"{name}: tensor-parallel style {style!r} is not built (generic_run.check_run "
                               "refuses it at plan time)")
        count += 1
    return count


def whole_state(model, group, tp: int, trained_only: bool = False, ep_group=None,
                ep: int = 1) -> dict[str, torch.Tensor]:
    """The model's state dict with every TP-split parameter gathered whole (collective over `group`), and every
    expert-split one over `ep_group` (adapter/modeling/hf_ep.py): what `save_pretrained` writes, as the model would
    be at tp = ep = 1. `trained_only`: the trained tensors alone (a PEFT adapter's save keeps only those)."""
    from adapter.modeling.hf_ep import whole_rows

    out = {}
    for key, t in model.state_dict(keep_vars=True).items():
        if trained_only and not t.requires_grad:
            continue
        dim = getattr(t, "partition_dim", None)
        if tp > 1 and dim is not None:
            parts = getattr(t, "nd_tp_parts", 1)
            pieces = [torch.empty_like(t.data) for _ in range(tp)]
            dist.all_gather(pieces, t.data.contiguous(), group=group)
            blocks = [p.chunk(parts, dim=dim) for p in pieces]
            t = torch.cat([torch.cat([b[i] for b in blocks], dim=dim) for i in range(parts)], dim=dim)
        if ep > 1 and hasattr(t, "nd_ep_rows"):
            t = whole_rows(t, ep_group, ep)
        out[key] = t.detach().clone()
    return out


__all__ = ["shard", "whole_state"]
