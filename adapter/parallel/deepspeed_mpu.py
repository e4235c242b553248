"""The object DeepSpeed calls for group information (`mpu=`), built from our groups.

megatron.core.parallel_state cannot be passed as-is (DeepSpeed asks for get_model_parallel_*, which it lacks).
What DeepSpeed's "data parallel" means differs by use: its group is what ZeRO partitions over (dp_shard×cp for exact
HSDP, dp×cp otherwise) while its world size feeds batch math (dp_replicate·dp_shard: cp ranks share a batch).
Never add an attribute named `initialize_sequence_parallel`: DeepSpeed then treats this as a Ulysses MPU.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class DeepSpeedMPU:
    def __init__(self, *, tp_group: ProcessGroup, partition_group: ProcessGroup, dp_world_size: int,
                 replica_group: ProcessGroup | None = None) -> None:
        self._tp = tp_group
        self._partition = partition_group
        self._dp_world = dp_world_size
        self.replica_group = replica_group  # exact HSDP: gradients are averaged over it after each backward

    # data parallel (ZeRO partitioning group; world size for batch math)
    def get_data_parallel_group(self) -> ProcessGroup:
        return self._partition

    def get_data_parallel_world_size(self) -> int:
        return self._dp_world

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self._partition)

    # DeepSpeed's "sequence data parallel" world sizes its checkpoint bookkeeping (how many ZeRO shard files a
    # save writes and a load reads): it must be the partition group, which includes cp ranks.
    def get_sequence_data_parallel_group(self) -> ProcessGroup:
        return self._partition

    def get_sequence_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self._partition)

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank(self._partition)

    # model parallel == tensor parallel (no pipeline stages)
    def get_model_parallel_group(self) -> ProcessGroup:
        return self._tp

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self._tp)

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self._tp)

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_process_group_ranks(self._tp)[0]

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0
