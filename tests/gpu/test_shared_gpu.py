"""GPU host only: multi-rank layouts on the GPU's own kernels with every rank on ONE GPU through gloo (the shared-GPU
mode, adapter/parallel/shared_gpu.py), each against the same model at one rank on the same GPU and the same batches
(the global batch kept: one rank accumulates what the layout's data-parallel ranks take). fp32 where the kernels
allow (≤ 1e-4 relative over 4 steps; fp32 packed documents run the reference varlen kernels, FlashAttention
being bf16/fp16 only), bf16 where they need it (FlashAttention's varlen under cp: the bf16 band of
the other GPU parity tests, 2e-2). A run saved under one layout resumes under another on the same curve. What this
mode cannot check: speed, NCCL itself, point-to-point transfers under NCCL, per-GPU memory."""
from __future__ import annotations

import pytest

from tests.helpers.dist import run_workers

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
STEPS, SEQ = 4, 128
LORA = {"r": 4, "alpha": 8, "target_linear": True}
# name: (parallelism, ranks, precision, extra keys); the 1-rank reference keeps the batch (ga × dp)
LAYOUTS = {
    "tp=2, sequence parallel": ({"tp_size": 2, "dp_shard_size": 1}, 2, "fp32", {}),
    "tp=2 LoRA": ({"tp_size": 2, "dp_shard_size": 1}, 2, "fp32", {"lora": LORA}),
    "tp=2 QLoRA (NF4 on CUDA)": ({"tp_size": 2, "dp_shard_size": 1}, 2, "bf16",
                                {"lora": {**LORA, "quantize_base": "nf4"}}),
    "cp=2 packed documents (varlen)": ({"cp_size": 2, "dp_shard_size": 1}, 2, "bf16", {}),
    "dp_shard=2 ZeRO-3": ({"dp_shard_size": 2}, 2, "fp32", {}),
    "dp_shard=2 ZeRO-3, compiled layers (inductor)": ({"dp_shard_size": 2}, 2, "fp32", {"compile": True}),
    "dp_shard=2 ZeRO-3, transformers engine + Liger's fused linear CE": (
        {"dp_shard_size": 2}, 2, "fp32", {"engine": "transformers", "liger": ["fused_linear_cross_entropy"]}),
    "exact HSDP 2 × 2": ({"dp_replicate_size": 2, "dp_shard_size": 2}, 4, "fp32", {}),
    "ep=2 Qwen3-MoE": ({"dp_shard_size": 2, "ep_size": 2}, 2, "fp32", {"moe": True}),
    "ep=2 × tp=2 Qwen3-MoE": ({"dp_shard_size": 2, "tp_size": 2, "ep_size": 2}, 4, "fp32", {"moe": True}),
}
# fp8 at tp=2 is not in the list: nd-adapter refuses fp8 beside tensor parallelism (models/checks.py)
BF16_BAND, FP32_BAND = 2e-2, 1e-4


def _dp(par: dict) -> int:
    return par.get("dp_replicate_size", 1) * par.get("dp_shard_size", 1)


def _raw(model_dir: str, root: str, par: dict, precision: str, extra: dict, ga: int | None = None,
         steps: int = STEPS, ckpt: str | None = None) -> dict:
    """The run at layout `par`, `ga` micro-batches of one sample per data-parallel rank a step (default: four
    samples a step at every layout, so the 4 steps stay inside one epoch, whose tail each dp rounds differently)."""
    ga = ga or 4 // _dp(par)
    from adapter.demo.build import ASSETS

    raw = {"model": {"path": model_dir, "cache_dir": f"{root}/cache", "compile": False}, "parallelism": {**par},
           "batch": {"micro_batch_size": 1, "gradient_accumulation_steps": ga},
           "seq_len": SEQ, "precision": precision, "checkpoint": {"dir": ckpt},
           "optimizer": {"lr": 1e-3, "schedule": "constant", "warmup_steps": 0, "max_steps": steps, "clip_grad": 1e12},
           "data": {"datasets": [{"path": str(ASSETS / "chat_genesis.jsonl"), "type": "chat_template"}],
                    "chat_template": "chatml", "sample_packing": True, "prepared_path": f"{root}/prep"}}
    if "lora" in extra:
        raw["lora"] = extra["lora"]
    if "engine" in extra:  # transformers' own model; Liger's loss reads lm_head's weight outside lm_head (ZeRO-3
        # gathers it as an external parameter of the model: adapter/train/engine._transformers_model)
        raw["model"].update(engine=extra["engine"], liger=extra["liger"])
    if extra.get("compile"):  # compiled layers (the 1-rank reference compiles too), every parameter partitioned
        raw["model"]["compile"] = True
        raw["deepspeed"] = {"param_persistence_threshold": 0}
    return raw


def _one_rank(raw: dict) -> dict:
    """The same global batch on one rank: every size 1, the data-parallel ranks' micro-batches accumulated."""
    ga = raw["batch"]["gradient_accumulation_steps"] * _dp(raw["parallelism"])
    return {**raw, "parallelism": {"dp_shard_size": 1}, "checkpoint": {"dir": None},
            "batch": {"micro_batch_size": 1, "gradient_accumulation_steps": ga}}


def _world(rank, world, jobs):
    """Every job of one world size in one set of processes (a spawn on CUDA costs ~20 s a process; one per layout
    put the file past the GPU suite's ten minutes): [(start step, losses, shared-GPU lines)] in job order. A failing
    job fails the set, named."""
    import os

    import torch

    from adapter import config
    from adapter.parallel import shared_gpu
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    if world > 1 and torch.cuda.is_available():  # (without CUDA: the same runs as CPU processes, a dry run)
        os.environ[shared_gpu.ENV] = "1"
    init_distributed()
    out = []
    for name, raw, resume in jobs:
        lines: list[str] = []
        try:
            res = train(config.build(raw, env={}, world_size=world), resume=resume, log=lines.append)
        except Exception as e:
            raise RuntimeError(f"{name}: {e}") from e
        out.append((res.start_step, res.losses, [ln for ln in lines if ln.startswith("shared GPU")]))
    return out


def _key(model: str, precision: str, extra: dict) -> tuple:
    return model, precision, repr(sorted(extra.items()))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every layout, the one-rank runs they are measured against (one per model, precision and keys: every
    layout's one-rank run takes the same global batch) and the save-then-resume pair, in three sets of processes."""
    from tests.helpers.sft import make_model, make_moe
    from tests.helpers.sft_data import tiny_model

    root = tmp_path_factory.mktemp("shared-gpu")
    tok = tiny_model(root / "tok")
    models = {"dense": str(make_model(root / "dense", tok, hidden=128, heads=4, kv_heads=2)),
              "moe": str(make_moe(root / "moe", tok, hidden=64, router_loss=False))}
    jobs: dict[int, list] = {1: [], 2: [], 4: []}
    refs: dict[tuple, int] = {}
    for name, (par, ranks, precision, extra) in LAYOUTS.items():
        model = models["moe" if extra.get("moe") else "dense"]
        raw = _raw(model, str(root / name), par, precision, extra)
        key = _key(model, precision, extra)
        if key not in refs:
            refs[key] = len(jobs[1])
            jobs[1].append((f"one rank for {name}", _one_rank(raw), False))
        jobs[ranks].append((name, raw, False))
    dense, ck = models["dense"], str(root / "ckpt")  # two steps at tp=2, then on at dp_shard=2 from its checkpoint
    jobs[2].append(("save at tp=2", _raw(dense, str(root / "save"), {"tp_size": 2, "dp_shard_size": 1}, "fp32", {},
                                         steps=2, ckpt=ck), False))
    jobs[2].append(("resume at dp_shard=2", _raw(dense, str(root / "save"), {"dp_shard_size": 2}, "fp32", {},
                                                 ckpt=ck), True))
    done = {w: run_workers(_world, w, jobs[w], timeout=900)[0] for w in (1, 2, 4) if jobs[w]}
    got = {name: r for w in (2, 4) for (name, _, _), r in zip(jobs[w], done.get(w, []))}
    return got, {key: done[1][i][1] for key, i in refs.items()}, models


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_on_one_gpu_matches_one_rank(name, results):
    got_all, one_rank, models = results
    par, ranks, precision, extra = LAYOUTS[name]
    want = one_rank[_key(models["moe" if extra.get("moe") else "dense"], precision, extra)]
    _, got, said = got_all[name]
    band = BF16_BAND if precision == "bf16" else FP32_BAND
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    print(f"{name}: max |layout - 1 rank| / |1 rank| over {STEPS} steps: {worst:.2e} ({precision})")
    assert len(got) == len(want) == STEPS and worst <= band, (name, got, want)
    assert said and f"all {ranks} ranks on cuda:0 through gloo" in said[0], said


def test_save_at_one_layout_resume_at_another_on_one_gpu(results):
    """Two steps at tp=2, then on at dp_shard=2 under ZeRO-3 from its checkpoint: the 1-rank curve (the dense fp32
    one: the same 4 samples a step)."""
    got_all, one_rank, models = results
    start, got, _ = got_all["resume at dp_shard=2"]
    want = one_rank[_key(models["dense"], "fp32", {})]
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want[2:]))
    print(f"save at tp=2, resume at dp_shard=2: max |resumed - 1 rank| / |1 rank|: {worst:.2e} (fp32)")
    assert start == 2 and len(got) == 2 and worst <= FP32_BAND, (got, want)


def test_rehearse_gpu_runs_a_users_layout_on_the_one_gpu(tmp_path):
    """`nd-adapter rehearse --gpu`: a user's 4-rank layout (tp=2 × ZeRO-3 dp_shard=2, bf16, the Llama-3.1-8B shape
    shrunk by the rehearsal) trains, saves and resumes with all its ranks on this machine's one GPU."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{path: {root / 'configs/models/llama-3.1-8b'}}}\n"
                   "parallelism: {tp_size: 2, dp_shard_size: 2}\nseq_len: 1024\nprecision: bf16\n"
                   "data: {synthetic: true}\noptimizer: {max_steps: 10}\nhardware: {gpus_per_node: 4}\n")
    p = subprocess.run([sys.executable, "-m", "adapter", "rehearse", "--config", str(cfg), "--steps", "2", "--gpu"],
                       capture_output=True, text=True, timeout=300, cwd=root,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root),
                                                                              os.environ.get("PYTHONPATH")]))})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "all 4 ranks on cuda:0 through gloo" in p.stdout, p.stdout[-2000:]
    assert "rehearsal ok: 4 processes, layout 1x2x1x2, saved at step 1 and resumed" in p.stdout, p.stdout[-2000:]
