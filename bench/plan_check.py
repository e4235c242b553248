"""`plan` against one-GPU runs of the families and modes its validation table (bench/plan_vs_measured.py) has no
measured row for yet: soft-capped attention and final logits (Gemma 2), GLM-4's extra norms, Phi-3's packed linears
with LongRoPE, QLoRA on the transformers engine; each at nd-adapter's defaults, so the rows also measure what those
defaults hold.

    python bench/plan_check.py --dry-run           # plan's predictions and the commands (any machine)
    python bench/plan_check.py --out /tmp/pc       # on the GPU host: every row, then the table (+ rows.json)

Each row trains `--steps` steps on synthetic tokens (launch/train.py, one rank) and reads its step lines: the mean
tokens/s after two warm-up steps and the largest `peak_mem` (bench/compare.py's parser), beside plan's prediction
for the same config. Copy measured rows into bench/plan_vs_measured.py's RUNS and PEAKS, with the date.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare import parse_steps, run_logged  # noqa: E402

CONFIG = "bench/configs/plan-check-1gpu.yaml"
BF16 = {"optimizer.state_dtype": "bf16"}  # the larger shapes' model states fit one 80 GB GPU so
# label -> the run's --set overrides on CONFIG
ROWS: dict[str, dict] = {
    "Gemma-2-9B shape, 8 layers (soft-capped scores and logits), bf16 states":
        {"model.path": "configs/models/gemma-2-9b-8l-shape", **BF16},
    "GLM-4-9B shape, 8 layers, bf16 states": {"model.path": "configs/models/glm-4-9b-8l-shape", **BF16},
    "Phi-3.5-mini (packed linears, LongRoPE), bf16 states": {"model.path": "configs/models/phi-3.5-mini-instruct",
                                                             **BF16},
    "Olmo-3 shape, 8 layers, QLoRA (NF4) r16, transformers engine, micro-batch 1":
        {"model.path": "configs/models/olmo3-7b-8l-shape", "lora.r": 16, "lora.alpha": 32,
         "lora.target_linear": True, "lora.quantize_base": "nf4", "batch.micro_batch_size": 1},
    "GLM-4-9B shape, 8 layers, whole logits (model.fused_linear_ce: false), bf16 states":
        {"model.path": "configs/models/glm-4-9b-8l-shape", "model.fused_linear_ce": False, **BF16},
}


def sets(over: dict) -> list[str]:
    out = []
    for k, v in over.items():
        out += ["--set", f"{k}={json.dumps(v) if isinstance(v, bool) else v}"]
    return out


def predicted(over: dict, path: Path = ROOT / CONFIG) -> dict:
    """plan's peak memory (GiB) and tokens/s for the row (the config at `path` with `over`), for the GPU it names."""
    from adapter import config
    from adapter.models.resolved import resolve_run
    from adapter.plan.build import build_plan
    from adapter.plan.memory import GIB

    cfg = config.load(path, overrides=over, world_size=1)
    plan = build_plan(resolve_run(cfg, gpu=True), config_path=str(path))
    return {"peak_gib": round(plan.memory.peak / GIB, 2),
            "tokens_per_s_per_gpu": round(plan.predicted.tokens_per_s_per_gpu) if plan.predicted else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/plan-check", help="directory for the logs and rows.json (not the "
                    "checkout: a dry run writes rows.json too)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--timeout", type=int, default=420, help="seconds per row")
    ap.add_argument("--only", nargs="*", help="rows whose label contains any of these")
    ap.add_argument("--dry-run", action="store_true", help="the predictions and commands only")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for label, over in ROWS.items():
        if a.only and not any(o in label for o in a.only):
            continue
        over = {**over, "optimizer.max_steps": a.steps}
        cmd = ["deepspeed", "--num_gpus=1", "launch/train.py", "--config", CONFIG, *sets(over)]
        row = {"run": label, "set": over, "plan": predicted(over), "command": " ".join(cmd)}
        if not a.dry_run:
            row["measured"] = parse_steps(run_logged(label, cmd, str(out), a.timeout))
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_table(out, rows)
    return 0


def write_table(out: Path, rows: list[dict]) -> None:
    """rows.json under `out`, and the markdown table of measured against planned (bench/vision_plan_check.py too)."""
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    print("\n| run | measured GiB | plan GiB | error | measured tok/s | plan tok/s | error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        m, p = r.get("measured") or {}, r["plan"]
        mem = f"{p['peak_gib'] / m['peak_gib'] - 1:+.1%}" if m.get("peak_gib") else ""
        tps = (f"{p['tokens_per_s_per_gpu'] / m['tokens_per_s_per_gpu'] - 1:+.1%}"
               if m.get("tokens_per_s_per_gpu") and p["tokens_per_s_per_gpu"] else "")
        print(f"| {r['run']} | {m.get('peak_gib', '')} | {p['peak_gib']} | {mem} | "
              f"{m.get('tokens_per_s_per_gpu', '')} | {p['tokens_per_s_per_gpu']} | {tps} |")


if __name__ == "__main__":
    raise SystemExit(main())
