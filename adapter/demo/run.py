"""The whole nd-adapter path on CPU, as a user would type it: build a tiny Llama -> plan -> convert -> train (tp=2 ×
ZeRO-3 dp=2, four gloo processes) -> resume -> export to HF -> load and generate with transformers -> fine-tune
that model on a chat dataset from an Axolotl-style YAML (its weights converted once into a cache; a held-out eval
loss) -> answer a question through the exported model's chat template -> train LoRA adapters on the same set from
an Axolotl LoRA YAML, load them with PEFT and answer, merge them with `nd-adapter merge-lora`.

Every stage that has a CLI runs it as a subprocess (`python -m adapter ...`, i.e. `nd-adapter ...`) from inside the
output directory, so the config's relative paths are the ones a user would write and a fresh clone needs nothing but
`pip install -e .`. Exit status 0 only when every stage did what it should (loss fell, resume continued, the export
loads and generates); 1 when a stage failed; 2 for bad arguments. Run: `python -m adapter.demo [--out demo-out]`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

import adapter
from adapter.demo.build import ASSETS, build_demo, chapters
from adapter.demo.configs import QUICK, Settings, render_config, render_finetune, render_lora
from adapter.errors import EXIT_USAGE, UserError, bad

MARKER = ".nd-adapter-demo"  # only a directory holding it is ever wiped by a rerun
CONFIG_NAME = "demo.yaml"
PROMPT = "In the beginning"
STEP_LINE = re.compile(r"^step (\d+)/(\d+) \| loss ([0-9.]+)")
FINETUNE_NAME = "finetune.yaml"
LORA_NAME = "lora.yaml"
QUESTION = "Who created the heaven and the earth?"
EVAL_LINE = re.compile(r"^eval after step (\d+) \| eval_loss ([0-9.]+)")


class DemoFailure(Exception):
    """A stage ran but did not do what it should: exit status 1 with the reason."""


# --- running the CLI --------------------------------------------------------------------------------------------

def _env() -> dict[str, str]:
    """The directory that holds the package on PYTHONPATH, so the subprocesses import this very copy (installed or
    not; the package's own folder there would shadow installed packages by its subpackages' names: `kernels`,
    which transformers imports when installed); no GPUs, so a machine that has some still runs the CPU demo (4
    ranks, gloo) rather than 4 ranks on its GPUs."""
    root = str(Path(adapter.__file__).resolve().parents[1])
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("COLUMNS", str(shutil.get_terminal_size((120, 40)).columns))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def stage_lora(out: Path, s: Settings) -> dict:
    """Train LoRA adapters on the frozen export through `nd-adapter train` (the held-out loss must fall), load them
    with PEFT on the base and ask the question; `nd-adapter merge-lora` must give the same logits."""
    from peft import PeftModel  # the reference and export format for adapters

    (out / LORA_NAME).write_text(render_lora(s))
    lines = nd_adapter(["train", "--config", LORA_NAME], out, out / "logs/lora.log",
                       lambda x: not _noise(x) and not STEP_LINE.match(x) or x.startswith("step 1/"))
    evals = [(int(m.group(1)), float(m.group(2))) for m in map(EVAL_LINE.match, lines) if m]
    if len(evals) < 2 or not evals[-1][1] < evals[0][1]:
        raise DemoFailure(f"the held-out loss did not fall over the LoRA run: {evals}")
    print(f"  held-out loss {evals[0][1]:.3f} before -> {evals[-1][1]:.3f} after {evals[-1][0]} steps (adapters only)")
    tok = AutoTokenizer.from_pretrained(str(out / "lora-out"))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(out / "hf-export")),
                                      str(out / "lora-out")).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=48, do_sample=False, pad_token_id=tok.eos_token_id)
        logits = model(**ids).logits
    answer = tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    print(f"  PEFT, base + lora-out: {QUESTION!r} -> {answer!r}")
    nd_adapter(["merge-lora", "--config", LORA_NAME], out, out / "logs/merge.log")
    merged = AutoModelForCausalLM.from_pretrained(str(out / "lora-out" / "merged")).eval()
    with torch.no_grad():
        gap = (merged(**ids).logits - logits).abs().max().item()
    print(f"  merged model (lora-out/merged) against PEFT: max |Δ logit| {gap:.1e}")
    if not answer or gap > 1e-4:
        raise DemoFailure(f"the adapter answered {answer!r}; merged vs PEFT logits differ by {gap}")
    return {"lora_eval_losses": evals, "lora_answer": answer}


def stage_finetune(out: Path, s: Settings) -> dict:
    """Fine-tune the exported model on the chat set through `nd-adapter train`; its held-out loss must fall, and
    the exported model must answer through its chat template."""
    shutil.copyfile(ASSETS / "chat_genesis.jsonl", out / "data" / "chat_genesis.jsonl")
    (out / FINETUNE_NAME).write_text(render_finetune(s))
    lines = nd_adapter(["train", "--config", FINETUNE_NAME], out, out / "logs/finetune.log",
                       lambda x: not _noise(x) and not STEP_LINE.match(x) or x.startswith("step 1/"))
    evals = [(int(m.group(1)), float(m.group(2))) for m in map(EVAL_LINE.match, lines) if m]
    if len(evals) < 2 or not evals[-1][1] < evals[0][1]:
        raise DemoFailure(f"the held-out loss did not fall over the fine-tuning run: {evals}")
    print(f"  held-out loss {evals[0][1]:.3f} before fine-tuning -> {evals[-1][1]:.3f} after {evals[-1][0]} steps")
    model_dir = out / "finetuned"
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=48, do_sample=False, pad_token_id=tok.eos_token_id)
    answer = tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    print(f"  {QUESTION!r} -> {answer!r}")
    if not answer:
        raise DemoFailure("the fine-tuned model answered nothing through its chat template")
    return {"finetune_eval_losses": evals, "answer": answer}


def nd_adapter(args: list[str], cwd: Path, log: Path, show: Callable[[str], bool] = lambda line: True) -> list[str]:
    """Run `nd-adapter ARGS` in `cwd`; the whole output goes to `log`, lines `show` accepts to the terminal."""
    print(f"  ({cwd.name})$ nd-adapter {' '.join(args)}", flush=True)
    lines: list[str] = []
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "adapter", *args], cwd=cwd, env=_env(), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            line = line.rstrip("\n").split("\r")[-1]
            lines.append(line)
            if show(line):
                print(f"    {line}", flush=True)
        rc = proc.wait()
    if rc != 0:
        tail = "\n".join(f"    | {x}" for x in lines[-15:])
        raise DemoFailure(f"`nd-adapter {' '.join(args)}` exited with status {rc} (full log: {log}):\n{tail}")
    return lines


def _noise(line: str) -> bool:
    """DeepSpeed's per-rank op-build chatter and progress bars: kept in the log, not on the terminal."""
    return "built successfully" in line or line.startswith(("tokenising", "Writing", "Loading")) or not line.strip()


def step_losses(lines: Sequence[str]) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(3)) for m in map(STEP_LINE.match, lines) if m}


def _train_filter(first: int, last: int, every: int) -> Callable[[str], bool]:
    def show(line: str) -> bool:
        m = STEP_LINE.match(line)
        if m:
            step = int(m.group(1))
            return step in (first, last) or step % every == 0
        return not _noise(line)
    return show


# --- stages -----------------------------------------------------------------------------------------------------

def _prepare_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not (out / MARKER).is_file():
            raise bad("--out", str(out), "exists, is not empty and is not a demo output directory",
                      "choose another directory or remove it")
        shutil.rmtree(out)  # our own previous run: start clean, so `train` cannot find stale checkpoints
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by python -m adapter.demo; a rerun deletes this directory\n")


def stage_build(out: Path, s: Settings) -> dict:
    paths = build_demo(out, vocab_size=s.vocab, hidden=s.hidden, layers=s.layers, heads=s.heads,
                       kv_heads=s.kv_heads, ffn=s.ffn, max_positions=s.max_positions, seed=0)
    cfg = json.loads((paths["model"] / "config.json").read_text())
    n_docs = sum(1 for _ in open(paths["data"]))
    print(f"  model/  LlamaForCausalLM hidden {cfg['hidden_size']}, layers {cfg['num_hidden_layers']}, heads "
          f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']} kv, ffn {cfg['intermediate_size']}, vocab "
          f"{cfg['vocab_size']}, random weights (seed 0)")
    print("  tokenizer/  byte-level BPE trained on adapter/demo/data/genesis_kjv.txt")
    print(f"  data/genesis.jsonl  {n_docs} documents (one per chapter)")
    return {k: str(v.relative_to(out)) for k, v in paths.items()}


def stage_train(out: Path, s: Settings) -> dict:
    every = max(1, s.total_steps // 10)
    a = nd_adapter(["train", "--config", CONFIG_NAME, "--max-steps", str(s.first_steps)], out, out / "logs/train-1.log",
                   _train_filter(1, s.first_steps, every))
    first = step_losses(a)
    if sorted(first) != list(range(1, s.first_steps + 1)):
        raise DemoFailure(f"first run logged steps {sorted(first)}, expected 1..{s.first_steps}")
    latest = (out / "checkpoints" / "latest").read_text().strip()
    if latest != f"global_step{s.first_steps}":
        raise DemoFailure(f"checkpoints/latest is {latest!r} after the first run, expected global_step{s.first_steps}")
    print(f"  saved checkpoints/{latest}; now resume from it")
    b = nd_adapter(["train", "--config", CONFIG_NAME, "--resume", "--max-steps", str(s.total_steps)], out,
                   out / "logs/train-2.log", _train_filter(s.first_steps + 1, s.total_steps, every))
    second = step_losses(b)
    if sorted(second) != list(range(s.first_steps + 1, s.total_steps + 1)):
        raise DemoFailure(f"resumed run logged steps {sorted(second)[:3]}..., expected {s.first_steps + 1}.."
                          f"{s.total_steps}: it did not continue from the checkpoint")
    losses = {**first, **second}
    tail = [losses[i] for i in range(max(1, s.total_steps - 4), s.total_steps + 1)]
    start, end = losses[1], sum(tail) / len(tail)
    print(f"  loss {start:.3f} at step 1 -> {end:.3f} (mean of the last {len(tail)} steps)")
    if not start - end >= s.min_drop:
        raise DemoFailure(f"the loss fell by only {start - end:.3f} (from {start:.3f} to {end:.3f}), "
                          f"expected at least {s.min_drop}")
    return {"first_loss": start, "last_loss": end, "losses": [losses[i] for i in sorted(losses)],
            "resumed_from": s.first_steps, "checkpoint": (out / "checkpoints" / "latest").read_text().strip()}


def _eval_loss(model, ids, seq_len: int) -> float:
    n = (ids.numel() // seq_len) * seq_len
    batch = ids[:n].view(-1, seq_len)
    with torch.no_grad():
        return float(model(input_ids=batch, labels=batch).loss)


def stage_export(out: Path, s: Settings) -> dict:
    """Load what training exported with plain transformers; it must beat the random start and generate."""
    export = out / "hf-export"
    tok = AutoTokenizer.from_pretrained(str(export))
    model = AutoModelForCausalLM.from_pretrained(str(export)).eval()  # fp32 on disk, as trained
    initial = AutoModelForCausalLM.from_pretrained(str(out / "model")).eval()
    ids = torch.tensor(tok(chapters()[0])["input_ids"][: 4 * s.seq_len])
    trained_loss, initial_loss = _eval_loss(model, ids, s.seq_len), _eval_loss(initial, ids, s.seq_len)
    print(f"  hf-export/ loads as {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} params)")
    print(f"  loss on Genesis 1: {trained_loss:.3f} exported vs {initial_loss:.3f} for the random start")
    if not trained_loss < initial_loss - s.min_drop / 2:
        raise DemoFailure(f"the exported model ({trained_loss:.3f}) is not clearly better than the random one "
                          f"({initial_loss:.3f}): were the trained weights exported?")
    inputs = tok(PROMPT, return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**inputs, max_new_tokens=s.new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
    new = gen[0, inputs["input_ids"].shape[1]:]
    text = tok.decode(gen[0], skip_special_tokens=True)
    print(f"  greedy, {s.new_tokens} new tokens: {text!r}")
    if new.numel() == 0:
        raise DemoFailure("generate() returned no new tokens")
    return {"export_loss": trained_loss, "initial_loss": initial_loss, "generated": text,
            "new_tokens": int(new.numel())}


# --- driver -----------------------------------------------------------------------------------------------------

def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    class Parser(argparse.ArgumentParser):
        def error(self, message: str):
            raise UserError(f"demo: {message}. Fix: see `python -m adapter.demo --help`")

    ap = Parser(prog="python -m adapter.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="demo-out", help="output directory (default demo-out; a rerun replaces it)")
    ap.add_argument("--quick", action="store_true", help="smaller model and fewer steps (tests)")
    ap.add_argument("--first-steps", type=int, help="steps of the first `train` (before --resume)")
    ap.add_argument("--total-steps", type=int, help="step the resumed `train` ends at")
    ap.add_argument("--print-config", action="store_true",
                    help="print the config with repo-root paths (configs/demo-llama-tiny.yaml) and exit")
    return ap.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    s = QUICK if args.quick else Settings()
    s = replace(s, first_steps=s.first_steps if args.first_steps is None else args.first_steps,
                total_steps=s.total_steps if args.total_steps is None else args.total_steps)
    if not 1 <= s.first_steps < s.total_steps:
        raise bad("--first-steps", s.first_steps, f"must be at least 1 and below --total-steps={s.total_steps}",
                  "resume needs steps left to run")
    return s


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse(argv)
        s = settings_from(args)
        if args.print_config:
            print(render_config(s, prefix=f"{Path(args.out).as_posix().rstrip('/')}/"), end="")
            return 0
        out = Path(args.out).absolute()
        _prepare_out(out)
        os.environ["ND_ADAPTER_CACHE"] = str(out / "cache")  # converted weights stay in the demo's directory
    except UserError as e:
        print(f"nd-adapter demo: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    summary: dict = {"settings": asdict(s), "stages": {}}
    hf_logging.disable_progress_bar()  # this process's load/save bars; the subprocesses' output is filtered
    stages: list[tuple[str, Callable[[], object]]] = [
        ("1. build a tiny Llama HF checkpoint", lambda: stage_build(out, s)),
        ("2. write the run config", lambda: _write_config(out, s)),
        ("3. plan", lambda: nd_adapter(["plan", CONFIG_NAME], out, out / "logs/plan.log", lambda x: True)),
        ("4. convert HF -> Megatron (tp 2)" + (" and verify" if s.verify else ""), lambda: _convert(out, s.verify)),
        ("5. train, then resume", lambda: stage_train(out, s)),
        ("6. load the exported HF checkpoint and generate", lambda: stage_export(out, s)),
        ("7. fine-tune it on a chat set (Axolotl YAML), then ask it a question", lambda: stage_finetune(out, s)),
        ("8. train LoRA adapters on it (Axolotl LoRA YAML), load them with PEFT, merge", lambda: stage_lora(out, s)),
    ]
    t_all = time.perf_counter()
    for title, fn in stages:
        print(f"\n== {title} ==", flush=True)
        t0 = time.perf_counter()
        try:
            result = fn()
        except (DemoFailure, UserError) as e:
            print(f"\nFAILED at stage {title!r}: {e}", file=sys.stderr, flush=True)
            return 1
        dt = time.perf_counter() - t0
        summary["stages"][title] = round(dt, 1)
        if isinstance(result, dict):
            summary.update(result)
        print(f"  [ok, {dt:.1f} s]", flush=True)
    summary["total_s"] = round(time.perf_counter() - t_all, 1)
    (out / "demo-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n== done in {summary['total_s']:.0f} s: loss {summary['first_loss']:.2f} -> {summary['last_loss']:.2f}, "
          f"resumed at step {summary['resumed_from']}, exported to {out.name}/hf-export ==")
    print(f"  generated: {summary['generated']!r}")
    print(f"  fine-tuned, asked {QUESTION!r}: {summary['answer']!r}")
    print(f"  LoRA adapter (PEFT), asked the same: {summary['lora_answer']!r}")
    return 0


def _write_config(out: Path, s: Settings) -> None:
    text = render_config(s)
    (out / CONFIG_NAME).write_text(text)
    print(f"  {out.name}/{CONFIG_NAME} (the same as configs/demo-llama-tiny.yaml, with paths relative to {out.name}/):")
    for line in text.splitlines()[2:]:
        print(f"    {line}")


def _convert(out: Path, verify: bool) -> None:
    nd_adapter(["convert", "hf-to-megatron", "--hf", "model", "--out", "megatron", "--tp", "2", "--no-progress"], out,
               out / "logs/convert.log", lambda x: not _noise(x))
    if not verify:
        return
    lines = nd_adapter(["convert", "verify", "--hf", "model", "--megatron", "megatron"], out, out / "logs/verify.log",
                       lambda x: not _noise(x))
    if "OK" not in lines:
        raise DemoFailure("convert verify did not report OK")


if __name__ == "__main__":
    raise SystemExit(main())
