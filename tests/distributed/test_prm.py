"""`process_reward_model: true` against TRL's own PRMTrainer (1.8.0's experimental one, Axolotl 067b021's base
class): an Axolotl YAML as its qwen2/prm.yaml writes it (model_type AutoModelForTokenClassification, num_labels 2,
rows of type stepwise_supervised) on a tiny Llama token-classification checkpoint, fp32 on CPU at dp_shard 2: a full
fine-tune under ZeRO-3 and LoRA (PEFT's TOKEN_CLS task, as Axolotl builds it: the score head trained in full) under
ZeRO-2. Every step's loss, the held-out loss and TRL's eval accuracy (its compute_accuracy over the labelled tokens)
against TRL run on the same rows in the same steps (its SequentialSampler over nd-adapter's order, a step's rows in
one batch: see the reference's comment); the prepared
tokens and labels against Axolotl's stepwise rule written out here (tests/helpers/prm.step_ids); the exports load
in transformers (PEFT) and classify as TRL's trained models do."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.dist import run_workers
from tests.helpers.prm import prepared_rows, prm_model, rows, step_ids, trl_prm
from tests.helpers.reward import EPS, step_pairs
from tests.helpers.sft_data import write_jsonl

pytestmark = pytest.mark.slow
SEQ, LR, STEPS, WORLD, GA, VAL = 64, 2e-2, 4, 2, 2, 4
LORA = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_target_linear": True}
RUNS = {"full": (3, {}), "lora": (2, LORA)}


def _raw(model: Path, data: Path, root: Path, name: str) -> dict:
    zero, extra = RUNS[name]
    return {**extra, "base_model": str(model), "model_type": "AutoModelForTokenClassification", "num_labels": 2,
            "process_reward_model": True, "datasets": [{"path": str(data), "type": "stepwise_supervised",
                                                        "step_separator": "\n", "train_on_last_step_only": False}],
            "sequence_len": SEQ, "sample_packing": False, "dataset_prepared_path": str(root / "prep"),
            "output_dir": str(root / f"out-{name}"), "val_set_size": VAL, "micro_batch_size": 1,
            "gradient_accumulation_steps": GA, "max_steps": STEPS, "learning_rate": LR, "lr_scheduler": "constant",
            "warmup_steps": 0, "weight_decay": 0.0, "adam_epsilon": EPS, "max_grad_norm": 1e12,
            "optimizer": "adamw_torch_fused", "eval_steps": 2, "dp_shard_size": WORLD,
            "deepspeed": str(root / f"zero{zero}.json")}


def _worker(rank, world, model, data, root):
    from adapter import config
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    init_distributed()
    out = {}
    for name in RUNS:
        lines: list[str] = []
        res = train(config.build(_raw(Path(model), Path(data), Path(root), name), env={}, world_size=world),
                    log=lines.append)
        out[name] = (res.losses, res.eval_losses, res.eval_rewards, lines)
    return out


def test_process_reward_model_matches_trl(tmp_path):
    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from adapter import config
    from adapter.data.sft.prepare import prepare
    from tests.helpers.runs import vocab_of

    model = prm_model(tmp_path)
    data_rows = rows(16 + VAL)
    data = write_jsonl(tmp_path / "steps.jsonl", data_rows)
    for zero, _ in RUNS.values():  # written once, before any rank reads them
        (tmp_path / f"zero{zero}.json").write_text(json.dumps({"zero_optimization": {"stage": zero}}))
    got = run_workers(_worker, WORLD, str(model), str(data), str(tmp_path), timeout=600)[0]

    tok = AutoTokenizer.from_pretrained(str(model))
    want = [step_ids(tok, r, seq=SEQ) for r in data_rows]
    cfg = config.build(_raw(model, data, tmp_path, "full"), env={}, world_size=WORLD)
    sft = prepare(cfg, model, vocab_of(cfg), builder=True, barrier=None, progress=False)
    assert sft.reused  # the runs' own prepared samples

    train_rows, held = prepared_rows(sft.train, want), prepared_rows(sft.val, want)
    assert len(train_rows) == 16 and len(held) == VAL
    steps = step_pairs(cfg.data.seed, len(train_rows), world=WORLD, ga=GA, steps=STEPS)
    # TRL's batch j of a step: micro-batch j of every DP rank (step_pairs lists a rank's micro-batches together)
    order = [train_rows[step[r * GA + j]] for step in steps for j in range(GA) for r in range(WORLD)]
    # TRL's batch of a step in one (ga 1): transformers 5.25's token classifier ignores num_items_in_batch, so at
    # grad-accum > 1 TRL sums each micro-batch's own mean; in one batch its loss is the mean over the step's labelled
    # tokens, which nd-adapter's runs at dp 2 × grad-accum 2 compute (the trainer's one normalisation)
    ref = {name: trl_prm(model, order, held, tmp_path / f"trl-{name}", batch=WORLD * GA, ga=1, steps=STEPS, lr=LR,
                         lora=name == "lora") for name in RUNS}
    for name, (losses, eval_losses, eval_metrics, lines) in got.items():
        want_steps, want_evals, _ = ref[name]
        assert any(ln.startswith("engine: transformers' own LlamaForTokenClassification") for ln in lines), lines
        assert name != "full" or any("process_reward_model: true -> model.num_labels: 2" in ln for ln in lines), lines
        assert len(losses) == len(want_steps) == STEPS, (losses, want_steps)
        for step, (loss, w) in enumerate(zip(losses, want_steps), 1):
            assert abs(loss - w["loss"]) <= 1e-5 * max(1.0, abs(w["loss"])), (name, step, loss, w)
        assert [s for s, _ in eval_losses] == [s for s, _ in want_evals] == [0, 2, 4], (eval_losses, want_evals)
        for (s, loss), (_, metrics), (_, w) in zip(eval_losses, eval_metrics, want_evals, strict=True):
            assert abs(loss - w["eval_loss"]) <= 1e-5 * max(1.0, abs(w["eval_loss"])), (name, s, loss, w)
            assert abs(metrics["accuracy"] - w["eval_accuracy"]) <= 1e-9, (name, s, metrics, w)
        assert abs(want_steps[-1]["loss"] - want_steps[0]["loss"]) > 1e-2, want_steps  # it trained
    assert len({w["eval_accuracy"] for _, w in ref["full"][1]}) > 1, ref["full"][1]  # the accuracy moved

    # the exports: a token classifier transformers loads, and PEFT's adapter with the score beside it
    from peft import PeftModel

    probe = torch.tensor([held[0]["input_ids"][:12], held[1]["input_ids"][:12]])
    with torch.no_grad():
        exported = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "out-full"))
        assert exported.config.num_labels == 2
        trained = ref["full"][2].eval()
        assert torch.allclose(exported(input_ids=probe).logits, trained(input_ids=probe).logits, atol=1e-5, rtol=1e-4)
        adapted = PeftModel.from_pretrained(AutoModelForTokenClassification.from_pretrained(str(model)),
                                            str(tmp_path / "out-lora")).eval()
        trained = ref["lora"][2].eval()
        assert torch.allclose(adapted(input_ids=probe).logits, trained(input_ids=probe).logits, atol=1e-5, rtol=1e-4)
