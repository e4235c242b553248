"""`rl: dpo` learns a preference it was not given: a tiny Llama (random weights, tests/helpers/sft_data.tiny_model)
trained through `nd-adapter train` (an Axolotl YAML, LoRA, one CPU process, fp32) on synthetic pairs comes to prefer
the chosen answers of held-out pairs, and the adapter it exports, loaded by transformers + PEFT, does too.

The rule is one no model can prefer before it is trained on it: eight prompt words and eight answer words drawn with
a fixed seed from the tokenizer's vocabulary and paired at random (a codebook). A prompt is three distinct prompt
words; its chosen answer spells each word's code in order, its rejected answer the code of the next word in a cycle
of the eight (a wrong codebook of the same kind). Every answer word is the code of some prompt word, so each appears
about as often in chosen answers as in rejected ones (65 to 76 times of the 576 on either side), and every answer is
"So" plus three one-token words: neither word frequency nor length decides a pair, only the association of prompt
words with answer words. The held-out pairs are prompts made of word sets (in any order) no training prompt uses.

Measured with plain transformers before training (the base) and after (the export): the held-out accuracy (the
share of pairs where Σ log p(chosen | prompt) > Σ log p(rejected | prompt) over the answer's tokens, TRL's: the
answer, the chat template's end of turn and the EOS) and the mean margin. The run's own eval of the same pairs
(`test_datasets`, before step 1 and at the end) agrees: its logged logps/chosen − logps/rejected are the margins
measured here on the base and on the export (so the exported adapter is the policy the run trained), its eval loss
falls below log 2 and its reward accuracy rises. docs/BENCHMARKS.md records the numbers. The test can fail: with
learning_rate 1e-9 (0 is refused) the export measures as the base did, 0.438, and the accuracy assertion fails."""
from __future__ import annotations

import itertools
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.sft_data import tiny_model, write_jsonl

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
WORDS, LENGTH, TRAIN, HELD, HELD_SETS = 8, 3, 192, 32, 6  # held-out prompts: 32 orders of 6 unseen word sets
STEPS, LR, MICRO, BETA = 60, 1e-2, 32, 0.1  # 60 steps of 32 pairs: 10 epochs of the 192


def _pairs(tok) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows) in the chat_template.default layout."""
    vocab = sorted(w[1:] for w in tok.get_vocab() if w.startswith("Ġ") and w[1:].isalpha() and w[1:].islower()
                   and len(w) >= 4)  # " word" is one token
    rng = random.Random(0)
    pool = rng.sample(vocab, 2 * WORDS)
    prompt_words, code = pool[:WORDS], dict(zip(pool[:WORDS], pool[WORDS:]))
    wrong = {w: code[prompt_words[(i + 1) % WORDS]] for i, w in enumerate(prompt_words)}
    sets = list(itertools.combinations(prompt_words, LENGTH))
    rng.shuffle(sets)
    held_sets = {frozenset(s) for s in sets[:HELD_SETS]}
    prompts = list(itertools.permutations(prompt_words, LENGTH))
    rng.shuffle(prompts)

    def row(words) -> dict:
        return {"messages": [{"role": "user", "content": " ".join(words)}],
                "chosen": {"role": "assistant", "content": "So " + " ".join(code[w] for w in words)},
                "rejected": {"role": "assistant", "content": "So " + " ".join(wrong[w] for w in words)}}

    train = [row(p) for p in prompts if frozenset(p) not in held_sets][:TRAIN]
    held = [row(p) for p in prompts if frozenset(p) in held_sets][:HELD]
    return train, held


def _chatml(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def _margins(model, tok, rows: list[dict]) -> list[float]:
    """Per pair: Σ log p(chosen answer) − Σ log p(rejected answer) given the prompt, over the answer's tokens as
    TRL takes them (the ids of prompt + answer + end of turn + EOS after the prompt's)."""
    import torch

    seqs, starts = [], []
    for r in rows:
        prompt = _chatml(r["messages"][0]["content"])
        head = tok(prompt)["input_ids"]
        for side in ("chosen", "rejected"):
            ids = tok(prompt + r[side]["content"] + "<|im_end|>" + tok.eos_token)["input_ids"]
            assert ids[:len(head)] == head
            seqs.append(ids)
            starts.append(len(head))
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    answer = torch.zeros(len(seqs), width - 1)
    for i, (s, start) in enumerate(zip(seqs, starts)):
        ids[i, :len(s)], attn[i, :len(s)], answer[i, start - 1:len(s) - 1] = torch.tensor(s), 1, 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits.float()
    logp = logits[:, :-1].log_softmax(-1).gather(2, ids[:, 1:, None])[..., 0]
    per_seq = (logp * answer).sum(1).view(-1, 2)
    return (per_seq[:, 0] - per_seq[:, 1]).tolist()


def _summary(margins: list[float]) -> tuple[float, float]:
    """(accuracy, mean margin)."""
    return sum(m > 0 for m in margins) / len(margins), sum(margins) / len(margins)


def _evals(stdout: str) -> dict[int, dict[str, float]]:
    """The run's `eval after step N | eval_loss … | P eval pairs | rewards/chosen … | …` lines, by step."""
    out = {}
    for line in stdout.splitlines():
        m = re.match(r"eval after step (\d+) \| (.*)$", line)
        if m:
            fields = [f.rsplit(" ", 1) for f in m.group(2).split(" | ") if not f.endswith("eval pairs")]
            out[int(m.group(1))] = {k: float(v) for k, v in fields}
    return out


def test_dpo_raises_heldout_preference_and_the_export_keeps_it(tmp_path):
    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_model(tmp_path, weights=True)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    train, held = _pairs(tok)
    assert len(train) == TRAIN and len(held) == HELD
    assert not {r["messages"][0]["content"] for r in train} & {r["messages"][0]["content"] for r in held}
    for r in train + held:  # the same number of tokens in both answers
        assert len(tok(r["chosen"]["content"])["input_ids"]) == len(tok(r["rejected"]["content"])["input_ids"]), r
    write_jsonl(tmp_path / "train.jsonl", train)
    write_jsonl(tmp_path / "held.jsonl", held)

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    before = _margins(base, tok, held)
    acc0, margin0 = _summary(before)

    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "base_model": str(model_dir), "rl": "dpo", "rl_beta": BETA, "chat_template": "chatml",
        "datasets": [{"path": "train.jsonl", "type": "chat_template.default"}],
        "test_datasets": [{"path": "held.jsonl", "type": "chat_template.default", "split": "train"}],
        "dataset_prepared_path": "prepared", "sequence_len": 64, "micro_batch_size": MICRO,
        "gradient_accumulation_steps": 1, "max_steps": STEPS, "learning_rate": LR, "lr_scheduler": "constant",
        "warmup_steps": 0, "optimizer": "adamw_torch", "weight_decay": 0.0, "bf16": False,
        "adapter": "lora", "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "lora_target_linear": True,
        "eval_steps": STEPS // 2, "save_steps": STEPS, "load_best_model_at_end": False, "logging_steps": 1,
        "output_dir": "./outputs/dpo"}))
    p = subprocess.run([sys.executable, "-m", "adapter", "train", "--config", "run.yaml", "--nproc", "1",
                        "--set", "model.cache_dir=cache"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = tmp_path / "outputs/dpo"
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(model_dir)

    exported = AutoPeftModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()  # base from the config
    out_tok = AutoTokenizer.from_pretrained(str(out))
    question = held[0]["messages"]
    assert out_tok.apply_chat_template(question, add_generation_prompt=True, tokenize=False) == _chatml(
        question[0]["content"])  # the export's chat template renders the prompts measured here
    after = _margins(exported, out_tok, held)
    acc1, margin1 = _summary(after)
    evals = _evals(p.stdout)
    print(f"held-out pairs ({HELD}): accuracy {acc0:.3f} -> {acc1:.3f}, mean margin {margin0:+.3f} -> {margin1:+.3f} "
          f"nats (Σ log p chosen − rejected) after {STEPS} DPO steps; the run's eval: {evals}")

    assert acc0 <= 0.6 and abs(margin0) < 0.2, (acc0, margin0)  # no preference before training
    assert acc1 >= 0.85 and margin1 >= 1.0, (acc1, margin1, after)  # a clear one after

    assert sorted(evals) == [0, STEPS // 2, STEPS], p.stdout[-3000:]
    first, last = evals[0], evals[STEPS]
    for logged, measured in ((first, margin0), (last, margin1)):  # the run's eval: the same pairs, the same margins
        assert abs(logged["logps/chosen"] - logged["logps/rejected"] - measured) < 2e-3, (logged, measured)
    assert first["eval_loss"] == pytest.approx(math.log(2), abs=1e-4) and first["rewards/margins"] == 0.0
    assert last["eval_loss"] < 0.65 and last["rewards/accuracies"] >= 0.85, last
    assert last["rewards/margins"] == pytest.approx(BETA * (margin1 - margin0), abs=2e-3), (last, margin0, margin1)
