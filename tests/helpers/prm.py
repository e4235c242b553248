"""A process reward model's test pieces (tests/distributed/test_prm.py): a tiny Llama token classifier, stepwise
rows, Axolotl's ids and labels of a row written out, and TRL's PRMTrainer on given rows in order (one step =
`batch` consecutive rows)."""
from __future__ import annotations

from pathlib import Path

from tests.helpers.reward import EPS, classifier, in_order

IGNORE = -100


def rows(n: int) -> list[dict]:
    """Rows of Axolotl's stepwise_supervised type: a prompt, its steps and each step's label (bools, as Math-Shepherd
    gives them; every third row labels with class numbers)."""
    words = "add the two then carry one so the sum is nine and we are done".split()
    out = []
    for i in range(n):
        k = 2 + i % 3
        steps = [" ".join(words[(i + j) % 8: (i + j) % 8 + 2 + (i + j) % 3]) for j in range(k)]
        labels = [(i * 7 + j) % 3 != 0 for j in range(k)]
        out.append({"prompt": f"Problem {i}: what is {i} plus {i + 1}?", "completions": steps,
                    "labels": [int(x) for x in labels] if i % 3 == 0 else labels})
    return out


def prm_model(root: Path) -> Path:
    """A tiny Llama causal LM's weights under a seeded two-class token head (spread, so that the loss moves off log 2
    within a few steps), saved as a token classifier."""
    return classifier(root, "LlamaForTokenClassification", 2, "prm", head_scale=20.0)


def step_ids(tok, row: dict, *, sep: str = "\n", seq: int, last_only: bool = False) -> tuple[list[int], list[int]]:
    """Axolotl's StepwiseSupervisedPromptTokenizingStrategy on one row, written out: each step + the separator
    tokenised apart, the step's class on its last token, the BOS (where the tokenizer has one) before the prompt."""
    sep_ids = tok.encode(sep, add_special_tokens=False)
    labels = [int(x) for x in row["labels"]]
    if last_only:
        labels = [IGNORE] * (len(labels) - 1) + labels[-1:]
    ids, tags = [], []
    for step, c in zip(row["completions"], labels):
        piece = tok(step, add_special_tokens=False)["input_ids"] + sep_ids
        ids += piece
        tags += [IGNORE] * (len(piece) - 1) + [c]
    head = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + tok(row["prompt"],
                                                                              add_special_tokens=False)["input_ids"]
    return (head + ids)[:seq], ([IGNORE] * len(head) + tags)[:seq]


def prepared_rows(part, want: list[tuple[list[int], list[int]]]) -> list[dict]:
    """The prepared samples of `part` (one unpacked row each) as TRL's rows: their tokens (each checked to be one of
    `want`'s, Axolotl's ids) and classes (the loop's shifted labels unshifted back)."""
    out = []
    for i in range(len(part)):
        sample = part[i]
        n = int(sample["attention_mask"].sum())  # one unpacked example, then padding
        ids = sample["tokens"][:n].tolist()
        labels = [IGNORE] + [int(c) if m else IGNORE for c, m in zip(sample["labels"][:n - 1], sample["loss_mask"])]
        assert (ids, labels) in want, (ids, labels)
        out.append({"input_ids": ids, "labels": labels})
    return out


def trl_prm(model_dir: Path, order: list[dict], held: list[dict], out: Path, *, batch: int, steps: int, lr: float,
            ga: int = 1, lora: bool = False, cpu: bool = True):
    """TRL's PRMTrainer (1.8.0's, Axolotl's base class) on the tokenised rows in `order` (input_ids, labels; one step
    = `batch` consecutive rows in `ga` batches), evaluating `held` in one batch before step 1 and every 2 steps:
    (per step: its logged loss, per eval: its logged metrics, the trained model). `cpu` false: on the GPU."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForTokenClassification, AutoTokenizer
    from trl.experimental.prm import PRMConfig, PRMTrainer

    model = AutoModelForTokenClassification.from_pretrained(str(model_dir), dtype=torch.float32)
    if lora:  # Axolotl's LoRA on a token classifier: PEFT's TOKEN_CLS task (the score trained in full). PEFT 0.21's
        # "all-linear" leaves a SEQ_CLS head out but not a TOKEN_CLS one, and then refuses the score as both a target
        # and a module to save: lora_target_linear is the decoder's linears, as for a reward model
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(42)  # the run's seed, as adapter/modeling/hf_build.add_peft draws the adapters
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="TOKEN_CLS",
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj"]))
    InOrder, logged, seen, evals = in_order(PRMTrainer)
    args = PRMConfig(output_dir=str(out), per_device_train_batch_size=batch // ga, gradient_accumulation_steps=ga,
                     max_steps=steps, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
                     weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=EPS, max_grad_norm=0.0,
                     logging_steps=1, report_to=[], use_cpu=cpu, save_strategy="no", seed=42, bf16=False,
                     dataloader_num_workers=0, optim="adamw_torch", eval_strategy="steps", eval_steps=2,
                     eval_on_start=True, per_device_eval_batch_size=len(held))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.pad_token = tok.pad_token or tok.eos_token  # (its collator pads; the padding is masked and unlabelled)
    trainer = InOrder(model=model, args=args, train_dataset=Dataset.from_list(order),
                      eval_dataset=Dataset.from_list(held), callbacks=[logged], processing_class=tok)
    trainer.train()
    return seen, evals, trainer.model


__all__ = ["rows", "prm_model", "step_ids", "prepared_rows", "trl_prm"]
