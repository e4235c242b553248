"""A reward model's test pieces (tests/distributed/test_reward.py on CPU, tests/gpu/test_reward.py on CUDA): a tiny
Llama sequence classifier, Bradley-Terry rows, Axolotl's ids of a row written out, and TRL's RewardTrainer on given
pairs in order (one step = `batch` consecutive pairs)."""
from __future__ import annotations

from pathlib import Path

from tests.helpers.sft_data import tiny_model

EPS = 1e-8


def rows(n: int) -> list[dict]:
    words = "red green blue small large quick slow bright dark warm cold soft".split()
    return [{"system": "Be brief." if i % 3 == 0 else "", "input": f"Describe thing {i}.",
             "chosen": " ".join(words[: 2 + i % 5]) + ".", "rejected": f"No {i}" + " idea" * (1 + i % 3)}
            for i in range(n)]


def reward_model(root: Path) -> Path:
    """A tiny Llama causal LM's weights under a seeded one-label score head, saved as a sequence classifier."""
    return classifier(root, "LlamaForSequenceClassification", 1, "rm")


def classifier(root: Path, cls_name: str, labels: int, name: str, head_scale: float = 1.0) -> Path:
    """A tiny Llama causal LM's body under a seeded `labels`-output score head (× `head_scale`), saved as transformers'
    `cls_name` in root/name with the LM's tokenizer files."""
    import torch
    import transformers

    src = tiny_model(root / "t", weights=True)
    lm = transformers.AutoModelForCausalLM.from_pretrained(str(src))
    cfg = lm.config
    cfg.num_labels, cfg.architectures = labels, [cls_name]
    torch.manual_seed(1)
    m = getattr(transformers, cls_name)(cfg)
    m.model.load_state_dict(lm.model.state_dict())
    with torch.no_grad():
        m.score.weight.mul_(head_scale)
    out = root / name
    m.save_pretrained(str(out))
    for f in Path(src).glob("*"):
        if "token" in f.name or f.suffix == ".jinja":
            (out / f.name).write_bytes(f.read_bytes())
    return out


LORA = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_target_linear": True}


def bt_ids(tok, template: str, row: dict, answer: str, seq: int) -> list[int]:
    """Axolotl's bradley_terry.chat_template ids of one answer (its strategy's legacy path), cut to `seq`."""
    system = [{"role": "system", "content": row["system"]}]  # its own turn, or the one Axolotl adds for an empty one
    turns = [*system, {"role": "user", "content": row["input"]}, {"role": "assistant", "content": answer}]
    prompt = tok.apply_chat_template(turns[:-1], add_generation_prompt=True, tokenize=True, return_dict=False,
                                     chat_template=template)
    whole = tok.apply_chat_template(turns, tokenize=True, return_dict=False, chat_template=template)
    return (list(prompt) + list(whole)[len(prompt):])[:seq]


def trl_reward(model_dir: Path, order: list[dict], held: list[dict], out: Path, *, batch: int, steps: int, lr: float,
               seq: int, center: float, eval_batch: int, ga: int = 1, lora: bool = False, cpu: bool = True):
    """TRL's RewardTrainer on the tokenised pairs in `order` (one step = `batch` consecutive pairs, in `ga` batches),
    evaluating `held` before step 1 and every 2 steps: (per step: loss and metrics, per eval: its logged metrics, the
    trained model). `cpu` false: on the GPU."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=torch.float32, num_labels=1)
    if lora:  # Axolotl's LoRA on a sequence classifier: PEFT's SEQ_CLS task (the score trained in full)
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(42)  # the run's seed, as adapter/modeling/hf_build.add_peft draws the adapters
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                                 task_type="SEQ_CLS"))
    InOrder, logged, seen, evals = in_order(RewardTrainer)
    args = RewardConfig(output_dir=str(out), per_device_train_batch_size=batch // ga, gradient_accumulation_steps=ga,
                        max_steps=steps, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
                        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=EPS, max_grad_norm=0.0,
                        max_length=seq, center_rewards_coefficient=center, logging_steps=1, report_to=[],
                        use_cpu=cpu, save_strategy="no", seed=42, bf16=False, dataloader_num_workers=0,
                        optim="adamw_torch", eval_strategy="steps", eval_steps=2, eval_on_start=True,
                        per_device_eval_batch_size=eval_batch)
    trainer = InOrder(model=model, args=args, train_dataset=Dataset.from_list(order),
                      eval_dataset=Dataset.from_list(held), callbacks=[logged],
                      processing_class=AutoTokenizer.from_pretrained(str(model_dir)))
    trainer.train()
    return seen, evals, trainer.model


def in_order(trainer_cls):
    """(a subclass of a TRL trainer that takes its train rows in order, a callback that records its logs, the step
    logs it records, the eval logs it records (step, logs))."""
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback

    seen: list[dict] = []
    evals: list[tuple[int, dict]] = []

    class Logged(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "eval_loss" in logs:
                evals.append((state.global_step, dict(logs)))
            elif logs and "loss" in logs:
                seen.append(dict(logs))

    class InOrder(trainer_cls):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    return InOrder, Logged(), seen, evals


def one_gpu_head_run(model: Path, root: Path, *, seq: int, lr: float, ga: int, steps: int) -> dict:
    """The schedule keys of the one-GPU classification-head tests (tests/gpu/test_reward.py, test_prm.py): an Axolotl
    file of `steps` steps of `ga` rows, constant lr, no decay or clipping, torch's fused AdamW; the test adds the
    head's and the data's keys."""
    return {"base_model": str(model), "sequence_len": seq, "dataset_prepared_path": str(root / "prep"),
            "output_dir": str(root / "out"), "micro_batch_size": 1, "gradient_accumulation_steps": ga,
            "max_steps": steps, "learning_rate": lr, "lr_scheduler": "constant", "warmup_steps": 0,
            "weight_decay": 0.0, "adam_epsilon": EPS, "max_grad_norm": 1e12, "optimizer": "adamw_torch_fused"}


def step_pairs(seed: int, n: int, *, world: int, ga: int, steps: int) -> list[list[int]]:
    """The pairs of each step, as nd-adapter's sampler hands them to `world` ranks of `ga` micro-batches of one."""
    from adapter.data.sampler import DPSampler

    its = [iter(DPSampler(n, dp_rank=r, dp_size=world, micro_batch=1, seed=seed)) for r in range(world)]
    return [[int(i) for it in its for _ in range(ga) for i in next(it)] for _ in range(steps)]


__all__ = ["EPS", "rows", "reward_model", "classifier", "bt_ids", "trl_reward", "in_order", "step_pairs"]
