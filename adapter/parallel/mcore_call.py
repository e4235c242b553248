"""The `initialize_model_parallel(...)` call a layout maps onto. Torch-free: `plan` prints it, adapter/parallel/
mcore_groups.py makes it.

Megatron-Core builds tp, cp, dp and dp-with-cp itself; its default order "tp-cp-ep-dp-pp" (first varies fastest) is
our mesh order, and `num_distributed_optimizer_instances = dp_replicate` also gives the dp_shard×cp group ZeRO-3
partitions over. Its expert groups (order "tp-ep-dp-pp", expert tp = tp) are the layout's ep / expt_dp.
"""
from __future__ import annotations

from typing import Any

from adapter.parallel.layout import Layout


def initialize_kwargs(layout: Layout) -> dict[str, Any]:
    return {
        "tensor_model_parallel_size": layout.tp,
        "pipeline_model_parallel_size": 1,
        "context_parallel_size": layout.cp,
        "expert_model_parallel_size": layout.ep,
        "num_distributed_optimizer_instances": layout.dp_replicate,
        "order": "tp-cp-ep-dp-pp",
        "create_gloo_process_groups": False,
    }


def call_string(layout: Layout) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in initialize_kwargs(layout).items())
    return f"megatron.core.parallel_state.initialize_model_parallel({args})"


__all__ = ["initialize_kwargs", "call_string"]
