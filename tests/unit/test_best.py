"""The best checkpoint and early stopping decide as transformers' Trainer does (tests/helpers/sft.py:hf_best runs
its own code), on eval-loss sequences with ties, plateaus and evaluations at steps that are not saved."""
from __future__ import annotations

import random

import pytest

from adapter.train.best import Best
from tests.helpers.sft import hf_best


def _ours(evals, saves, patience):
    best = Best(patience)
    for step in sorted(set(evals) | saves):
        stop = best.observe(step, evals[step]) if step in evals else False
        if step in saves:
            best.on_save(step)
        if stop:
            return best.saved, step
    return best.saved, None


@pytest.mark.parametrize("seed", range(40))
def test_best_checkpoint_and_early_stop_match_transformers(seed):
    rng = random.Random(seed)
    steps = rng.randint(3, 14)
    eval_every, save_every = rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 4])
    # few distinct values, so ties (no new best, as HF's strict comparison) are common
    evals = {s: rng.choice([1.0, 1.5, 2.0, 2.5, 3.0]) for s in range(eval_every, steps + 1, eval_every)}
    saves = set(range(save_every, steps + 1, save_every)) | {steps}
    patience = rng.choice([None, 1, 2, 3])
    assert _ours(evals, saves, patience) == hf_best(evals, saves, patience), (evals, saves, patience)


def test_an_unsaved_best_keeps_the_earlier_checkpoint_and_ties_are_not_better():
    evals = {1: 2.0, 2: 1.0, 3: 1.5, 4: 1.0}  # step 2 is the best but only 1 and 3/4 are saved
    assert _ours(evals, {1, 4}, None) == hf_best(evals, {1, 4}, None) == (1, None)
    assert _ours(evals, {1, 2, 4}, 2) == hf_best(evals, {1, 2, 4}, 2) == (2, 4)
    state = Best(2)
    state.observe(1, 3.0), state.on_save(1)
    restored = Best(2)
    restored.load_state_dict(state.state_dict())
    assert restored == state
