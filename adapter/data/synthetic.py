"""Deterministic random tokens, for benchmarks and rehearsals without data files (the same item API as
PackedDataset: every token trained, one document per sample)."""
from __future__ import annotations

import numpy as np


class SyntheticData:
    def __init__(self, vocab: int, seq_len: int, seed: int, n: int = 4096):
        self.vocab, self.seq_len, self.seed, self.n = vocab, seq_len, seed, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        window = np.random.default_rng([self.seed, i]).integers(0, self.vocab, self.seq_len + 1)
        return {"tokens": window[:-1], "labels": window[1:], "loss_mask": np.ones(self.seq_len, np.float32),
                "position_ids": np.arange(self.seq_len), "segment_ids": np.zeros(self.seq_len, np.int64)}
