"""`nd-adapter train` as users meet it: bad input ends as one line and status 2 with nothing written, and a run
that crashes mid-save resumes to exactly the losses of one that never stopped."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from adapter import config
from tests.helpers.cli import said
from tests.helpers.dist import run_workers
from tests.helpers.hf import flip_chunk

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny Llama + data + its tp=2 conversion, and the conversion of a narrower model (the wrong checkpoint)."""
    from adapter.convert.to_megatron import hf_to_megatron
    from adapter.demo.build import build_demo, make_tiny_llama

    root = tmp_path_factory.mktemp("tiny")
    paths = build_demo(root, vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, max_positions=256)
    hf_to_megatron(paths["model"], root / "megatron", tp=2, dtype="fp32", progress=False)
    make_tiny_llama(root / "narrow", tokenizer_dir=paths["tokenizer"], hidden=32, layers=2, heads=4, kv_heads=2)
    hf_to_megatron(root / "narrow", root / "narrow-megatron", tp=2, dtype="fp32", progress=False)
    shutil.copytree(root / "megatron", root / "damaged")
    flip_chunk(root / "damaged", "linear_proj.weight")
    return {k: str(v) for k, v in paths.items()} | {"root": str(root), "megatron": str(root / "megatron"),
                                                      "narrow_megatron": str(root / "narrow-megatron"),
                                                      "damaged": str(root / "damaged")}


def raw_config(tiny, ckpt_dir, **over) -> dict:
    raw = {"model": {"path": tiny["model"], "checkpoint": tiny["megatron"]},
           "parallelism": {"dp_replicate_size": 1, "dp_shard_size": 2, "cp_size": 1, "tp_size": 2},
           "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 1}, "seq_len": 64, "precision": "fp32",
           "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "schedule": "cosine", "warmup_steps": 2, "max_steps": 8},
           "data": {"files": [tiny["data"]], "cache_dir": f"{tiny['root']}/cache"},
           "checkpoint": {"dir": str(ckpt_dir), "save_every": 2, "keep_last": 2}}
    for k, v in over.items():
        config.set_dotted(raw, k, v)
    return raw


# --- bad input through the CLI ----------------------------------------------------------------------------------

def _nd_train(cfg_file: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "adapter", "train", "--config", str(cfg_file), *extra],
                          cwd=cfg_file.parent, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


BAD = {  # name: (config overrides, extra CLI args, text the one line must contain)
    "unknown key": ({"optimizer.lrr": 1e-3}, (), "optimizer.lrr"),
    "checkpoint of another model": ({"model.checkpoint": "NARROW"}, (), "model.checkpoint="),
    "world size": ({}, ("--nproc", "3"), "but the world size is 3"),
    "missing data file": ({"data.files": ["no/such.jsonl"]}, (), "data.files="),
    "wrong text_key": ({"data.text_key": "content"}, (), "data.text_key='content'"),
    "model.checkpoint not converted": ({"model.checkpoint": "MODEL"}, (), "nd-adapter convert hf-to-megatron"),
    "compiled layers under per-module ZeRO-3 gathers": ({"model.compile": True,
                                                         "deepspeed.gather_granularity": "module"}, (),
                                                        "model.compile=True: compiled layers under ZeRO-3 need"),
    "flat AdamW with something to shard": ({"optimizer.impl": "flat"}, (), "optimizer.impl='flat': it needs a layout"),
    "damaged converted checkpoint": ({"model.checkpoint": "DAMAGED"}, (), "does not match the checksum"),
    # SFT datasets are checked before any process starts too (adapter/data/sft check)
    "unknown SFT dataset type": ({"data.files": [], "data.datasets": [{"path": "DATA", "type": "alpaka"}]}, (),
                                 "data.datasets[0].type='alpaka': unknown dataset type"),
    "SFT hub dataset not cached": ({"data.files": [], "data.datasets": [{"path": "acme/none", "type": "alpaca"}]},
                                   (), "data.datasets[0].path='acme/none': not a local file or directory"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_status_2_and_writes_nothing(tiny, tmp_path, case):
    over, extra, needle = BAD[case]
    over = {k: {"NARROW": tiny["narrow_megatron"], "MODEL": tiny["model"], "DAMAGED": tiny["damaged"]}.get(v, v)
            if isinstance(v, str) else v
            for k, v in over.items()}
    if "data.datasets" in over:
        over["data.datasets"] = [{**e, "path": tiny["data"] if e["path"] == "DATA" else e["path"]}
                                 for e in over["data.datasets"]]
    ckpt_dir = tmp_path / "checkpoints"
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(raw_config(tiny, ckpt_dir, **over)))
    r = _nd_train(cfg_file, *extra)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = said(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("nd-adapter: error: "), r.stderr
    assert needle in lines[0] and "Fix:" in lines[0], lines[0]
    assert "Traceback" not in r.stderr + r.stdout
    assert not ckpt_dir.exists(), sorted(p.name for p in ckpt_dir.iterdir())


# --- crash during a save, resume, same losses -------------------------------------------------------------------

class _Crash(Exception):
    pass


def _crash_at_save(step_to_crash: int):
    """Make checkpoint.save die at `step_to_crash` on every rank after DeepSpeed wrote its files but before the
    rename (what SIGKILL there leaves on disk), with one file truncated as a torn write. Every rank raises at the
    same point, after the same collectives, so the processes can go on to the resumed run."""
    from adapter.train import checkpoint as ckpt

    real = ckpt.save

    def save(engine, save_dir, step, *args, **kwargs):
        if step != step_to_crash:
            return real(engine, save_dir, step, *args, **kwargs)
        engine.save_checkpoint(str(save_dir), tag=ckpt.TMP + ckpt.tag_for(step), save_latest=False)
        import torch.distributed as dist

        if dist.get_rank() == 0:
            victim = sorted((Path(save_dir) / (ckpt.TMP + ckpt.tag_for(step))).glob("*.pt"))[0]
            victim.write_bytes(victim.read_bytes()[:100])
        dist.barrier()
        raise _Crash(step)

    ckpt.save = save
    return lambda: setattr(ckpt, "save", real)


def _resume_worker(rank, world, tiny, root):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    init_distributed()

    def load(name, **over):
        return config.with_grad_accum(config.build(raw_config(tiny, Path(root) / name, **over), env={},
                                                   world_size=world))

    def listing():  # (DeepSpeed also drops its zero_to_*.py helper scripts there)
        return sorted(p.name for p in (Path(root) / "crashed").iterdir() if not p.name.endswith(".py"))

    # the uninterrupted run is also profiled (steps 2-3, ranks 0 and 3): profiling must not change the numbers
    whole = run(load("whole", **{"logging.profile_steps": [2, 3], "logging.profile_ranks": [0, 3],
                                 "logging.profile_dir": f"{root}/prof"}), log=lambda s: None)
    seen: list[float] = []
    undo = _crash_at_save(6)
    try:
        run(load("crashed"), log=lambda s: seen.extend(map(float, re.findall(r"^step \d+/\d+ \| loss (\S+)", s))))
        raise AssertionError("the injected crash did not happen")
    except _Crash:
        pass
    finally:
        undo()
    on_disk = listing()
    resumed = run(load("crashed"), resume=True, log=lambda s: None)
    after = listing()
    return {"whole": whole.losses, "before_crash": seen, "start": resumed.start_step, "resumed": resumed.losses,
            "on_disk": on_disk, "after": after, "latest": (Path(root) / "crashed" / "latest").read_text()}


@pytest.mark.slow
def test_divergence_stops_with_one_line_status_2_and_keeps_the_last_good_checkpoint(tiny, tmp_path):
    """An absurd learning rate blows the weights up after step 1: the run stops at step 2 with one line and status
    2 (the fix is in the config), and the step-1 checkpoint stays the latest."""
    ckpt_dir = tmp_path / "checkpoints"
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(raw_config(
        tiny, ckpt_dir, **{"optimizer.lr": 1e30, "optimizer.min_lr": 1e29, "optimizer.schedule": "constant",
                           "optimizer.warmup_steps": 0, "checkpoint.save_every": 1})))
    r = _nd_train(cfg_file)
    stopped = [line for line in r.stderr.splitlines() if line.startswith("nd-adapter: training stopped: ")]
    assert r.returncode == 2 and len(stopped) == 1, (r.returncode, r.stderr[-2000:])
    assert "at step 2" in stopped[0] and "optimizer.lr" in stopped[0], stopped
    assert "Traceback" not in r.stderr + r.stdout
    assert (ckpt_dir / "latest").read_text().strip() == "global_step1"
    assert sorted(p.name for p in ckpt_dir.iterdir() if p.name.startswith("global_step")) == ["global_step1"]


def test_crash_during_save_then_resume_matches_uninterrupted_run(tiny, tmp_path):
    """tp=2 × ZeRO-3 dp=2, cosine schedule with warmup: weights, Adam state, LR schedule, data position all resume."""
    r = run_workers(_resume_worker, 4, tiny, str(tmp_path), timeout=600)[0]
    whole = r["whole"]
    assert len(whole) == 8 and whole[-1] < whole[0], whole
    assert r["on_disk"] == ["global_step2", "global_step4", "latest", "tmp-global_step6"], r["on_disk"]
    assert r["before_crash"] == pytest.approx(whole[:6], abs=1e-4)  # the log line rounds to 4 decimals
    assert r["start"] == 4  # the last complete checkpoint, not the torn one
    assert r["resumed"] == whole[4:], (r["resumed"], whole[4:])  # bit-identical on CPU
    assert r["latest"] == "global_step8" and r["after"] == ["global_step6", "global_step8", "latest"], r["after"]
    prof = tmp_path / "prof"
    assert sorted(p.name for p in prof.iterdir()) == ["ops-rank0.txt", "ops-rank3.txt", "trace-rank0.json.gz",
                                                       "trace-rank3.json.gz"]
    import gzip
    import json

    events = json.load(gzip.open(prof / "trace-rank0.json.gz", "rt"))["traceEvents"]
    phases = sorted(e["name"] for e in events if str(e.get("name", "")).startswith("nd."))
    assert phases == ["nd.backward"] * 2 + ["nd.forward"] * 2 + ["nd.step"] * 2, phases  # steps 2 and 3 only
