"""Expert parallelism on the transformers engine, from the model's own plan (transformers' `ep_plan`: the config's
`base_model_ep_plan`, e.g. `layers.*.mlp.experts.gate_up_proj: grouped_gemm`, `layers.*.mlp.experts:
ep_dispatch_experts`).

What the two styles mean, as transformers' own EP (transformers/distributed/expert_parallel.py) means them:
`grouped_gemm` on an experts module's stacked parameter ([experts, ...]): each of the ep ranks keeps a contiguous
block of `num_experts / ep` experts along dim 0; `ep_dispatch_experts` on the experts module: its forward (rows,
top-k expert ids, top-k weights) sends every (row, expert) pair to the rank holding that expert with one all-to-all,
runs this rank's experts on what it received (local ids, unit weights), sends the outputs back with a second one and
sums them per row with the routing weights on the sender -- so the routing weights' gradient stays where the router
is. That is transformers' `AllToAllEP` at tp = 1.

Why not transformers' own: it makes the expert weights DTensors on a DeviceMesh, which DeepSpeed's ZeRO does not
partition. Here they stay plain tensors, marked as the native engine's experts are (`nd_expert`), so
adapter/patches/zero.place_experts keeps them within the ranks holding the same experts (Megatron-Core's
expert-data-parallel group: ZeRO-3 partitions them there, ZeRO-1/2 give them groups of their own) -- the native
engine's machinery, not a second one. The exchange is Megatron-Core's autograd all-to-all over the layout's ep group
(laid over dp_shard × cp, adapter/parallel/layout.py): the ep ranks hold different tokens, as data-parallel ranks do.

A rank that receives no rows still runs the exchange's backward (its empty result is tied to the received rows), or
the other ranks' backward all-to-all would wait for it forever. Each stacked parameter records its split
(`nd_ep_rows`: the experts it holds and where they start) so the checkpoint resharding (adapter/train/reshard.py)
and the export (`whole_rows`) put the blocks back in order.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import all_to_all

from adapter.models.tp_plan import plan_matches
from adapter.patches.mcore import install_cpu_shims

PARAM, MODULE = "grouped_gemm", "ep_dispatch_experts"


def model_ep_plan(model) -> dict[str, str]:
    """The model's resolved expert-parallel plan (full paths, `*` for a layer index), as transformers resolves it."""
    plan = getattr(model, "ep_plan", None) or {}
    return {k: v for k, v in dict(plan).items() if isinstance(v, str)}


def _dispatching_forward(experts_forward, local: int, ep: int, group):
    """The `ep_dispatch_experts` forward: (rows [T, H], top-k ids [T, k] global, top-k weights [T, k]) -> [T, H]."""

    def forward(hidden_states, top_k_index, top_k_weights):
        rows, k = hidden_states.shape[0], top_k_index.shape[-1]
        ids = top_k_index.reshape(-1)
        order = torch.argsort(ids, stable=True)  # pairs grouped by expert, hence by the rank holding it
        send = hidden_states[order // k]
        counts = torch.bincount(ids, minlength=local * ep).view(ep, local)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        send_sizes, recv_sizes = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        got = all_to_all(group, send, recv_sizes, send_sizes)
        got_ids = torch.arange(local, device=ids.device).repeat(ep).repeat_interleave(recv_counts.reshape(-1))
        out = experts_forward(got, got_ids.unsqueeze(-1), torch.ones(got.shape[0], 1, dtype=got.dtype,
                                                                      device=got.device))
        if got.shape[0] == 0:  # no rows here: keep the backward exchange (module docstring)
            out = out + got.sum() * 0
        back = all_to_all(group, out, send_sizes, recv_sizes)
        per_pair = back[torch.argsort(order)].view(rows, k, -1)
        return (per_pair * top_k_weights.unsqueeze(-1).to(per_pair.dtype)).sum(1).to(hidden_states.dtype)

    return forward


def shard(model, ep: int, rank: int, group) -> int:
    """Keep this ep rank's experts of `model` (a transformers model, possibly inside PEFT) and route tokens to the
    others' through `group` (ep = 1: mark the stacked tensors alone); returns how many experts modules were split.
    Call on the whole model with its weights (every rank builds the same one) before DeepSpeed wraps it."""
    install_cpu_shims()  # Megatron's all-to-all allocates on "the current CUDA device"; CPU runs need the shim
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    plan = model_ep_plan(base)
    count = 0  # at ep = 1 the stacked tensors are only marked (a checkpoint of another ep reads them by blocks)
    matches = plan_matches(base, plan)
    params = {name for name, style, mod in matches if style == PARAM and mod is None}  # split with their module
    for name, style, mod in matches:
        if style == PARAM:
            continue
        if style != MODULE or mod is None:
            raise RuntimeError(f"{name}: expert-parallel style {style!r} is not built (generic_run.check_run "
                               "refuses it at plan time)")
        stacked = [(pname, p) for pname, p in mod.named_parameters(recurse=False) if f"{name}.{pname}" in params]
        if not stacked:  # PEFT's LoRA on the experts' own parameters wraps them (refused beside ep > 1)
            if ep > 1:
                raise RuntimeError(f"{name}: no stacked experts to split (generic_run.check_run refuses LoRA on "
                                   "the experts' parameters beside ep > 1)")
            continue
        experts = stacked[0][1].shape[0]
        local = experts // ep
        if ep == 1:
            for _, p in stacked:
                p.nd_ep_rows = (0, experts)
            continue
        for pname, p in stacked:
            mine = p.data[rank * local:(rank + 1) * local].contiguous()
            new = torch.nn.Parameter(mine, requires_grad=p.requires_grad)
            new.nd_expert, new.nd_ep_rows = True, (rank * local, experts)
            setattr(mod, pname, new)
        mod.num_experts = local
        mod._is_expert_parallel = True  # transformers' grouped kernels then skip ids past this rank's experts
        mod.forward = _dispatching_forward(mod.forward, local, ep, group)
        count += 1
    return count


def whole_rows(t: torch.Tensor, group, ep: int) -> torch.Tensor:
    """An expert-split tensor (`nd_ep_rows`) gathered whole over the ep group (collective): every expert in order,
    as the model holds it at ep = 1."""
    pieces = [torch.empty_like(t.data) for _ in range(ep)]
    dist.all_gather(pieces, t.data.contiguous(), group=group)
    return torch.cat(pieces, dim=0)


__all__ = ["model_ep_plan", "shard", "whole_rows"]
