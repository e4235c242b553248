"""Image-text SFT (`processor_type: AutoProcessor`, Axolotl's multimodal path) against transformers' own
Gemma3ForConditionalGeneration (and PEFT for LoRA) trained on the same micro-batches, fp32 on CPU, two processes:
an Axolotl YAML as its Gemma 3 vision example writes it (skip_prepare_dataset, chat_template gemma3, rows of
`messages` with an `images` column), a full fine-tune under ZeRO-3 (every weight trained, the vision tower too, and
the held-out loss), freeze_mm_modules under ZeRO-2 (the towers and projector frozen), and LoRA on the language
model's linears (a lora_target_modules regex, as the examples give) under ZeRO-3; and a second family, Qwen2.5-VL
(chat_template qwen2_vl: M-RoPE positions and a windowed vision tower), under ZeRO-2. Each micro-batch of the
reference is built here from the rows (the image put at the user turn's placeholder, the processor's chat template,
its padding) and labelled by the format's rule written out in tests/helpers/image_text.FAMILIES: only the assistant
turns' tokens, their closing marker included, are trained; never padding or image tokens. The step's loss is the sum
over its trained tokens divided by their count over every rank and micro-batch, as transformers' Trainer
normalises."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.dist import run_workers
from tests.helpers.image_text import ANSWERS, gemma3_vlm, qwen2_5_vlm, reference, rows
from tests.helpers.sft_data import write_jsonl

pytestmark = pytest.mark.slow
WORLD, MB, GA, STEPS, LR, N, VAL = 2, 2, 2, 3, 2e-3, 14, 2
REGEX = r"model.language_model.layers.[\d]+.(mlp|self_attn).(up|down|gate|q|k|v|o)_proj"
RUNS = {"full": ({}, 3, "mm"), "frozen towers": ({"freeze_mm_modules": True}, 2, "mm"),
        # with gradient checkpointing: the frozen tower runs no backward (hf_build.drop_frozen_input_grads)
        "lora": ({"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                  "lora_target_modules": REGEX, "gradient_checkpointing": True}, 3, "mm"),
        # one row in four with an image: micro-batches without any, under ZeRO-3; rendered ahead in a worker process
        "mixed rows": ({"dataloader_num_workers": 1}, 3, "mixed"),
        # another family: Qwen2.5-VL (M-RoPE positions the model places from the image grids, a windowed vision
        # tower over a flat patch list), ZeRO-2 with micro-batches that need the blank filler (without it DeepSpeed's
        # gradient buckets differ between the ranks and its all-reduce fails)
        "qwen": ({"chat_template": "qwen2_vl"}, 2, "mixed")}
FAMILY = {"qwen": "qwen2_5_vl"}


def _model_of(root: Path, name: str) -> Path:
    return root / ("qwen" if name in FAMILY else "model")


def _qwen_processor_here(monkeypatch=None):
    """AutoProcessor loads Qwen2.5-VL's processor only with torchvision (its video processor), which CPU CI lacks: the
    test's processor (tests/helpers/image_text.qwen_processor) stands in for it, in this process alone."""
    import transformers

    from tests.helpers.image_text import qwen_processor

    real = transformers.AutoProcessor.from_pretrained.__func__

    def load(cls, path, *a, **k):
        return qwen_processor(Path(path)) if Path(path).name == "qwen" else real(cls, path, *a, **k)
    if monkeypatch is None:  # a worker process of its own
        transformers.AutoProcessor.from_pretrained = classmethod(load)
    else:
        monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", classmethod(load))


def _raw(model: Path, root: Path, name: str) -> dict:
    extra, zero, data = RUNS[name]  # (the DeepSpeed JSONs: written once by the test, before any rank reads them)
    base = _model_of(root, name) if name in FAMILY else model
    return {"base_model": str(base), "processor_type": "AutoProcessor", "skip_prepare_dataset": True,
            "remove_unused_columns": False, "sample_packing": False, "chat_template": "gemma3",
            "datasets": [{"path": str(root / f"{data}.jsonl"), "type": "chat_template"}], "sequence_len": 256,
            "dataset_prepared_path": str(root / "prep"), "output_dir": str(root / f"out-{name.split()[0]}"),
            "val_set_size": VAL, "micro_batch_size": MB, "gradient_accumulation_steps": GA,
            "max_steps": STEPS, "learning_rate": LR, "lr_scheduler": "constant", "warmup_steps": 0,
            "weight_decay": 0.0, "max_grad_norm": 1e12, "optimizer": "adamw_torch_fused", "dp_shard_size": WORLD,
            "deepspeed": str(root / f"zero{zero}.json"), **extra}


def _worker(rank, world, model, root):
    from adapter import config
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    init_distributed()
    _qwen_processor_here()
    out = {}
    for name in RUNS:
        lines: list[str] = []
        res = train(config.build(_raw(Path(model), Path(root), name), env={}, world_size=world),
                    log=lines.append)
        out[name] = (res.losses, res.eval_losses, lines)
    return out


def test_image_text_sft_matches_transformers(tmp_path, monkeypatch):
    import numpy as np
    from transformers import AutoProcessor

    from adapter import config
    from adapter.data.sampler import DPSampler
    from adapter.data.sft.multimodal import MultimodalRows, load
    from adapter.errors import UserError

    model = gemma3_vlm(tmp_path)
    qwen2_5_vlm(tmp_path)
    data_rows = rows(tmp_path, N)
    write_jsonl(tmp_path / "mm.jsonl", data_rows)
    write_jsonl(tmp_path / "mixed.jsonl", rows(tmp_path, N, images_every=4))
    for zero in (2, 3):
        (tmp_path / f"zero{zero}.json").write_text(json.dumps({"zero_optimization": {"stage": zero}}))
    got = run_workers(_worker, WORLD, str(model), str(tmp_path), timeout=900)[0]

    cfg = config.build(_raw(model, tmp_path, "full"), env={}, world_size=WORLD)
    train_set, held_set, _ = load(cfg, model, model, 10 ** 6)
    assert isinstance(train_set, MultimodalRows) and held_set is not None and len(held_set) == VAL
    # the format's labels: only the answers (and their <end_of_turn>) are trained, never the image tokens
    processor = AutoProcessor.from_pretrained(str(model))
    tok = processor.tokenizer
    batch = train_set.collate([train_set[i] for i in range(4)])
    for i in range(4):
        trained = batch["labels"][i][batch["loss_mask"][i] > 0].tolist()
        row = train_set.rows[i]
        assert tok.decode(trained) == row["messages"][-1]["content"] + "<end_of_turn>", tok.decode(trained)
    assert "mm_pixel_values" in batch and "mm_token_type_ids" in batch and "mm_attention_mask" in batch

    _qwen_processor_here(monkeypatch)

    def same_batches(name):
        """The same rows in the same micro-batches: each step, micro-batch j of every rank (DPSampler's order)."""
        c = config.build(_raw(model, tmp_path, name), env={}, world_size=WORLD)
        m = _model_of(tmp_path, name)
        tr, he, _ = load(c, m, m, 10 ** 6)
        split_train = [tr.rows[i] for i in range(len(tr))]
        its = [iter(DPSampler(len(split_train), dp_rank=r, dp_size=WORLD, micro_batch=MB, seed=c.data.seed))
               for r in range(WORLD)]
        order = [[[split_train[int(i)] for i in next(it)] for it in its for _ in range(GA)] for _ in range(STEPS)]
        return order, [he.rows[i] for i in range(len(he))]

    for name in RUNS:
        losses, evals, lines = got[name]
        order, held = same_batches(name)
        if name in ("mixed rows", "qwen"):  # the filler ran: some rank's micro-batch held no image
            assert any(not any(r.get("images") for r in micro) for step in order for micro in step)
        want, want_eval, _ = reference(_model_of(tmp_path, name), order, held, lr=LR,
                                       freeze_towers=name == "frozen towers", lora=REGEX if name == "lora" else None,
                                       family=FAMILY.get(name, "gemma3"))
        assert len(losses) == STEPS and np.allclose(losses, want, rtol=1e-5, atol=0), (name, losses, want)
        assert abs(want[-1] - want[0]) > 1e-3, want  # it trained
        assert any("an image-text run" in ln for ln in lines), lines
        assert evals and abs(evals[-1][1] - want_eval) <= 1e-5 * abs(want_eval), (evals, want_eval)
    assert any("freeze_mm_modules" in ln for ln in got["frozen towers"][2])
    assert set(ANSWERS) >= {r["messages"][-1]["content"] for r in data_rows}

    # an image path that is not a file is said before training, in one line
    raw = _raw(model, tmp_path, "full")
    raw["datasets"][0]["path"] = str(write_jsonl(tmp_path / "gone.jsonl", [
        {**data_rows[0], "images": [str(tmp_path / "no.png")]}, *data_rows]))
    with pytest.raises(UserError, match=r"1 image path\(s\) of the `images` column are not files"):
        load(config.build(raw, env={}, world_size=WORLD), model, model, 10 ** 6)
    # under ZeRO-3 or dp > 1 a micro-batch without an image gets an untrained row with a blank one, below the rows,
    # which keep their tokens and padding (left or right) exactly
    mixed, _, _ = load(config.build(_raw(model, tmp_path, "mixed rows"), env={}, world_size=WORLD), model, model,
                       10 ** 6, filler=True)
    bare = [i for i in range(len(mixed)) if not mixed.rows[i].get("images")][:2]
    for side in ("right", "left"):
        mixed.processor.tokenizer.padding_side = side
        mixed.blank_filler = False  # the same rows without the filler, for comparison
        want_b = mixed.collate([mixed[i] for i in bare])
        mixed.blank_filler = True
        got_b = mixed.collate([mixed[i] for i in bare])
        n, s = want_b["tokens"].shape
        assert got_b["tokens"].shape[0] == n + 1 and "mm_pixel_values" in got_b and "mm_pixel_values" not in want_b
        assert not got_b["loss_mask"][n].any()
        for k in ("tokens", "loss_mask", "mm_attention_mask"):
            assert (got_b[k][:n, :s] == want_b[k]).all(), (side, k)
        trained = want_b["loss_mask"] > 0
        assert (got_b["labels"][:n, :s][trained] == want_b["labels"][trained]).all()
        assert not got_b["mm_attention_mask"][:n, s:].any() and not got_b["loss_mask"][:, s:].any()
