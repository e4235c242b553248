"""Examples -> fixed-length training samples ("bins"), and the item API the sampler and loop read.

An example is stored as its tokens and, per position, the target that position is trained to predict (the next token
of the same example where that token's label is trained, else -1). So a position never predicts across examples: the
last token of every example has no target. With packing, whole examples go into bins of seq_len tokens by best fit
(or next fit: data.pack_in_order), in the (seeded, shuffled) example order; no example is split across bins. Without
packing, each example gets a bin of its own. The rest of a bin is padding: pad tokens, never trained, one more
segment.
"""
from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np

IGNORE = -100
ARRAYS = ("ids", "tgt", "ex", "bins")


def ragged_take(offsets: np.ndarray, order: np.ndarray, lengths: np.ndarray | None = None):
    """Flat indices of examples `order` (each cut to `lengths`, if given) back to back, and their new offsets."""
    order = np.asarray(order, dtype=np.int64)
    starts = offsets[:-1][order]
    lens = (offsets[1:] - offsets[:-1])[order] if lengths is None else np.asarray(lengths, dtype=np.int64)
    new = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(lens, out=new[1:])
    idx = np.arange(new[-1], dtype=np.int64) - np.repeat(new[:-1] - starts, lens)
    return idx, new


def targets(labels: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Shift HF-style labels (aligned with input_ids, -100 = untrained) to per-position targets (-1 = none)."""
    n = len(labels)
    tgt = np.full(n, -1, dtype=np.int32)
    if n > 1:
        nxt = labels[1:].astype(np.int64)
        same = np.ones(n - 1, dtype=bool)
        ends = offsets[1:-1] - 1  # last position of every example but the final one
        same[ends[(ends >= 0) & (ends < n - 1)]] = False
        tgt[:-1] = np.where(same & (nxt != IGNORE), nxt, -1)
    return tgt


def best_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of example indices, each summing to at most `capacity`: every example, in the given order, goes into
    the open bin it fills most tightly (a new bin if none fits). Open bins are kept by remaining space, so one
    example costs a bisection over at most capacity+1 distinct values."""
    bins: list[list[int]] = []
    spaces: list[int] = []            # sorted distinct remaining capacities of open bins
    by_space: dict[int, list[int]] = {}
    for i, n in enumerate(lengths.tolist()):
        k = bisect.bisect_left(spaces, n)
        if k < len(spaces):
            space = spaces[k]
            b = by_space[space].pop()
            if not by_space[space]:
                del by_space[space]
                spaces.pop(k)
        else:
            b, space = len(bins), capacity
            bins.append([])
        bins[b].append(i)
        left = space - n
        if left > 0:
            if left not in by_space:
                by_space[left] = []
                bisect.insort(spaces, left)
            by_space[left].append(b)
    return bins


def next_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins in the examples' order: each example joins the last bin where it fits, else opens the next (Axolotl's
    sample_packing_sequentially), so that bins taken in order meet the examples in the order given."""
    bins: list[list[int]] = []
    left = 0
    for i, n in enumerate(lengths.tolist()):
        if bins and n <= left:
            bins[-1].append(i)
            left -= n
        else:
            bins.append([i])
            left = capacity - n
    return bins


def write_split(d: Path, ids: np.ndarray, tgt: np.ndarray, offsets: np.ndarray, seq_len: int,
                pack: bool, in_order: bool = False) -> dict:
    """Bin the examples (in their current order; packed by best fit, or by next fit `in_order`) and write them to
    `d`; returns the split's statistics."""
    d.mkdir(parents=True, exist_ok=True)
    lengths = np.diff(offsets)
    groups = ((next_fit if in_order else best_fit)(lengths, seq_len) if pack else
              [[i] for i in range(len(lengths))])
    order = np.asarray([i for g in groups for i in g], dtype=np.int64)
    idx, ex = ragged_take(offsets, order)
    bins = np.zeros(len(groups) + 1, dtype=np.int64)
    np.cumsum([len(g) for g in groups], out=bins[1:])
    np.save(d / "ids.npy", ids[idx].astype(np.int32))
    np.save(d / "tgt.npy", tgt[idx].astype(np.int32))
    np.save(d / "ex.npy", ex)
    np.save(d / "bins.npy", bins)
    real, trained = int(lengths.sum()), int((tgt >= 0).sum())
    return {"examples": int(len(lengths)), "bins": len(groups), "tokens": real, "trained_tokens": trained,
            "packing_efficiency": round(real / max(1, len(groups) * seq_len), 4), "packed": pack}


class SFTDataset:
    """Bins on disk as training samples: `ds[i]` -> tokens, labels (0 where untrained), loss_mask, position_ids
    (restarting at 0 per example and for the padding), segment_ids (examples numbered in the bin; padding the
    next number), attention_mask (1 for the examples' tokens, 0 for the padding, as transformers' collators: a
    mixture of experts' load-balancing statistic leaves padding out) -- the item API of
    adapter.data.pretraining.PackedDataset."""

    def __init__(self, d: Path, seq_len: int, pad_id: int):
        self.path, self.seq_len, self.pad_id = Path(d), seq_len, pad_id
        self.ids, self.tgt, self.ex, self.bins = (np.load(self.path / f"{n}.npy", mmap_mode="r") for n in ARRAYS)

    def __len__(self) -> int:
        return len(self.bins) - 1

    def examples(self, i: int) -> np.ndarray:
        """Token offsets of bin i's examples (relative to the bin start), with the end of the last."""
        e0, e1 = int(self.bins[i]), int(self.bins[i + 1])
        ex = np.asarray(self.ex[e0:e1 + 1], dtype=np.int64)
        return ex - ex[0]

    def longest(self) -> int:
        """Tokens of the longest example (what a sliding attention window must cover)."""
        return int(np.diff(np.asarray(self.ex, dtype=np.int64)).max()) if len(self.ex) > 1 else 0

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        s, bounds = self.seq_len, self.examples(i)
        a = int(self.ex[int(self.bins[i])])
        n = int(bounds[-1])
        tokens = np.full(s, self.pad_id, dtype=np.int64)
        tokens[:n] = self.ids[a:a + n]
        tgt = np.full(s, -1, dtype=np.int64)
        tgt[:n] = self.tgt[a:a + n]
        lens = np.diff(bounds)
        segment = np.full(s, len(lens), dtype=np.int64)
        segment[:n] = np.repeat(np.arange(len(lens)), lens)
        position = np.arange(s, dtype=np.int64)
        position[:n] -= np.repeat(bounds[:-1], lens)
        position[n:] -= n
        real = np.zeros(s, dtype=np.int64)
        real[:n] = 1
        return {"tokens": tokens, "labels": np.maximum(tgt, 0), "loss_mask": (tgt >= 0).astype(np.float32),
                "position_ids": position, "segment_ids": segment, "attention_mask": real}


def trim_tail(batch: dict, multiple: int) -> dict:
    """A host micro-batch of unpacked examples cut after its last trained position, rounded up to `multiple` (at
    most the full length). Exact under causal attention: no kept position attends to the cut tail, and the tail
    is never trained. Unpacked SFT samples are one example padded to seq_len, so this is Axolotl's pad-to-longest
    without giving up fixed multiples (CP's 2·cp chunks, SP's tp shards, kernel-friendly lengths)."""
    mask = batch["loss_mask"]
    s = mask.shape[1]
    trained = mask.reshape(-1, s).any(0).nonzero()
    used = int(trained.max()) + 1 if trained.numel() else 1
    keep = min(s, -(-used // multiple) * multiple)
    return batch if keep == s else {k: v[:, :keep] for k, v in batch.items()}


__all__ = ["SFTDataset", "best_fit", "next_fit", "targets", "ragged_take", "write_split", "trim_tail"]
