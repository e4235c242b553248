"""GPU host only: the runs that `model.compile: auto` compiles since they were measured faster compiled on one H100
(2026-12-07: LoRA SFT on packed rows, a full-parameter DPO run, SimPO with LoRA and of every weight) follow their
eager runs on CUDA (bf16, inductor). Each run's config leaves `model.compile` at auto: the test asserts that auto,
resolved on CUDA, chose compiled layers there and said so in its first line. (Graph counts cannot tell: Dynamo
reuses the first run's graphs of the same layer code in later runs of the process.) The exact semantics (fp32,
against transformers, PEFT and TRL) are the CPU tests'; here inductor's code runs them."""
from __future__ import annotations

import pytest

from tests.helpers.dist import run_workers

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
LORA = {"r": 8, "alpha": 16, "target_linear": True}
# name: objective, adapters, data type
RUNS = {"lora sft": ("sft", LORA, "chat_template"), "full dpo": ("dpo", None, "chat_template.default"),
        "lora simpo": ("simpo", LORA, "chat_template.default"), "full simpo": ("simpo", None, "chat_template.default")}


def _chats(n: int = 48) -> list[dict]:
    from tests.helpers.sft_data import WORDS

    return [{"messages": [{"role": "user", "content": f"Name the {WORDS[i % 12]} thing {i}" + " please" * (i % 5)},
                          {"role": "assistant", "content": " ".join(WORDS[i % 5: 3 + i % 11]) + "."}]}
            for i in range(n)]


def _worker(rank, world, model, pairs, chats, root):
    import torch

    from adapter import config
    from adapter.models.resolved import resolve_run
    from adapter.train.engine import init_distributed
    from adapter.train.trainer import run

    torch.cuda.set_device(rank)
    init_distributed()
    out = {}
    for name, (objective, lora, kind) in RUNS.items():
        for compiled in ("auto", False):
            raw = {"model": {"path": model, "engine": "megatron", "compile": compiled,
                             "cache_dir": f"{root}/cache"}, "objective": objective, "lora": lora, "seq_len": 256,
                   "precision": "bf16", "batch": {"micro_batch_size": 1, "gradient_accumulation_steps": 2},
                   "optimizer": {"lr": 2e-3 if lora else 2e-5, "schedule": "constant", "warmup_steps": 0,
                                 "max_steps": 6},
                   "data": {"datasets": [{"path": pairs if objective != "sft" else chats, "type": kind}],
                            "chat_template": "chatml", "prepared_path": f"{root}/prep-{objective}",
                            "sample_packing": objective == "sft"}, "eval": {"per_epoch": 0}}
            if objective == "simpo":
                raw["simpo"] = {"gamma": 0.5}
            resolved = resolve_run(config.build(raw, env={}, world_size=world))  # auto decided here, on CUDA
            res = run(resolved, log=lambda s: None)
            out[(name, compiled)] = {"losses": res.losses, "compiled": resolved.cfg.model.compile,
                                     "said": [n for n in resolved.cfg.notes if "model.compile" in n]}
    return out


def test_runs_auto_compiles_follow_eager_on_cuda(tmp_path):
    from adapter.demo.build import make_tiny_llama
    from tests.helpers.sft_data import tiny_model, varied_pairs, write_jsonl

    tok = tiny_model(tmp_path / "t", vocab=512)
    model = make_tiny_llama(tmp_path / "m", tokenizer_dir=tok, hidden=128, layers=2, heads=4, kv_heads=2, seed=0)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", varied_pairs())
    chats = write_jsonl(tmp_path / "chats.jsonl", _chats())
    got = run_workers(_worker, 1, str(model), str(pairs), str(chats), str(tmp_path), timeout=900)[0]
    print({k: (v["losses"], v["compiled"], v["said"]) for k, v in got.items()})
    for name in RUNS:
        auto, eager = got[(name, "auto")], got[(name, False)]
        assert auto["compiled"] is True and eager["compiled"] is False, (name, auto["said"])
        assert len(auto["said"]) == 1 and "model.compile: auto: on" in auto["said"][0], (name, auto["said"])
        assert len(auto["losses"]) == len(eager["losses"]) == 6
        # bf16: compiled layers keep fp32 intermediates where eager rounds (tests/gpu/test_dpo.py's 1e-2)
        for a, b in zip(auto["losses"], eager["losses"], strict=True):
            assert abs(a - b) <= 1e-2 * max(1.0, abs(b)), (name, auto["losses"], eager["losses"])
