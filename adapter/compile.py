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
so `ds_config.zero_stage` refuses the combination.
"""
from __future__ import annotations

import torch


def _quiet_row_parallel_group() -> None:
    """Megatron 0.16's RowParallelLinear passes tp_group=None on every forward; the lookup then warns (on rank 0),
    and `warnings.warn` is a graph break. Resolve None to the TP group without the warning: same group, same math."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers

    original = layers.get_tensor_model_parallel_group_if_none
    if getattr(original, "_nd_quiet", False):
        return

    def group_if_none(tp_group, is_expert=False, check_initialized=True):
        if tp_group is None and not is_expert and parallel_state.is_initialized():
            return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)
        return original(tp_group, is_expert=is_expert, check_initialized=check_initialized)

    group_if_none._nd_quiet = True
    layers.get_tensor_model_parallel_group_if_none = group_if_none


def compile_layers(model: torch.nn.Module) -> int:
    """Compile every decoder layer in place (forward only: module hooks stay eager). Returns how many."""
    _quiet_row_parallel_group()
    layers = list(model.decoder.layers)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=False)
    return len(layers)


__all__ = ["compile_layers"]
