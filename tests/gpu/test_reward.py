"""GPU host only: a reward model (`reward_model: true`) trained on one GPU through nd-adapter's CUDA path (the
transformers engine's sequence classifier, nd-adapter's attention kernels through its attention interface) against
TRL's RewardTrainer on the same GPU and pairs, fp32 with TF32 off on both sides: the same losses and accuracy over
4 steps of 4 pairs. The exact semantics (CPU, fp32, ZeRO-3/2, LoRA, the eval, resume, the export):
tests/distributed/test_reward.py."""
from __future__ import annotations

import pytest

from tests.helpers.dist import run_workers
from tests.helpers.runs import cuda_train

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
SEQ, LR, STEPS, GA, CENTER = 64, 1e-2, 4, 4, 0.05


def test_reward_model_on_cuda_follows_trl(tmp_path):
    import torch
    from transformers import AutoTokenizer

    from adapter import config
    from adapter.data.sft import preference, templates
    from tests.helpers.reward import bt_ids, one_gpu_head_run, reward_model, rows, step_pairs, trl_reward
    from tests.helpers.sft_data import write_jsonl

    assert torch.cuda.is_available()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = reward_model(tmp_path)
    data_rows = rows(20)
    data = write_jsonl(tmp_path / "bt.jsonl", data_rows)
    raw = {**one_gpu_head_run(model, tmp_path, seq=SEQ, lr=LR, ga=GA, steps=STEPS),
           "model_type": "AutoModelForSequenceClassification", "num_labels": 1, "reward_model": True,
           "center_rewards_coefficient": CENTER, "chat_template": "chatml",
           "datasets": [{"path": str(data), "type": "bradley_terry.chat_template"}]}
    losses, rewards = run_workers(cuda_train, 1, raw, ("losses", "rewards"), timeout=600)[0]
    tok = AutoTokenizer.from_pretrained(str(model))
    tok.pad_token = tok.pad_token or tok.eos_token
    template = templates.resolve_template("chatml", None, tok, "")
    pairs = [{"chosen_ids": bt_ids(tok, template, r, r["chosen"], SEQ),
              "rejected_ids": bt_ids(tok, template, r, r["rejected"], SEQ)} for r in data_rows]
    cfg = config.build(raw, env={}, world_size=1)
    train_rows, _ = preference.split(cfg, len(data_rows))
    steps = step_pairs(cfg.data.seed, len(train_rows), world=1, ga=GA, steps=STEPS)
    order = [pairs[int(train_rows[i])] for step in steps for i in step]
    want, _, _ = trl_reward(model, order, pairs[:4], tmp_path / "trl", batch=GA, steps=STEPS, lr=LR, seq=SEQ,
                            center=CENTER, eval_batch=4, cpu=False)
    assert len(losses) == len(want) == STEPS
    for got, have, w in zip(losses, rewards, want, strict=True):
        assert abs(got - w["loss"]) <= 1e-4, (losses, [x["loss"] for x in want])
        assert have["accuracy"] == w["accuracy"], (rewards, want)
