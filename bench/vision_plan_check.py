"""`plan` against one-GPU image-text runs: the vision tower's terms in plan's memory and step time
(adapter/plan/memory.py vision_load, adapter/models/counts.py vision_*) had no measured row before 2026-12-06.

Builds a Gemma 3 image-text checkpoint with gemma-3-4b-it's vision tower (SigLIP: 27 layers, 1,152 wide, FFN
4,304; 896-pixel images in 14-pixel patches, so 4,096 patches an image, pooled to 256 soft tokens), `--text-layers`
of its language model, and the tests' tiny tokenizer (tests/helpers/image_text.py), so that the tower is most of
the step and its terms are what the comparison checks. Every row renders to the same length (one image, the same
text), and `sequence_len` is set to that length, so plan's tokens are the run's. Rows, each Axolotl's own
gemma-3-4b-vision-qlora.yml with local paths and `max_steps`:

- "QLoRA (the example)": NF4 language model, adapters on its linears, gradient checkpointing: the tower runs its
  forward only;
- "full fine-tune": no adapter, bf16, AdamW (fused): the tower trains (its activations kept, three GEMMs each).
- "compiled full fine-tune": the same with `torch_compile: true` (the tower's layers compiled with the text's).

    python bench/vision_plan_check.py --dry-run          # plan's predictions (any machine; builds the checkpoint)
    python bench/vision_plan_check.py --out /tmp/vpc     # on the GPU host: train each row, then the table

Run on the GPU host by `bash bench/gpu_batch.sh DEADLINE vision` (carry .whl). Copy measured rows into
bench/plan_vs_measured.py with the date.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare import parse_steps, run_logged  # noqa: E402
from bench.plan_check import predicted, write_table  # noqa: E402

TOWER = json.loads((ROOT / "configs/models/gemma-3-4b-it/config.json").read_text())["vision_config"]
TARGETS = r"model.language_model.layers.[\d]+.(mlp|cross_attn|self_attn).(up|down|gate|q|k|v|o)_proj"  # the example's
ANSWER = "the cat sat on the mat " * 60  # the assistant's turn: the same length in every row

# label -> the keys that differ from the example (None drops a key)
ROWS: dict[str, dict] = {
    "QLoRA (the example)": {},
    "full fine-tune": {"adapter": None, "load_in_4bit": None, "lora_r": None, "lora_alpha": None,
                       "lora_dropout": None, "lora_target_modules": None, "optimizer": "adamw_torch_fused",
                       "gradient_checkpointing": False, "gradient_checkpointing_kwargs": None},
}
ROWS["compiled full fine-tune"] = {**ROWS["full fine-tune"], "torch_compile": True}  # the tower's layers compiled too


def build(root: Path, text_layers: int) -> tuple[Path, Path, int]:
    """(checkpoint, rows file, the rendered length of every row)."""
    from PIL import Image
    from transformers import AutoProcessor

    from tests.helpers.image_text import gemma3_vlm
    from tests.helpers.sft_data import write_jsonl

    text = json.loads((ROOT / "configs/models/gemma-3-4b-it/config.json").read_text())["text_config"]
    text = {k: v for k, v in text.items() if k != "model_type"} | {"num_hidden_layers": text_layers}
    vision = {k: v for k, v in TOWER.items() if k not in ("model_type", "vision_use_head")}
    model = root / "model"
    if not (model / "config.json").exists():
        gemma3_vlm(root, text=text, vision=vision, image_seq_length=256, spread=1.0)
    img = root / "img.png"
    Image.new("RGB", (640, 480), (120, 30, 200)).save(img)
    row = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe"}]},
                        {"role": "assistant", "content": ANSWER}], "images": [str(img)]}
    data = write_jsonl(root / "rows.jsonl", [row] * 64)
    processor = AutoProcessor.from_pretrained(str(model))
    msgs = [{"role": "user", "content": [{"type": "image", "image": Image.open(img).convert("RGB")},
                                         {"type": "text", "text": "describe"}]},
            {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]}]
    ids = processor.apply_chat_template([msgs], tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
    return model, data, int(ids.shape[1])


def example(model: Path, data: Path, length: int, out: Path, steps: int) -> dict:
    """Axolotl's examples/gemma3/gemma-3-4b-vision-qlora.yml (067b021) with local paths and a bounded run."""
    return {"base_model": str(model), "processor_type": "AutoProcessor", "load_in_4bit": True,
            "skip_prepare_dataset": True, "remove_unused_columns": False, "sample_packing": False,
            "ddp_find_unused_parameters": True, "chat_template": "gemma3", "eot_tokens": ["<end_of_turn>"],
            "datasets": [{"path": str(data), "type": "chat_template"}], "dataset_prepared_path": str(out / "prep"),
            "val_set_size": 0, "output_dir": str(out / "run"), "adapter": "qlora", "sequence_len": length,
            "pad_to_sequence_len": False, "lora_r": 32, "lora_alpha": 16, "lora_dropout": 0,
            "lora_target_modules": TARGETS,
            "gradient_accumulation_steps": 4, "micro_batch_size": 2, "max_steps": steps, "optimizer": "adamw_bnb_8bit",
            "lr_scheduler": "cosine", "learning_rate": 2e-4, "bf16": True, "tf32": True,
            "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False},
            "logging_steps": 1, "attn_implementation": "flash_attention_2", "warmup_ratio": 0.1,
            "save_strategy": "no", "weight_decay": 0.0}


def main(argv=None) -> int:
    import yaml

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/vision-plan-check")
    ap.add_argument("--text-layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per row")
    ap.add_argument("--only", nargs="*", help="rows whose label contains any of these")
    ap.add_argument("--dry-run", action="store_true", help="the checkpoint and plan's predictions only")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model, data, length = build(out, a.text_layers)
    print(f"checkpoint {model}: {a.text_layers} text layers, tower {TOWER['num_hidden_layers']} × "
          f"{TOWER['hidden_size']}; every row {length} tokens", flush=True)
    rows = []
    for label, diff in ROWS.items():
        if a.only and not any(o in label for o in a.only):
            continue
        raw = example(model, data, length, out / label.split()[0], a.steps)
        raw = {k: v for k, v in {**raw, **diff}.items() if v is not None}
        path = out / f"{label.split()[0]}.yaml"
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        row = {"run": label, "yaml": str(path), "plan": predicted({}, path)}
        if not a.dry_run:
            shutil.rmtree(raw["output_dir"], ignore_errors=True)  # a run left there would (rightly) refuse a fresh one
            cmd = ["deepspeed", "--num_gpus=1", "launch/train.py", "--config", str(path)]
            row["measured"] = parse_steps(run_logged(label, cmd, str(out), a.timeout))
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_table(out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
