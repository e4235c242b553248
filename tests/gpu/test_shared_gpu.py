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
    "exact HSDP 2 × 2": ({"dp_replicate_size": 2, "dp_shard_size": 2}, 4, "fp32", {}),
    "ep=2 Qwen3-MoE": ({"dp_shard_size": 2, "ep_size": 2}, 2, "fp32", {"moe": True}),
}
BF16_BAND, FP32_BAND = 2e-2, 1e-4
_ONE_RANK: dict[tuple, list[float]] = {}  # (model, precision, extra keys) -> the one-rank losses


def _dp(par: dict) -> int:
    return par.get("dp_replicate_size", 1) * par.get("dp_shard_size", 1)


def _raw(model_dir: str, root: str, par: dict, precision: str, extra: dict, ga: int | None = None,
         steps: int = STEPS, ckpt: str | None = None) -> dict:
    """The run at layout `par`, `ga` micro-batches of one sample per data-parallel rank a step (default: four
    samples a step at every layout, so the 4 steps stay inside one epoch, whose tail each dp rounds differently)."""
    ga = ga or 4 // _dp(par)
    from adapter.demo.build import ASSETS

    raw = {"model": {"path": model_dir, "cache_dir": f"{root}/cache"}, "parallelism": {**par},
           "batch": {"micro_batch_size": 1, "gradient_accumulation_steps": ga},
           "seq_len": SEQ, "precision": precision, "checkpoint": {"dir": ckpt},
           "optimizer": {"lr": 1e-3, "schedule": "constant", "warmup_steps": 0, "max_steps": steps, "clip_grad": 1e12},
           "data": {"datasets": [{"path": str(ASSETS / "chat_genesis.jsonl"), "type": "chat_template"}],
                    "chat_template": "chatml", "sample_packing": True, "prepared_path": f"{root}/prep"}}
    if "lora" in extra:
        raw["lora"] = extra["lora"]
    return raw


def _one_rank(raw: dict) -> dict:
    """The same global batch on one rank: every size 1, the data-parallel ranks' micro-batches accumulated."""
    ga = raw["batch"]["gradient_accumulation_steps"] * _dp(raw["parallelism"])
    return {**raw, "parallelism": {"dp_shard_size": 1}, "checkpoint": {"dir": None},
            "batch": {"micro_batch_size": 1, "gradient_accumulation_steps": ga}}


def _train(rank, world, model_dir, root, raw, shared, resume):
    import os

    from adapter import config
    from adapter.parallel import shared_gpu
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    if shared:
        os.environ[shared_gpu.ENV] = "1"
    init_distributed()
    lines: list[str] = []
    res = train(config.build(raw, env={}, world_size=world), resume=resume, log=lines.append)
    return res.start_step, res.losses, [ln for ln in lines if ln.startswith("shared GPU")]


def _run(world: int, raw: dict, model_dir: str, root: str, resume: bool = False):
    return run_workers(_train, world, model_dir, root, raw, world > 1, resume, timeout=600)[0]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.helpers.sft import make_model, make_moe
    from tests.helpers.sft_data import tiny_model

    root = tmp_path_factory.mktemp("shared-gpu")
    tok = tiny_model(root / "tok")
    return {"dense": str(make_model(root / "dense", tok, hidden=128, heads=4, kv_heads=2)),
            "moe": str(make_moe(root / "moe", tok, hidden=64, router_loss=False))}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_on_one_gpu_matches_one_rank(name, models, tmp_path):
    par, ranks, precision, extra = LAYOUTS[name]
    model = models["moe" if extra.get("moe") else "dense"]
    raw = _raw(model, str(tmp_path), par, precision, extra)
    key = (model, precision, repr(sorted(extra.items())))  # every layout's one-rank run is the same batch (ga × dp)
    if key not in _ONE_RANK:  # tp=2, ZeRO-3 and HSDP share theirs: the suite stays inside ten minutes
        _ONE_RANK[key] = _run(1, _one_rank(raw), model, str(tmp_path / "one"))[1]
    want = _ONE_RANK[key]
    _, got, said = _run(ranks, raw, model, str(tmp_path / "layout"))
    band = BF16_BAND if precision == "bf16" else FP32_BAND
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    print(f"{name}: max |layout - 1 rank| / |1 rank| over {STEPS} steps: {worst:.2e} ({precision})")
    assert len(got) == len(want) == STEPS and worst <= band, (name, got, want)
    assert said and f"all {ranks} ranks on cuda:0 through gloo" in said[0], said


def test_save_at_one_layout_resume_at_another_on_one_gpu(models, tmp_path):
    """Two steps at tp=2, then on at dp_shard=2 under ZeRO-3 from its checkpoint: the 1-rank curve."""
    model, root, ck = models["dense"], str(tmp_path), str(tmp_path / "ckpt")
    first = _raw(model, root, {"tp_size": 2, "dp_shard_size": 1}, "fp32", {}, steps=2, ckpt=ck)
    _run(2, first, model, root)
    then = _raw(model, root, {"dp_shard_size": 2}, "fp32", {}, ckpt=ck)  # the same 4 samples a step
    start, got, _ = _run(2, then, model, root, resume=True)
    _, want, _ = _run(1, _one_rank(then), model, str(tmp_path / "one"))
    assert start == 2 and max(abs(a - b) / abs(b) for a, b in zip(got, want[2:])) <= FP32_BAND, (got, want)
