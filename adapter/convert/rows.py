"""Row plans: every transform in the tables only moves whole rows, so each output chunk is a list of row runs.

Running a table's forward transform on row *indices* instead of weights gives, for every Megatron row, the HF part
and row it comes from (0 = zero padding). A chunk is then filled with a few positioned reads straight from the input
file into its output buffer: no intermediate tensors, and memory bounded by one chunk. The tensor-level transforms
stay the definition (and `verify` checks the result through the independent inverse transforms).
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache

import numpy as np
import torch

from adapter.models.mapping import Ctx, Rule, hf_shape


@cache
def row_map(rule: Rule, ctx: Ctx) -> tuple[np.ndarray, np.ndarray]:
    """(for each Megatron row: 0 for padding else 1 + row in the concatenated HF parts; part start offsets)."""
    if not rule.rowwise:
        raise NotImplementedError(f"{type(rule).__name__} is not row-wise; mark a rule rowwise only if it moves "
                                  "whole rows")
    rows = [hf_shape(spec, ctx.arch)[0] for _, spec in rule.hf]
    bounds = np.concatenate([[0], np.cumsum(rows)])
    idx = [torch.arange(b + 1, b + r + 1, dtype=torch.int64) for b, r in zip(bounds[:-1], rows)]
    return rule.to_megatron(idx, ctx).numpy(), bounds


def megatron_shape(rule: Rule, ctx: Ctx) -> tuple[int, ...]:
    """Per-layer global shape of `rule`'s Megatron tensor: row-wise ops keep the trailing dims."""
    return (len(row_map(rule, ctx)[0]), *hf_shape(rule.hf[0][1], ctx.arch)[1:])


def contiguous_strides(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(tuple(shape)):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def runs(sel: np.ndarray, bounds: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Coalesce a row selection into (dst_row, part, src_row, count) runs; part -1 marks zero rows."""
    n = len(sel)
    if n == 0:
        return []
    k = sel - 1
    part = np.where(sel > 0, np.searchsorted(bounds, k, side="right") - 1, -1)
    brk = np.ones(n, dtype=bool)
    brk[1:] = (part[1:] != part[:-1]) | ((part[1:] >= 0) & (sel[1:] - sel[:-1] != 1))
    starts = np.flatnonzero(brk)
    ends = np.append(starts[1:], n)
    return [(int(s), int(part[s]), int(k[s] - bounds[part[s]]) if part[s] >= 0 else 0, int(e - s))
            for s, e in zip(starts, ends)]


def inverse(sel: np.ndarray, total: int) -> np.ndarray:
    """For every concatenated HF row, the Megatron row holding it."""
    inv = np.full(total, -1, dtype=np.int64)
    pos = np.flatnonzero(sel > 0)
    inv[sel[pos] - 1] = pos
    if (inv < 0).any():
        raise AssertionError("row map drops HF rows")
    return inv


class Pool:
    """Reused byte buffers. Fresh memory is slow to fault in (notably on VMs with free-page reporting), and DCP's
    writer clones any tensor that does not own its whole storage; a tensor made by frombuffer owns exactly its bytes."""

    def __init__(self):
        self.bufs: dict[str, bytearray] = {}

    def reserve(self, slot: str, nbytes: int) -> None:
        if len(self.bufs.get(slot, b"")) < nbytes:
            self.bufs[slot] = bytearray(nbytes)  # never resized in place: live tensors may still export it

    def tensor(self, slot: str, shape, dtype: torch.dtype) -> torch.Tensor:
        n = torch.Size(shape).numel() * dtype.itemsize
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        self.reserve(slot, n)
        return torch.frombuffer(self.bufs[slot], dtype=torch.uint8, count=n).view(dtype).view(shape)


class Prefetch:
    """Makes items of a known order one ahead on a worker thread, into two alternating buffer slots.

    Reading the next piece overlaps writing the current one (both release the GIL). A consumer must be done with an
    item before asking for the next (true of DCP's serial writer and of ours). A request out of the expected order is
    simply made on the spot, so a wrong guess costs time, never correctness.
    """

    def __init__(self, order: list, make: Callable[[object, str], torch.Tensor]):
        self.order, self.make = order, make
        self.index = {item: i for i, item in enumerate(order)}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nd-convert-prefetch")
        self.pending: tuple[object, Future] | None = None

    def get(self, item) -> torch.Tensor:
        i = self.index[item]
        if self.pending is not None and self.pending[0] == item:
            out = self.pending[1].result()
        else:
            if self.pending is not None:
                self.pending[1].result()  # it may share state (staging) with the make below
            out = self.make(item, f"buf{i % 2}")
        self.pending = None
        if i + 1 < len(self.order):
            nxt = self.order[i + 1]
            self.pending = (nxt, self.pool.submit(self.make, nxt, f"buf{(i + 1) % 2}"))
        return out

    def close(self) -> None:
        if self.pending is not None:
            self.pending[1].cancel()
        self.pool.shutdown(wait=True)
