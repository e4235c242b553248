"""What the multi-process training tests start from: the demo's tiny Llama, its data and its tp=2 fp32 conversion
(tests/distributed/conftest.py hands them out as the `demo` fixture), and the native config of a run on them."""
from __future__ import annotations

from pathlib import Path

from adapter import config


def converted_demo(root: Path, **model) -> dict[str, str]:
    """The demo's tokenizer, model (vocab 512, hidden 64, 2 layers, 4 heads, 2 KV heads, FFN 128; `model` changes
    make_tiny_llama's other keywords) and data under `root`, and the model converted at tp=2 in fp32: the paths of
    "tokenizer", "model", "data", "megatron" and "root"."""
    from adapter.convert.to_megatron import hf_to_megatron
    from adapter.demo.build import build_demo

    paths = build_demo(root, vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, **model)
    hf_to_megatron(paths["model"], root / "megatron", tp=2, dtype="fp32", progress=False)
    return {k: str(v) for k, v in paths.items()} | {"megatron": str(root / "megatron"), "root": str(root)}


def run_config(demo, shape, steps=10, world=4, **over):
    """A run of `demo` (converted_demo's paths) at (dp_replicate, dp_shard, cp, tp) = `shape`: fp32, seq 64, global
    batch 4, constant lr 1e-3; `over`: dotted keys set on top."""
    r, s, c, t = shape
    raw = {"model": {"path": demo["model"], "checkpoint": demo["megatron"]},
           "parallelism": {"dp_replicate_size": r, "dp_shard_size": s, "cp_size": c, "tp_size": t},
           "batch": {"micro_batch_size": 1, "global_batch_size": 4}, "seq_len": 64, "precision": "fp32",
           "optimizer": {"lr": 1e-3, "schedule": "constant", "warmup_steps": 0, "max_steps": steps},
           "data": {"files": [demo["data"]], "cache_dir": f"{demo['root']}/cache"}}
    for k, v in over.items():
        config.set_dotted(raw, k, v)
    return config.with_grad_accum(config.build(raw, env={}, world_size=world))
