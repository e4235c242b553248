"""The order prepared examples take, as Axolotl's `merge_datasets` gives it (utils/data/shared.py at 067b021): the
merged datasets shuffled once with the seed (`shuffle_merged_datasets`), then held out from the tail (prepare.py,
preference.py). `curriculum_sampling` (data.curriculum) keeps one dataset's rows in their order; the sampler then
takes the samples in the prepared order every epoch (adapter/train/batches.shuffles).
"""
from __future__ import annotations

import numpy as np


def merged_shuffled(cfg, datasets: int) -> bool:
    """Whether the merged examples take the seed's permutation, as Axolotl's merge_datasets decides it:
    shuffle_merged_datasets, except that curriculum_sampling keeps ONE dataset's rows in their order (several are
    still shuffled together unless shuffle_merged_datasets is false: Axolotl warns and shuffles them)."""
    d = cfg.data
    return d.shuffle_merged_datasets and not (d.curriculum and datasets == 1)


def merged_order(cfg, n: int, datasets: int) -> np.ndarray:
    """The order of n merged examples of `datasets` datasets (merged_shuffled)."""
    return np.random.default_rng(cfg.data.seed).permutation(n) if merged_shuffled(cfg, datasets) else np.arange(n)
