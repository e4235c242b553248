"""Side-by-side GPU benchmark: this project's entry point and its peers, in one invocation on the same GPUs.

    python bench/compare.py                        # on the GPU host, 2 GPUs; see docs/BENCHMARKS.md
    python bench/compare.py --gpus 1 --shape 3b    # one GPU: against transformers, + torch.compile, + Liger
    python bench/compare.py --dry-run              # print the commands only (works anywhere)

2 GPUs: nd-adapter dp_shard=2 and tp=2 (launch/train.py under the deepspeed launcher, configs in bench/configs/),
and the peers in bench/peers.py (Accelerate ParallelismConfig + FSDP2, Accelerate + transformers TP plan, DeepSpeed
ZeRO-3 on the HF model); ratios against the Accelerate FSDP2 row of the same run. 1 GPU: nd-adapter (one
rank, nothing to shard) against plain transformers, transformers + torch.compile and transformers + Liger; ratios
against the Liger row. One MFU formula for all rows (adapter/train/metrics.py). `act GiB` is activation + logits
memory: the peak minus weights, gradients and optimizer states (16 bytes/param for our fp32-master bf16 training,
8 for the HF rows' bf16 parameters and states).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (runs with masked rows also log the trained tokens' rate after the total's: skipped, so MFU and the peak parse)
STEP = re.compile(r"^step (\d+)/\d+ \| loss ([\d.]+) .*?\| ([\d,]+) tok/s/GPU(?: \| [\d,]+ trained tok/s/GPU)?"
                  r"(?: \| MFU ([\d.]+)%)?(?: \| peak_mem ([\d.]+) GiB)?")
OURS = {"nd-adapter dp_shard=2 (ZeRO-2)": "bench/configs/llama-3.2-1b-dp2.yaml",
        "nd-adapter dp_shard=2 (ZeRO-3)": "bench/configs/llama-3.2-1b-dp2-zero3.yaml",
        "nd-adapter tp=2": "bench/configs/llama-3.2-1b-tp2.yaml"}
PEERS = ("accelerate-fsdp2", "accelerate-tp", "deepspeed-hf")
ONE_GPU = {"1b": "llama-3.2-1b", "3b": "llama-3.2-3b",  # shape -> configs/models/<name>, bench/configs/<name>-1gpu.yaml
           "phi4-mini": "phi-4-mini-shape", "gemma3-4b": "gemma-3-4b-shape",
           "qwen3-moe-8l": "qwen3-30b-a3b-8l-shape",  # its peers run transformers' grouped_mm experts
           "olmo3-8l": "olmo3-7b-8l-shape"}  # no native family: nd-adapter's transformers engine
ONE_GPU_PEERS = ("hf", "hf-compile", "hf-liger")
OUR_STATE_BYTES = 16  # bf16 weights + bf16 grads + fp32 master + fp32 Adam moments (optimizer.state_dtype: bf16: 8)


def parse_steps(log: str, skip: int = 2) -> dict | None:
    """Summarise our step lines: mean throughput/MFU after `skip` warm-up steps, peak memory, last loss."""
    rows = [m.groups() for m in map(STEP.match, log.splitlines()) if m]
    if not rows:
        return None
    steady = rows[skip:] or rows
    tps = mean(float(r[2].replace(",", "")) for r in steady)
    mfus = [float(r[3]) / 100 for r in steady if r[3]]
    return {"tokens_per_s_per_gpu": round(tps), "mfu": round(mean(mfus), 4) if mfus else None,
            "peak_gib": max(float(r[4]) for r in rows if r[4]) if any(r[4] for r in rows) else None,
            "loss": float(rows[-1][1])}


def yaml_model_path(cfg_file: Path) -> str:
    import yaml

    raw = yaml.safe_load(cfg_file.read_text())
    return raw["base_model"] if "base_model" in raw else raw["model"]["path"]


def parse_result(log: str) -> dict | None:
    lines = [ln for ln in log.splitlines() if ln.startswith("RESULT ")]
    return json.loads(lines[-1][7:]) if lines else None


FP8 = ["--set", "precision=fp8"]
LINEAR_CE = ["--set", "model.fused_linear_ce=true", "--set", "model.fused_linear_ce_chunk=2048"]
HF_ENGINE_LIGER = ["--set", "model.engine=transformers", "--set", "model.compile=false", "--set",
                   "model.liger=[rope,rms_norm,glu_activation,fused_linear_cross_entropy]"]
ONE_GPU_VARIANTS = {  # our 1-GPU rows: the default (flat AdamW), memory-budget recompute, fp8, DeepSpeed's step
    "": [],
    "compiled layers": ["--set", "model.compile=true"],
    "activation budget 0.6": ["--set", "model.compile_memory_budget=0.6"],
    "linear CE": LINEAR_CE,
    "fp8": FP8,
    "fp8 rowwise": [*FP8, "--set", "model.fp8_recipe=rowwise"],
    "fp8 all linears": [*FP8, "--set", "model.fp8_linears=[qkv,proj,fc1,fc2]"],
    "fp8, linear CE": [*FP8, *LINEAR_CE],
    "fp8, activation budget 0.6": [*FP8, "--set", "model.compile_memory_budget=0.6"],
    "DeepSpeed ZeRO-1 step": ["--set", "optimizer.impl=deepspeed"],
    "bf16 states": ["--set", "optimizer.state_dtype=bf16"],  # the peers' precision: no fp32 master, bf16 moments
    "bf16 states, fp8, linear CE": ["--set", "optimizer.state_dtype=bf16", *FP8, *LINEAR_CE],
    "bf16 states, linear CE": ["--set", "optimizer.state_dtype=bf16", *LINEAR_CE],
    "bf16 states, compiled layers": ["--set", "optimizer.state_dtype=bf16", "--set", "model.compile=true"],
    # the transformers engine with nd-adapter's fused linear CE in place of Liger's (the other Liger kernels kept)
    "bf16 states, our linear CE": ["--set", "optimizer.state_dtype=bf16", "--set",
                                   "model.liger=[rope,rms_norm,glu_activation]", "--set", "model.fused_linear_ce=true"],
    "bf16 states, compiled layers, linear CE": ["--set", "optimizer.state_dtype=bf16", "--set", "model.compile=true",
                                                *LINEAR_CE],
    # the same model trained by the transformers engine (transformers' own modules under nd-adapter's loop and ZeRO)
    "transformers engine": ["--set", "model.engine=transformers", "--set", "model.compile=false"],
    "transformers engine, bf16 states": ["--set", "model.engine=transformers", "--set", "model.compile=false",
                                         "--set", "optimizer.state_dtype=bf16"],
    # ... with the Liger kernels the peer row runs (Axolotl's liger_* keys: model.liger)
    "transformers engine, Liger": [*HF_ENGINE_LIGER],
    "transformers engine, Liger, bf16 states": [*HF_ENGINE_LIGER, "--set", "optimizer.state_dtype=bf16"],
}


AXOLOTL_VARIANTS = {"": [], "torch_compile": ["--set", "model.compile=true"],  # the YAML as written; + compile
                    "torch_compile, linear CE": ["--set", "model.compile=true", *LINEAR_CE]}


def ours(a) -> dict[str, tuple[str, list[str]]]:
    """Row name -> (config, extra arguments). `--axolotl`: bench/configs/axolotl/<shape>.yaml, an Axolotl YAML as a
    user writes it (its precision keys decide weights, masters and moments), on synthetic tokens."""
    if a.gpus == 1 and a.axolotl:
        cfg = f"bench/configs/axolotl/{ONE_GPU[a.shape]}.yaml"
        return {f"nd-adapter Axolotl YAML ({a.shape}{', ' + v if v else ''})": (cfg, ["--set", "data.synthetic=true",
                                                                                     *sets])
                for v, sets in AXOLOTL_VARIANTS.items()}
    if a.gpus == 1:
        cfg = f"bench/configs/{ONE_GPU[a.shape]}-1gpu.yaml"
        return {f"nd-adapter 1 GPU ({a.shape}{', ' + v if v else ''})": (cfg, sets)
                for v, sets in ONE_GPU_VARIANTS.items()}
    return {name: (cfg, []) for name, cfg in OURS.items()}


def commands(a) -> dict[str, list[str]]:
    cmds = {name: ["deepspeed", f"--num_gpus={a.gpus}", "launch/train.py", "--config", cfg, *sets]
            for name, (cfg, sets) in ours(a).items()}
    model = f"configs/models/{ONE_GPU[a.shape]}/config.json"
    for mode in ONE_GPU_PEERS if a.gpus == 1 else PEERS:
        cmds[mode] = ["torchrun", f"--nproc-per-node={a.gpus}", "bench/peers.py", mode, "--model-config", model,
                      "--seq", str(a.seq), "--micro-batch", str(a.micro_batch), "--steps", str(a.steps)]
    return {k: v for k, v in cmds.items()
            if not a.only or any(k == o[1:] if o.startswith("=") else o in k for o in a.only)}


def activation_gib(r: dict) -> float | None:
    """Peak minus model states (weights, gradients, optimizer states)."""
    if not r.get("peak_gib") or not r.get("num_params"):
        return None
    return r["peak_gib"] - r["num_params"] * r["model_state_bytes_per_param"] / 2**30


def render(rows: dict[str, dict | None], reference: str = "accelerate-fsdp2",
           title: str = "Llama-3.2-1B shape, seq 4096, micro-batch 2 per DP rank, bf16, 2 GPUs") -> str:
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    ref = (rows.get(reference) or {}).get("tokens_per_s_per_gpu")
    t = Table(title=title)
    for col in ("system", "tokens/s/GPU", f"× {reference}", "MFU", "peak GiB", "act GiB", "loss"):
        t.add_column(col)
    for name, r in rows.items():
        if r is None:
            t.add_row(name, "failed", "", "", "", "", "")
            continue
        ratio = f"{r['tokens_per_s_per_gpu'] / ref:.2f}" if ref else ""
        act = activation_gib(r)
        t.add_row(name, f"{r['tokens_per_s_per_gpu']:,}", ratio, f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "",
                  f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "", "" if act is None else f"{act:.1f}",
                  f"{r['loss']:.3f}")
    buf = StringIO()
    Console(file=buf, width=120).print(t)
    return buf.getvalue()


def run_logged(name: str, cmd: list[str], log_dir: str, timeout: int) -> str:
    """One row's command from the project root: its stdout + stderr (what it printed before a timeout), kept as
    `<log_dir>/<name>.log`."""
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        out = p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    (Path(log_dir) / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.log").write_text(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2, choices=(1, 2))
    ap.add_argument("--shape", choices=sorted(ONE_GPU), default="1b", help="model shape of the 1-GPU rows")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--only", nargs="*", help="substrings of the rows to run (=name: that row only)")
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--axolotl", action="store_true", help="1 GPU: our rows from bench/configs/axolotl/<shape>.yaml")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--log-dir", default=os.environ.get("OUT", "/tmp/compare"))
    a = ap.parse_args(argv)
    cmds = commands(a)
    if a.dry_run:
        for name, cmd in cmds.items():
            print(f"{name}: {' '.join(cmd)}")
        return 0
    Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    rows = {}
    for name, cmd in cmds.items():
        out = run_logged(name, cmd, a.log_dir, a.timeout)
        ours_cfg = ours(a).get(name, (None,))[0]
        rows[name] = parse_steps(out) if ours_cfg else parse_result(out)
        if ours_cfg and rows[name]:
            from adapter.models.arch import load_arch
            from adapter.models.counts import num_params

            model = (ROOT / ours_cfg).parent / yaml_model_path(ROOT / ours_cfg)
            states = 8 if "optimizer.state_dtype=bf16" in ours(a)[name][1] or a.axolotl else OUR_STATE_BYTES
            rows[name].update(num_params=num_params(load_arch(model)), model_state_bytes_per_param=states)
        print(name, json.dumps(rows[name]), flush=True)
    if a.gpus == 1:
        print(render(rows, "hf-liger", f"{ONE_GPU[a.shape]} shape, seq {a.seq}, micro-batch {a.micro_batch}, bf16, "
                                      "1 GPU"))
    else:
        print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
