"""A process reward model's config and rows (Axolotl's process_reward_model: true, its qwen2/prm.yaml): what it maps
to, what `preprocess` prepares and shows, and what it refuses in one line. The training itself against TRL's
PRMTrainer: tests/distributed/test_prm.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from adapter import config
from adapter.errors import UserError
from tests.helpers.cli import run_cli
from tests.helpers.prm import prm_model, rows, step_ids
from tests.helpers.sft_data import write_jsonl


def _raw(model, data, **over) -> dict:
    """Axolotl's qwen2/prm.yaml (067b021) with a local model and rows."""
    raw = {"base_model": str(model), "model_type": "AutoModelForTokenClassification", "num_labels": 2,
           "tokenizer_type": "AutoTokenizer", "process_reward_model": True, "chat_template": None,
           "datasets": [{"path": str(data), "type": "stepwise_supervised", "step_separator": "\n",
                         "max_completion_length": None, "train_on_last_step_only": False}],
           "val_set_size": 0.2, "output_dir": str(Path(data).parent / "out"), "remove_unused_columns": False,
           "sequence_len": 2048, "sample_packing": False, "eval_sample_packing": False,
           "gradient_accumulation_steps": 1, "micro_batch_size": 8, "eval_batch_size": 8, "num_epochs": 1,
           "optimizer": "adamw_torch", "lr_scheduler": "cosine", "learning_rate": 0.0002, "bf16": True,
           "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False},
           "logging_steps": 1, "attn_implementation": "flash_attention_2", "warmup_ratio": 0.1,
           "eval_steps": 100, "saves_per_epoch": 1, "weight_decay": 0.0}
    return {**raw, **over}


@pytest.fixture(scope="module")
def prm(tmp_path_factory):
    root = tmp_path_factory.mktemp("prm")
    return root, prm_model(root), write_jsonl(root / "steps.jsonl", rows(20))


def test_the_example_plans_and_preprocesses(prm):
    """The example plans as the token classifier, and preprocess --debug shows each step's last token with its
    class (the rows as Axolotl's stepwise strategy tokenises them)."""
    from transformers import AutoTokenizer

    root, model, data = prm
    path = root / "prm.yaml"
    path.write_text(yaml.safe_dump(_raw(model, data)))
    code, out, err = run_cli("plan", str(path), "--gpus-per-node", "1")
    flat = " ".join(out.split())
    assert code == 0 and "transformers' own LlamaForTokenClassification" in flat, (out[-3000:], err)
    assert "process_reward_model: true -> model.num_labels: 2" in flat, flat[-3000:]
    code, out, err = run_cli("preprocess", "--config", str(path), "--debug")
    assert code == 0, (out[-2000:], err)
    tok = AutoTokenizer.from_pretrained(str(model))
    shown = [ln for ln in out.splitlines() if ln.startswith("sample 0 example 0")]
    assert shown, out[-2000:]
    ids_of = {tuple(step_ids(tok, r, seq=2048)[0]): step_ids(tok, r, seq=2048)[1] for r in rows(20)}
    pairs = shown[0].split("): ", 1)[1]
    labels = [int(p.rsplit(", ", 1)[1].rstrip(")")) for p in pairs.split(") (")]
    assert labels in list(ids_of.values()), (labels, pairs[:400])
    assert {0, 1} & set(labels), labels


@pytest.mark.parametrize("over, says", [
    ({"process_reward_model": None, "model_type": None, "num_labels": None},
     "type: stepwise_supervised': a process reward model's rows (a class per step) train a token-classification"),
    ({"num_labels": 1}, "num_labels=1: a process reward model classifies each step's last token into at least two"),
    ({"reward_model": True}, "process_reward_model=True: a process reward model and reward_model: True are two"),
    ({"datasets": [{"path": "x.jsonl", "type": "chat_template"}]},
     "num_labels=2: a process reward model: its rows' labels are classes: a chat_template dataset's are token ids"),
    ({"tensor_parallel_size": 2, "_world": 2}, "num_labels=2: a process reward model: tensor and context parallelism"),
    ({"adapter": "qlora", "load_in_4bit": True, "lora_r": 4, "lora_alpha": 8, "lora_target_linear": True},
     "num_labels=2: a process reward model: a 4/8-bit base under its head is not built"),
    ({"datasets": [{"path": "x.jsonl", "type": "alpaca", "step_separator": "\n\n"}]},
     "step_separator='\\n\\n': only applies to type stepwise_supervised, not alpaca"),
])
def test_what_it_refuses_is_one_line(prm, over, says):
    from adapter.data.sft.prepare import check_choices
    from adapter.models import checks, source

    root, model, data = prm
    world = over.pop("_world", 1)
    raw = {k: v for k, v in _raw(model, data, **over).items() if v is not None}
    with pytest.raises(UserError) as e:
        cfg = config.build(raw, env={}, world_size=world)
        check_choices(cfg)
        checks.check(cfg, source.arch_for(cfg))
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_rows_it_cannot_label_are_one_line(prm):
    """A row whose labels do not pair with its steps, or a class past num_labels: one line naming the row."""
    root, model, _ = prm
    for name, bad_rows, says in (
            ("short", [{"prompt": "p", "completions": ["a", "b"], "labels": [True]}],
             "completions and labels must be lists of the same length"),
            ("class", [{"prompt": "p", "completions": ["a", "b"], "labels": [1, 2]}],
             "are not classes 0 to 1")):
        path = root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(_raw(model, write_jsonl(root / f"{name}.jsonl", bad_rows * 4),
                                            dataset_prepared_path=str(root / f"prep-{name}"))))
        code, out, err = run_cli("preprocess", "--config", str(path))
        said = [ln for ln in err.splitlines() if ln.startswith("nd-adapter: error:")]
        assert code == 2 and len(said) == 1 and says in said[0] and "row 0" in said[0], (out[-1500:], err)


def test_packed_rows_classify_as_they_do_alone(prm):
    """Packed (sample_packing), each row's labelled tokens get the losses they get alone: the loop's next-token
    layout (labels shifted left, masked across a row's end) undone per position, and attention kept within rows."""
    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from adapter.data.sft.bins import targets
    from adapter.modeling.hf_heads import TokenClassLosses

    root, model_dir, _ = prm
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForTokenClassification.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    a, b = (step_ids(tok, r, seq=64) for r in rows(2))
    losses = TokenClassLosses(model)

    def run(ids, labels, offsets):
        import numpy as np

        tgt = targets(np.array(labels), np.array(offsets))
        pos = torch.cat([torch.arange(offsets[k + 1] - offsets[k]) for k in range(len(offsets) - 1)])
        with torch.no_grad():
            out = losses(torch.tensor([ids]), pos[None], labels=torch.tensor([np.maximum(tgt, 0).astype("int64")]),
                         loss_mask=torch.tensor([(tgt >= 0).astype("float32")]))
        return out[0], torch.tensor(tgt >= 0)

    packed, mask = run(a[0] + b[0], a[1] + b[1], [0, len(a[0]), len(a[0]) + len(b[0])])
    alone = [run(ids, labels, [0, len(ids)]) for ids, labels in (a, b)]
    want = torch.cat([loss[m] for loss, m in alone])
    assert int(mask.sum()) == len(want) > 2 and torch.allclose(packed[mask], want, atol=1e-5), (packed[mask], want)


def test_stepwise_keys_at_their_defaults_are_not_stray():
    """A config written back out (model_dump) holds every entry key, the stepwise ones at their defaults: another
    type's entry says nothing of them (DPO runs rebuilt from a dump were refused); set to something, they are."""
    from adapter.config.schema_data import DatasetEntry
    from adapter.data.sft.formats import kind_of

    pairs = DatasetEntry(path="x.jsonl", type="chat_template.default")
    entry = DatasetEntry.model_validate(pairs.model_dump())
    assert "step_separator" in entry.model_fields_set
    assert kind_of(entry, "datasets[0]", "dpo") == "chat_template.default"
    with pytest.raises(UserError, match="train_on_last_step_only=True: only applies to type stepwise_supervised"):
        kind_of(DatasetEntry(path="x.jsonl", type="chat_template", train_on_last_step_only=True), "datasets[0]")


def test_a_native_config_says_what_it_trains(prm):
    """A native config (model.num_labels) says the head, the loss and the dropout it turns off in its first lines, as
    the Axolotl mapping's note does."""
    from adapter.models import announce
    from adapter.models.resolved import resolve_run

    root, model, data = prm
    cfg = config.build({"model": {"path": str(model), "num_labels": 2}, "seq_len": 128,
                        "data": {"datasets": [{"path": str(data), "type": "stepwise_supervised"}]}}, env={})
    lines = announce.announce(resolve_run(cfg))
    assert any(ln.startswith("loss: a process reward model: LlamaForTokenClassification with 2 classes") and
               "every dropout of the model off" in ln for ln in lines), lines
