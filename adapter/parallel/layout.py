"""Pure rank arithmetic for the 4-D mesh (dp_replicate, dp_shard, cp, tp): no torch, no processes.

The order is Accelerate's (replication outermost, tp innermost, row-major): rank = ((r·S + s)·C + c)·T + t. It is
also what megatron-core's default order "tp-cp-ep-dp-pp" builds, so one table of groups serves Accelerate's
DeviceMesh, Megatron's parallel_state and DeepSpeed's MPU alike (tests check all three on real process groups).

Expert parallelism is not a fifth axis: as in Megatron-Core (expert order "tp-ep-dp-pp", expert tp = tp), the ep
ranks are the innermost factor of the flattened data-parallel × cp index m = (r·S + s)·C + c. Expert group of a
rank: the same t and m // ep; expert-data-parallel group (the ranks holding the same experts): the same t and m % ep;
its part inside one replica (`expt_dp_shard`, Megatron's intra-partial expert-data-parallel group) is what exact
HSDP partitions the experts over.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from itertools import product
from math import prod
from typing import TYPE_CHECKING

from adapter.errors import bad

if TYPE_CHECKING:
    from adapter.config.schema import ParallelismConfig


class Axis(str, Enum):
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"


ORDER = (Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP, Axis.TP)

# Every group a run uses, as the mesh axes it spans (flattened in mesh order, like DeviceMesh._flatten).
GROUPS: dict[str, tuple[Axis, ...]] = {
    "tp": (Axis.TP,),
    "cp": (Axis.CP,),
    "dp_shard": (Axis.DP_SHARD,),
    "dp_replicate": (Axis.DP_REPLICATE,),
    "dp": (Axis.DP_REPLICATE, Axis.DP_SHARD),
    "dp_cp": (Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP),
    "dp_shard_cp": (Axis.DP_SHARD, Axis.CP),
}

# Expert parallelism's groups (laid over dp_cp, not mesh axes): the experts' ranks, the ranks that hold the same
# experts (their gradients' data-parallel group), and those of them inside one replica
EXPERT_GROUPS = ("ep", "expt_dp", "expt_dp_shard")


@dataclass(frozen=True)
class Layout:
    """One frozen object owns the mesh shape, its validation and every derived group (cf. torchtitan ParallelDims)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    gpus_per_node: int | None = None
    ep: int = 1  # expert-parallel ranks, laid over dp × cp (module docstring)

    def __post_init__(self) -> None:
        for axis in ORDER:
            n = getattr(self, axis.value)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise bad(f"{axis.value}_size", n, f"{axis.value}_size must be at least 1", "use an integer ≥ 1")
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise bad("ep_size", self.ep, "ep_size must be at least 1", "use an integer ≥ 1")
        if self.size("dp_shard_cp") % self.ep:  # within one replica: every replica holds every expert
            raise bad("ep_size", self.ep, f"does not divide dp_shard × cp = {self.size('dp_shard_cp')}: the "
                      "expert-parallel ranks are laid over the data-parallel and context-parallel ranks of one "
                      "replica", "use an ep_size that divides it (or raise dp_shard_size)")
        g = self.gpus_per_node
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise bad("gpus_per_node", g, "must be an integer ≥ 1", "pass --gpus-per-node N")
        if g is not None and self.world % g and self.world > g:
            raise bad("gpus_per_node", g, f"does not divide the world size {self.world}",
                      "use whole nodes: world size = nodes × gpus_per_node")

    @classmethod
    def from_config(cls, par: ParallelismConfig, gpus_per_node: int | None = None) -> Layout:
        return cls(par.dp_replicate_size, par.dp_shard_size or 1, par.cp_size, par.tp_size, gpus_per_node,
                   getattr(par, "ep_size", 1))

    # --- shape ---------------------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def world(self) -> int:
        return prod(self.shape)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def size(self, group: str) -> int:
        if group in EXPERT_GROUPS:
            return {"ep": self.ep, "expt_dp": self.size("dp_cp") // self.ep,
                    "expt_dp_shard": self.size("dp_shard_cp") // self.ep}[group]
        return prod(getattr(self, a.value) for a in GROUPS[group])

    @property
    def nodes(self) -> int:
        g = self.gpus_per_node or self.world
        return max(1, -(-self.world // g))

    # --- coordinates ---------------------------------------------------------------------------------------------
    def coords(self, rank: int) -> dict[Axis, int]:
        if not 0 <= rank < self.world:
            raise bad("rank", rank, f"outside the world of {self.world}", f"use 0..{self.world - 1}")
        out = {}
        for axis in reversed(ORDER):
            n = getattr(self, axis.value)
            out[axis] = rank % n
            rank //= n
        return {a: out[a] for a in ORDER}

    def rank(self, coords: dict[Axis, int]) -> int:
        r = 0
        for axis in ORDER:
            r = r * getattr(self, axis.value) + coords.get(axis, 0)
        return r

    def node(self, rank: int) -> int:
        return rank // (self.gpus_per_node or self.world)

    def local_rank(self, rank: int) -> int:
        return rank % (self.gpus_per_node or self.world)

    # --- groups --------------------------------------------------------------------------------------------------
    @cached_property
    def _groups(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        out = {name: self._build(axes) for name, axes in GROUPS.items()}
        ep, tp = self.ep, self.tp
        m = self.size("dp_cp")
        out["ep"] = tuple(sorted(tuple(i * tp + t for i in range(j * ep, (j + 1) * ep))
                                 for j in range(m // ep) for t in range(tp)))
        out["expt_dp"] = tuple(sorted(tuple(i * tp + t for i in range(e, m, ep)) for e in range(ep) for t in range(tp)))
        r = self.size("dp_shard_cp")  # m's of one replica: [j·r, (j + 1)·r)
        out["expt_dp_shard"] = tuple(sorted(tuple(i * tp + t for i in range(j * r + e, (j + 1) * r, ep))
                                            for j in range(self.dp_replicate) for e in range(ep) for t in range(tp)))
        return out

    def _build(self, axes: tuple[Axis, ...]) -> tuple[tuple[int, ...], ...]:
        fixed = [a for a in ORDER if a not in axes]
        out = []
        for fixed_vals in product(*(range(getattr(self, a.value)) for a in fixed)):
            base = dict(zip(fixed, fixed_vals))
            members = [self.rank({**base, **dict(zip(axes, vals))})
                       for vals in product(*(range(getattr(self, a.value)) for a in axes))]
            out.append(tuple(members))
        return tuple(sorted(out))

    def groups(self, name: str) -> tuple[tuple[int, ...], ...]:
        """All groups of one kind, each a tuple of global ranks in mesh order, sorted by first member."""
        return self._groups[name]

    def group_of(self, name: str, rank: int) -> tuple[int, ...]:
        return next(g for g in self._groups[name] if rank in g)

    @cached_property
    def _crossing(self) -> dict[str, bool]:
        return {name: any(len({self.node(r) for r in g}) > 1 for g in gs) for name, gs in self._groups.items()}

    def crosses_nodes(self, name: str) -> bool:
        return self._crossing[name]  # cached: plan --search asks it thousands of times per layout

    def data_rank(self, rank: int) -> int:
        """Which data shard a rank reads: ranks of one tp×cp block share it (Accelerate: rank // (tp·cp))."""
        c = self.coords(rank)
        return c[Axis.DP_REPLICATE] * self.dp_shard + c[Axis.DP_SHARD]

    def rank_table(self) -> list[dict[str, int]]:
        return [{"rank": r, "node": self.node(r), "local_rank": self.local_rank(r),
                 **{a.value: v for a, v in self.coords(r).items()}} for r in range(self.world)]

    def describe(self) -> str:
        return (" × ".join(f"{a.value}={getattr(self, a.value)}" for a in ORDER) + f" = {self.world}"
                + (f" (ep={self.ep} over dp × cp)" if self.ep > 1 else ""))
