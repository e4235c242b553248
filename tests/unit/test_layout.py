"""The layout's groups equal torch DeviceMesh's (Accelerate's dim order) and megatron-core's, on real gloo groups."""
from __future__ import annotations

import pytest

from adapter.errors import UserError
from adapter.parallel.layout import Axis, Layout

NAMES = ("tp", "cp", "dp_shard", "dp_replicate", "dp", "dp_cp", "dp_shard_cp")


def test_notes_example_world16():
    lay = Layout(dp_replicate=2, dp_shard=2, cp=2, tp=2)
    assert lay.groups("tp")[:3] == ((0, 1), (2, 3), (4, 5))
    assert lay.groups("cp")[:4] == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert lay.groups("dp_shard")[:5] == ((0, 4), (1, 5), (2, 6), (3, 7), (8, 12))
    assert lay.groups("dp_replicate")[:2] == ((0, 8), (1, 9))
    assert lay.groups("dp")[:2] == ((0, 4, 8, 12), (1, 5, 9, 13))
    assert lay.groups("dp_shard_cp")[:3] == ((0, 2, 4, 6), (1, 3, 5, 7), (8, 10, 12, 14))


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 1, 2), (1, 4, 2, 2), (3, 1, 2, 1)])
def test_rank_coords_roundtrip_and_partition(shape):
    lay = Layout(*shape)
    for r in range(lay.world):
        assert lay.rank(lay.coords(r)) == r
        c = lay.coords(r)
        want = ((c[Axis.DP_REPLICATE] * lay.dp_shard + c[Axis.DP_SHARD]) * lay.cp + c[Axis.CP]) * lay.tp + c[Axis.TP]
        assert r == want
    for name in NAMES:  # every kind of group partitions the world
        members = sorted(x for g in lay.groups(name) for x in g)
        assert members == list(range(lay.world))
        assert all(len(g) == lay.size(name) for g in lay.groups(name))


def test_nodes_and_crossing():
    lay = Layout(2, 4, 1, 2, gpus_per_node=8)
    assert lay.nodes == 2 and lay.node(9) == 1 and lay.local_rank(9) == 1
    assert lay.crosses_nodes("dp_replicate") and not lay.crosses_nodes("tp") and not lay.crosses_nodes("dp_shard")
    assert Layout(1, 1, 1, 16, gpus_per_node=8).crosses_nodes("tp")
    assert lay.data_rank(0) == lay.data_rank(1) == 0 and lay.data_rank(8) == 4


def test_bad_sizes():
    with pytest.raises(UserError, match="tp_size=0: tp_size must be at least 1"):
        Layout(1, 1, 1, 0)
    with pytest.raises(UserError, match="gpus_per_node=3"):
        Layout(1, 4, 1, 2, gpus_per_node=3)


