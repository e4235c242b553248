"""GPU host only: a process reward model (`process_reward_model: true`) trained on one GPU through nd-adapter's CUDA
path (the transformers engine's token classifier, nd-adapter's attention kernels through its attention interface)
against transformers' own token classifier trained on the same GPU and rows as TRL's PRMTrainer trains it (dropout
off, each step's rows in one batch, the mean cross-entropy over their labelled tokens, AdamW), fp32 with TF32 off on
both sides: the same losses over 4 steps of 4 rows. (The host's TRL, 1.16, has no PRMTrainer; against TRL's own, and
the exact semantics on CPU: ZeRO-3/2, LoRA, the eval accuracy, the exports: tests/distributed/test_prm.py.)"""
from __future__ import annotations

import pytest

from tests.helpers.dist import run_workers
from tests.helpers.runs import cuda_train

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
SEQ, LR, STEPS, GA = 64, 2e-2, 4, 4


def test_process_reward_model_on_cuda_follows_trl(tmp_path):
    import torch
    from transformers import AutoTokenizer

    from adapter import config
    from adapter.data.sft.prepare import prepare
    from tests.helpers.prm import prepared_rows, prm_model, rows, step_ids
    from tests.helpers.reward import one_gpu_head_run, step_pairs
    from tests.helpers.runs import vocab_of
    from tests.helpers.sft_data import write_jsonl

    assert torch.cuda.is_available()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = prm_model(tmp_path)
    data_rows = rows(20)
    data = write_jsonl(tmp_path / "steps.jsonl", data_rows)
    raw = {**one_gpu_head_run(model, tmp_path, seq=SEQ, lr=LR, ga=GA, steps=STEPS),
           "model_type": "AutoModelForTokenClassification", "num_labels": 2, "process_reward_model": True,
           "datasets": [{"path": str(data), "type": "stepwise_supervised"}]}
    (losses,) = run_workers(cuda_train, 1, raw, ("losses",), timeout=600)[0]
    tok = AutoTokenizer.from_pretrained(str(model))
    cfg = config.build(raw, env={}, world_size=1)
    sft = prepare(cfg, model, vocab_of(cfg), builder=True, barrier=None, progress=False)
    train = prepared_rows(sft.train, [step_ids(tok, r, seq=SEQ) for r in data_rows])
    steps = step_pairs(cfg.data.seed, len(train), world=1, ga=GA, steps=STEPS)
    want = _reference(model, [[train[i] for i in step] for step in steps])
    assert len(losses) == len(want) == STEPS
    for got, w in zip(losses, want, strict=True):
        assert abs(got - w) <= 1e-4 * max(1.0, abs(w)), (losses, want)
    assert abs(want[-1] - want[0]) > 1e-2, want  # it trained


def _reference(model_dir, steps: list[list[dict]]) -> list[float]:
    """transformers' token classifier on the GPU as TRL's PRMTrainer trains it at one batch a step: every dropout
    off, the rows right-padded with an attention mask, the mean cross-entropy over the labelled tokens, AdamW."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForTokenClassification

    from tests.helpers.reward import EPS

    model = AutoModelForTokenClassification.from_pretrained(str(model_dir), dtype=torch.float32).cuda().train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=EPS, weight_decay=0.0)
    out = []
    for batch in steps:
        n = max(len(r["input_ids"]) for r in batch)
        ids = torch.tensor([r["input_ids"] + [0] * (n - len(r["input_ids"])) for r in batch]).cuda()
        mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (n - len(r["input_ids"])) for r in batch]).cuda()
        labels = torch.tensor([r["labels"] + [-100] * (n - len(r["labels"])) for r in batch]).cuda()
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss))
    return out
