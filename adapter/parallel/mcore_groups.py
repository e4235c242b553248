"""Layout -> Megatron-Core parallel_state (the call: adapter/parallel/mcore_call.py), and a check that what Megatron
built is what the layout says. Megatron has no dp_shard-alone or dp_replicate group, so those two are created here,
from the same layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist
from megatron.core import parallel_state as ps

from adapter.errors import bad
from adapter.parallel.layout import Layout
from adapter.parallel.mcore_call import initialize_kwargs

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass
class Groups:
    """Process groups of this rank, one per layout group name (torch ProcessGroup objects)."""

    tp: ProcessGroup
    cp: ProcessGroup
    dp: ProcessGroup
    dp_cp: ProcessGroup
    dp_shard_cp: ProcessGroup
    dp_shard: ProcessGroup
    dp_replicate: ProcessGroup
    ep: ProcessGroup | None = None             # expert-parallel ranks (mixtures of experts)
    expt_dp: ProcessGroup | None = None        # the ranks holding the same experts
    expt_dp_shard: ProcessGroup | None = None  # those of them in this rank's replica (exact HSDP partitions experts
    #                                            over it)


def _new_groups(layout: Layout, name: str, rank: int) -> ProcessGroup:
    """Every rank must create every group, in the same order (torch.distributed rule). Returns `rank`'s."""
    mine: ProcessGroup | None = None
    for members in layout.groups(name):
        g = dist.new_group(list(members))
        if rank in members:
            mine = g
    if mine is None:  # the layout's groups of a name partition its world, and initialize checked the world size
        raise RuntimeError(f"rank {rank} is in no {name} group of the layout ({layout.describe()})")
    return mine


def initialize(layout: Layout) -> Groups:
    """Build Megatron's groups for `layout` (torch.distributed must be up) and verify them against it."""
    if dist.get_world_size() != layout.world:
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
        ep=ps.get_expert_model_parallel_group(),
        expt_dp=ps.get_expert_data_parallel_group(),
        expt_dp_shard=(ps.get_expert_data_parallel_group(partial_expert_data_parallel=True)
                       if layout.dp_replicate > 1 else ps.get_expert_data_parallel_group()),
    )
    verify(layout, groups, rank)
    return groups


def verify(layout: Layout, groups: Groups, rank: int) -> None:
    """Fail fast if Megatron's rank order ever drifts from the layout (e.g. after a megatron-core upgrade)."""
    for name in ("tp", "cp", "dp", "dp_cp", "dp_shard_cp", "dp_shard", "dp_replicate", "ep", "expt_dp",
                 "expt_dp_shard"):
        got = tuple(dist.get_process_group_ranks(getattr(groups, name)))
        want = layout.group_of(name, rank)
        if got != want:
            raise RuntimeError(f"megatron-core built {name} group {got} on rank {rank}, layout expects {want}; "
                               "the rank order changed (check the megatron-core version)")


def destroy() -> None:
    ps.destroy_model_parallel()
