"""Axolotl's `tokens:` trained: two new tokens and a new special token, used in prompts and answers, on a tiny
Llama (fp32, CPU). The native
engine at tp=2 (the new rows written into each rank's vocabulary slice) and the transformers engine at dp_shard=2
give the same losses over 3 steps as transformers itself resizing the checkpoint with resize_token_embeddings
(Axolotl's call, mean_resizing=False: the new rows drawn from normal(0, initializer_range) under the run's seed)
and training on the same prepared samples; the export holds the resized model and the extended tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

from adapter import config
from tests.helpers.dist import run_workers
from tests.helpers.runs import vocab_of
from tests.helpers.sft import make_model, packed_examples, rel

SEQ, LR, STEPS, WARMUP, SEED = 64, 2e-3, 3, 1, 5
NEW = ["<think>", "</think>"]
SPECIAL = {"additional_special_tokens": ["<tool>"]}  # a new special token too: 1026, after `tokens` (Axolotl's order)
LAYOUTS = {"native tp=2": ({"tp_size": 2, "dp_shard_size": 1}, 2, "megatron"),
           "transformers dp_shard=2": ({"tp_size": 1, "dp_shard_size": 2}, 1, "transformers")}


def _cfg(model_dir: str, data: str, root: str, parallelism: dict, micro: int, engine: str):
    raw = {"model": {"path": model_dir, "cache_dir": f"{root}/cache", "engine": engine}, "parallelism": parallelism,
           "batch": {"micro_batch_size": micro, "gradient_accumulation_steps": 1}, "seq_len": SEQ,
           "precision": "fp32", "seed": SEED,
           "optimizer": {"lr": LR, "schedule": "cosine", "warmup_steps": WARMUP, "max_steps": STEPS,
                         "clip_grad": 1e12},
           "checkpoint": {"export_hf": f"{root}/export"},
           "data": {"datasets": [{"path": data, "type": "chat_template"}], "chat_template": "chatml",
                    "sample_packing": True, "prepared_path": f"{root}/prep", "tokens": NEW,
                    "special_tokens": SPECIAL}}
    return config.build(raw, env={}, world_size=2)


def _worker(rank, world, model_dir, data, root):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    init_distributed()
    return {name: train(_cfg(model_dir, data, f"{root}/{name.split()[0]}", par, mb, eng), log=lambda s: None).losses
            for name, (par, mb, eng) in LAYOUTS.items()}


def _rows(i: int) -> dict:
    q = " ".join(["light", "water", "earth", "day"][: 1 + i % 4])
    return {"messages": [{"role": "user", "content": f"<think> {q} </think> why?"},
                         {"role": "assistant",
                          "content": f"<think> {q} and {q} </think> because <tool>" + " so" * (i % 5)}]}


def _reference(model_dir: str, data, cfg, rows: int) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

    from adapter.data import DPSampler

    order = iter(DPSampler(len(data.train), dp_rank=0, dp_size=1, micro_batch=2, seed=cfg.data.seed))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(SEED)
    hf.resize_token_embeddings(rows, mean_resizing=False)  # Axolotl's call (mean_resizing_embeddings: false)
    opt = torch.optim.AdamW(hf.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    sched = get_cosine_schedule_with_warmup(opt, WARMUP, STEPS)
    out = []
    for _ in range(STEPS):
        total, count = 0.0, 0.0
        for i in next(order):
            for loss_sum, n, _ in packed_examples(hf, data.train, i):
                total, count = total + loss_sum, count + n
        loss = total / count
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        out.append(float(loss.detach()))
    return out


def test_new_tokens_train_as_transformers_resizing_them(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adapter.data.sft import prepare
    from tests.helpers.sft_data import tiny_model, write_jsonl

    tok = tiny_model(tmp_path / "tok")
    model_dir = str(make_model(tmp_path / "model", tok, hidden=32, layers=1))
    data = str(write_jsonl(tmp_path / "chat.jsonl", [_rows(i) for i in range(12)]))
    got = run_workers(_worker, 2, model_dir, data, str(tmp_path), timeout=300)[0]

    cfg = _cfg(model_dir, data, f"{tmp_path}/native", *LAYOUTS["native tp=2"])
    rows = vocab_of(cfg)
    assert rows == 1024 + len(NEW) + 1
    prepared = prepare(cfg, model_dir, rows, builder=True, barrier=None, progress=False)
    assert prepared.reused  # the runs' own samples
    tokens = [t for i in range(len(prepared.train)) for t in prepared.train[i]["tokens"].tolist()]
    assert {1024, 1025, 1026} <= set(tokens)  # the new ids are fed (and trained: they sit in the answers)
    ref = _reference(model_dir, prepared, cfg, rows)
    for name, losses in got.items():
        assert len(losses) == STEPS and all(rel(a, b) <= 2e-6 for a, b in zip(losses, ref)), (name, losses, ref)
    for engine in ("native", "transformers"):  # the resized model and the tokenizer that names its new rows
        out = tmp_path / engine / "export"
        assert json.loads((out / "config.json").read_text())["vocab_size"] == rows
        assert AutoModelForCausalLM.from_pretrained(str(out)).get_input_embeddings().weight.shape[0] == rows
        assert AutoTokenizer.from_pretrained(str(out)).convert_tokens_to_ids([*NEW, "<tool>"]) == [1024, 1025, 1026]
    assert Path(tmp_path / "native" / "prep").is_dir()
