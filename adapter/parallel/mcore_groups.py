"""Layout -> Megatron-Core parallel_state, and a check that what Megatron built is what the layout says.

Megatron-Core builds tp, cp, dp and dp-with-cp itself (its default order "tp-cp-ep-dp-pp" is our mesh order), and
with `num_distributed_optimizer_instances = dp_replicate` also the dp_shard×cp group that ZeRO-3 partitions over.
It has no dp_shard-alone or dp_replicate group, so those two are created here, from the same layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapter.parallel.layout import Layout


def initialize_kwargs(layout: Layout) -> dict[str, Any]:
    return {
        "tensor_model_parallel_size": layout.tp,
        "pipeline_model_parallel_size": 1,
        "context_parallel_size": layout.cp,
        "num_distributed_optimizer_instances": layout.dp_replicate,
        "order": "tp-cp-ep-dp-pp",
        "create_gloo_process_groups": False,
    }


def call_string(layout: Layout) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in initialize_kwargs(layout).items())
    return f"megatron.core.parallel_state.initialize_model_parallel({args})"


@dataclass
class Groups:
    """Process groups of this rank, one per layout group name (torch ProcessGroup objects)."""

    tp: Any
    cp: Any
    dp: Any
    dp_cp: Any
    dp_shard_cp: Any
    dp_shard: Any
    dp_replicate: Any


def _new_groups(layout: Layout, name: str, rank: int):
    """Every rank must create every group, in the same order (torch.distributed rule)."""
    import torch.distributed as dist

    mine = None
    for members in layout.groups(name):
        g = dist.new_group(list(members))
        if rank in members:
            mine = g
    return mine


def initialize(layout: Layout) -> Groups:
    """Build Megatron's groups for `layout` (torch.distributed must be up) and verify them against it."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if dist.get_world_size() != layout.world:
        from adapter.errors import bad

        raise bad("world_size", dist.get_world_size(),
                  f"the layout needs {layout.world} processes ({layout.describe()})",
                  f"launch {layout.world} processes or change the parallelism sizes")
    ps.initialize_model_parallel(**initialize_kwargs(layout))
    rank = dist.get_rank()
    groups = Groups(
        tp=ps.get_tensor_model_parallel_group(),
        cp=ps.get_context_parallel_group(),
        dp=ps.get_data_parallel_group(),
        dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
        dp_shard_cp=ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True),
        dp_shard=_new_groups(layout, "dp_shard", rank),
        dp_replicate=_new_groups(layout, "dp_replicate", rank),
    )
    verify(layout, groups, rank)
    return groups


def verify(layout: Layout, groups: Groups, rank: int) -> None:
    """Fail fast if Megatron's rank order ever drifts from the layout (e.g. after a megatron-core upgrade)."""
    import torch.distributed as dist

    for name in ("tp", "cp", "dp", "dp_cp", "dp_shard_cp", "dp_shard", "dp_replicate"):
        got = tuple(dist.get_process_group_ranks(getattr(groups, name)))
        want = layout.group_of(name, rank)
        if got != want:
            raise RuntimeError(f"megatron-core built {name} group {got} on rank {rank}, layout expects {want}; "
                               "the rank order changed (check the megatron-core version)")


def destroy() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
