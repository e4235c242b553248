"""`reward_model: true` against TRL's own RewardTrainer (1.8.0, Axolotl 067b021's pin): an Axolotl YAML as a user
writes it (model_type AutoModelForSequenceClassification, num_labels 1, center_rewards_coefficient, pairs of type
bradley_terry.chat_template) on a tiny Llama sequence-classification checkpoint, full fine-tune, fp32 on CPU, at
dp_shard 2 under ZeRO-3 and under ZeRO-2 (Axolotl's deepspeed JSONs), and LoRA (PEFT's SEQ_CLS task, as Axolotl
builds it: the score trained in full) under ZeRO-3, four pairs a step: the losses and TRL's logged metrics
(accuracy, margin, mean_reward) of every step, the held-out eval, and the exported model's scores (a run saved at
step 2 and resumed continues on the same curve), against TRL run on the same pairs in the same steps (its
SequentialSampler over nd-adapter's order). The pairs' tokens are checked against Axolotl's rule written out here
(the chat template over each whole conversation, an empty system turn where the row's system is empty)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.dist import run_workers
from tests.helpers.sft_data import tiny_model, write_jsonl

pytestmark = pytest.mark.slow
SEQ, LR, STEPS, WORLD, GA, EPS, VAL, CENTER = 64, 1e-2, 4, 2, 2, 1e-8, 4, 0.05
METRICS = ("accuracy", "margin", "mean_reward")


def _rows() -> list[dict]:
    words = "red green blue small large quick slow bright dark warm cold soft".split()
    return [{"system": "Be brief." if i % 3 == 0 else "", "input": f"Describe thing {i}.",
             "chosen": " ".join(words[: 2 + i % 5]) + ".", "rejected": f"No {i}" + " idea" * (1 + i % 3)}
            for i in range(16 + VAL)]


def _reward_model(root: Path) -> Path:
    """A tiny Llama causal LM's weights under a seeded one-label score head, saved as a sequence classifier."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForSequenceClassification

    src = tiny_model(root / "t", weights=True)
    lm = AutoModelForCausalLM.from_pretrained(str(src))
    cfg = lm.config
    cfg.num_labels, cfg.architectures = 1, ["LlamaForSequenceClassification"]
    torch.manual_seed(1)
    rm = LlamaForSequenceClassification(cfg)
    rm.model.load_state_dict(lm.model.state_dict())
    out = root / "rm"
    rm.save_pretrained(str(out))
    for f in Path(src).glob("*"):
        if "token" in f.name or f.suffix == ".jinja":
            (out / f.name).write_bytes(f.read_bytes())
    return out


LORA = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_target_linear": True}


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
    import json

    from adapter import config
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    init_distributed()
    out = {}
    for zero in (3, 2):
        Path(root, f"zero{zero}.json").write_text(json.dumps({"zero_optimization": {"stage": zero}}))
        lines: list[str] = []
        res = train(config.build(_raw(Path(model), Path(data), Path(root), zero), env={}, world_size=world),
                    log=lines.append)
        out[zero] = (res.losses, res.rewards, res.eval_losses, res.eval_rewards, lines)
    lines = []
    res = train(config.build({**_raw(Path(model), Path(data), Path(root), 3, lora=True), "output_dir":
                              str(Path(root, "out-lora"))}, env={}, world_size=world), log=lines.append)
    out["lora"] = (res.losses, res.rewards, res.eval_losses, res.eval_rewards, lines)
    cut = {**_raw(Path(model), Path(data), Path(root), 3), "output_dir": str(Path(root, "cut"))}  # saved at step 2,
    train(config.build({**cut, "max_steps": 2}, env={}, world_size=world), log=lambda s: None)  # resumed to 4
    again = train(config.build(cut, env={}, world_size=world), resume=True, log=lambda s: None)
    return out, (again.start_step, again.losses, again.rewards)


def _ids(tok, template: str, row: dict, answer: str) -> list[int]:
    """Axolotl's bradley_terry.chat_template ids of one answer (its strategy's legacy path), cut to SEQ."""
    system = [{"role": "system", "content": row["system"]}]  # its own turn, or the one Axolotl adds for an empty one
    turns = [*system, {"role": "user", "content": row["input"]}, {"role": "assistant", "content": answer}]
    prompt = tok.apply_chat_template(turns[:-1], add_generation_prompt=True, tokenize=True, return_dict=False,
                                     chat_template=template)
    whole = tok.apply_chat_template(turns, tokenize=True, return_dict=False, chat_template=template)
    return (list(prompt) + list(whole)[len(prompt):])[:SEQ]


def _trl(model_dir: Path, order: list[dict], held: list[dict], out: Path, lora: bool = False):
    """TRL's RewardTrainer on the tokenised pairs in `order` (one step = 4 consecutive pairs), evaluating `held` before
    step 1 and at steps 2 and 4: (per step: loss and metrics, per eval: its logged metrics, the trained model)."""
    import torch
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl import RewardConfig, RewardTrainer

    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=torch.float32, num_labels=1)
    if lora:  # Axolotl's LoRA on a sequence classifier: PEFT's SEQ_CLS task (the score trained in full)
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(42)  # the run's seed, as adapter/modeling/hf_build.add_peft draws the adapters
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                                 task_type="SEQ_CLS"))
    seen: list[dict] = []
    evals: list[tuple[int, dict]] = []

    class Logged(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "eval_loss" in logs:
                evals.append((state.global_step, dict(logs)))
            elif logs and "loss" in logs:
                seen.append(dict(logs))

    class InOrder(RewardTrainer):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    args = RewardConfig(output_dir=str(out), per_device_train_batch_size=WORLD * GA, gradient_accumulation_steps=1,
                        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=EPS, max_grad_norm=0.0,
                        max_length=SEQ, center_rewards_coefficient=CENTER, logging_steps=1, report_to=[],
                        use_cpu=True, save_strategy="no", seed=42, bf16=False, dataloader_num_workers=0,
                        optim="adamw_torch", eval_strategy="steps", eval_steps=2, eval_on_start=True,
                        per_device_eval_batch_size=VAL)
    trainer = InOrder(model=model, args=args, train_dataset=Dataset.from_list(order),
                      eval_dataset=Dataset.from_list(held), callbacks=[Logged()],
                      processing_class=AutoTokenizer.from_pretrained(str(model_dir)))
    trainer.train()
    return seen, evals, trainer.model


def _step_pairs(seed: int, n: int) -> list[list[int]]:
    from adapter.data.sampler import DPSampler

    its = [iter(DPSampler(n, dp_rank=r, dp_size=WORLD, micro_batch=1, seed=seed)) for r in range(WORLD)]
    return [[int(i) for it in its for _ in range(GA) for i in next(it)] for _ in range(STEPS)]


def test_reward_model_matches_trl(tmp_path):
    import numpy as np
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from adapter import config
    from adapter.data.sft import preference, templates

    model = _reward_model(tmp_path)
    rows = _rows()
    data = write_jsonl(tmp_path / "bt.jsonl", rows)
    got, (start, resumed, resumed_rewards) = run_workers(_worker, WORLD, str(model), str(data), str(tmp_path),
                                                         timeout=600)[0]
    assert start == 2 and len(resumed) == 2, (start, resumed)  # a checkpoint at step 2 continues on the same curve
    for a, b in zip(resumed + [r["margin"] for r in resumed_rewards],
                    got[3][0][2:] + [r["margin"] for r in got[3][1][2:]], strict=True):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(b)), (resumed, got[3][0])
    (tmp_path / "zero3.json").write_text('{"zero_optimization": {"stage": 3}}')
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
    pairs = [{"chosen_ids": _ids(tok, template, r, r["chosen"]), "rejected_ids": _ids(tok, template, r, r["rejected"])}
             for r in rows]
    train_rows, held_rows = preference.split(cfg, len(rows))  # nothing is dropped: prepared pair i is row i
    prepared = next(Path(tmp_path, "prep").glob("bt*/pairs.npz"))
    stored = np.load(prepared)["tokens"]
    for k, i in enumerate(train_rows):  # nd-adapter's prepared tokens are Axolotl's ids, padded with the pad token
        for j, side in enumerate(("chosen_ids", "rejected_ids")):
            ids = pairs[int(i)][side]
            assert stored[k, j, :len(ids)].tolist() == ids and set(stored[k, j, len(ids):]) <= {tok.pad_token_id}
    order = [pairs[int(train_rows[i])] for step in _step_pairs(cfg.data.seed, len(train_rows)) for i in step]
    held = [pairs[int(i)] for i in held_rows]
    want_steps, want_evals, trl_model = _trl(model, order, held, tmp_path / "trl")
    lora_steps, lora_evals, trl_lora = _trl(model, order, held, tmp_path / "trl-lora", lora=True)
    assert len(want_steps) == STEPS and [s for s, _ in want_evals] == [0, 2, 4], (want_steps, want_evals)
    assert any("score trained in full" in ln and "(PEFT on transformers' model)" in ln for ln in got["lora"][4])
    for zero, (losses, rewards, eval_losses, eval_rewards, _) in got.items():
        steps, evals = (lora_steps, lora_evals) if zero == "lora" else (want_steps, want_evals)
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
    trl_model.eval()
    with torch.no_grad():
        want = trl_model(input_ids=probe).logits
        for zero in (3, 2):
            exported = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / f"out{zero}"))
            assert exported.config.num_labels == 1 and exported.config.pad_token_id == tok.pad_token_id
            have = exported(input_ids=probe).logits
            assert torch.allclose(have, want, atol=1e-5, rtol=1e-4), (zero, have, want)
        # the LoRA run's export is PEFT's adapter (the score saved beside it) on the base sequence classifier
        from peft import PeftModel

        base = AutoModelForSequenceClassification.from_pretrained(str(model), num_labels=1)
        base.config.pad_token_id = tok.pad_token_id
        adapted = PeftModel.from_pretrained(base, str(tmp_path / "out-lora"))
        trl_lora.eval()
        assert torch.allclose(adapted(input_ids=probe).logits, trl_lora(input_ids=probe).logits, atol=1e-5, rtol=1e-4)
