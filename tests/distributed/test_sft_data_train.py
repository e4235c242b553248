"""The trainer on SFT data (gloo + DeepSpeed CPU, dp_shard=2): its first loss equals plain transformers' on the
same packed samples with the same masks, both ranks read one prepared cache, and training goes on from there."""
from __future__ import annotations

import json

import pytest

from adapter import config
from tests.helpers.dist import run_workers
from tests.helpers.runs import vocab_of
from tests.helpers.sft import packed_examples

pytestmark = pytest.mark.slow


def _cfg(root: str):
    from adapter.demo.build import CHAT_DATA

    raw = {"base_model": f"{root}/model", "sequence_len": 256, "sample_packing": True, "micro_batch_size": 1,
           "gradient_accumulation_steps": 1, "dp_shard_size": 2, "learning_rate": 1e-3, "lr_scheduler": "constant",
           "max_steps": 3, "special_tokens": {"eos_token": "<|im_end|>"}, "dataset_prepared_path": f"{root}/prep",
           "val_set_size": 4, "datasets": [{"path": str(CHAT_DATA), "type": "chat_template",
                                            "chat_template": "chatml"}]}
    over = {"model.checkpoint": f"{root}/megatron", "precision": "fp32", "data.document_mask": True}
    return config.with_grad_accum(config.build(raw, env={}, world_size=2, overrides=over))


def _worker(rank, world, root):
    from adapter.models.resolved import resolve_run
    from adapter.train.engine import init_distributed
    from adapter.train.trainer import Trainer

    init_distributed()
    t = Trainer(resolve_run(_cfg(root)), log=lambda s: None)
    try:
        t.setup()
        first = next(iter(t.sampler.__class__(len(t.dataset), dp_rank=t.layout.data_rank(rank), dp_size=2,
                                              micro_batch=1, seed=t.cfg.data.seed)))
        res = t.fit(export=False)
        return {"losses": res.losses, "first": first, "path": str(t.sft.path), "reused": t.sft.reused,
                "val": len(t.val_dataset)}
    finally:
        t.close()


def test_sft_run_matches_transformers_on_its_first_step(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from adapter.convert.to_megatron import hf_to_megatron
    from adapter.data.sft import prepare
    from tests.helpers.sft_data import tiny_model

    model_dir = tiny_model(tmp_path, weights=True)
    hf_to_megatron(model_dir, tmp_path / "megatron", tp=1, dtype="fp32", progress=False)
    out = run_workers(_worker, 2, str(tmp_path), timeout=600)
    assert out[0]["path"] == out[1]["path"] and out[0]["losses"] == out[1]["losses"]
    assert out[0]["val"] == out[1]["val"] >= 1
    losses = out[0]["losses"]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    # reference: each rank's first sample through plain transformers, example by example (attention stays inside
    # an example either way); the step's loss is Σ loss / Σ trained tokens over both ranks' samples
    data = prepare(_cfg(str(tmp_path)), model_dir, vocab_of(_cfg(str(tmp_path))), progress=False)
    assert data.reused and str(data.path) == out[0]["path"]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    totals, counts = [], []
    with torch.no_grad():
        for r in range(2):
            (i,) = out[r]["first"]
            total, count = 0.0, 0
            for loss_sum, n, _ in packed_examples(hf, data.train, i):
                total += float(loss_sum)
                count += int(n)
            totals.append(total)
            counts.append(count)
    ref = sum(totals) / sum(counts)
    assert ref > 5  # a random model on a 1024-token vocabulary: near ln(1024)
    assert abs(losses[0] - ref) <= 1e-4 * ref, (losses[0], ref, json.dumps(out[0]))
