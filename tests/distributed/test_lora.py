"""LoRA against PEFT (CPU, fp32): a chat_template dataset, packed, trained by nd-adapter on every
layout from a PEFT adapter with non-zero B (`lora.init_from`, Axolotl's lora_model_dir) and by transformers + PEFT
from the same adapter on the same samples: same losses; the adapter's logits before training equal PEFT's; the
exported adapter loads in PEFT and gives nd-adapter's logits; `merge-lora` equals PEFT's merge_and_unload; the
default initialisation does not depend on tp; a resumed run continues exactly (exact HSDP, 4 processes)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from adapter import config
from tests.helpers.dist import run_workers
from tests.helpers.lora import ALL7, PROBE, STEPS, lora_cfg, lora_section, peft_reference
from tests.helpers.runs import vocab_of
from tests.helpers.sft import make_gemma, make_glm4, make_model, make_phi3, peft_adapter, rel

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
# adapter: (model, PEFT LoraConfig keys); each is started from a PEFT adapter written by the test
ADAPTERS = {"all seven, r 8": ("untied", {"r": 8, "lora_alpha": 16, "target_modules": ALL7}),
            "q/v, rslora": ("untied", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
                                       "use_rslora": True}),
            "lm_head saved, tied": ("tied", {"r": 4, "lora_alpha": 8, "target_modules": ALL7,
                                             "modules_to_save": ["lm_head"]}),
            # Phi-3's packed linears: B in the HF tensor's row order for PEFT, Megatron's inside
            "phi3 packed": ("phi3", {"r": 8, "lora_alpha": 16,
                                     "target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}),
            # GLM-4: q, k, v apart (with biases) and gate, up packed, beside its post-norms
            "glm4 mixed": ("glm4", {"r": 8, "lora_alpha": 16,
                                    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj",
                                                       "down_proj"]}),
            # Gemma 3: all seven beside its sandwich norms (o_proj's and down_proj's adapters add before the
            # post-norm), windows shorter than the examples, tied embeddings
            "gemma3 all seven": ("gemma3", {"r": 8, "lora_alpha": 16, "target_modules": ALL7})}
PLUS = "lora.plus_lr_ratio"
# name: adapter, (dp_shard, cp, tp), micro-batch, overrides -- each a world of 2
RUNS = {"tp=2 +SP (flat AdamW)": ("all seven, r 8", (1, 1, 2), 2, {}),
        "tp=2, no SP": ("all seven, r 8", (1, 1, 2), 2, {"sequence_parallel": False}),
        "dp_shard=2 (ZeRO-3)": ("all seven, r 8", (2, 1, 1), 1, {}),
        "dp_shard=2 (ZeRO-2, full recompute)": ("all seven, r 8", (2, 1, 1), 1, {"deepspeed.zero_stage": 2,
                                                                                 "recompute": "full"}),
        "cp=2": ("all seven, r 8", (1, 2, 1), 2, {}),
        "q/v rslora, tp=2 +SP": ("q/v, rslora", (1, 1, 2), 2, {}),
        "q/v rslora, dp_shard=2": ("q/v, rslora", (2, 1, 1), 1, {}),
        "lm_head, tp=2 +SP": ("lm_head saved, tied", (1, 1, 2), 2, {}),
        "lm_head, dp_shard=2": ("lm_head saved, tied", (2, 1, 1), 1, {}),
        "phi3, tp=2 +SP": ("phi3 packed", (1, 1, 2), 2, {}),
        "phi3, dp_shard=2": ("phi3 packed", (2, 1, 1), 1, {}),
        "glm4, tp=2 +SP": ("glm4 mixed", (1, 1, 2), 2, {}),
        "glm4, dp_shard=2": ("glm4 mixed", (2, 1, 1), 1, {}),
        "gemma3, tp=2 +SP": ("gemma3 all seven", (1, 1, 2), 2, {}),
        "gemma3, dp_shard=2": ("gemma3 all seven", (2, 1, 1), 1, {}),
        # LoRA+ (Axolotl's loraplus_lr_ratio): B at 16 × lr, PEFT's create_loraplus_optimizer the reference
        "LoRA+, tp=2 +SP (flat AdamW)": ("all seven, r 8", (1, 1, 2), 2, {PLUS: 16.0}),
        "LoRA+, dp_shard=2 (ZeRO-3)": ("all seven, r 8", (2, 1, 1), 1, {PLUS: 16.0})}


EXPORTS = {"tp=2 +SP (flat AdamW)": "export", "phi3, tp=2 +SP": "export-phi3"}  # run -> its PEFT export's dir


def _logits(trainer):
    import torch

    from adapter.modeling.gpt import forward_logits

    model = trainer.engine.ds.module
    with torch.no_grad():
        logits = forward_logits(model, torch.tensor(PROBE), vocab_size=trainer.arch.vocab_size)
    return logits.float().cpu().numpy()  # by value: a worker's tensors would travel as shared memory it frees


def _parity_worker(rank, world, models, adapters, root):
    from adapter.models.resolved import resolve_run
    from adapter.train.engine import init_distributed
    from adapter.train.trainer import Trainer

    init_distributed()
    out = {"init": _default_init(models["untied"], root)}
    for name, (adapter, shape, micro, over) in RUNS.items():
        model, peft_kw = ADAPTERS[adapter]
        export = {"checkpoint.export_hf": f"{root}/{EXPORTS[name]}"} if name in EXPORTS else {}
        lines: list[str] = []
        t = Trainer(resolve_run(lora_cfg(models[model], root, shape, micro, lora_section(peft_kw, adapters[adapter]),
                             **over, **export)), log=lines.append)
        try:
            t.setup()
            before = _logits(t)
            r = t.fit()
            after = _logits(t)
            opt = t.engine.ds.optimizer
            groups = getattr(opt, "bit16_groups", None) or getattr(opt, "fp16_groups", None) or \
                [f.params for f in opt.flats]
            names = {id(p): n for n, p in t.engine.ds.module.named_parameters()}
            optimized = sorted(names[id(p)] for g in groups for p in g)
        finally:
            t.close()
        out[name] = {"losses": r.losses, "before": before, "after": after, "optimized": optimized,
                     "said": [ln for ln in lines if ln.startswith(("lora:", "exported", "lora.plus_lr_ratio"))]}
    return out


def _default_init(model_dir, root):
    """The adapters a run starts with when no adapter is given, gathered whole, at tp=2 and at dp_shard=2."""
    import deepspeed

    from adapter.modeling.lora import full_state
    from adapter.models.resolved import resolve_run
    from adapter.train.trainer import Trainer

    out = {}
    for name, shape, micro in (("tp=2", (1, 1, 2), 2), ("dp_shard=2", (2, 1, 1), 1)):
        t = Trainer(resolve_run(lora_cfg(model_dir, root, shape, micro, {"r": 8, "alpha": 16, "target_linear": True})),
                    log=lambda s: None)
        try:
            t.setup()
            model = t.engine.ds.module
            with deepspeed.zero.GatheredParameters([p for p in model.parameters() if p.requires_grad]):
                out[name] = {k: v.numpy() for k, v in full_state(model, t.lora, t.arch, t.groups.tp).items()}
        finally:
            t.close()
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The two tiny Llamas (untied, tied), PEFT adapters with non-zero B for each adapter kind, the references."""
    from tests.helpers.sft_data import tiny_model

    root = tmp_path_factory.mktemp("lora")
    tok = tiny_model(root / "tok")
    models = {"untied": str(make_model(root / "untied", tok)), "tied": str(make_model(root / "tied", tok, tie=True)),
              "phi3": str(make_phi3(root / "phi3", tok)), "glm4": str(make_glm4(root / "glm4", tok)),
              "gemma3": str(make_gemma(root / "gemma3", tok, 3))}
    adapters = {name: str(peft_adapter(models[model], kw, root / f"adapter-{i}"))
                for i, (name, (model, kw)) in enumerate(ADAPTERS.items())}
    return root, models, adapters


def _check_default_init(inits, model_dir):
    """PEFT's initialisation, drawn for each whole matrix from the run's seed: the same at tp=2 and at tp=1."""
    import numpy as np

    from adapter.modeling.lora import init_a
    from adapter.models import lora
    from adapter.models.arch import load_arch

    arch = load_arch(model_dir)
    spec = lora.resolve(arch, r=8, alpha=16, target_linear=True)
    tp2, tp1 = inits["tp=2"], inits["dp_shard=2"]
    assert tp2.keys() == tp1.keys() == {lora.peft_key(t, w) for t in spec.targets for w in "AB"}
    seed = config.build({"model": {"path": model_dir}}, env={}).seed
    for t in spec.targets:
        a, b = lora.peft_key(t, "A"), lora.peft_key(t, "B")
        assert np.array_equal(tp2[a], tp1[a]) and np.array_equal(tp2[a], init_a(t, 8, seed).numpy()), a
        assert not tp2[b].any() and not tp1[b].any(), b  # B starts at zero: the first forward is the base's
        bound = 1 / t.linear.inp ** 0.5
        assert abs(tp2[a]).max() <= bound and abs(tp2[a]).max() > 0.9 * bound  # U(-1/sqrt(in), 1/sqrt(in))
    firsts = [tp2[lora.peft_key(t, "A")][0, 0] for t in spec.targets]
    assert len(set(firsts)) == len(firsts)  # each adapter its own draw


def test_lora_matches_peft_on_every_layout(setup):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from adapter.data.sft import prepare

    root, models, adapters = setup
    got = run_workers(_parity_worker, 2, models, adapters, str(root), timeout=1200)[0]
    _check_default_init(got.pop("init"), models["untied"])
    refs = {}
    for name, (model, kw) in ADAPTERS.items():
        cfg = lora_cfg(models[model], root, (1, 1, 2), 2, lora_section(kw, adapters[name]))
        data = prepare(cfg, Path(models[model]), vocab_of(cfg), builder=True, barrier=None, progress=False)
        assert data.reused  # the runs' own prepared samples
        refs[name] = peft_reference(models[model], adapters[name], data, cfg)
        if name == "all seven, r 8":
            refs[name, 16.0] = peft_reference(models[model], adapters[name], data, cfg, plus=16.0)
    full = refs["all seven, r 8"]["losses"]
    assert rel(refs["q/v, rslora"]["losses"][1], full[1]) > 1e-3  # the targets change the curve: the test can fail
    assert rel(refs["all seven, r 8", 16.0]["losses"][1], full[1]) > 1e-3  # and so does LoRA+
    for name, r in got.items():
        adapter = RUNS[name][0]
        ref = refs[adapter, RUNS[name][3][PLUS]] if PLUS in RUNS[name][3] else refs[adapter]
        assert all(rel(a, b) <= 1e-4 for a, b in zip(r["losses"], ref["losses"])), (name, r["losses"], ref["losses"])
        if RUNS[name][1][1] == 1:  # (a CP rank's forward takes its chunks of a sequence, not the whole probe)
            diff = (torch.as_tensor(r["before"]) - ref["before"]).abs().max().item()
            assert diff <= 1e-5 * ref["before"].abs().max().item(), (name, diff)  # lora_model_dir: PEFT's logits
        saved = ADAPTERS[adapter][1].get("modules_to_save", [])
        assert all(".lora." in n or ("output_layer" in n and saved) for n in r["optimized"]), (name, r["optimized"])
        assert len(r["optimized"]) == 2 * len([n for n in ref["trained"] if "lora_A" in n]) + len(saved), name
        assert len(r["said"]) >= 1 and r["said"][0].startswith("lora: LoRA r"), r["said"]
        assert any(ln.startswith("lora.plus_lr_ratio: LoRA+") for ln in r["said"]) == (PLUS in RUNS[name][3])
    # the export of the tp=2 run: PEFT's format, and PEFT gives nd-adapter's logits after training
    export = root / "export"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in export.iterdir()}
    base = AutoModelForCausalLM.from_pretrained(models["untied"], dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(export))
    with torch.no_grad():
        logits = peft(input_ids=torch.tensor(PROBE)).logits.float()
    ours = torch.as_tensor(got["tp=2 +SP (flat AdamW)"]["after"])
    assert (logits - ours).abs().max() <= 1e-5 * logits.abs().max(), (logits - ours).abs().max()
    phi3 = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(models["phi3"], dtype=torch.float32),
                                     str(root / "export-phi3"))  # packed B back in HF row order
    with torch.no_grad():
        logits = phi3(input_ids=torch.tensor(PROBE)).logits.float()
    ours = torch.as_tensor(got["phi3, tp=2 +SP"]["after"])
    assert (logits - ours).abs().max() <= 1e-5 * logits.abs().max(), (logits - ours).abs().max()
    # merge-lora: equal to PEFT's merge_and_unload, in a fresh process, as a user runs it
    import yaml

    merged_cfg = root / "merge.yaml"
    lora = lora_section(ADAPTERS["all seven, r 8"][1], None)
    merged_cfg.write_text(yaml.safe_dump({"model": {"path": models["untied"]}, "lora": lora,
                                          "checkpoint": {"export_hf": str(export)}}))
    p = subprocess.run([sys.executable, "-m", "adapter", "merge-lora", "--config", str(merged_cfg)],
                       capture_output=True, text=True, cwd=root, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-2000:]
    merged = AutoModelForCausalLM.from_pretrained(str(export / "merged"), dtype=torch.float32)
    reference = peft.merge_and_unload()
    for (n, a), (_, b) in zip(sorted(merged.state_dict().items()), sorted(reference.state_dict().items())):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item()), n


def _resume_worker(rank, world, models, adapters, root):
    """Exact HSDP (dp_replicate=2 x dp_shard=2): 4 steps whole, and 2 + 2 resumed in a fresh engine; what the
    checkpoint holds; resumes at two other layouts."""
    import torch

    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    init_distributed()
    lora = lora_section(ADAPTERS["all seven, r 8"][1], adapters["all seven, r 8"])

    def cfg(steps, ckpt, shape=(2, 1, 1), **over):
        return lora_cfg(models["untied"], root, shape, 1, lora, world=4, steps=steps,
                        **{"parallelism.dp_replicate_size": 2, "checkpoint.dir": f"{root}/{ckpt}", **over})

    whole = run(cfg(STEPS, "whole"), log=lambda s: None)
    first = run(cfg(2, "cut"), log=lambda s: None)
    lines: list[str] = []
    second = run(cfg(STEPS, "cut"), resume=True, log=lines.append)
    latest = Path(f"{root}/cut/latest").read_text().strip()
    moved = {}  # the adapters' checkpoint resharded: from the same state, the same next loss
    for name, shape, over in (("tp=2 x dp_shard=2", (2, 1, 2), {"parallelism.dp_replicate_size": 1,
                                                                 "batch.gradient_accumulation_steps": 2}),
                              ("dp_shard=4", (4, 1, 1), {"parallelism.dp_replicate_size": 1})):
        if rank == 0:
            shutil.copytree(f"{root}/cut", f"{root}/cut-{shape[2]}")
        torch.distributed.barrier()
        moved[name] = run(cfg(STEPS + 1, f"cut-{shape[2]}", shape, **over), resume=True, log=lambda s: None).losses
    files = sorted(Path(f"{root}/cut/{latest}").glob("*model_states.pt"))
    states = torch.load(files[0], map_location="cpu", weights_only=False)
    return {"whole": whole.losses, "first": first.losses, "second": second.losses, "start": second.start_step,
            "said": [ln for ln in lines if ln.startswith("weights:")], "moved": moved,
            "module": sorted((states.get("module") or {}).keys()),
            "shapes": sorted(k for g in states.get("param_shapes") or [] for k in g)}


def test_lora_resumes_exactly_at_exact_hsdp_and_keeps_only_what_is_trained(setup):
    from adapter.data.sft import prepare

    root, models, adapters = setup
    r = run_workers(_resume_worker, 4, models, adapters, str(root), timeout=1200)[0]
    assert r["start"] == 2 and r["first"] + r["second"] == r["whole"], r  # bit-identical on CPU
    assert r["said"] and "the frozen base from the converted weights" in r["said"][0], r["said"]
    # the checkpoint holds the adapters only: no base weight in its module state or its optimizer's partitions
    assert r["shapes"] and all(".lora." in k for k in r["shapes"]), r["shapes"]
    assert all(".lora." in k or k.endswith("_extra_state") for k in r["module"]), r["module"]
    (a,), (b,) = r["moved"].values()  # one step each, from the same adapters at two other layouts
    assert abs(a - b) <= 1e-5 * abs(a) and a < r["whole"][0], r["moved"]
    kw = ADAPTERS["all seven, r 8"][1]
    cfg = lora_cfg(models["untied"], root, (2, 1, 1), 1, lora_section(kw, adapters["all seven, r 8"]), world=4,
                   **{"parallelism.dp_replicate_size": 2})
    data = prepare(cfg, Path(models["untied"]), vocab_of(cfg), builder=True, barrier=None, progress=False)
    ref = peft_reference(models["untied"], adapters["all seven, r 8"], data, cfg, global_batch=4)
    assert all(rel(a, b) <= 1e-4 for a, b in zip(r["whole"], ref["losses"])), (r["whole"], ref["losses"])


def test_bad_lora_input_is_one_line_status_2_and_writes_nothing(setup, tmp_path):
    """Axolotl YAMLs a user could write: each refused before any process starts, naming the key and the fix."""
    import yaml
    from safetensors.torch import save_file

    root, models, adapters = setup
    import torch

    alien = tmp_path / "alien"  # an adapter of another base model (hidden 32, not 64)
    alien.mkdir()
    (alien / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16, '
                                               '"target_modules": ["q_proj", "v_proj"]}')
    save_file({f"base_model.model.model.layers.{i}.self_attn.{m}_proj.lora_{w}.weight":
               torch.zeros((8, 32) if w == "A" else (32, 8)) for i in range(2) for m in "qv" for w in "AB"},
              str(alien / "adapter_model.safetensors"))
    base = {"base_model": models["untied"], "learning_rate": 1e-4, "micro_batch_size": 1, "sequence_len": 64,
            "max_steps": 1, "datasets": [{"path": "unused.jsonl", "type": "completion"}],
            "output_dir": str(tmp_path / "out")}
    cases = {
        "unknown target": ({"adapter": "lora", "lora_target_modules": ["q_proj", "c_attn"]},
                           "lora_target_modules='c_attn': matches no linear of this llama model's layers"),
        "rank 0": ({"adapter": "lora", "lora_r": 0}, "lora_r=0: the adapter rank must be a positive integer"),
        "qlora without 4-bit": ({"adapter": "qlora"}, "adapter='qlora': QLoRA trains adapters on a 4-bit base"),
        "8-bit base without adapter": ({"load_in_8bit": True}, "load_in_8bit=True: a LoRA setting without `adapter`"),
        "adapter of another rank": ({"adapter": "lora", "lora_r": 16, "lora_alpha": 16,
                                     "lora_model_dir": adapters["q/v, rslora"]},
                                    "lora_model_dir='r=8': the adapter's rank differs from this run's 16"),
        "adapter of another base": ({"adapter": "lora", "lora_r": 8, "lora_alpha": 16, "lora_model_dir": str(alien)},
                                    "was trained on another base model"),
    }
    for name, (extra, needle) in cases.items():
        (tmp_path / "run.yaml").write_text(yaml.safe_dump({**base, **extra}))
        p = subprocess.run([sys.executable, "-m", "adapter", "train", "--config", "run.yaml", "--nproc", "1"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and needle in lines[0] and "Fix:" in lines[0], (name, p.stderr)
        assert not (tmp_path / "out").exists(), name


def _plus_resume_worker(rank, world, models, adapters, root):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    init_distributed()
    lora = {**lora_section(ADAPTERS["all seven, r 8"][1], adapters["all seven, r 8"]), "plus_lr_ratio": 16.0}
    out = {}
    for stage in (2, 3):
        def cfg(steps, ckpt, stage=stage):
            return lora_cfg(models["untied"], root, (2, 1, 1), 1, lora, steps=steps, **{
                "checkpoint.dir": f"{root}/plus-{ckpt}-{stage}", "deepspeed.zero_stage": stage,
                "optimizer.schedule": "cosine", "optimizer.warmup_steps": 1})
        whole = run(cfg(STEPS, "whole"), log=lambda s: None)
        run(cfg(2, "cut"), log=lambda s: None)
        out[stage] = (whole.losses, run(cfg(STEPS, "cut"), resume=True, log=lambda s: None).losses)
    return out


def test_lora_plus_resumes_on_its_own_rates(setup):
    """LoRA+ (B at 16 × lr) under a warm-up and cosine schedule, saved after 2 steps and resumed under ZeRO-2 and
    ZeRO-3: the resumed steps are the whole run's, each group back on its own rate (Engine.follow_schedule)."""
    root, models, adapters = setup
    got = run_workers(_plus_resume_worker, 2, models, adapters, str(root), timeout=900)[0]
    for stage, (whole, resumed) in got.items():
        assert len(whole) == STEPS and resumed == whole[2:], (stage, whole, resumed)
