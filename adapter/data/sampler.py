"""Samples -> one deterministic, resumable micro-batch stream per data-parallel rank."""
from __future__ import annotations

import signal
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np

from adapter.errors import bad


class DPSampler:
    """Infinite, deterministic stream of micro-batch indices for one data-parallel rank.

    Each round of dp_size·micro_batch consecutive samples of the epoch's permutation is split by dp_rank, so DP
    ranks are disjoint and the TP/CP ranks that share a dp_rank get the same batch. An epoch's tail that cannot fill
    a round is skipped (every rank must take the same number of steps); the next epoch reshuffles with seed+epoch.
    The state is global (epoch, samples of it consumed by all ranks), so it is the same on every rank and resuming
    with another dp_size or micro_batch continues at the same place in the data.
    """

    def __init__(self, num_samples: int, *, dp_rank: int, dp_size: int, micro_batch: int, seed: int = 0,
                 shuffle: bool = True, data_key: str = "data.files"):
        if micro_batch < 1:
            raise bad("micro_batch_size", micro_batch, "must be at least 1", "set a positive micro-batch size")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside dp_size {dp_size}")
        if num_samples < dp_size * micro_batch:
            raise bad(data_key, num_samples, f"only that many samples, fewer than one round of dp_size×micro_batch"
                      f" = {dp_size * micro_batch}", "add data, or lower seq_len or micro_batch_size")
        self.data_key = data_key  # the config key that names the data, for errors
        self.num_samples, self.dp_rank, self.dp_size, self.micro_batch = num_samples, dp_rank, dp_size, micro_batch
        self.seed, self.shuffle = seed, shuffle
        self.epoch = self.offset = 0
        self._order: tuple[int, np.ndarray] | None = None

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // (self.dp_size * self.micro_batch)

    def order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            perm = (np.random.default_rng([self.seed, epoch]).permutation(self.num_samples) if self.shuffle
                    else np.arange(self.num_samples))
            self._order = (epoch, perm)
        return self._order[1]

    def __iter__(self) -> Iterator[list[int]]:
        step = self.dp_size * self.micro_batch
        while True:
            if self.offset + step > self.num_samples:
                self.epoch, self.offset = self.epoch + 1, 0
            lo = self.offset + self.dp_rank * self.micro_batch
            idx = self.order(self.epoch)[lo:lo + self.micro_batch]
            self.offset += step  # before the yield: the state counts what the consumer has been handed
            yield idx.tolist()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "num_samples": self.num_samples, "seed": self.seed,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_samples"] != self.num_samples:
            raise bad(self.data_key, self.num_samples, f"the checkpoint was trained on {state['num_samples']} samples,"
                      " this data gives a different count", "resume with the same data and seq_len, or start a"
                      " fresh run in an empty checkpoint directory")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.seed, self.shuffle = state["seed"], state["shuffle"]  # the checkpoint's order wins, for exact resume


def build_batches(dataset, sampler: DPSampler, *, workers: int = 0, prefetch: int = 2, pin: bool = False,
                  stop_signals: tuple[int, ...] = ()) -> Iterator[dict[str, Any]]:
    """Endless dicts of [micro_batch, seq_len] tensors from `dataset[i]` (e.g. a PackedDataset): tokens, labels,
    position_ids, segment_ids (int64) and loss_mask (float32). Take `sampler.state_dict()` between steps: it counts
    exactly the batches yielded so far.

    `workers` > 0: the micro-batches are rendered ahead in that many worker processes (torch's DataLoader, each
    holding `prefetch` batches; `pin`: in page-locked memory, so that the copy to the GPU overlaps), as Axolotl's
    `dataloader_num_workers` does. Worth it only where `collate` does real work: an image-text dataset's processor
    took about 200 ms of a 0.7 s step on one H100, with the GPU idle (docs/BENCHMARKS.md 2026-12-07). The workers
    draw their indices from a copy of `sampler`; `sampler` itself moves on as each batch is handed over, so a
    checkpoint's state is that of the batches trained, not of those rendered ahead, and resume stays exact.
    `stop_signals` (checkpoint.exit_signals, and SIGINT) are ignored by the workers: a cluster's SIGTERM reaches
    every process of the job, and a worker it ended would end the training process at its next batch (torch's
    DataLoader raises on a dead worker), before the step the signal asks to finish and save. The workers end with
    the loader, or with the training process."""
    if workers <= 0:
        for idx in sampler:
            yield collate(dataset, [dataset[i] for i in idx])
        return
    import copy

    from torch.utils.data import DataLoader

    ahead = copy.deepcopy(sampler)
    loader = DataLoader(_MicroBatches(dataset), sampler=ahead, batch_size=None, collate_fn=_as_is,
                        num_workers=workers, prefetch_factor=prefetch, pin_memory=pin,
                        worker_init_fn=partial(_ignore_signals, (*stop_signals, int(signal.SIGINT))))
    for batch, _ in zip(loader, sampler):
        if isinstance(batch, _Failed):  # a worker's error, raised here as it is (one line for a UserError)
            raise batch.error
        yield batch


class _MicroBatches:
    """A DataLoader's map-style dataset whose keys are micro-batches' index lists."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __getitem__(self, idx: list[int]):
        try:
            return collate(self.dataset, [self.dataset[i] for i in idx])
        except Exception as e:  # noqa: BLE001 -- DataLoader would re-raise it wrapped in a worker's traceback
            return _Failed(e)


class _Failed:
    def __init__(self, error: Exception):
        self.error = error


def _ignore_signals(signals: tuple[int, ...], _worker: int) -> None:
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)


def _as_is(batch):
    return batch


def collate(dataset, items: list[dict]) -> dict[str, Any]:
    """One micro-batch of `dataset`'s items: the dataset's own `collate` where it has one (image-text rows, which
    its processor renders: adapter/data/sft/multimodal.py), else their arrays stacked."""
    import torch

    if hasattr(dataset, "collate"):
        return dataset.collate(items)
    return {k: torch.from_numpy(np.stack([it[k] for it in items])) for k in items[0]}
