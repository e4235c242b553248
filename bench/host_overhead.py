"""Host time of one training step, on any machine (no GPU needed): the Llama-3.2-1B shape's structure (16 layers,
GQA, tied embeddings, the same loop, DeepSpeed engine, Megatron modules, flat AdamW) at toy widths, so the kernels
cost next to nothing and what is left is the Python and dispatch work a GPU run pays on its host.

Why: on one H200 the 1B step's host work was ~112 ms against ~121 ms of GPU work (docs/BENCHMARKS.md, 2026-12-01,
fourth session), so on a slower host CPU the GPU waits: the same code ran 19-23% slower on one machine than on
another while HF + Liger did not. This lets host-side changes be measured before any GPU time is spent.

    python bench/host_overhead.py                    # ms per step, eager layers
    python bench/host_overhead.py --compile          # compiled layers (what the GPU runs use)
    python bench/host_overhead.py --profile 25       # + cProfile: the top 25 functions, and time per package
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STEP = re.compile(r"^step (\d+)/\d+ .*?\| ([\d,]+) tok/s/GPU")
PACKAGES = ("adapter", "deepspeed", "megatron", "torch", "transformers")


def tiny_llama(out: Path, layers: int) -> Path:
    cfg = json.loads((ROOT / "configs/models/llama-3.2-1b/config.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_hidden_layers=layers, vocab_size=512, max_position_embeddings=512)
    cfg.pop("rope_scaling", None)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def package_of(filename: str) -> str:
    for pkg in PACKAGES:
        if f"/{pkg}/" in filename:
            return pkg
    return "other"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--profile", type=int, metavar="TOP", help="cProfile the run; print the TOP functions")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(k, v)
    from adapter import config
    from adapter.models.resolved import resolve_run
    from adapter.train.engine import init_distributed
    from adapter.train.trainer import run
    from adapter.train.worker import quiet_third_party

    quiet_third_party()
    with tempfile.TemporaryDirectory() as tmp:
        raw = {"model": {"path": str(tiny_llama(Path(tmp) / "model", a.layers)), "compile": a.compile},
               "parallelism": {"dp_shard_size": 1}, "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 1},
               "seq_len": a.seq, "precision": "bf16",
               "optimizer": {"lr": 1e-4, "warmup_steps": 2, "max_steps": a.steps}, "data": {"synthetic": True},
               "logging": {"every": 1}}
        cfg = config.build(raw, env={}, overrides=config.parse_sets(a.set), world_size=1)
        init_distributed()
        lines: list[str] = []
        prof = cProfile.Profile() if a.profile else None
        if prof:  # steady-state steps only: after the first third (compilation, warm-up)
            from adapter.train.trainer import Trainer

            plain = Trainer.train_step

            def profiled(self, step, *args, **kw):
                if step <= a.steps // 3:
                    return plain(self, step, *args, **kw)
                prof.enable()
                try:
                    return plain(self, step, *args, **kw)
                finally:
                    prof.disable()
            Trainer.train_step = profiled
        run(resolve_run(config.with_grad_accum(cfg)), synthetic_data=True, log=lines.append, export=False)
    tps = [float(m.group(2).replace(",", "")) for m in map(STEP.match, lines) if m]
    steady = sorted(tps[len(tps) // 3:])  # after compilation and warm-up
    tokens = 2 * a.seq
    median = steady[len(steady) // 2]
    print(f"host time per step ({a.layers} layers, {'compiled' if a.compile else 'eager'} layers): "
          f"{1000 * tokens / median:.2f} ms (median of steps {len(tps) - len(steady) + 1}-{len(tps)}; "
          f"best {1000 * tokens / steady[-1]:.2f} ms)")
    if prof:
        stats = pstats.Stats(prof)
        per_pkg: dict[str, float] = {}
        for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():
            per_pkg[package_of(filename)] = per_pkg.get(package_of(filename), 0.0) + tottime
        total = sum(per_pkg.values())
        print("self time by package: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in
                                                   sorted(per_pkg.items(), key=lambda kv: -kv[1])))
        stats.sort_stats("tottime").print_stats(a.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
