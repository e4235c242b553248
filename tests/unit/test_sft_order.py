"""The order SFT trains its examples in, as Axolotl's curriculum_sampling and sample_packing_sequentially give it: one
dataset's rows in their file order (several datasets still shuffled together, as Axolotl's merge does), packed by
next fit, and the samples taken in that order every epoch."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapter.data.sampler import DPSampler
from adapter.data.sft.bins import next_fit
from adapter.data.sft.prepare import prepare
from adapter.train.batches import shuffles
from tests.helpers.sft_data import VOCAB, axolotl_cfg, tiny_model

ROWS = 24


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 16), min_size=1, max_size=40), st.integers(16, 24))
def test_next_fit_keeps_the_order_within_capacity(lengths, cap):
    bins = next_fit(np.array(lengths), cap)
    assert [i for b in bins for i in b] == list(range(len(lengths)))  # the examples in order, each once
    assert all(sum(lengths[i] for i in b) <= cap for b in bins)
    assert all(sum(lengths[i] for i in b) + lengths[c[0]] > cap for b, c in zip(bins, bins[1:]))  # next one did not fit


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("sft-order"))


def _files(tmp_path, n_files: int) -> list[dict]:
    out = []
    for f in range(n_files):
        path = tmp_path / f"rows{f}.jsonl"
        path.write_text("".join(json.dumps({"text": f"row {f * ROWS + i} " + "word " * (i % 5)}) + "\n"
                                for i in range(ROWS)))
        out.append({"path": str(path), "type": "completion"})
    return out


def _trained_order(cfg, model) -> list[int]:
    """The rows' numbers in the order the sampler of one data-parallel rank meets them in epoch 0."""
    data = prepare(cfg, model, VOCAB, progress=False)
    sampler = DPSampler(len(data.train), dp_rank=0, dp_size=1, micro_batch=1, seed=cfg.data.seed,
                        shuffle=shuffles(cfg))
    from transformers import AutoTokenizer

    tok, seen = AutoTokenizer.from_pretrained(model), []
    for i in sampler.order(0).tolist():  # with micro-batch 1 and one rank, the epoch's batches are this order
        text = tok.decode([t for t in data.train[i]["tokens"].tolist() if t != tok.pad_token_id])
        seen += [int(s.split()[0]) for s in text.split("row ")[1:]]
    return seen


def test_curriculum_trains_one_dataset_in_file_order_packed_in_order(model, tmp_path):
    cfg = axolotl_cfg(model, _files(tmp_path, 1), tmp_path, sample_packing=True, curriculum_sampling=True,
                      sample_packing_sequentially=True)
    assert cfg.data.curriculum and cfg.data.pack_in_order and not shuffles(cfg)
    assert _trained_order(cfg, model) == list(range(ROWS))
    plain = axolotl_cfg(model, _files(tmp_path, 1), tmp_path / "plain", sample_packing=True)
    assert shuffles(plain) and sorted(order := _trained_order(plain, model)) == list(range(ROWS))
    assert order != list(range(ROWS))  # the default: shuffled once when merged and again every epoch


def test_curriculum_over_several_datasets_keeps_axolotls_shuffled_merge(model, tmp_path):
    """Axolotl's merge_datasets shuffles several datasets together even under curriculum_sampling (it warns), unless
    shuffle_merged_datasets is false; the samples then train in that merged order."""
    two = _files(tmp_path, 2)
    cfg = axolotl_cfg(model, two, tmp_path, curriculum_sampling=True, seed=3)
    assert _trained_order(cfg, model) == np.random.default_rng(3).permutation(2 * ROWS).tolist()
    kept = axolotl_cfg(model, two, tmp_path / "kept", curriculum_sampling=True, shuffle_merged_datasets=False)
    assert _trained_order(kept, model) == list(range(2 * ROWS))
