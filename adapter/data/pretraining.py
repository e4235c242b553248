"""Pretraining samples: the token stream of `data.files` (adapter/data/token_cache.py) cut into fixed-length samples.

As Megatron's GPTDataset: sample i is tokens [i·S, i·S + S], inputs [:-1], labels [1:]. Documents do not leak into
each other's loss: the label after a document's last token (the next document's first token) has loss_mask 0, and
position_ids restart at 0 at each document start (and at the sample start, as attention cannot see further back).
`segment_ids` number the documents inside a sample, for attention within documents (adapter/kernels/thd.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from adapter.data.token_cache import TokenCache, build_token_cache
from adapter.errors import bad


class PackedDataset:
    """Fixed-length samples over the concatenated token stream (see the module docstring for the masking rules)."""

    def __init__(self, cache: TokenCache, seq_len: int):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise bad("seq_len", seq_len, "must be a positive integer", "set seq_len to e.g. 2048")
        n = len(cache.tokens)
        if n < seq_len + 1:
            raise bad("data.files", cache.path.name, f"only {n} tokens, fewer than one sample of seq_len+1="
                      f"{seq_len + 1}", "add data or lower seq_len")
        self.cache, self.seq_len = cache, seq_len
        self.starts = cache.doc_offsets[:-1]

    def __len__(self) -> int:
        return (len(self.cache.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        s = i * self.seq_len
        g = np.arange(s, s + self.seq_len + 1)
        window = np.asarray(self.cache.tokens[s:s + self.seq_len + 1], dtype=np.int64)
        doc = np.searchsorted(self.starts, g, side="right") - 1
        doc_start = self.starts[doc]
        return {
            "tokens": window[:-1],
            "labels": window[1:],
            "loss_mask": (doc_start[1:] != g[1:]).astype(np.float32),  # 0 where the label opens a new document
            "position_ids": (g - np.maximum(doc_start, s))[:-1],
            "segment_ids": (doc - doc[0])[:-1],
        }


def open_dataset(files: str | Path | Sequence[str | Path], tokenizer_dir: str | Path, cache_dir: str | Path,
                 seq_len: int, **cache_kwargs: Any) -> PackedDataset:
    return PackedDataset(build_token_cache(files, tokenizer_dir, cache_dir, **cache_kwargs), seq_len)
