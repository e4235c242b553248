"""LoRA and QLoRA on one GPU, side by side with the peer, in one invocation.

    python bench/lora_bench.py                 # on the GPU host (with the wheels of bench/gpu_run.sh installed)
    python bench/lora_bench.py --dry-run       # the commands and plan's predictions only (anywhere)

Rows: nd-adapter LoRA (bench/configs/llama-3.1-8b-lora-1gpu.yaml: the Llama-3.1-8B shape, r 16 / alpha 32 on all
seven linears, seq 4096, micro-batch 1, bf16 base) and the same on an NF4 base (`lora.quantize_base=nf4`, QLoRA),
under the one entry point (launch/train.py); transformers + PEFT + Liger, and + bitsandbytes NF4, in
bench/peer_lora.py (`--gc` adds the peers' gradient-checkpointing rows). Ratios are against the peer of the same
base format; plan's predicted tokens/s and peak memory stand beside ours. One MFU convention for all rows:
lora.flops_per_token (frozen weights 4 FLOPs per weight and token, trained ones 6).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.compare import parse_result, parse_steps, run_logged  # noqa: E402

CONFIG = "bench/configs/llama-3.1-8b-lora-1gpu.yaml"
MODEL = "configs/models/llama-3.1-8b/config.json"
OURS = {"nd-adapter LoRA": [], "nd-adapter QLoRA (NF4)": ["--set", "lora.quantize_base=nf4"],
        # PEFT itself on transformers' model under nd-adapter's loop (model.engine: transformers)
        "nd-adapter LoRA (transformers engine)": ["--set", "model.engine=transformers", "--set", "model.compile=false"],
        "nd-adapter QLoRA (NF4, transformers engine)": ["--set", "model.engine=transformers", "--set",
                                                        "model.compile=false", "--set", "lora.quantize_base=nf4"],
        # with the Liger kernels the peer row runs (model.liger: Axolotl's liger_* keys)
        "nd-adapter LoRA (transformers engine, Liger)": [
            "--set", "model.engine=transformers", "--set", "model.compile=false",
            "--set", "model.liger=[rope,rms_norm,glu_activation,fused_linear_cross_entropy]"]}
PEERS = {"peer LoRA": [], "peer QLoRA": ["--qlora"]}
VERSUS = {"nd-adapter LoRA": "peer LoRA", "nd-adapter QLoRA (NF4)": "peer QLoRA"}


def commands(a) -> dict[str, list[str]]:
    cmds = {name: ["deepspeed", "--num_gpus=1", "launch/train.py", "--config", a.config, *sets,
                   *(x for kv in a.set for x in ("--set", kv))] for name, sets in OURS.items()}
    for name, extra in PEERS.items():
        for gc in ((False, True) if a.gc else (False,)):
            cmds[name + (" + gc" if gc else "")] = [sys.executable, "bench/peer_lora.py", "--model-config", a.model,
                                                    "--steps", str(a.steps), *extra, *(["--gc"] if gc else [])]
    return {k: v for k, v in cmds.items() if not a.only or any(o in k for o in a.only)}


def predicted(config_path: str, sets: list[str]) -> dict:
    from adapter import config
    from adapter.models.resolved import resolve_run
    from adapter.plan.build import build_plan

    over = [sets[i + 1] for i in range(0, len(sets), 2)]
    cfg = config.load(ROOT / config_path, overrides=config.parse_sets(over), world_size=1)
    plan = build_plan(resolve_run(cfg, gpu=True), config_path=str(ROOT / config_path))
    return {"tokens_per_s_per_gpu": round(plan.predicted.tokens_per_s_per_gpu),
            "peak_gib": round(plan.memory.peak / 2**30, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--config", default=CONFIG, help="our rows' config (its model's other shapes: with --model)")
    ap.add_argument("--model", default=MODEL, help="the peers' config.json")
    ap.add_argument("--gc", action="store_true", help="also the peers with gradient checkpointing")
    ap.add_argument("--only", nargs="*", help="substrings of the rows to run")
    ap.add_argument("--set", nargs="*", default=[], help="overrides for our rows (KEY=VALUE)")
    ap.add_argument("--timeout", type=int, default=420)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--log-dir", default=os.environ.get("OUT", "/tmp/lora-bench"))
    a = ap.parse_args(argv)
    cmds = commands(a)
    plans = {name: predicted(a.config, sets + [x for kv in a.set for x in ("--set", kv)])
             for name, sets in OURS.items() if not a.only or any(o in name for o in a.only)}
    if a.dry_run:
        for name, cmd in cmds.items():
            print(f"{name}: {' '.join(cmd)}" + (f"   plan: {json.dumps(plans[name])}" if name in plans else ""))
        return 0
    Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    rows = {}
    for name, cmd in cmds.items():
        out = run_logged(name, cmd, a.log_dir, a.timeout)
        rows[name] = parse_steps(out) if name in OURS else parse_result(out)
        if name in plans and rows[name]:
            rows[name]["plan"] = plans[name]
        print(name, json.dumps(rows[name]), flush=True)
    print("\n| system | tokens/s | × peer | MFU (4N) | peak GiB | plan tokens/s | plan peak GiB | loss |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        if r is None:
            print(f"| {name} | failed | | | | | | |")
            continue
        ref = rows.get(VERSUS.get(name, ""))
        ratio = f"{r['tokens_per_s_per_gpu'] / ref['tokens_per_s_per_gpu']:.2f}" if ref else ""
        pl = r.get("plan", {})
        print(f"| {name} | {r['tokens_per_s_per_gpu']:,} | {ratio} | "
              f"{100 * r['mfu']:.1f}% | {r.get('peak_gib') or ''} | {pl.get('tokens_per_s_per_gpu', '')} | "
              f"{pl.get('peak_gib', '')} | {r['loss']} |" if r.get("mfu") else
              f"| {name} | {r['tokens_per_s_per_gpu']:,} | {ratio} | | {r.get('peak_gib') or ''} | "
              f"{pl.get('tokens_per_s_per_gpu', '')} | {pl.get('peak_gib', '')} | {r['loss']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
