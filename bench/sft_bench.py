"""SFT throughput on one GPU: the Llama-3.2-1B shape fine-tuned from an Axolotl-style YAML on a packed
chat dataset, through the one entry point. Reports tokens/s/GPU (every token of the packed samples) and trained
tokens/s/GPU (the assistant tokens the loss counts), from the run's own step lines and its data report.

    python bench/sft_bench.py --out /tmp/sft-bench [--conversations 20000] [--steps 12]

The chat rows are drawn from the conversations shipped in adapter/demo/data/chat_genesis.jsonl (re-combined, so
turn counts and lengths vary); the model directory holds the 1B shape's config.json and the demo tokenizer (chatml
specials), no weights: throughput does not depend on them.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEP = re.compile(r"^step (\d+)/\d+ \| loss ([\d.]+) .*?\| ([\d,]+) tok/s/GPU")
TRAIN = re.compile(r"train: (\d+) examples in (\d+) samples of (\d+) tokens .*?([\d,]+) trained tokens of ([\d,]+)")


def build(out: Path, conversations: int, seed: int = 0) -> tuple[Path, Path]:
    from adapter.demo.build import ASSETS, train_tokenizer

    tok = out / "tokenizer"
    if not (tok / "tokenizer.json").exists():
        train_tokenizer(out_dir=tok, vocab_size=2048)
    model = out / "model"
    model.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((ROOT / "configs/models/llama-3.2-1b/config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in tok.iterdir():
        if f.is_file():
            (model / f.name).write_bytes(f.read_bytes())
    rows = [json.loads(line) for line in (ASSETS / "chat_genesis.jsonl").read_text().splitlines() if line.strip()]
    pairs = [(m["content"], r["messages"][i + 1]["content"]) for r in rows for i, m in enumerate(r["messages"][:-1])
             if m["role"] == "user" and r["messages"][i + 1]["role"] == "assistant"]
    rng = random.Random(seed)
    data = out / "chat.jsonl"
    with open(data, "w") as f:
        for _ in range(conversations):
            turns = [{"role": "system", "content": "You answer questions about the Book of Genesis."}]
            for q, a in rng.sample(pairs, rng.randint(1, 6)):
                turns += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return model, data


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--conversations", type=int, default=20000)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--name", default="train", help="the run's log is <out>/<name>.log")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to the entry point")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    model, data = build(a.out, a.conversations)
    yaml = {"base_model": str(model), "datasets": [{"path": str(data), "type": "chat_template"}],
            "chat_template": "chatml", "special_tokens": {"eos_token": "<|im_end|>"}, "sample_packing": True,
            "sequence_len": a.seq, "micro_batch_size": a.micro_batch, "gradient_accumulation_steps": 1,
            "learning_rate": a.lr, "seed": a.seed, "max_steps": a.steps, "bf16": True,
            "dataset_prepared_path": str(a.out / "prep"),
            "dp_shard_size": 1}
    cfg = a.out / "sft.yaml"
    cfg.write_text(json.dumps(yaml, indent=1))  # JSON is YAML
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    sets = [x for kv in a.set for x in ("--set", kv)]
    p = subprocess.run(["deepspeed", "--num_gpus", "1", str(ROOT / "launch/train.py"), "--config", str(cfg), *sets],
                       capture_output=True, text=True, env=env, timeout=1500)
    log = p.stdout + p.stderr
    (a.out / f"{a.name}.log").write_text(log)
    steps = [m.groups() for m in map(STEP.match, log.splitlines()) if m]
    train = next((m.groups() for m in map(TRAIN.search, log.splitlines()) if m), None)
    if p.returncode or not steps or train is None:
        raise SystemExit(f"run failed ({p.returncode}):\n{log[-3000:]}")
    examples, bins, seq, trained, tokens = (int(x.replace(",", "")) for x in train)
    tps = mean(float(s[2].replace(",", "")) for s in steps[2:] or steps)
    frac = trained / (bins * seq)
    result = {"tokens_per_s_per_gpu": round(tps), "trained_tokens_per_s_per_gpu": round(tps * frac),
              "trained_fraction_of_sample_tokens": round(frac, 4),
              "packing_efficiency": round(tokens / (bins * seq), 4),
              "examples": examples, "samples": bins, "losses": [float(s[1]) for s in steps]}
    print("RESULT " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
