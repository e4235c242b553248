"""GPU host only: the training entry point on one GPU (NCCL), bf16, tiny model; run with `pytest -m gpu`."""
from __future__ import annotations

import pytest

from tests._dist import run_workers

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _worker(rank, world, model_dir):
    import torch

    from adapter import config
    from adapter.train.loop import init_distributed, run

    torch.cuda.set_device(rank)
    init_distributed()
    raw = {"model": {"path": model_dir}, "parallelism": {"tp_size": world}, "seq_len": 256, "precision": "bf16",
           "batch": {"micro_batch_size": 2}, "optimizer": {"lr": 1e-3, "warmup_steps": 0, "max_steps": 8,
                                                          "schedule": "constant"},
           "data": {"synthetic": True}}
    return run(config.build(raw, env={}, world_size=world), log=lambda s: None).losses


def test_train_tp_on_gpus(tmp_path):
    import torch

    from adapter.demo import make_tiny_llama, train_tokenizer

    tok = train_tokenizer(out_dir=tmp_path / "tok", vocab_size=512)
    model = make_tiny_llama(tmp_path / "m", tokenizer_dir=tok, hidden=128, layers=2, heads=4, kv_heads=2)
    world = min(2, torch.cuda.device_count())
    losses = run_workers(_worker, world, str(model), timeout=600)[0]
    assert len(losses) == 8 and all(x == x for x in losses)
