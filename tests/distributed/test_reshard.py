"""Resume at another layout: a checkpoint saved at one (world size, tp, cp, dp, ZeRO stage, optimizer)
continues at another with the losses of the run nobody moved (fp32, CPU, gloo).

One chain through every reader and every setter: dp_shard=4 (ZeRO-3) → tp=2 × dp_shard=2 (ZeRO-2) → cp=2 ×
dp_shard=2 (ZeRO-3) → tp=4 (the flat AdamW) on 4 processes, then dp_shard=2 (ZeRO-3) on 2; each leg's losses
equal the uninterrupted dp_shard=4 run's (same global batches: the sampler counts samples, not ranks). A LoRA run
(its checkpoint holds only the adapters) of a Phi-3, whose packed linears' adapters keep B in Megatron's row order
([gate_r; up_r] per rank), moves from tp=2 to dp_shard=2 the same way."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.dist import run_workers
from tests.helpers.train import run_config

pytestmark = pytest.mark.slow
STEPS = 10
CHAIN = [("tp=2 × dp_shard=2, ZeRO-2", (1, 2, 1, 2), {"deepspeed.zero_stage": 2}, 4),
         ("cp=2 × dp_shard=2, ZeRO-3", (1, 2, 2, 1), {}, 6),
         ("tp=4, flat AdamW", (1, 1, 1, 4), {}, 8)]
LORA = {"lora": {"r": 4, "alpha": 8, "target_linear": True}}


def _quiet(line):
    pass


def _four(rank, world, paths, root):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    init_distributed()
    whole = run(run_config(paths, (1, 4, 1, 1), steps=STEPS), log=_quiet).losses
    ck = {"checkpoint.dir": f"{root}/moving"}
    run(run_config(paths, (1, 4, 1, 1), steps=2, **ck), log=_quiet)
    legs, said = {}, []
    for name, shape, over, upto in CHAIN:
        lines = []
        r = run(run_config(paths, shape, steps=upto, **over, **ck), resume=True, log=lines.append)
        legs[name] = (r.start_step, r.losses)
        said += [ln for ln in lines if "resharded" in ln]
    return {"whole": whole, "legs": legs, "said": said}


def _two(rank, world, paths, root, phi3_dir):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    init_distributed()
    ck = {"checkpoint.dir": f"{root}/moving"}
    last = run(run_config(paths, (1, 2, 1, 1), steps=STEPS, world=2, **ck), resume=True, log=_quiet)
    phi3 = {**paths, "model": phi3_dir, "megatron": None}  # packed linears: their adapters' B in Megatron's order
    lora = {**LORA, "model.cache_dir": f"{root}/weights"}
    lora_whole = run(run_config(phi3, (1, 2, 1, 1), steps=4, world=2, **lora), log=_quiet).losses
    lk = {"checkpoint.dir": f"{root}/lora"}
    run(run_config(phi3, (1, 1, 1, 2), steps=2, world=2, **lora, **lk), log=_quiet)
    lora_moved = run(run_config(phi3, (1, 2, 1, 1), steps=4, world=2, **lora, **lk), resume=True, log=_quiet)
    return {"last": (last.start_step, last.losses), "lora_whole": lora_whole,
            "lora_moved": (lora_moved.start_step, lora_moved.losses), "bf16_states": _bf16_states(paths, root)}


def _bf16_states(paths, root):
    """optimizer.state_dtype: bf16 at tp=2 (bf16 on CPU): a resume continues the uninterrupted curve bit for bit; a
    run keeping fp32 states refuses its checkpoint at the same layout and at another."""
    from adapter.errors import UserError
    from tests.helpers.runs import train as run

    b16 = {"precision": "bf16", "optimizer.state_dtype": "bf16"}
    said = []
    whole = run(run_config(paths, (1, 1, 1, 2), steps=4, world=2, **b16), log=said.append).losses
    ck = {"checkpoint.dir": f"{root}/bf16-states"}
    run(run_config(paths, (1, 1, 1, 2), steps=2, world=2, **b16, **ck), log=_quiet)
    moved = run(run_config(paths, (1, 1, 1, 2), steps=4, world=2, **b16, **ck), resume=True, log=_quiet)
    refused = []
    for shape in ((1, 1, 1, 2), (1, 2, 1, 1)):
        try:
            run(run_config(paths, shape, steps=4, world=2, precision="bf16", **ck), resume=True, log=_quiet)
        except UserError as e:
            refused.append(str(e))
    return {"whole": whole, "moved": (moved.start_step, moved.losses), "refused": refused,
            "said": [s for s in said if "optimizer:" in s]}


def _close(got, want, what):
    assert len(got) == len(want), (what, got, want)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    assert worst <= 1e-5, f"{what}: {got} vs {want} (rel {worst:.2e})"


def test_resume_moves_across_layouts_world_sizes_and_optimizers(demo, tmp_path):
    four = run_workers(_four, 4, demo, str(tmp_path), timeout=900)[0]
    whole = four["whole"]
    assert len(whole) == STEPS and whole[-1] < whole[0] - 0.05, whole  # it learns: the comparison can fail
    start = 2
    for name, _, _, upto in CHAIN:
        begun, losses = four["legs"][name]
        assert begun == start, (name, begun)
        _close(losses, whole[start:upto], name)
        start = upto
    assert len(four["said"]) == len(CHAIN) and all("saved at another layout" in s for s in four["said"])
    from tests.helpers.sft import make_phi3

    phi3 = str(make_phi3(tmp_path / "phi3", Path(demo["model"])))
    two = run_workers(_two, 2, demo, str(tmp_path), phi3, timeout=600)[0]
    begun, losses = two["last"]
    assert begun == 8
    _close(losses, whole[8:], "2 processes, dp_shard=2")
    begun, losses = two["lora_moved"]
    assert begun == 2
    _close(losses, two["lora_whole"][2:], "Phi-3 LoRA tp=2 → dp_shard=2")
    b16 = two["bf16_states"]
    assert b16["moved"] == (2, b16["whole"][2:]), b16
    assert any("optimizer.state_dtype: bf16: no fp32 master" in s for s in b16["said"]), b16["said"]
    assert len(b16["refused"]) == 2 and all("its optimizer states are bf16, this run keeps fp32 ones" in e and
                                            "resume with optimizer.state_dtype: bf16" in e for e in b16["refused"])
