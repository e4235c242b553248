"""`reward_model: true` against TRL's own RewardTrainer (1.8.0, Axolotl 067b021's pin): an Axolotl YAML as a user
writes it (model_type AutoModelForSequenceClassification, num_labels 1, center_rewards_coefficient, pairs of type
bradley_terry.chat_template) on a tiny Llama sequence-classification checkpoint, full fine-tune, fp32 on CPU, at
dp_shard 2 under ZeRO-3 and under ZeRO-2 (Axolotl's deepspeed JSONs), and LoRA (PEFT's SEQ_CLS task, as Axolotl
builds it: the score trained in full) under ZeRO-3, and tp=2 (transformers' own plan), four pairs a step: the losses
and TRL's logged metrics (accuracy, margin, mean_reward, min_reward, max_reward) of every step, the held-out eval,
and the exported model's scores (a run saved at step 2 and resumed continues on the same curve), against TRL run on
the same pairs in the same steps (its SequentialSampler over nd-adapter's order, each of its batches the DP ranks'
micro-batch). The pairs' tokens are checked against Axolotl's rule written out here (the chat template over each
whole conversation, an empty system turn where the row's system is empty)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.dist import run_workers
from tests.helpers.reward import EPS, bt_ids, reward_model, step_pairs, trl_reward
from tests.helpers.reward import rows as bt_rows
from tests.helpers.sft_data import write_jsonl

pytestmark = pytest.mark.slow
SEQ, LR, STEPS, WORLD, GA, VAL, CENTER = 64, 1e-2, 4, 2, 2, 4, 0.05
LORA = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_target_linear": True}
METRICS = ("accuracy", "margin", "mean_reward", "min_reward", "max_reward")
# TRL's batches as nd-adapter's micro-batches over its DP ranks (min_reward / max_reward are each batch's extremes)
TRL = {"batch": WORLD * GA, "ga": GA, "steps": STEPS, "lr": LR, "seq": SEQ, "center": CENTER, "eval_batch": WORLD}


def _raw(model: Path, data: Path, root: Path, zero: int, lora: bool = False) -> dict:
    return {**(LORA if lora else {}), "base_model": str(model), "model_type": "AutoModelForSequenceClassification",
            "num_labels": 1, "reward_model": True, "center_rewards_coefficient": CENTER, "chat_template": "chatml",
            "datasets": [{"path": str(data), "type": "bradley_terry.chat_template"}], "sequence_len": SEQ,
            "dataset_prepared_path": str(root / "prep"), "output_dir": str(root / f"out{zero}"),
            "val_set_size": VAL, "micro_batch_size": 1, "gradient_accumulation_steps": GA, "max_steps": STEPS,
            "learning_rate": LR, "lr_scheduler": "constant", "warmup_steps": 0, "weight_decay": 0.0,
            "adam_epsilon": EPS, "max_grad_norm": 1e12, "optimizer": "adamw_torch_fused", "eval_steps": 2,
            "dp_shard_size": WORLD, "deepspeed": str(root / f"zero{zero}.json")}


def _worker(rank, world, model, data, root):
    from adapter import config
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    init_distributed()
    out = {}
    for zero in (3, 2):
        lines: list[str] = []
        res = train(config.build(_raw(Path(model), Path(data), Path(root), zero), env={}, world_size=world),
                    log=lines.append)
        out[zero] = (res.losses, res.rewards, res.eval_losses, res.eval_rewards, lines)
    lines = []
    res = train(config.build({**_raw(Path(model), Path(data), Path(root), 3, lora=True), "output_dir":
                              str(Path(root, "out-lora"))}, env={}, world_size=world), log=lines.append)
    out["lora"] = (res.losses, res.rewards, res.eval_losses, res.eval_rewards, lines)
    lines = []  # tp=2 (transformers' own plan; the score head whole on both ranks), one data-parallel rank
    tp = {**_raw(Path(model), Path(data), Path(root), 2), "output_dir": str(Path(root, "out-tp")), "dp_shard_size": 1,
          "tensor_parallel_size": 2, "gradient_accumulation_steps": WORLD * GA}
    res = train(config.build(tp, env={}, world_size=world), log=lines.append)
    out["tp"] = (res.losses, res.rewards, res.eval_losses, res.eval_rewards, lines)
    cut = {**_raw(Path(model), Path(data), Path(root), 3), "output_dir": str(Path(root, "cut"))}  # saved at step 2,
    train(config.build({**cut, "max_steps": 2}, env={}, world_size=world), log=lambda s: None)  # resumed to 4
    again = train(config.build(cut, env={}, world_size=world), resume=True, log=lambda s: None)
    return out, (again.start_step, again.losses, again.rewards)


def test_reward_model_matches_trl(tmp_path):
    import numpy as np
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from adapter import config
    from adapter.data.sft import preference, templates

    model = reward_model(tmp_path)
    rows = bt_rows(16 + VAL)
    data = write_jsonl(tmp_path / "bt.jsonl", rows)
    for zero in (3, 2):  # written once, before any rank reads them
        (tmp_path / f"zero{zero}.json").write_text(json.dumps({"zero_optimization": {"stage": zero}}))
    got, (start, resumed, resumed_rewards) = run_workers(_worker, WORLD, str(model), str(data), str(tmp_path),
                                                         timeout=600)[0]
    assert start == 2 and len(resumed) == 2, (start, resumed)  # a checkpoint at step 2 continues on the same curve
    for a, b in zip(resumed + [r["margin"] for r in resumed_rewards],
                    got[3][0][2:] + [r["margin"] for r in got[3][1][2:]], strict=True):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(b)), (resumed, got[3][0])
    cfg = config.build(_raw(model, data, tmp_path, 3), env={}, world_size=WORLD)
    lines = got[3][4]
    said = [[ln for ln in got[z][4] if ln.startswith("optimizer: ")] for z in (3, 2)]
    assert said == [["optimizer: DeepSpeed's ZeRO-3 AdamW"], ["optimizer: DeepSpeed's ZeRO-2 AdamW"]], said
    assert any(ln.startswith("engine: transformers' own LlamaForSequenceClassification") for ln in lines), lines
    assert any("objective: reward (TRL's RewardTrainer" in ln and "0.05·(r_chosen + r_rejected)²" in ln
               for ln in lines), lines

    tok = AutoTokenizer.from_pretrained(str(model))
    tok.pad_token = tok.pad_token or tok.eos_token
    template = templates.resolve_template("chatml", None, tok, "")
    pairs = [{"chosen_ids": bt_ids(tok, template, r, r["chosen"], SEQ),
              "rejected_ids": bt_ids(tok, template, r, r["rejected"], SEQ)} for r in rows]
    train_rows, held_rows = preference.split(cfg, len(rows))  # nothing is dropped: prepared pair i is row i
    prepared = next(Path(tmp_path, "prep").glob("bt*/pairs.npz"))
    stored = np.load(prepared)["tokens"]
    for k, i in enumerate(train_rows):  # nd-adapter's prepared tokens are Axolotl's ids, padded with the pad token
        for j, side in enumerate(("chosen_ids", "rejected_ids")):
            ids = pairs[int(i)][side]
            assert stored[k, j, :len(ids)].tolist() == ids and set(stored[k, j, len(ids):]) <= {tok.pad_token_id}
    steps = step_pairs(cfg.data.seed, len(train_rows), world=WORLD, ga=GA, steps=STEPS)
    # TRL's micro-batch j of a step: micro-batch j of every DP rank (step_pairs lists a rank's micro-batches together)
    order = [pairs[int(train_rows[step[r * GA + j]])] for step in steps for j in range(GA) for r in range(WORLD)]
    held = [pairs[int(i)] for i in held_rows]
    want_steps, want_evals, trl_model = trl_reward(model, order, held, tmp_path / "trl", **TRL)
    lora_steps, lora_evals, trl_lora = trl_reward(model, order, held, tmp_path / "trl-lora", lora=True, **TRL)
    one = step_pairs(cfg.data.seed, len(train_rows), world=1, ga=WORLD * GA, steps=STEPS)  # tp's one DP rank
    tp_steps, tp_evals, trl_tp = trl_reward(model, [pairs[int(train_rows[i])] for s in one for i in s], held,
                                            tmp_path / "trl-tp", **{**TRL, "ga": WORLD * GA, "eval_batch": 1})
    assert len(want_steps) == STEPS and [s for s, _ in want_evals] == [0, 2, 4], (want_steps, want_evals)
    assert any("score trained in full" in ln and "(PEFT on transformers' model)" in ln for ln in got["lora"][4])
    assert any(ln.startswith("engine:") and "tp=2 from its own tensor-parallel plan" in ln for ln in got["tp"][4])
    for zero, (losses, rewards, eval_losses, eval_rewards, _) in got.items():
        steps, evals = {"lora": (lora_steps, lora_evals), "tp": (tp_steps, tp_evals)}.get(zero, (want_steps,
                                                                                                  want_evals))
        for step, (loss, have, want) in enumerate(zip(losses, rewards, steps, strict=True), 1):
            assert abs(loss - want["loss"]) <= 1e-5, (zero, step, loss, want)
            for k in METRICS:
                assert abs(have[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])), (zero, step, k, have[k], want[k])
        assert [s for s, _ in eval_losses] == [0, 2, 4], eval_losses
        for (s, loss), (_, have), (_, want) in zip(eval_losses, eval_rewards, evals, strict=True):
            assert abs(loss - want["eval_loss"]) <= 1e-5, (zero, s, loss, want)
            for k in METRICS:
                assert abs(have[k] - want[f"eval_{k}"]) <= 1e-5 * max(1.0, abs(want[f"eval_{k}"])), (zero, s, k)
    for steps in (want_steps, lora_steps):
        assert abs(steps[-1]["margin"] - steps[0]["margin"]) > 1e-3  # training moved the scores

    # the export is a sequence classifier transformers loads, scoring as TRL's trained model does
    probe = torch.tensor([pairs[0]["chosen_ids"], pairs[1]["rejected_ids"][:len(pairs[0]["chosen_ids"])]])
    with torch.no_grad():
        for out, trained in (("out3", trl_model), ("out2", trl_model), ("out-tp", trl_tp)):  # tp's gathered whole
            exported = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / out))
            assert exported.config.num_labels == 1 and exported.config.pad_token_id == tok.pad_token_id
            trained.eval()
            have, want = exported(input_ids=probe).logits, trained(input_ids=probe).logits
            assert torch.allclose(have, want, atol=1e-5, rtol=1e-4), (out, have, want)
        # the LoRA run's export is PEFT's adapter (the score saved beside it) on the base sequence classifier
        from peft import PeftModel

        base = AutoModelForSequenceClassification.from_pretrained(str(model), num_labels=1)
        base.config.pad_token_id = tok.pad_token_id
        adapted = PeftModel.from_pretrained(base, str(tmp_path / "out-lora"))
        trl_lora.eval()
        assert torch.allclose(adapted(input_ids=probe).logits, trl_lora(input_ids=probe).logits, atol=1e-5, rtol=1e-4)
