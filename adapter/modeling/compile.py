"""`model.compile`: each transformer layer's forward (and, through AOTAutograd, its backward) as one torch.compile'd
graph.

Why: on the Llama-3.2-1B shape the forward pass is bound by the CPU, not the GPU: Megatron's layer issues ~40
eager ops per layer, each a Python dispatch and a kernel launch, and the H200 finishes them faster than the host
issues them (docs/BENCHMARKS.md, session 4). One compiled graph per layer fuses the norms, residual adds, casts and
RoPE into a few kernels and replaces the per-op Python with one guarded call; the 16 identical layers share one
graph (torch inlines nn.Module attributes as graph inputs), so it compiles once.

At tp = 1 the linears' matmuls are plain `F.linear` inside the graph (`set_linear_impl`), not Megatron's autograd
Function: a Function's saved tensors are fixed outputs of its forward, so AOTAutograd's partitioner could not choose
to recompute the SwiGLU product or the norms' outputs in backward instead of saving them (measured:
docs/BENCHMARKS.md, 2026-12-01, third session, lever 2). With nothing to communicate, the Function adds nothing
else.

Where it stops: Megatron's tensor-parallel linears are autograd Functions with asynchronous collectives, which
Dynamo does not trace, so with tp > 1 the graph breaks at every linear (correct, but little is fused).

Under ZeRO-3 each layer is one gather unit (`deepspeed.gather_granularity: layer`, a ZeRO-3 leaf module): its hooks
run around the compiled forward, never inside it, so the graph always sees the layer's whole weights; and
AOTAutograd saves the parameters themselves for backward (no view of a gathered weight: checked with saved-tensor
hooks, tests/distributed/test_train.py), so ZeRO-3's release empties them and its re-gather before the layer's
backward refills them, as in eager mode. Per-module gathers would run inside the graph: refused there
(`deepspeed_config.zero_stage`). `model.compile: auto` leaves ZeRO-3 eager until it is measured faster there.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from adapter.patches.mcore import quiet_row_parallel_group, set_linear_impl


def compile_layers(model: torch.nn.Module, memory_budget: float | None = None, steady: bool = True) -> int:
    """Compile every decoder layer in place (forward only: module hooks stay eager). Returns how many.

    `steady`: every micro-batch has one length (packed SFT), so the graphs are static. Otherwise (preference pairs,
    unpacked SFT: RunConfig.steady_lengths) torch's automatic dynamic shapes: the first length compiles static, the
    second recompiles with the length as a symbol, and that graph serves every later one (static graphs would
    recompile at each new length until torch's recompile limit, then run eager).

    `memory_budget` (0-1]: AOTAutograd's activation memory budget for the layers' backward graphs: below 1 its
    partitioner recomputes the cheapest activations (pointwise ops first) instead of saving them. It is a process-wide
    setting of torch, read when the graphs compile (at the first step)."""
    quiet_row_parallel_group()
    layers = list(model.decoder.layers)
    if model.config.tensor_model_parallel_size == 1 and not model.config.gradient_accumulation_fusion:
        for layer in layers:
            for m in layer.modules():
                if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and "_forward_impl" not in vars(m):
                    set_linear_impl(m, F.linear)
    if memory_budget is not None:
        torch._functorch.config.activation_memory_budget = memory_budget
    for layer in layers:
        if hasattr(layer.mlp, "router"):  # a mixture of experts: its attention half only (the token dispatcher's
            # graph fails AOTAutograd: "Node ... was invalid, but is output", torch 2.13); the experts stay eager
            layer._forward_attention = _one_stride(
                torch.compile(layer._forward_attention, dynamic=False if steady else None))
        else:
            layer.forward = _one_stride(torch.compile(layer.forward, dynamic=False if steady else None))
    return len(layers)


def _one_stride(compiled):
    """The compiled forward, its hidden states [s, 1, h] given one stride for their size-1 batch dimension.

    The first layer's input is the embedding's output transposed ([1, s, h] -> [s, 1, h], batch stride s·h; torch
    calls it contiguous, so Megatron's `.contiguous()` keeps it), every later layer's a layer's output (batch stride
    h). Dynamo guards on strides, so the two would compile two graphs, and with the length a symbol the guard on
    s·h fails at every new length (a recompile each, seen on the DPO stream; a view with the other stride is guarded
    through its base). The first layer's input is copied to batch stride h: one [s, h] copy a forward."""
    def forward(*args, **kwargs):
        if args:
            args = (_canonical(args[0]), *args[1:])
        elif "hidden_states" in kwargs:
            kwargs["hidden_states"] = _canonical(kwargs["hidden_states"])
        return compiled(*args, **kwargs)
    return forward


def _canonical(x):
    if isinstance(x, torch.Tensor) and x.dim() == 3 and x.size(1) == 1 and x.stride(1) != x.size(2):
        return x.clone(memory_format=torch.contiguous_format)
    return x


__all__ = ["compile_layers"]
