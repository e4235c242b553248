"""`model.compile`: each transformer layer's forward (and, through AOTAutograd, its backward) as one torch.compile'd
graph.

Why: on the Llama-3.2-1B shape the forward pass is bound by the CPU, not the GPU: Megatron's layer issues ~40
eager ops per layer, each a Python dispatch and a kernel launch, and the H200 finishes them faster than the host
issues them (docs/BENCHMARKS.md, session 4). One compiled graph per layer fuses the norms, residual adds, casts and
RoPE into a few kernels and replaces the per-op Python with one guarded call; the 16 identical layers share one
graph (torch inlines nn.Module attributes as graph inputs), so it compiles once.

Where it stops: Megatron's tensor-parallel linears are autograd Functions with asynchronous collectives, which
Dynamo does not trace, so with tp > 1 the graph breaks at every linear (correct, but little is fused). ZeRO-3
swaps parameter storage in and out around each gather unit, which a compiled graph's saved tensors do not follow,
so `deepspeed_config.zero_stage` refuses the combination.
"""
from __future__ import annotations

import torch

from adapter.patches.mcore import quiet_row_parallel_group


def compile_layers(model: torch.nn.Module) -> int:
    """Compile every decoder layer in place (forward only: module hooks stay eager). Returns how many."""
    quiet_row_parallel_group()
    layers = list(model.decoder.layers)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=False)
    return len(layers)


__all__ = ["compile_layers"]
