"""`python -m adapter.demo`: the whole CPU path (build, plan, convert, train, resume, export, generate) in its
--quick sizes, plus the guards around it (shipped config in sync, foreign output dirs left alone)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapter import config
from adapter.demo import run as demo_run
from tests.helpers.cli import said
from tests.helpers.why import say_at_the_end

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "configs" / "demo-llama-tiny.yaml"


# --- fast -------------------------------------------------------------------------------------------------------

def test_shipped_config_is_what_the_demo_writes():
    assert SHIPPED.read_text() == demo_run.render_config(demo_run.Settings(), prefix="demo-out/"), (
        "regenerate it: python -m adapter.demo --print-config > configs/demo-llama-tiny.yaml")
    finetune = SHIPPED.with_name("demo-finetune-axolotl.yaml")
    assert finetune.read_text() == demo_run.render_finetune(demo_run.Settings(), prefix="demo-out/"), (
        "regenerate configs/demo-finetune-axolotl.yaml from adapter.demo.run.render_finetune")
    lora = SHIPPED.with_name("demo-lora-axolotl.yaml")
    assert lora.read_text() == demo_run.render_lora(demo_run.Settings(), prefix="demo-out/"), (
        "regenerate configs/demo-lora-axolotl.yaml from adapter.demo.run.render_lora")
    lo = config.build(config.read_yaml(lora), env={})
    assert lo.source == "axolotl" and lo.lora.target_linear and (lo.lora.r, lo.world_size) == (16, 4)
    ft = config.build(config.read_yaml(finetune), env={})  # Axolotl's keys only, and what the demo promises
    assert ft.source == "axolotl" and (ft.world_size, ft.precision, ft.data.sample_packing) == (4, "fp32", True)
    cfg = config.load(SHIPPED, env={})  # schema-valid, and the layout is what the demo promises
    assert (cfg.world_size, cfg.parallelism.tp_size, cfg.parallelism.dp_shard_size, cfg.precision) == (4, 2, 2, "fp32")
    assert cfg.model.path == "demo-out/model" and cfg.checkpoint.export_hf == "demo-out/hf-export"


def test_refuses_an_output_dir_it_did_not_write(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("keep me")
    assert demo_run.main(["--out", str(tmp_path)]) == 2
    assert (tmp_path / "precious.txt").read_text() == "keep me"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out=" in err[0] and "Fix:" in err[0]


def test_rerun_starts_from_a_clean_output_dir(tmp_path):
    out = tmp_path / "demo-out"
    (out / "checkpoints").mkdir(parents=True)
    (out / demo_run.MARKER).write_text("")
    (out / "checkpoints" / "latest").write_text("global_step99")  # stale: would be resumed or skipped
    demo_run._prepare_out(out)
    assert sorted(p.name for p in out.iterdir()) == [demo_run.MARKER]


def test_subprocesses_import_this_copy_and_nothing_shadowed_by_its_subpackages():
    """PYTHONPATH gets the folder that holds the package: the package's own folder there made its subpackage
    `kernels` shadow the `kernels` transformers 5.25 installs and imports (every demo rank failed on it)."""
    path = demo_run._env()["PYTHONPATH"].split(os.pathsep)
    assert Path(path[0]) == ROOT and (ROOT / "adapter" / "__init__.py").is_file()


def test_a_failing_cli_stage_raises_with_the_log_tail(tmp_path):
    with pytest.raises(demo_run.DemoFailure, match=r"status 2(.|\n)*--config='nope.yaml'"):
        demo_run.nd_adapter(["train", "--config", "nope.yaml"], tmp_path, tmp_path / "logs/x.log")


# --- the demo, once ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quick(tmp_path_factory, request):
    """The quick demo, once. If it fails, why (the demo's FAILED line with the stage's log tail) goes to the end of
    the run's output (tests/conftest.py), where a CI log clipped in the middle still shows it."""
    out = tmp_path_factory.mktemp("demo") / "demo-out"
    err = io.StringIO()
    with contextlib.redirect_stderr(_Tee(sys.stderr, err)):
        code = demo_run.main(["--out", str(out), "--quick"])
    summary = json.loads((out / "demo-summary.json").read_text()) if code == 0 else {}
    if code != 0:
        say_at_the_end(request.config, f"the quick demo (status {code}):\n{err.getvalue()}")
    return code, out, summary


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)


@pytest.mark.slow
def test_quick_demo_trains_resumes_and_exports(quick):
    code, out, s = quick
    assert code == 0
    q = demo_run.QUICK
    assert len(s["losses"]) == q.total_steps and s["first_loss"] - s["last_loss"] >= q.min_drop, s["losses"]
    # the second `train --resume` started right after the first run's last checkpoint
    assert s["resumed_from"] == q.first_steps
    resumed = demo_run.step_losses((out / "logs/train-2.log").read_text().splitlines())
    assert min(resumed) == q.first_steps + 1 and max(resumed) == q.total_steps
    assert (out / "checkpoints/latest").read_text() == f"global_step{q.total_steps}"
    assert s["export_loss"] < s["initial_loss"] - q.min_drop / 2
    # the LoRA leg: held-out loss fell with the base frozen; PEFT loaded the adapter; merge-lora matched it
    assert s["lora_eval_losses"][-1][1] < s["lora_eval_losses"][0][1] and s["lora_answer"], s
    assert (out / "lora-out/adapter_config.json").is_file() and (out / "lora-out/merged/config.json").is_file()


@pytest.mark.slow
def test_quick_demo_export_loads_in_transformers(quick):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    code, out, _ = quick
    assert code == 0
    tok = AutoTokenizer.from_pretrained(str(out / "hf-export"))
    model = AutoModelForCausalLM.from_pretrained(str(out / "hf-export"))
    ids = tok(demo_run.PROMPT, return_tensors="pt")
    gen = model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.eos_token_id)
    assert gen.shape[1] == ids["input_ids"].shape[1] + 4
    assert tok.decode(gen[0], skip_special_tokens=True).startswith(demo_run.PROMPT)
    trained = dict(model.named_parameters())["model.layers.0.mlp.down_proj.weight"]
    start = AutoModelForCausalLM.from_pretrained(str(out / "model"))
    assert not torch.equal(trained, dict(start.named_parameters())["model.layers.0.mlp.down_proj.weight"])


@pytest.mark.slow
def test_resume_that_cannot_move_is_refused_and_touches_nothing(quick):
    """A resume at another layout with 8-bit moments (quantised in blocks of the saved partitions; everything
    else reshards): refused in one line, status 2, before any process starts (the checkpoint's own record names
    its layout), and nothing touched."""
    code, out, _ = quick
    assert code == 0
    text = (out / demo_run.CONFIG_NAME).read_text()
    text = text.replace("dp_shard_size: 2", "dp_shard_size: 1").replace("gpus_per_node: 4", "gpus_per_node: 2")
    (out / "relayout.yaml").write_text(text)
    before = {p: p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "adapter", "train", "--config", "relayout.yaml", "--resume",
                        "--set", "optimizer.name=adamw_8bit"], cwd=out, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = said(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("nd-adapter: error: checkpoint.dir='checkpoints': cannot resume "
                                                   "global_step"), r.stderr[-3000:]
    assert "8-bit optimizer moments" in lines[0] and "Fix:" in lines[0]
    assert "Traceback" not in r.stdout + r.stderr
    assert {p: p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")} == before
