"""The training entry point on CPU: loss parity across layouts, resume, bad input (gloo + DeepSpeed CPU)."""
from __future__ import annotations

import pytest

from adapter import config
from tests.helpers.dist import run_workers
from tests.helpers.train import run_config

pytestmark = pytest.mark.slow

LAYOUTS = {"dp_shard=4": ((1, 4, 1, 1), {}), "tp=2,dp_shard=2": ((1, 2, 1, 2), {}), "tp=4": ((1, 1, 1, 4), {}),
           "dp_replicate=2,dp_shard=2 (exact HSDP)": ((2, 2, 1, 1), {}),
           "dp_replicate=2,dp_shard=2 (hpZ)": ((2, 2, 1, 1), {"deepspeed.replicate_mode": "hpz"}),
           "cp=2,tp=2": ((1, 1, 2, 2), {}),
           "cp=2 (p2p),dp_shard=2": ((1, 2, 2, 1), {"parallelism.cp_comm_type": "p2p"}),
           "dp_shard=4 (ZeRO-2)": ((1, 4, 1, 1), {"deepspeed.zero_stage": 2}),
           "cp=2,tp=2 (ZeRO-2 over cp)": ((1, 1, 2, 2), {"deepspeed.zero_stage": 2}),
           # ZeRO-3's gather unit is a whole layer by default: DeepSpeed's per-module hooks must give the same losses,
           # and so must layer gathers under activation recompute (the layer's forward runs again in backward)
           "dp_shard=4 (per-module gathers)": ((1, 4, 1, 1), {"deepspeed.gather_granularity": "module"}),
           "tp=2,dp_shard=2 (full recompute)": ((1, 2, 1, 2), {"recompute": "full"}),
           # torch.compile'd layers (one graph a layer, the linears plain F.linear: tp = 1) under ZeRO-2's gradient
           # hooks: traced by dynamo and split by AOTAutograd as in a run, its kernels left to eager (_parity_worker);
           # tp = 2 (graph breaks at Megatron's linears, 7 s more here) against eager is
           # test_model.py::test_compiled_layers_match_eager, inductor's code tests/gpu/test_packed.py
           "dp_shard=4 (ZeRO-2, compiled layers)": ((1, 4, 1, 1), {"deepspeed.zero_stage": 2, "model.compile": True})}


MASKED = {"dp_shard=4 +document_mask": ((1, 4, 1, 1), {"data.document_mask": True}),
          "tp=2,dp_shard=2 +document_mask": ((1, 2, 1, 2), {"data.document_mask": True}),
          # packed documents split per document over CP ranks: same curve (ZeRO-3 over cp, SP over tp)
          "cp=2,tp=2 +document_mask": ((1, 1, 2, 2), {"data.document_mask": True}),
          "cp=2 (p2p),dp_shard=2 +document_mask": ((1, 2, 2, 1), {"data.document_mask": True,
                                                                   "parallelism.cp_comm_type": "p2p"}),
          "cp=2,dp_shard=2 (ZeRO-2, full recompute) +document_mask": ((1, 2, 2, 1), {
              "data.document_mask": True, "deepspeed.zero_stage": 2, "recompute": "full"})}


PARITY_STEPS = 6  # 17 layouts in one world: each step more is ~17 × 4 rank-steps of CI time


def _parity_worker(rank, world, demo):
    import functools

    import torch

    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    init_distributed()
    torch.compile = functools.partial(torch.compile, backend="aot_eager")  # this worker process only
    return {name: run(run_config(demo, shape, steps=PARITY_STEPS, **over), log=lambda s: None).losses
            for name, (shape, over) in (LAYOUTS | MASKED).items()}


def test_loss_parity_across_layouts(demo):
    results = run_workers(_parity_worker, 4, demo, timeout=900)
    curves = dict(results[0])
    ref = curves["dp_shard=4"]
    assert len(ref) == PARITY_STEPS and ref[-1] < ref[0] - 0.05, ref  # it learns
    masked = [curves.pop(name) for name in MASKED]
    for other in masked[1:]:  # document masking is layout-independent too
        assert max(abs(a - b) for a, b in zip(masked[0], other)) < 2e-5, masked
    assert masked[0] != ref  # and it changes what the model sees
    for name, losses in curves.items():
        diff = max(abs(a - b) for a, b in zip(ref, losses))
        assert diff < 2e-5, f"{name} differs from dp_shard=4 by {diff}: {losses} vs {ref}"
    for r, other in enumerate(results[1:], 1):  # every rank logs the same global loss
        for name in other:
            gap = max(abs(a - b) for a, b in zip(other[name], results[0][name]))
            assert gap < 1e-9, f"rank {r} logs {name} differently from rank 0 by {gap}"


def _grad_norm_worker(rank, world, demo):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    init_distributed()
    norms = {}
    for name, (shape, stage) in {"dp_shard=4 (ZeRO-3)": ((1, 4, 1, 1), 3),
                                 "tp=4 (ZeRO-1, nothing to shard)": ((1, 1, 1, 4), 3),
                                 "tp=2,dp_shard=2 (ZeRO-2)": ((1, 2, 1, 2), 2)}.items():
        lines = []
        run(run_config(demo, shape, steps=2, precision="bf16", **{"optimizer.clip_grad": 100.0,
                                                                  "deepspeed.zero_stage": stage}), log=lines.append)
        norms[name] = [float(line.split("grad_norm ")[1].split()[0]) for line in lines if line.startswith("step ")]
    return norms


def test_bf16_grad_norm_counts_tp_shards_once(demo):
    """The norm that clipping uses must not depend on the layout (DeepSpeed's bf16 stage-0 optimizer got it wrong
    by √tp, which is why tp-only layouts run ZeRO stage 1)."""
    norms = run_workers(_grad_norm_worker, 4, demo, timeout=600)[0]
    ref, *others = norms.values()
    for other in others:
        assert all(abs(a - b) / a < 0.01 for a, b in zip(ref, other)), norms


def _zero3_whole_layers_worker(rank, world, demo):
    """dp_shard=2 under ZeRO-3 with every parameter partitioned (persistence threshold 0, as a real model's are):
    the whole logits, the fused linear CE (reading the output weight outside the output layer's forward), and
    compiled layers beside it (Dynamo + AOTAutograd's partitioner, without inductor's C++), with the saved tensors
    that point into a parameter's storage counted by whether they are the parameter itself."""
    import functools

    import torch

    torch.compile = functools.partial(torch.compile, backend="aot_eager_decomp_partition")  # this worker only

    from adapter.train import trainer
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    init_distributed()
    params: dict[int, torch.nn.Parameter] = {}
    build = trainer.build_engine

    def kept(*a, **k):  # the model's parameters, to tell them from views into their storage
        engine = build(*a, **k)
        params.update({id(p): p for p in engine.ds.module.parameters()})
        return engine

    trainer.build_engine = kept
    out = {}
    for name, over in (("whole logits", {"model.fused_linear_ce": False}), ("linear CE", {}),
                       ("linear CE, compiled", {"model.compile": True})):
        saved = {"parameter": 0, "view": 0}

        def pack(t, saved=saved):
            if id(t) in params:
                saved["parameter"] += 1
            elif t.numel() and any(p.numel() and t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
                                   for p in params.values()):
                saved["view"] += 1
            return t

        cfg = run_config(demo, (1, 2, 1, 1), steps=3, world=2, **{"deepspeed.zero_stage": 3,
                                                                  "deepspeed.param_persistence_threshold": 0, **over})
        lines: list[str] = []
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out[name] = run(cfg, log=lines.append).losses
        out[f"{name} saved"] = saved
        out[f"{name} said"] = [ln for ln in lines if "fused_linear_ce" in ln]
    from torch._dynamo.utils import counters

    out["graphs"] = counters["stats"]["unique_graphs"]  # the compiled run's layers (one graph, shared)
    return out


def test_zero3_partitioned_weights_under_the_fused_linear_ce_and_compiled_layers(demo):
    r = run_workers(_zero3_whole_layers_worker, 2, demo, timeout=600)[0]
    ref = r["whole logits"]
    for name in ("linear CE", "linear CE, compiled"):
        assert max(abs(a - b) / b for a, b in zip(ref, r[name])) < 1e-6, (name, ref, r[name])
    assert r["linear CE, compiled saved"]["view"] == 0 and r["linear CE, compiled saved"]["parameter"] > 0, r
    assert any("chunks of" in ln for ln in r["linear CE said"]), r["linear CE said"]
    assert r["graphs"] >= 1, r


def _whole_then_cut(demo, shape, steps, cut_at, prefix, over, resume_over=None, log=None):
    """The same run whole (its lines to `log`), and cut: `cut_at` steps, then resumed in a fresh engine up to
    `steps`. Checkpoints go to `prefix`-whole and `prefix`-cut."""
    from tests.helpers.runs import train as run

    def quiet(line):
        pass

    whole = run(run_config(demo, shape, steps=steps, **over, **{"checkpoint.dir": f"{prefix}-whole"}),
                log=log or quiet)
    cut = {"checkpoint.dir": f"{prefix}-cut"}
    first = run(run_config(demo, shape, steps=cut_at, **over, **cut), log=quiet)
    second = run(run_config(demo, shape, steps=steps, **over, **cut, **(resume_over or {})), resume=True, log=quiet)
    return whole, first, second


def _zero2_resume_worker(rank, world, demo, root):
    """ZeRO-2 (tp=2 × dp_shard=2): save at step 3, resume in a fresh engine, export HF at the end."""
    from adapter.patches import zero
    from adapter.train import engine as engine_mod
    from adapter.train import trainer
    from adapter.train.engine import init_distributed

    init_distributed()
    build, ours = engine_mod.build_engine, []

    def spy(*a, **k):  # every engine runs adapter.patches.zero's clipping, not DeepSpeed's host-waiting one
        engine = build(*a, **k)
        clip = getattr(engine.ds.optimizer.unscale_and_clip_grads, "__func__", None)
        ours.append(clip is zero.unscale_and_clip_grads)
        return engine

    trainer.build_engine = spy  # the name the trainer calls
    over = {"deepspeed.zero_stage": 2, "checkpoint.save_every": 3}
    whole, first, second = _whole_then_cut(demo, (1, 2, 1, 2), 6, 3, f"{root}/z2", over,
                                           {"checkpoint.export_hf": f"{root}/hf"})
    return {"whole": whole.losses, "first": first.losses, "second": second.losses, "start": second.start_step,
            "exported": second.exported, "patched": ours}


def test_zero2_resumes_exactly_and_exports(demo, tmp_path):
    r = run_workers(_zero2_resume_worker, 4, demo, str(tmp_path), timeout=600)[0]
    assert r["start"] == 3 and r["first"] + r["second"] == r["whole"], r   # bit-identical on CPU
    assert r["patched"] == [True, True, True], r["patched"]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(r["exported"]).num_parameters() > 0


def _flat_resume_worker(rank, world, demo, root):
    """tp=4 (the flat AdamW): save at step 3, resume in a fresh engine (tests/distributed/test_reshard.py moves its
    checkpoints to ZeRO and back)."""
    from adapter.train.engine import init_distributed

    init_distributed()
    over = {"checkpoint.save_every": 3, "precision": "bf16", "optimizer.weight_decay": 0.1}
    whole, first, second = _whole_then_cut(demo, (1, 1, 1, 4), 6, 3, f"{root}/flat", over)
    return {"whole": whole.losses, "cut": first.losses + second.losses, "start": second.start_step}


def test_flat_optimizer_resumes_exactly(demo, tmp_path):
    r = run_workers(_flat_resume_worker, 4, demo, str(tmp_path), timeout=600)[0]
    assert r["start"] == 3 and r["cut"] == r["whole"], r   # bit-identical on CPU (bf16 weights, fp32 master)


def _nan_grad_worker(rank, world, demo, root):
    """Poison one weight's gradient with NaN under bf16 (DeepSpeed's own overflow check is off by default)."""
    import torch

    from adapter.models.resolved import resolve_run
    from adapter.train import engine as engine_mod
    from adapter.train import trainer

    engine_mod.init_distributed()
    build = engine_mod.build_engine

    def poisoned(*a, **k):
        engine = build(*a, **k)
        next(engine.ds.module.parameters()).register_hook(lambda g: torch.full_like(g, float("nan")))
        return engine

    trainer.build_engine = poisoned  # the name the trainer calls
    out = {}
    for stage in (2, 3, "flat"):  # flat: tp=4, nothing to shard (the flat AdamW)
        shape = (1, 1, 1, 4) if stage == "flat" else (1, 4, 1, 1)
        try:
            trainer.run(resolve_run(run_config(demo, shape, steps=3, precision="bf16",
                                            **{"deepspeed.zero_stage": 2 if stage == "flat" else stage,
                                               "checkpoint.dir": f"{root}/z{stage}", "checkpoint.save_every": 1})),
                        log=lambda s: None)
            out[stage] = "finished"
        except RuntimeError as e:
            out[stage] = str(e)
    return out


def test_nonfinite_grad_norm_stops_before_any_checkpoint(demo, tmp_path):
    from pathlib import Path

    out = run_workers(_nan_grad_worker, 4, demo, str(tmp_path), timeout=600)
    for stage in (2, 3, "flat"):
        assert all(r[stage].startswith("the gradient norm is inf/NaN at step 1") for r in out), out
        assert "\n" not in out[0][stage] and "check_grad_overflow" in out[0][stage]
        assert not list(Path(tmp_path, f"z{stage}").glob("*step*")), f"ZeRO-{stage} wrote a checkpoint"


def _replica_resume_worker(rank, world, demo, root):
    """dp_replicate=2 × dp_shard=2, exact HSDP and hpZ: save at step 2, resume in a fresh engine, go on to step 4."""
    from adapter.train.engine import init_distributed

    init_distributed()
    out = {}
    for mode in ("hsdp", "hpz"):
        over = {"deepspeed.replicate_mode": mode, "checkpoint.save_every": 2}
        whole, first, second = _whole_then_cut(demo, (2, 2, 1, 1), 4, 2, f"{root}/{mode}", over)
        out[mode] = {"whole": whole.losses, "cut": first.losses + second.losses, "start": second.start_step}
    return out


@pytest.mark.slow
def test_replicas_resume_exactly_hsdp_and_hpz(demo, tmp_path):
    """hpZ's ranks each hold their own shard: all of them must write it (a resume once found half the files
    missing, because only replica 0 wrote, as exact HSDP does)."""
    r = run_workers(_replica_resume_worker, 4, demo, str(tmp_path), timeout=600)[0]
    for mode in ("hsdp", "hpz"):
        assert r[mode]["start"] == 2 and r[mode]["cut"] == r[mode]["whole"], (mode, r[mode])
    assert r["hsdp"]["whole"] == pytest.approx(r["hpz"]["whole"], abs=1e-5)  # both are ZeRO-3 over dp, exactly


def _fp8_worker(rank, world, demo):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    init_distributed()
    out = {}
    every = {"model.fp8_linears": ["qkv", "proj", "fc1", "fc2"], "model.fp8_recipe": "rowwise",
             "model.fused_linear_ce": True, "model.fused_linear_ce_chunk": 48}
    for name, precision, over in (("bf16", "bf16", {}), ("fp8", "fp8", {}), ("fp8 every linear", "fp8", every)):
        raw = {"model": {"path": demo["model"], "checkpoint": demo["megatron"]},
               "parallelism": {"dp_shard_size": 1}, "batch": {"micro_batch_size": 2, "global_batch_size": 2},
               "seq_len": 64, "precision": precision,
               "optimizer": {"lr": 3e-3, "schedule": "constant", "warmup_steps": 0, "max_steps": 8},
               "data": {"files": [demo["data"]], "cache_dir": f"{demo['root']}/cache"}}
        for k, v in over.items():
            config.set_dotted(raw, k, v)
        lines = []
        out[name] = run(config.with_grad_accum(config.build(raw, env={}, world_size=1)), log=lines.append).losses
        out[f"{name} log"] = lines
    return out


def test_fp8_trains_like_bf16(demo):
    """precision fp8 (emulated on CPU): the MLP's matmuls through torch._scaled_mm (tensorwise), then every linear
    (rowwise) with the fused linear CE in 48-token chunks (3 per micro-batch of 2 × 64 tokens, the last one short);
    each curve follows bf16's."""
    r = run_workers(_fp8_worker, 1, demo, timeout=300)[0]
    bf16 = r["bf16"]
    for name in ("fp8", "fp8 every linear"):
        fp8 = r[name]
        assert fp8[-1] < fp8[0] - 0.1, (name, fp8)                      # it learns
        assert max(abs(a - b) / b for a, b in zip(bf16, fp8)) < 0.02, (name, bf16, fp8)
        assert fp8 != bf16                                               # and it did run in fp8
    assert r["fp8"] != r["fp8 every linear"]
    assert [ln for ln in r["fp8 every linear log"] if ln.startswith("precision: fp8")] == [
        "precision: fp8 (rowwise scaling) for the qkv, proj, fc1, fc2 matmuls of every layer; weights, other "
        "matmuls, attention and the loss in bf16"]
    assert not [ln for ln in r["bf16 log"] if ln.startswith("precision: fp8")]
    said = [ln for ln in r["bf16 log"] if ln.startswith("optimizer: ")]  # the run names its optimizer, once
    assert said == ["optimizer: nd-adapter's flat AdamW (nothing to shard; fp32 master weights and moments, one fused "
                    "pass per parameter; optimizer.impl: deepspeed for DeepSpeed's ZeRO-1)"], said


def _eight_bit_worker(rank, world, demo, root):
    """bitsandbytes' AdamW8bit under ZeRO-3, ZeRO-2 (tp=2 × dp_shard=2) and the flat AdamW (tp=4), and torchao's
    AdamW4bit under ZeRO-2 (its partitions' whole blocks 4-bit, the rest fp32; ZeRO-1/2 link per-parameter fragments
    to the states after each step, and save and load them): 4 steps whole, and cut at 2 and resumed in a fresh engine;
    fp32 AdamW on the same batches."""
    from pathlib import Path

    import torch

    from adapter.errors import UserError
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    init_distributed()
    out = {}
    zero2 = {"deepspeed.zero_stage": 2}
    for name, shape, over in (("zero3", (1, 2, 1, 2), {}), ("zero2", (1, 2, 1, 2), zero2), ("flat", (1, 1, 1, 4), {}),
                              ("zero2 4-bit", (1, 2, 1, 2), {**zero2, "optimizer.name": "adamw_4bit"})):
        said: list[str] = []
        over = {"optimizer.name": "adamw_8bit", **over, "checkpoint.save_every": 2}
        whole, first, second = _whole_then_cut(demo, shape, 4, 2, f"{root}/{name}", over, log=said.append)
        out[name] = {"whole": whole.losses, "cut": first.losses + second.losses, "start": second.start_step,
                     "said": [ln for ln in said if ln.startswith("optimizer: ")]}
    # what the 4-bit run saved of this rank's partitions: each one's whole blocks 4-bit, the rest fp32
    saved = torch.load(next(Path(f"{root}/zero2 4-bit-whole/global_step4").glob(
        f"*zero_pp_rank_{rank // 2}_mp_rank_{rank % 2:02d}_optim_states.pt")), weights_only=False)
    base = saved["optimizer_state_dict"]["base_optimizer_state"]
    states = base["state"].values() if isinstance(base, dict) else [s for group in base for s in group.values()]
    out["4-bit states"] = [{k: (type(v["exp_avg"]).__name__, v["exp_avg"].numel()) for k, v in s.items()}
                           for s in states if isinstance(s, dict) and "blocks" in s]
    out["fp32"] = run(run_config(demo, (1, 2, 1, 2), steps=4), log=lambda s: None).losses
    try:  # the 8-bit run's ZeRO-3 checkpoint resumed with fp32 moments
        run(run_config(demo, (1, 2, 1, 2), steps=6, **{"checkpoint.dir": f"{root}/zero3-whole"}), resume=True,
            log=lambda s: None)
        out["refused"] = None
    except UserError as e:
        out["refused"] = str(e)
    return out


def test_8bit_adamw_on_every_optimizer_path_resumes_exactly_and_tracks_fp32(demo, tmp_path):
    r = run_workers(_eight_bit_worker, 4, demo, str(tmp_path), timeout=900)[0]
    for name in ("zero3", "zero2", "flat", "zero2 4-bit"):
        got = r[name]
        assert got["start"] == 2 and got["cut"] == got["whole"], (name, got)  # bit-identical on CPU
        # the same first step (to the fused loss's summation order, which differs between tp = 4 and tp = 2)
        assert abs(got["whole"][0] - r["fp32"][0]) <= 1e-6 * r["fp32"][0] and got["whole"] != r["fp32"], \
            (name, got, r["fp32"])
        assert max(abs(a - b) / b for a, b in zip(got["whole"], r["fp32"])) < 2e-3, (name, got, r["fp32"])
    assert r["zero3"]["said"] == ["optimizer: DeepSpeed's ZeRO-3 stepping bitsandbytes' AdamW8bit (fp32 master "
                                  "partitions, 8-bit moments)"]
    assert r["zero2 4-bit"]["said"] == ["optimizer: DeepSpeed's ZeRO-2 stepping torchao's AdamW4bit (fp32 master "
                                        "partitions, 4-bit moments in their whole blocks of 256)"]
    assert r["4-bit states"], r["4-bit states"]
    for part in r["4-bit states"]:
        assert part["blocks"][0] == "OptimState4bit" and part["blocks"][1] % 256 == 0, r["4-bit states"]
        assert part.get("tail", ("Tensor", 0))[0] == "Tensor" and part.get("tail", ("", 0))[1] < 256, r["4-bit states"]
    assert "optimizer.name: adamw_8bit" in r["refused"] and "\n" not in r["refused"], r["refused"]
    assert r["flat"]["said"] == ["optimizer: nd-adapter's flat AdamW (nothing to shard; fp32 master weights, 8-bit "
                                 "moments (bitsandbytes' AdamW8bit); optimizer.impl: deepspeed for DeepSpeed's ZeRO-1)"]


def _new_schedule_worker(rank, world, demo, root):
    """2 steps of a 2-step cosine run, saved; resumed as a 4-step run (Axolotl's example resumed with a
    longer max_steps took its next step at the old schedule's final rate, 0)."""
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    init_distributed()
    over = {"optimizer.schedule": "cosine", "checkpoint.dir": f"{root}/ck", "checkpoint.save_every": 2}
    run(run_config(demo, (1, 4, 1, 1), steps=2, **over), log=lambda s: None)
    lines: list[str] = []
    run(run_config(demo, (1, 4, 1, 1), steps=4, **over), resume=True, log=lines.append)
    return lines


def test_resume_follows_the_new_schedule_as_transformers_does(demo, tmp_path):
    import torch
    from transformers.optimization import get_cosine_schedule_with_warmup

    lines = run_workers(_new_schedule_worker, 4, demo, str(tmp_path), timeout=600)[0]
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    ref = get_cosine_schedule_with_warmup(opt, 0, 4)
    for _ in range(2):
        opt.step()
        ref.step()
    want = opt.param_groups[0]["lr"]  # the rate of step 3 of a 4-step schedule
    step3 = next(ln for ln in lines if ln.startswith("step 3/4"))
    assert f"lr {want:.3e}" in step3, (want, step3)
    assert f"schedule: step 3 of 4 runs at learning rate {want:.3e} from this run's schedule (the checkpoint's " \
           "run was at 0.000e+00)" in lines, lines
    assert "device: CPU (no GPU is visible to this process): training on the CPU with gloo" in lines
