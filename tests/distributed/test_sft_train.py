"""The fine-tuning path's training side on CPU (gloo, fp32), against plain transformers on the same batches: exact
loss normalisation on every layout, held-out evaluation, weights from `base_model` through the conversion cache,
and the export into Axolotl's output_dir."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapter import config
from tests.helpers.dist import run_workers
from tests.helpers.sft import MaskedData, hf_reference, make_model, rel

pytestmark = pytest.mark.slow

SEQ, VOCAB, LR = 32, 512, 2e-3
BEST_LR = 2e-2
# trained tokens per sample; one optimizer step = 4 consecutive samples (global batch 4, no shuffling): the
# first step mixes 1 and 31 trained tokens, the second trains none at all, the third is uneven again
TRAINED = [1, 31, 2, 20, 0, 0, 0, 0, 5, 31, 3, 12]
VAL = [7, 0, 30, 2, 11]  # 5 held-out samples: not a multiple of dp×micro_batch, one without trained tokens
STEPS = [list(range(4 * k, 4 * k + 4)) for k in range(3)]
LAYOUTS = {  # name: (dp_shard, cp, tp), micro_batch, grad_accum, overrides  -- every one a world of 2
    "micro 4 x accum 1 (tp 2)": ((1, 1, 2), 4, 1, {}),
    "micro 1 x accum 4 (tp 2)": ((1, 1, 2), 1, 4, {}),
    "dp_shard 2 x micro 2": ((2, 1, 1), 2, 1, {}),
    # also evaluates before the first step and every 2 steps, logged to TensorBoard too
    "cp 2 x micro 2 x accum 2": ((1, 2, 1), 2, 2, {"eval.every": 2, "logging.tensorboard": "TB"}),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from adapter.demo.build import train_tokenizer

    root = tmp_path_factory.mktemp("sft")
    tok = train_tokenizer(out_dir=root / "tokenizer", vocab_size=VOCAB)
    return make_model(root / "model", tok)


def _use_data(train, val, chat_template=None):
    """Replace the trainer's data with in-memory masked datasets (the SFT data side's item API)."""
    from adapter.data import DPSampler
    from adapter.train.trainer import Trainer

    def _data(self):
        self.val_dataset, self.chat_template = val, chat_template
        return train, DPSampler(len(train), dp_rank=self.layout.data_rank(self.rank), dp_size=self.layout.dp,
                                micro_batch=self.cfg.batch.micro_batch_size, seed=0, shuffle=False)

    Trainer._data = _data


def sft_config(model_dir, root, shape, mb, ga, steps=3, **over):
    s, c, t = shape
    raw = {"model": {"path": str(model_dir), "cache_dir": f"{root}/cache"},
           "parallelism": {"dp_shard_size": s, "cp_size": c, "tp_size": t},
           "batch": {"micro_batch_size": mb, "gradient_accumulation_steps": ga}, "seq_len": SEQ, "precision": "fp32",
           "optimizer": {"lr": LR, "schedule": "constant", "warmup_steps": 0, "max_steps": steps, "clip_grad": 1e12}}
    for k, v in over.items():
        config.set_dotted(raw, k, v)
    return config.build(raw, env={}, world_size=2)


def _normalisation_worker(rank, world, model_dir, root):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    init_distributed()
    _use_data(MaskedData(TRAINED, SEQ, VOCAB), MaskedData(VAL, SEQ, VOCAB, seed=1))
    out = {}
    for name, (shape, mb, ga, over) in LAYOUTS.items():
        over = {k: f"{root}/tb" if v == "TB" else v for k, v in over.items()}
        r = run(sft_config(model_dir, root, shape, mb, ga, **over), log=lambda s: None)
        out[name] = {"losses": r.losses, "grad_norms": r.grad_norms, "tokens": r.trained_tokens,
                     "eval": r.eval_losses}
    return out


def test_loss_normalisation_matches_transformers_on_every_layout(model_dir, tmp_path):
    """Σ loss / Σ trained tokens of the whole step, identical for (micro 4, accum 1), (1, 4), dp_shard 2 and cp 2,
    and equal to the HF model trained on the same batches; the zero-token step gives 0, not NaN; the held-out loss
    equals HF's over the whole set."""
    import torch

    train, val = MaskedData(TRAINED, SEQ, VOCAB), MaskedData(VAL, SEQ, VOCAB, seed=1)
    ref = hf_reference(model_dir, train, STEPS, lr=LR, val=val)
    assert ref["losses"][1] == 0.0 and ref["grad_norms"][1] == 0.0
    # the test can fail: the mean of per-micro-batch token means (grad-accum 4) differs from the step's token mean
    from transformers import AutoModelForCausalLM

    from tests.helpers.sft import batch_of, hf_loss

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        mean_of_means = sum(float(hf_loss(hf, batch_of(train, [i]))) for i in STEPS[0]) / 4
        eval_at_start = float(hf_loss(hf, batch_of(val, range(len(val)))))
    assert rel(mean_of_means, ref["losses"][0]) > 0.02, (mean_of_means, ref["losses"][0])

    results = run_workers(_normalisation_worker, 2, str(model_dir), str(tmp_path), timeout=900)
    for name, got in results[0].items():
        assert got["tokens"] == [54, 0, 51], (name, got["tokens"])
        assert got["losses"][1] == 0.0 and got["grad_norms"][1] == 0.0, (name, got)
        for a, b in zip(got["losses"], ref["losses"]):
            assert rel(a, b) < 1e-5 if b else a == 0.0, (name, got["losses"], ref["losses"])
        for a, b in zip(got["grad_norms"], ref["grad_norms"]):
            assert (rel(a, b) < 1e-4) if b else a == 0.0, (name, got["grad_norms"], ref["grad_norms"])
        *periodic, (step, loss) = got["eval"]
        assert step == 3 and rel(loss, ref["eval_loss"]) < 1e-5, (name, got["eval"], ref["eval_loss"])
        if LAYOUTS[name][3]:
            assert [s for s, _ in periodic] == [0, 2] and rel(periodic[0][1], eval_at_start) < 1e-5, got["eval"]
        else:
            assert not periodic, got["eval"]
    assert results[1] == results[0]  # every rank logs the same numbers
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp_path / "tb"))
    tb.Reload()
    logged = [(e.step, e.value) for e in tb.Scalars("eval_loss")]
    assert [s for s, _ in logged] == [0, 2, 3] and rel(logged[-1][1], ref["eval_loss"]) < 1e-5, logged


CHATML = ("{% for m in messages %}<|begin_of_text|>{{ m['role'] }}\n{{ m['content'] }}<|end_of_text|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|begin_of_text|>assistant\n{% endif %}")


EAFT = {"k": 5, "alpha": 0.7}  # k well below the vocabulary, alpha off 1
EAFT_LAYOUTS = {  # Megatron's cross-entropy and nd-adapter's fused one, both with the vocabulary split over tp
    "tp 2, Megatron's CE": ((1, 1, 2), 2, 2, {}),
    "tp 2, fused kernels": ((1, 1, 2), 2, 2, {"model.fused_kernels": True}),
    "dp_shard 2": ((2, 1, 1), 2, 1, {}),
    "cp 2": ((1, 2, 1), 2, 2, {}),
    "transformers engine, dp_shard 2": ((2, 1, 1), 2, 1, {"model.engine": "transformers"}),
}


def _eaft_worker(rank, world, model_dir, root):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    init_distributed()
    _use_data(MaskedData(TRAINED, SEQ, VOCAB), MaskedData(VAL, SEQ, VOCAB, seed=1))
    out = {}
    for name, (shape, mb, ga, over) in EAFT_LAYOUTS.items():
        r = run(sft_config(model_dir, f"{root}/{len(out)}", shape, mb, ga, eaft=EAFT, **over), log=lambda s: None)
        out[name] = {"losses": r.losses, "eval": r.eval_losses}
    return out


def test_eaft_weighs_each_token_as_axolotl_on_every_layout(model_dir, tmp_path):
    """Axolotl's use_eaft (eaft:) gives the losses of transformers trained with Axolotl's EAFT loss on the same
    batches, held-out loss included, at tp=2 (the top-k merged over the split vocabulary), dp_shard=2, cp=2 and on
    the transformers engine; the weights differ enough from plain cross-entropy for the test to fail without them."""
    ref = hf_reference(model_dir, MaskedData(TRAINED, SEQ, VOCAB), STEPS, lr=LR, val=MaskedData(VAL, SEQ, VOCAB,
                       seed=1), eaft=(EAFT["k"], EAFT["alpha"]))
    plain = hf_reference(model_dir, MaskedData(TRAINED, SEQ, VOCAB), STEPS[:1], lr=LR)
    assert rel(plain["losses"][0], ref["losses"][0]) > 0.05, (plain, ref)
    results = run_workers(_eaft_worker, 2, str(model_dir), str(tmp_path), timeout=900)
    for name, got in results[0].items():
        for a, b in zip(got["losses"], ref["losses"]):
            assert rel(a, b) < 1e-5 if b else a == 0.0, (name, got["losses"], ref["losses"])
        assert rel(got["eval"][-1][1], ref["eval_loss"]) < 1e-5, (name, got["eval"], ref["eval_loss"])


def _weights_worker(rank, world, model_dir, root):
    import shutil

    import torch.distributed as dist

    from adapter.convert import cache
    from adapter.models import source
    from adapter.train.engine import init_distributed
    from tests.helpers.hf import flip_chunk
    from tests.helpers.runs import train as run

    init_distributed()
    _use_data(MaskedData(TRAINED, SEQ, VOCAB), None, chat_template=CHATML)
    conversions = []
    real = cache.hf_to_megatron
    cache.hf_to_megatron = lambda *a, **k: conversions.append(a[1]) or real(*a, **k)

    def one(name, cfg, **kw):
        lines: list[str] = []
        r = run(cfg, log=lines.append, **kw)
        return {"loss": r.losses[0], "log": lines, "conversions": len(conversions), "exported": r.exported}

    cfg = sft_config(model_dir, root, (2, 1, 1), 2, 1, steps=1)
    out = {"first": one("first", cfg), "again": one("again", cfg)}
    entry = source.resolve(cfg).checkpoint
    if rank == 0:
        out["damaged_chunk"] = flip_chunk(Path(entry), "linear_fc2.weight")
    dist.barrier()
    out["after_damage"] = one("after damage", cfg)
    bare = Path(root) / "bare"
    if rank == 0:
        bare.mkdir()
        shutil.copyfile(Path(model_dir) / "config.json", bare / "config.json")
    dist.barrier()
    out["bare"] = one("bare", sft_config(bare, root, (2, 1, 1), 2, 1, steps=1))
    # node-local caches: each rank plays a node of its own (local rank 0, its own disk), so each converts its copy
    import os

    os.environ["LOCAL_RANK"] = "0"
    before = len(conversions)
    node = one("node-local", sft_config(model_dir, root, (2, 1, 1), 2, 1, steps=1, **{
        "model.cache_dir": f"{root}/node{rank}", "model.cache_node_local": True}))
    out["node_local"] = {"loss": node["loss"], "converted_here": len(conversions) - before}
    os.environ["LOCAL_RANK"] = str(rank)
    # Axolotl's output_dir: checkpoints and the final HF model in one directory, exported twice
    od = f"{root}/output"
    over = {"checkpoint.dir": od, "checkpoint.export_hf": od, "checkpoint.save_every": 1}
    out["export1"] = one("export 1", sft_config(model_dir, root, (2, 1, 1), 2, 1, steps=2, **over))
    out["export2"] = one("export 2", sft_config(model_dir, root, (2, 1, 1), 2, 1, steps=3, **over), resume=True)
    out["entry"] = entry
    # the best checkpoint and early stopping (Axolotl's load_best_model_at_end, early_stopping_patience): a learning
    # rate high enough that the eval loss turns back up
    _use_data(MaskedData(TRAINED, SEQ, VOCAB), MaskedData(VAL, SEQ, VOCAB, seed=1))
    bd = f"{root}/best"
    best_cfg = sft_config(model_dir, root, (2, 1, 1), 2, 1, steps=8, **{
        "checkpoint.dir": bd, "checkpoint.export_hf": f"{bd}/hf", "checkpoint.save_every": 2,
        "checkpoint.keep_last": 1, "checkpoint.load_best": True, "eval.every": 1, "eval.early_stopping_patience": 3,
        "optimizer.lr": BEST_LR})
    r = run(best_cfg, log=lambda s: None)
    out["best"] = {"eval": r.eval_losses, "best": r.best_step, "final": r.final_step, "early": r.stopped_early,
                   "kept": sorted(p.name for p in Path(bd).glob("global_step*")),
                   "latest": (Path(bd) / "latest").read_text()}
    lines: list[str] = []  # the early-stopped run resumed: it has finished, and says so
    again = run(best_cfg, resume=True, log=lines.append)
    out["best"]["again"] = (again.final_step, again.stopped_early, [ln for ln in lines if ln.startswith("finished")])
    return out


def test_weights_from_base_model_cache_reuse_damage_and_export(model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers.sft import batch_of, hf_best, hf_loss

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        want = float(hf_loss(hf, batch_of(MaskedData(TRAINED, SEQ, VOCAB), STEPS[0])))
    ranks = run_workers(_weights_worker, 2, str(model_dir), str(tmp_path), timeout=900)
    r = ranks[0]
    assert [x["node_local"]["converted_here"] for x in ranks] == [1, 1]  # every "node" built its own copy
    assert r["node_local"]["loss"] == r["first"]["loss"]
    assert (tmp_path / "node0").is_dir() and (tmp_path / "node1").is_dir()
    first, again, damaged, bare = r["first"], r["again"], r["after_damage"], r["bare"]
    # the first run converts once (rank 0 only), says so, and starts at the HF model's own loss
    assert first["conversions"] == 1 and rel(first["loss"], want) < 1e-6, (first["loss"], want)
    assert any(line.startswith("weights: fine-tuning from the pre-trained weights in") and "converting them once"
               in line for line in first["log"]), first["log"][:5]
    # the second reuses the cache entry: no conversion, the same start
    assert again["conversions"] == 1 and again["loss"] == first["loss"]
    assert any("converted once before; reusing " + r["entry"] in line for line in again["log"]), again["log"][:5]
    # a flipped chunk is found by the load's checksums and the entry is converted again
    assert damaged["conversions"] == 2 and damaged["loss"] == first["loss"]
    assert any("is damaged" in line and r["damaged_chunk"] in line and "converting again" in line
               for line in damaged["log"]), damaged["log"][:6]
    # a bare config.json: random initialisation, said in words, and a start unlike the HF model's
    assert any(line.startswith("weights: RANDOM initialisation (seed 1234)") and "no weights" in line
               for line in bare["log"]), bare["log"][:3]
    assert abs(bare["loss"] - want) > 0.1
    # the export lands in output_dir beside the checkpoints, with tokenizer and chat template; both exports kept
    # the checkpoints (the second resumed from the first's)
    out = tmp_path / "output"
    assert r["export2"]["exported"] == str(out)
    assert (out / "latest").read_text() == "global_step3" and (out / "global_step2").is_dir()
    assert (out / "chat_template.jinja").read_text() == CHATML
    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out))
    prompt = tok.apply_chat_template([{"role": "user", "content": "In the beginning"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    gen = model.generate(**prompt, max_new_tokens=5, do_sample=False, pad_token_id=tok.eos_token_id)
    assert gen.shape[1] == prompt["input_ids"].shape[1] + 5
    start = dict(hf.named_parameters())["model.layers.0.mlp.down_proj.weight"]
    assert not torch.equal(dict(model.named_parameters())["model.layers.0.mlp.down_proj.weight"], start)
    # best checkpoint and early stopping: the steps transformers' own Trainer code picks from the same eval losses
    # (saves every 2 steps); at the end only the best checkpoint stays (keep_last 1: HF's save_total_limit 1 deletes
    # the rest when a run ends) and `latest` names it; the export is that checkpoint: its held-out loss in
    # transformers is the one logged after its step; resumed, the early-stopped run says it has finished
    b = r["best"]
    evals = {s: v for s, v in b["eval"] if s > 0}
    best, stop = hf_best(evals, set(range(2, b["final"] + 1, 2)), patience=3)
    assert (b["best"], b["final"] if b["early"] else None) == (best, stop), b
    assert b["early"] and b["best"] != b["final"], b  # the case where the export is not the last model
    assert b["kept"] == [f"global_step{best}"] and b["latest"] == f"global_step{best}", b
    final, early, said = b["again"]
    assert early and final == best and len(said) == 1 and f"after step {b['final']}" in said[0], b["again"]
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "best/hf"), dtype=torch.float32)
    val = MaskedData(VAL, SEQ, VOCAB, seed=1)
    with torch.no_grad():
        got = float(hf_loss(exported, batch_of(val, range(len(val)))))
    assert rel(got, evals[best]) < 1e-5, (got, evals)


# --- through the CLI --------------------------------------------------------------------------------------------

def _nd(*args: str, cwd: Path, env: dict | None = None):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, "-m", "adapter", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(root), **(env or {})})


def test_axolotl_yaml_through_nd_adapter_train(model_dir, tmp_path):
    """An Axolotl YAML unchanged: every note is said once (by rank 0, not as a warning per process), fp32 without
    bf16/fp16, FSDP's reshard_after_forward: false runs ZeRO-2, the model lands in output_dir beside checkpoints."""
    import yaml

    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "base_model": str(model_dir), "dp_shard_size": 2, "sequence_len": SEQ, "micro_batch_size": 2,
        "max_steps": 2, "learning_rate": 1e-3, "bf16": False, "output_dir": "./outputs/run",
        "fsdp_version": 2, "fsdp_config": {"reshard_after_forward": False, "offload_params": False},
        "plugins": ["axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"], "flash_attention": True,
        "wandb_watch": "gradients", "logging_steps": 1}))
    p = _nd("train", "--config", "run.yaml", "--set", "data.synthetic=true", "--set", "model.cache_dir=cache",
            cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stdout + p.stderr and "ignored" not in p.stderr and "warning" not in p.stderr
    once = ("ignored Axolotl keys (not used by nd-adapter): wandb_watch", "precision: fp32 (neither bf16 nor fp16",
            "FSDP -> DeepSpeed: fsdp_config.reshard_after_forward: false -> deepspeed.zero_stage 2",
            "kernels: nd-adapter's own are used", "weights: fine-tuning from the pre-trained weights in",
            "schedule: 2 optimizer steps", "optimizer: DeepSpeed's ZeRO-2 AdamW")
    for needle in once:
        assert p.stdout.count(needle) == 1, (needle, p.stdout[:3000])
    out = tmp_path / "outputs/run"
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file() and (out / "latest").read_text() == "global_step2"
    # what plan promises is what the run says: its notes are the run's first lines (one source: models/announce.py);
    # the disk line is taken again at run start with that moment's free space, and plan's word on resuming the
    # checkpoint now in output_dir is plan's own; plan plans for GPUs, so its compiled-layers line is the GPU's
    # (this run, on CPUs, says its own)
    plan = _nd("plan", "run.yaml", "--format", "json", "--set", "data.synthetic=true", "--set",
               "model.cache_dir=cache", cwd=tmp_path)
    notes = [n for n in json.loads(plan.stdout)["notes"] if not n.startswith(("checkpoints:", "--resume would"))
             and "model.compile: auto" not in n]
    missing = [n for n in notes if n not in p.stdout.splitlines()]
    assert len(notes) >= 5 and missing == [], (missing, p.stdout[:3000])
    assert sum("model.compile: auto: off" in ln for ln in p.stdout.splitlines()) == 1, p.stdout[:3000]


def test_mistral_common_yaml_trains_and_exports_its_tokenizer(tmp_path):
    """Axolotl's mistral examples' road (tokenizer_use_mistral_common: a checkpoint whose tokenizer is tekken.json
    alone): preprocessed by mistral-common (masks: tests/unit/test_mistral_common.py), trained, exported with
    tekken.json, which transformers' MistralCommonBackend loads back."""
    import torch
    import yaml
    from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

    from tests.helpers.sft_data import MISTRAL_CONV as CONV
    from tests.helpers.sft_data import tekken_model, write_jsonl

    model = tekken_model(tmp_path / "Ministral-tiny")
    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig.from_pretrained(model)).save_pretrained(model)
    rows = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CONV}] * 8)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "base_model": str(model), "tokenizer_use_mistral_common": True, "sequence_len": 64, "micro_batch_size": 2,
        "max_steps": 2, "learning_rate": 1e-3, "output_dir": "./out", "save_strategy": "no",
        "datasets": [{"path": str(rows), "type": "chat_template"}], "dataset_prepared_path": "prepared"}))
    p = _nd("train", "--config", "run.yaml", "--set", "model.cache_dir=cache", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step 2/2" in p.stdout and "Traceback" not in p.stdout + p.stderr
    from mistral_common.protocol.instruct.validator import ValidationMode
    from transformers.tokenization_mistral_common import MistralCommonBackend

    out = tmp_path / "out"
    tok = MistralCommonBackend.from_pretrained(str(out), mode=ValidationMode.finetuning)
    ids = torch.tensor([tok.apply_chat_template(CONV, tokenize=True, return_dict=False)])
    assert AutoModelForCausalLM.from_pretrained(out)(ids).logits.isfinite().all()


def test_weights_refusals_are_one_line_before_any_process(model_dir, tmp_path):
    import yaml

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((Path(model_dir) / "config.json").read_text())
    for raw, env, needle in (
            ({"model": {"path": str(bare), "init": "pretrained"}, "data": {"synthetic": True}}, {},
             "model.init='pretrained': "),
            ({"base_model": "no-such-org/no-such-model", "max_steps": 1, "learning_rate": 1e-5},
             {"HF_HOME": str(tmp_path / "hf")},
             "base_model)='no-such-org/no-such-model': not a local directory, and not in the local Hugging Face cache"),
    ):
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
        p = _nd("train", "--config", "run.yaml", "--nproc", "1", cwd=tmp_path, env=env)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and needle in lines[0] and "Fix:" in lines[0], p.stderr[-2000:]


UNFROZEN = ["model.layers.1.", "^model.embed_tokens.weight$[:256]", "^lm_head.weight$"]
FREEZE_LAYOUTS = {"tp 2 (flat AdamW)": ((1, 1, 2), 4, 1, {}), "dp_shard 2 (ZeRO-3)": ((2, 1, 1), 2, 1, {}),
                  "dp_shard 2 (ZeRO-2)": ((2, 1, 1), 2, 1, {"deepspeed.zero_stage": 2})}


def _freeze_worker(rank, world, model_dir, root):
    from adapter.models.resolved import resolve_run
    from adapter.train.engine import init_distributed
    from adapter.train.trainer import Trainer

    init_distributed()
    _use_data(MaskedData(TRAINED, SEQ, VOCAB), None)
    out = {}
    for name, (shape, mb, ga, over) in FREEZE_LAYOUTS.items():
        lines: list[str] = []
        t = Trainer(resolve_run(sft_config(model_dir, root, shape, mb, ga,
                                           **{"model.unfrozen_parameters": UNFROZEN, **over})), log=lines.append)
        try:
            t.setup()
            r = t.fit(export=False)
            module, opt = t.engine.ds.module, t.engine.ds.optimizer
            groups = getattr(opt, "bit16_groups", None) or getattr(opt, "fp16_groups", None) or \
                [f.params for f in opt.flats]
            optimized = {id(p) for g in groups for p in g}
            frozen = sorted(n for n, p in module.named_parameters() if not p.requires_grad)
            leaked = [n for n, p in module.named_parameters() if not p.requires_grad and id(p) in optimized]
        finally:
            t.close()
        out[name] = {"losses": r.losses, "grad_norms": r.grad_norms, "frozen": frozen, "leaked": leaked,
                     "said": [ln for ln in lines if ln.startswith("model.unfrozen_parameters")]}
    return out


def test_unfrozen_parameters_train_as_axolotl_does_on_every_optimizer_path(model_dir, tmp_path):
    """Axolotl's unfrozen_parameters (a whole layer, the first 256 embedding rows, the LM head; the rest frozen):
    the same losses and gradient norms as transformers with Axolotl's freezing on the same batches, at tp 2 (the
    flat AdamW, vocabulary rows split over TP), ZeRO-3 and ZeRO-2; frozen tensors never reach the optimizer."""
    train = MaskedData(TRAINED, SEQ, VOCAB)
    ref = hf_reference(model_dir, train, STEPS, lr=LR, unfrozen=UNFROZEN)
    full = hf_reference(model_dir, train, STEPS, lr=LR)
    assert rel(ref["losses"][2], full["losses"][2]) > 1e-3  # freezing changes the curve: the test can fail
    results = run_workers(_freeze_worker, 2, str(model_dir), str(tmp_path), timeout=900)
    for name, got in results[0].items():
        for a, b in zip(got["losses"], ref["losses"]):
            assert rel(a, b) < 1e-5 if b else a == 0.0, (name, got["losses"], ref["losses"])
        for a, b in zip(got["grad_norms"], ref["grad_norms"]):
            assert rel(a, b) < 1e-4 if b else a == 0.0, (name, got["grad_norms"], ref["grad_norms"])
        assert got["frozen"] == ["decoder.final_layernorm.weight"] + [
            f"decoder.layers.0.{n}" for n in ("input_layernorm.weight", "mlp.linear_fc1.weight",
                                              "mlp.linear_fc2.weight", "pre_mlp_layernorm.weight",
                                              "self_attention.linear_proj.weight",
                                              "self_attention.linear_qkv.weight")], (name, got["frozen"])
        assert got["leaked"] == [], (name, got["leaked"])
        assert len(got["said"]) == 1 and "the rest frozen: no gradients, no optimizer states" in got["said"][0]


class PadInside(MaskedData):
    """MaskedData with the pad token fed as input inside every sample (where later tokens see it): the case where
    HF's padding_idx keeps the pad row of the embedding and a plain Megatron embedding would train it."""

    def __init__(self, *a, pad: int, **k):
        super().__init__(*a, **k)
        self.pad = pad

    def __getitem__(self, i):
        item = super().__getitem__(i)
        item["tokens"] = item["tokens"].copy()
        item["tokens"][1::6] = self.pad
        return item


def _phi3_worker(rank, world, model_dir, root, pad):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    init_distributed()
    _use_data(PadInside(TRAINED, SEQ, VOCAB, pad=pad), None)
    lines: list[str] = []
    out = {name: run(sft_config(model_dir, f"{root}/{i}", shape, mb, 1), log=lines.append).losses
           for i, (name, shape, mb) in enumerate((("tp 2", (1, 1, 2), 4), ("dp_shard 2", (2, 1, 1), 2)))}
    return out, [ln for ln in lines if ln.startswith("embedding:")]


def test_phi3_matches_transformers_with_its_pad_row_held(tmp_path):
    """A Phi-3 (q, k, v and gate, up packed in one HF tensor each; its pad token is its EOS) trains as
    transformers trains it, at tp=2 and dp_shard=2, with the pad token inside the samples."""
    import json

    from adapter.demo.build import train_tokenizer
    from tests.helpers.sft import make_phi3

    tok = train_tokenizer(out_dir=tmp_path / "tokenizer", vocab_size=VOCAB)
    model_dir = make_phi3(tmp_path / "phi3", tok)
    pad = json.loads((model_dir / "config.json").read_text())["pad_token_id"]
    train = PadInside(TRAINED, SEQ, VOCAB, pad=pad)
    ref = hf_reference(model_dir, train, STEPS, lr=LR)["losses"]
    got, said = run_workers(_phi3_worker, 2, str(model_dir), str(tmp_path), pad, timeout=600)[0]
    assert len(said) == 2 and f"row {pad} (the pad token" in said[0], said  # said in each run's first lines
    for name, losses in got.items():
        assert len(losses) == 3 and all(rel(a, b) <= 1e-4 for a, b in zip(losses, ref)), (name, losses, ref)


# Axolotl's qat settings -> (weight, activation) fake-quantise configs as its _make_qat_config builds them, written
# out here from its code (utils/quantization.py, Axolotl 067b021)
QAT = {"int4/int8 from step 2": {"weight_dtype": "int4", "activation_dtype": "int8", "group_size": 32,
                                 "fake_quant_after_n_steps": 1},
       "mxfp4": {"weight_dtype": "mxfp4", "activation_dtype": "mxfp4", "group_size": 32},
       "fp8/fp8 + embeddings": {"weight_dtype": "fp8", "activation_dtype": "fp8", "quantize_embedding": True}}


def _axolotl_qat(model, q: dict) -> None:
    import torch
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig
    from torchao.quantization.qat.fake_quantize_config import (
        Float8FakeQuantizeConfig,
        Int4WeightFakeQuantizeConfig,
        IntxFakeQuantizeConfig,
    )

    if q["weight_dtype"] == "mxfp4":
        from torchao.prototype.qat import MXFakeQuantizeConfig

        mx = MXFakeQuantizeConfig(dtype=torch.float4_e2m1fn_x2, block_size=32)
        quantize_(model, QATConfig(activation_config=mx, weight_config=mx))
        return
    if q["weight_dtype"] == "int4":
        weight = Int4WeightFakeQuantizeConfig(group_size=q["group_size"], activation_dtype=torch.bfloat16)
        act = IntxFakeQuantizeConfig(dtype=torch.int8, granularity="per_token", is_symmetric=False)
    else:
        weight = act = Float8FakeQuantizeConfig(dtype=torch.float8_e4m3fn)
    quantize_(model, QATConfig(weight_config=weight, activation_config=act))
    if q.get("quantize_embedding"):
        quantize_(model, QATConfig(weight_config=Float8FakeQuantizeConfig(dtype=torch.float8_e4m3fn)),
                  filter_fn=lambda m, _: isinstance(m, torch.nn.Embedding))


def _axolotl_qat_callback(q: dict):
    """Axolotl's QATCallback.on_step_begin: off at global step 0, on at fake_quant_after_n_steps."""
    def before(model, done: int) -> None:
        from torchao.quantization.qat.linear import FakeQuantizedLinear

        n = q.get("fake_quant_after_n_steps")
        if n is None or done not in (0, n):
            return
        for m in model.modules():
            if isinstance(m, FakeQuantizedLinear):
                m.weight_fake_quantizer.enabled = m.activation_fake_quantizer.enabled = done == n
    return before


def _qat_worker(rank, world, model_dir, root):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    init_distributed()
    _use_data(MaskedData(TRAINED, SEQ, VOCAB), None)
    out = {}
    for name, q in QAT.items():
        over = {"model.engine": "transformers", **{f"qat.{k}": v for k, v in q.items()}}
        r = run(sft_config(model_dir, f"{root}/{name.split()[0]}", (2, 1, 1), 2, 1, **over), log=lambda s: None)
        out[name] = r.losses
    q = QAT["int4/int8 from step 2"]  # saved after step 1 (fake quantisation still off), resumed to step 3 (on)
    over = {"model.engine": "transformers", "checkpoint.dir": f"{root}/ck", **{f"qat.{k}": v for k, v in q.items()}}
    run(sft_config(model_dir, f"{root}/cut", (2, 1, 1), 2, 1, steps=1, **over), log=lambda s: None)
    r = run(sft_config(model_dir, f"{root}/cut", (2, 1, 1), 2, 1, **over), resume=True, log=lambda s: None)
    out["resumed"] = (r.start_step, r.losses)
    return out


def test_qat_trains_as_axolotl_prepares_it(model_dir, tmp_path):
    """Axolotl's qat: (int4 weights in groups of 32 with int8 activations, switched on after the first step; MXFP4;
    fp8 weights and activations with the embeddings fake-quantised too) on the transformers engine at dp_shard 2
    under ZeRO-3: the losses of transformers' model fake-quantised by torchao as Axolotl's code does it, trained on
    the same batches, with Axolotl's callback switching it; a run saved after step 1 resumes on the same curve."""
    train = MaskedData(TRAINED, SEQ, VOCAB)
    plain = hf_reference(model_dir, train, STEPS, lr=LR)["losses"]
    got = run_workers(_qat_worker, 2, str(model_dir), str(tmp_path), timeout=900)[0]
    start, resumed = got.pop("resumed")  # a run saved before its fake quantisation starts resumes on the curve
    assert start == 1 and len(resumed) == 2 and all(rel(a, b) < 1e-6 for a, b in zip(resumed, got[
        "int4/int8 from step 2"][1:])), (resumed, got["int4/int8 from step 2"])
    for name, q in QAT.items():
        want = hf_reference(model_dir, train, STEPS, lr=LR, prepare=lambda m, q=q: _axolotl_qat(m, q),
                            before_step=_axolotl_qat_callback(q))["losses"]
        assert rel(want[2], plain[2]) > 1e-4, (name, want, plain)  # fake quantisation moved the curve
        for a, b in zip(got[name], want, strict=True):
            assert rel(a, b) < 1e-5 if b else a == 0.0, (name, got[name], want)
    assert got["int4/int8 from step 2"][0] == pytest.approx(plain[0], rel=1e-5)  # step 1 without it
