"""`nd-adapter plan --search`: the enumeration against a brute-force list built through the project's own config
loading and checks, pins, memory-infeasible rows, the JSON schema, speed and no torch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import product
from pathlib import Path

import pytest

from adapter import config
from adapter.errors import UserError
from adapter.models import checks
from adapter.models.arch import load_arch
from adapter.parallel import deepspeed_config
from adapter.parallel.layout import Layout
from adapter.plan import hardware, search
from tests.helpers.cli import run_cli

ROOT = Path(__file__).resolve().parents[2]
CFG16 = str(ROOT / "configs/llama-3.1-8b-hsdp-tp.yaml")
SCHEMA = ROOT / "docs/plan-search-schema.json"
ARCH = load_arch(ROOT / "configs/models/llama-3.2-1b")       # 32 heads, 8 KV heads: tp 16 is refused


def base(world: int, gpn: int, global_batch: int, seq: int = 96):
    raw = {"model": {"path": str(ROOT / "configs/models/llama-3.2-1b")}, "seq_len": seq,
           "parallelism": {"dp_shard_size": world}, "batch": {"micro_batch_size": 1, "global_batch_size": global_batch},
           "hardware": {"nodes": world // gpn, "gpus_per_node": gpn, "gpu": "h200"}}
    return raw, config.with_grad_accum(config.build(raw, env={}))


def brute_force(raw: dict, world: int, gpn: int, pins: dict) -> set[tuple]:
    """Every value of every knob, each combination built and checked the slow, authoritative way: config.build
    (pydantic, batch arithmetic), models/checks, deepspeed_config.zero_stage. Identity = what the run would do."""
    found = set()
    sizes = range(1, world + 1)
    knobs = product(sizes, sizes, sizes, sizes, (2, 3), ("hsdp", "hpz"), ("none", "selective", "full"),
                    range(1, raw["batch"]["global_batch_size"] + 1), (True, False, None), (True, False))
    for r, s, c, t, stage, mode, rc, micro, sp, comp in knobs:
        if r * s * c * t != world:
            continue
        values = {"parallelism.dp_replicate_size": r, "parallelism.dp_shard_size": s, "parallelism.cp_size": c,
                  "parallelism.tp_size": t, "deepspeed.zero_stage": stage, "deepspeed.replicate_mode": mode,
                  "recompute": rc, "batch.micro_batch_size": micro, "sequence_parallel": sp, "model.compile": comp}
        if any(values[k] != v for k, v in pins.items()):
            continue
        try:
            cfg = config.with_grad_accum(config.build({**raw, "parallelism": {}}, env={}, world_size=world,
                                                      overrides=values))
            checks.check(cfg, ARCH)
            layout = Layout.from_config(cfg.parallelism, gpn)
            eff = deepspeed_config.zero_stage(cfg, layout)
        except UserError:
            continue
        found.add((r, s, c, t, eff, mode if r > 1 else None, rc, micro, cfg.grad_accum,
                   cfg.use_sequence_parallel and t > 1, comp))
    return found


def ids(found: search.Search) -> list[tuple]:
    return [(x.dp_replicate, x.dp_shard, x.cp, x.tp, x.zero_stage, x.replicate_mode, x.recompute, x.micro_batch_size,
             x.gradient_accumulation_steps, x.sequence_parallel, x.compiled_layers) for x in found.rows]


@pytest.mark.parametrize("world, gpn, batch, pins", [
    (4, 4, 4, {}),
    (8, 4, 8, {"recompute": "none", "model.compile": False}),
    (8, 4, 8, {"parallelism.tp_size": 2, "batch.micro_batch_size": 2}),
])
def test_enumeration_equals_brute_force(world, gpn, batch, pins):
    raw, cfg = base(world, gpn, batch)
    found = search.search(cfg, ARCH, hardware.read("h200"), nodes=world // gpn, gpus_per_node=gpn,
                          capacity=10**12, pins=pins)
    got = ids(found)
    assert len(got) == len(set(got)), "a layout ranked twice"
    assert set(got) == brute_force(raw, world, gpn, pins)
    assert found.ranked == len(got) and found.candidates >= found.ranked + sum(found.skipped.values()) - 1
    assert all(x.tp != 16 for x in found.rows)                     # refused by check_tp, never ranked
    speeds = [x.tokens_per_s_per_gpu for x in found.rows]
    assert speeds == sorted(speeds, reverse=True)                  # everything fits in 1 TB: one ranking


def test_infeasible_layouts_are_ranked_last_and_marked():
    _, cfg = base(4, 4, 8, seq=4096)
    found = search.search(cfg, ARCH, hardware.read("h200"), nodes=1, gpus_per_node=4,
                          capacity=int(30 * 2**30), pins={"recompute": "none"})
    fits = [x.fits for x in found.rows]
    assert any(fits) and not all(fits) and fits == sorted(fits, reverse=True)
    assert found.fitting == sum(fits)
    big = max(found.rows, key=lambda x: x.peak_memory)
    assert not big.fits and big.peak_memory + 1.5 * 2**30 > 30 * 2**30
    code, out, err = run_cli("plan", str(ROOT / "bench/configs/llama-3.2-1b-dp2.yaml"), "--search", "--gpu-mem-gib",
                             "21", "--set", "recompute=none", "--top", "3")
    assert code == 0, err
    # the config's own layout (21.0 GiB) does not fit in 21 GiB with the runtime reserve: shown, ranked after
    assert "faster, but do not fit in 21.00 GiB" in out and "NO" in out and "(does not fit)" in out
    assert "Best: nd-adapter plan" in out


def test_search_json_schema_and_the_recorded_2gpu_layouts():
    code, out, err = run_cli("plan", str(ROOT / "bench/configs/llama-3.2-1b-dp2.yaml"), "--search", "--format",
                             "json")
    assert code == 0, err
    doc = search.Search.model_validate_json(out)
    assert json.loads(SCHEMA.read_text()) == search.Search.model_json_schema(), "regenerate docs/plan-search-schema"
    assert doc.world == 2 and doc.global_batch_size == 4 and doc.profile == "h200" and doc.config_rank is not None
    assert {k for k in search.SEARCH_KEYS if k != "batch.gradient_accumulation_steps"} == set(doc.searched)
    # of the three layouts measured on 2×H200 (BENCHMARKS session 5), the search ranks the measured fastest first
    def rank(**want):
        return min(x.rank for x in doc.rows if all(getattr(x, k) == v for k, v in want.items()))
    z2 = rank(dp_shard=2, zero_stage=2, compiled_layers=True, micro_batch_size=2, recompute="none")
    z3 = rank(dp_shard=2, zero_stage=3, micro_batch_size=2, recompute="none")
    tp2 = rank(tp=2, sequence_parallel=False, micro_batch_size=2, recompute="none", compiled_layers=False)
    assert z2 < tp2 < z3


def test_pins_and_the_configs_own_world():
    code, out, err = run_cli("plan", CFG16, "--nodes", "2", "--gpus-per-node", "8", "--search", "--format", "json",
                             "--set", "parallelism.tp_size=2", "--set", "deepspeed.replicate_mode=hpz")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["pinned"] == {"parallelism.tp_size": 2, "deepspeed.replicate_mode": "hpz"}
    assert {r["tp"] for r in doc["rows"]} == {2}
    assert {r["replicate_mode"] for r in doc["rows"]} <= {None, "hpz"}
    # a 64-GPU search of a 16-GPU config keeps its global batch (32 sequences) and says so
    code, out, err = run_cli("plan", CFG16, "--nodes", "8", "--gpus-per-node", "8", "--search", "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["world"] == 64 and doc["global_batch_size"] == 32 and "searching 64" in doc["warnings"][0]
    assert all(r["dp_replicate"] * r["dp_shard"] * r["micro_batch_size"] * r["gradient_accumulation_steps"] == 32
               for r in doc["rows"])
    for argv, needle in ((("--set", "recompute=fast"), "--set recompute='fast': not a value the search can pin"),
                         (("--set", "parallelism.tp_size=0"), "--set parallelism.tp_size=0: must be an integer"),
                         (("--top", "0"), "--top=0"),
                         (("--set", "precision=fp32"), "precision='fp32'")):
        code, out, err = run_cli("plan", CFG16, "--search", *argv)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_search_over_64_gpus_imports_no_torch():
    """Its speed (the target: under 2 s) is measured by bench/search_time.py, not asserted here."""
    script = ("import sys, io, contextlib\n"
              "from adapter.cli import main\n"
              "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
              f"    code = main(['plan', {CFG16!r}, '--nodes', '8', '--gpus-per-node', '8', '--search', "
              "'--format', 'json'])\n"
              "assert code == 0\n"
              "print('torch' in sys.modules, len(out.getvalue()))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    torch_loaded, size = res.stdout.split()
    assert torch_loaded == "False" and int(size) > 1000
