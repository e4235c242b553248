"""Megatron-Core builds exactly the layout's groups (and DeviceMesh agrees), on real gloo process groups."""
from __future__ import annotations

import pytest

from adapter.parallel.layout import Layout
from tests.helpers.dist import run_workers

NAMES = ("tp", "cp", "dp_shard", "dp_replicate", "dp", "dp_cp", "dp_shard_cp")


# Real gloo groups are costly on 2 cores (megatron builds dozens of groups), so the real-process runs take a few
# shapes; the fake-backend test below checks megatron's construction for many more shapes and every rank.
SHAPES = {8: [(2, 2, 1, 2), (1, 2, 2, 2), (1, 8, 1, 1)], 16: [(2, 2, 2, 2)]}



FAKE_SHAPES = [(1, 8, 1, 1), (2, 2, 1, 2), (1, 2, 2, 2), (2, 1, 2, 2), (1, 1, 1, 8), (2, 2, 2, 1), (8, 1, 1, 1),
               (2, 4, 1, 2), (1, 2, 2, 4), (4, 1, 2, 2), (1, 1, 4, 4), (2, 2, 2, 2), (1, 1, 1, 1), (3, 2, 1, 2),
               # with expert parallelism (the 6th field, after gpus_per_node): over dp_shard, cp, both, with tp, HSDP
               (1, 4, 1, 2, None, 2), (1, 4, 1, 2, None, 4), (1, 2, 2, 2, None, 4), (1, 1, 2, 2, None, 2),
               (2, 2, 2, 1, None, 2), (2, 2, 2, 2, None, 4), (1, 8, 1, 1, None, 8)]



def _accelerate_mesh_groups(shape):
    """Mirror accelerate.ParallelismConfig.build_device_mesh: only dims > 1, flattened dp / dp_shard_cp / dp_cp."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sizes = dict(zip(("dp_replicate", "dp_shard", "cp", "tp"), shape))
    dims = [k for k, v in sizes.items() if v > 1]
    rank = dist.get_rank()
    out = {}
    if not dims:
        return {n: (rank,) for n in NAMES}
    mesh = init_device_mesh("cpu", tuple(sizes[d] for d in dims), mesh_dim_names=tuple(dims))
    flat = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
            "dp_cp": ("dp_replicate", "dp_shard", "cp")}
    for name in NAMES:
        axes = flat.get(name, (name,))
        live = tuple(a for a in axes if a in dims)
        if not live:
            out[name] = (rank,)
        elif len(live) == 1:
            out[name] = tuple(dist.get_process_group_ranks(mesh[live[0]].get_group()))
        else:
            sub = mesh[live]._flatten(f"{name}_flat")
            out[name] = tuple(dist.get_process_group_ranks(sub.get_group()))
    return out



def _megatron_groups(shape):
    """Megatron's own getters after our initialize (which also builds dp_shard/dp_replicate and verifies them)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from adapter.parallel import mcore_groups

    groups = mcore_groups.initialize(Layout(*shape))
    ranks = dist.get_process_group_ranks
    out = {"tp": tuple(ranks(ps.get_tensor_model_parallel_group())),
           "cp": tuple(ranks(ps.get_context_parallel_group())),
           "dp": tuple(ranks(ps.get_data_parallel_group())),
           "dp_cp": tuple(ranks(ps.get_data_parallel_group(with_context_parallel=True))),
           "dp_shard_cp": tuple(ranks(ps.get_data_parallel_group(with_context_parallel=True,
                                                                  partial_data_parallel=True))),
           "dp_shard": tuple(ranks(groups.dp_shard)),
           "dp_replicate": tuple(ranks(groups.dp_replicate))}
    ps.destroy_model_parallel()
    return out



def _compare_worker(rank, world, shapes):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    report = []
    for shape in shapes:
        lay = Layout(*shape)
        mesh = _accelerate_mesh_groups(shape)
        meg = _megatron_groups(shape)
        for name in NAMES:
            want = lay.group_of(name, rank)
            if mesh[name] != want:
                report.append(f"{shape} {name}: DeviceMesh {mesh[name]} != layout {want}")
            if name in meg and meg[name] != want:
                report.append(f"{shape} {name}: megatron {meg[name]} != layout {want}")
    dist.destroy_process_group()
    return report



@pytest.mark.slow
@pytest.mark.parametrize("world", [8, 16])
def test_groups_match_device_mesh_and_megatron(world):
    reports = run_workers(_compare_worker, world, SHAPES[world], timeout=300)
    problems = [p for r in reports for p in r]
    assert not problems, "\n".join(problems[:20])



def _fake_worker(rank, world, shapes):
    """megatron-core group construction for every rank of each shape, on torch's no-communication backend."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from adapter.parallel import mcore_groups

    problems = []
    for shape in shapes:
        lay = Layout(*shape)
        for r in range(lay.world):
            dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=lay.world)
            try:
                mcore_groups.initialize(lay)  # raises if any group differs from the layout
            except RuntimeError as e:
                problems.append(f"{shape} rank {r}: {e}")
            ps.destroy_model_parallel()
            dist.destroy_process_group()
    return problems



def test_megatron_groups_every_rank_fake_backend():
    (problems,) = run_workers(_fake_worker, 1, FAKE_SHAPES, timeout=300)
    assert not problems, "\n".join(problems[:20])


def _uneven(rank, world):
    """Megatron's sequence-parallel gather and its backward with per-rank counts (what the alltoall MoE dispatcher
    runs at tp > 1) over a gloo group, with the shared-GPU mode's patch."""
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    from adapter.patches.mcore import uneven_gloo_collectives

    dist.init_process_group("gloo")
    uneven_gloo_collectives()
    sizes = [3, 5]
    x = torch.arange(sizes[rank] * 2, dtype=torch.float32).reshape(-1, 2).add(100 * rank).requires_grad_()
    out = mappings.gather_from_sequence_parallel_region(x, group=dist.group.WORLD, output_split_sizes=sizes)
    (out * torch.arange(1, 9, dtype=torch.float32)[:, None]).sum().backward()  # each row's weight: its position + 1
    return out.detach().tolist(), x.grad.tolist()  # lists: a tensor's shared storage dies with its process


def test_uneven_gather_and_its_backward_over_gloo():
    """gloo has no uneven all_gather or reduce_scatter: without the patch the first call fails ("invalid tensor
    size", as ep=2 × tp=2 did on the GPU host in the shared-GPU mode). With it: every rank holds every row in rank
    order, and the backward's reduce-scatter gives each rank the summed gradient of its own rows (both ranks weight
    a row alike, so twice its weight)."""
    import torch

    (g0, d0), (g1, d1) = (tuple(map(torch.tensor, r)) for r in run_workers(_uneven, 2))
    want = torch.cat([torch.arange(6.).reshape(3, 2), torch.arange(10.).reshape(5, 2) + 100])
    assert torch.equal(g0, want) and torch.equal(g1, want)
    w = 2 * torch.arange(1, 9, dtype=torch.float32)[:, None].expand(8, 2)
    assert torch.equal(d0, w[:3]) and torch.equal(d1, w[3:])
