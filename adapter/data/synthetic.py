"""Deterministic random tokens, for benchmarks and rehearsals without data files (the same item API as
PackedDataset: every token trained, one document per sample, or documents of about `doc_len` tokens each, so
packed-document attention can be benchmarked without a corpus)."""
from __future__ import annotations

import numpy as np


class SyntheticData:
    def __init__(self, vocab: int, seq_len: int, seed: int, n: int = 4096, doc_len: int | None = None):
        self.vocab, self.seq_len, self.seed, self.n, self.doc_len = vocab, seq_len, seed, n, doc_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, i])
        window = rng.integers(0, self.vocab, self.seq_len + 1)
        s = self.seq_len
        segment = np.zeros(s, np.int64)
        if self.doc_len:  # lengths uniform in [doc_len/2, 3·doc_len/2]; the last document is cut by the sample end
            lo = max(1, self.doc_len // 2)
            lens = rng.integers(lo, self.doc_len * 3 // 2 + 1, s // lo + 1)
            starts = np.cumsum(lens)[:-1]
            segment[starts[starts < s]] = 1
            segment = np.cumsum(segment)
        new_doc = np.r_[segment[1:] != segment[:-1], False]  # the label after a document's last token opens the next
        first = np.r_[0, np.flatnonzero(segment[1:] != segment[:-1]) + 1]
        return {"tokens": window[:-1], "labels": window[1:], "loss_mask": (~new_doc).astype(np.float32),
                "position_ids": np.arange(s) - first[segment], "segment_ids": segment}
