"""DPO on one GPU: nd-adapter (an Axolotl `rl: dpo` YAML run by `deepspeed --num_gpus 1 launch/train.py`) against
TRL's DPOTrainer (as Axolotl runs it; `trl-liger`: with `use_liger_kernel`, Liger's fused linear DPO loss), in one
invocation, each row a subprocess with a timeout; logs, YAML and results under --out.

Modes: `lora` (the Llama-3.1-8B shape, random weights, LoRA r 16 / alpha 32 / dropout 0 on q,k,v,o,gate,up,down,
reference = the base with the adapters disabled), `qlora` (the same on an NF4 base: nd-adapter quantises its random
base on the GPU; TRL loads random bf16 weights saved once to the temp dir through BitsAndBytesConfig, NF4, double
quantisation, bf16 compute), `full` (every weight of the Llama-3.2-1B shape; TRL's reference a frozen copy of the
model, nd-adapter's the starting weights' log-probabilities computed once before step 1; `trl-pre`: TRL with
`precompute_ref_log_probs`, the same reference as nd-adapter's). Sigmoid loss, beta 0.1, one pair a step (micro-batch
1, no accumulation), bf16 weights (Axolotl's `bf16: true` on one GPU), AdamW (TRL: torch's fused; nd-adapter: what
`optimizer: adamw_torch_fused` maps to), lr 5e-6, no gradient checkpointing, no torch_compile key (TRL eager;
nd-adapter's default `model.compile: auto` compiles its layers in all three modes (DPO and SimPO were measured
faster compiled, docs/BENCHMARKS.md 2026-12-07): `--ours-set model.compile=true|false` to choose). Liger on the TRL
side only: nd-adapter's YAML sets no kernel keys.

Why the rows are the same work: both read the same JSONL of plain prompt / chosen / rejected strings, tokenised by
the same word-level tokenizer built here (word `wI` -> id I, no BOS; TRL and nd-adapter append the EOS to each
answer), so a pair is exactly --prompt prompt tokens and --chosen / --rejected answer tokens (EOS included) on both
sides: asserted before the runs on the tokenizer, and checked after them on what each side trained (TRL:
train_dataset[0]'s prompt_ids / chosen_ids / rejected_ids; nd-adapter: its prepared pairs; a mismatch is flagged).
nd-adapter reads them as Axolotl's `chat_template.default` type with a chat template that renders the bare text.
A step is one pair: chosen and rejected rows of prompt + answer, reference forward + policy forward and backward
(LoRA; a full fine-tune's reference is nd-adapter's table, TRL's frozen copy's forward). TRL pads the two rows to
the longer one; nd-adapter to that rounded up to a multiple of 64 (its trim): <= 63 more positions a row.

Per row: seconds per step (steady state: the wall time of the --steps steps after --warmup, TRL by a callback at each
step's start with a CUDA sync, nd-adapter by the arrival of its step lines), pair tokens / s ((P + C + R) / step),
peak GiB (torch.cuda.max_memory_allocated; TRL's reset after the warm-up, nd-adapter's `peak_mem` of its last step
line), the last step's loss. One `RESULT {json}` line per row and a table with TRL-liger's step / ours.

    python3 bench/dpo_bench.py --mode lora --out $OUT      # also: --mode qlora, --mode full; --rows ours,trl
    .venv/bin/python bench/dpo_bench.py --device cpu --mode lora --out /tmp/dpo   # tiny Llama, fp32, gloo, CPU
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = {"lora": "llama-3.1-8b", "qlora": "llama-3.1-8b", "full": "llama-3.2-1b"}
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 4096}
WORDS = 32000  # the tokenizer's vocabulary (at most the model's): ids 0-2 special, `wI` -> I for I >= 3
SPECIAL = {"<s>": 0, "</s>": 1, "<pad>": 2}
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the bare text, no generation prompt
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEP = re.compile(r"\bstep (\d+)/\d+ \| loss ([\d.]+) .*?\| ([\d,]+) tok/s/GPU")
PEAK = re.compile(r"peak_mem ([\d.]+) GiB")


def args_of(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=sorted(SHAPE), default="lora")
    ap.add_argument("--rows", default=None, help="of ours, trl, trl-liger, trl-pre (default: the first 3; cpu: 2)")
    ap.add_argument("--out", default="/tmp/dpo-bench", help="logs, YAML and results.jsonl")
    ap.add_argument("--tmp", default=None, help="where the temp model/data/weights dir goes (default: system tmp)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a tiny Llama, fp32, gloo")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 1062; cpu 20)")
    ap.add_argument("--chosen", type=int, default=None, help="chosen answer tokens, EOS included (1080; cpu 12)")
    ap.add_argument("--rejected", type=int, default=None, help="rejected answer tokens, EOS included (1075; cpu 10)")
    ap.add_argument("--seq-len", type=int, default=None, help="sequence_len (4096; cpu 64)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=32)
    ap.add_argument("--timeout", type=int, default=540, help="seconds per row")
    ap.add_argument("--ours-set", action="append", default=[], help="extra `--set key=value` for nd-adapter")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("--peer", default=None, help=argparse.SUPPRESS)  # internal: run one TRL row in this process
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    cpu = a.device == "cpu"
    a.rows = a.rows or ("ours,trl" if cpu else "ours,trl,trl-liger")  # Liger's kernels are Triton's: CUDA only
    assert a.warmup >= 1 and a.steps >= 1, "at least one warm-up and one timed step"
    for k, gpu, small in (("prompt", 1062, 20), ("chosen", 1080, 12), ("rejected", 1075, 10), ("seq_len", 4096, 64)):
        if getattr(a, k) is None:
            setattr(a, k, small if cpu else gpu)
    return a


# --- the shared inputs: model dir (config.json + tokenizer, no weights), pairs ------------------------------------

def build_inputs(a, work: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

    model = work / "model"
    model.mkdir(parents=True)
    if a.device == "cpu":
        LlamaConfig(**TINY, architectures=["LlamaForCausalLM"], tie_word_embeddings=False,
                    bos_token_id=0, eos_token_id=1, pad_token_id=2).save_pretrained(model)
    else:
        shutil.copy(REPO / "configs/models" / SHAPE[a.mode] / "config.json", model / "config.json")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    n = min(WORDS, vocab)
    tok = Tokenizer(models.WordLevel({**SPECIAL, **{f"w{i}": i for i in range(len(SPECIAL), n)}}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            chat_template=TEMPLATE).save_pretrained(model)
    tok = AutoTokenizer.from_pretrained(model)
    assert len(tok) <= vocab, (len(tok), vocab)
    import numpy as np

    rng = np.random.default_rng(0)
    words = lambda k, lead="": lead + " ".join(f"w{i}" for i in rng.integers(len(SPECIAL), n, k))
    # answers start with a space (prompt + answer must split between them) and get the EOS appended: C - 1 words
    rows = [{"prompt": words(a.prompt), "chosen": words(a.chosen - 1, " "), "rejected": words(a.rejected - 1, " ")}
            for _ in range(a.pairs)]
    for r in rows[:4]:  # TRL's (and nd-adapter's) tokenisation: prompt, then prompt + answer + EOS after the prompt's
        p = tok(r["prompt"])["input_ids"]
        c = tok(r["prompt"] + r["chosen"] + tok.eos_token)["input_ids"]
        j = tok(r["prompt"] + r["rejected"] + tok.eos_token)["input_ids"]
        assert (len(p), len(c) - len(p), len(j) - len(p)) == (a.prompt, a.chosen, a.rejected), (len(p), len(c), len(j))
        assert c[:len(p)] == p and c[-1] == tok.eos_token_id and tok.bos_token_id not in c, c[:4]
    (work / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


# --- nd-adapter -------------------------------------------------------------------------------------------------------

def ours_yaml(a, work: Path) -> str:
    import yaml

    cfg = {"base_model": str(work / "model"), "rl": "dpo", "rl_beta": 0.1,
           "datasets": [{"path": str(work / "pairs.jsonl"), "type": "chat_template.default",
                         "field_messages": "prompt", "field_chosen": "chosen", "field_rejected": "rejected"}],
           "chat_template": "jinja", "chat_template_jinja": TEMPLATE,
           "dataset_prepared_path": str(work / "prepared"), "sequence_len": a.seq_len,
           "micro_batch_size": 1, "gradient_accumulation_steps": 1, "learning_rate": 5e-6, "lr_scheduler": "constant",
           "warmup_steps": 0,
           "max_steps": a.warmup + a.steps, "optimizer": "adamw_torch_fused", "bf16": a.device == "cuda",
           "logging_steps": 1, "seed": 42}
    if a.mode != "full":
        cfg.update(adapter="lora", lora_r=16, lora_alpha=32, lora_dropout=0.0, lora_target_modules=LORA_TARGETS)
    if a.mode == "qlora":
        cfg.update(adapter="qlora", load_in_4bit=True)
    return yaml.safe_dump(cfg, sort_keys=False)


def run_logged(cmd: list[str], log: Path, timeout: int, env: dict) -> tuple[int, list[tuple[float, str]]]:
    """Run `cmd` (own process group) from the repo root; every output line timestamped on arrival and logged."""
    lines: list[tuple[float, str]] = []
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             bufsize=1, start_new_session=True)

        def read():
            for line in p.stdout:
                lines.append((time.perf_counter(), line.rstrip("\n")))
                f.write(line)
                f.flush()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            rc = p.wait()
            f.write(f"\n[dpo_bench] killed after {timeout} s\n")
        reader.join(timeout=10)
    return rc, lines


def run_ours(a, work: Path, out: Path, env: dict) -> dict:
    path = out / f"{a.mode}-ours.yaml"
    path.write_text(ours_yaml(a, work))
    sets = [x for kv in a.ours_set for x in ("--set", kv)]
    if a.device == "cpu":
        env = {**env, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", "29531"]
    else:
        ds = shutil.which("deepspeed") or shutil.which("deepspeed", path=str(Path(sys.executable).parent))
        launch = [ds] if ds else [sys.executable, "-m", "deepspeed.launcher.runner"]
        launch += ["--num_gpus", "1", "--master_port", "29531"]
    rc, lines = run_logged([*launch, "launch/train.py", "--config", str(path), *sets], out / f"{a.mode}-ours.log",
                           a.timeout, env)
    steps = [(t, int(m[1]), float(m[2]), int(m[3].replace(",", "")), PEAK.search(s))
             for t, s in lines for m in [STEP.search(s)] if m]
    res = {"row": "ours", "system": "nd-adapter " + ("QLoRA" if a.mode == "qlora" else a.mode), "rc": rc}
    npz = sorted((work / "prepared").glob("dpo*/pairs.npz"))
    if npz:  # what nd-adapter trained: prompt = the first completion position; each sequence's length
        import numpy as np

        z = np.load(npz[0])
        p = int(z["completion"][0, 0].argmax())
        res["tokens"] = {"prompt_ids": p, "chosen_ids": int(z["length"][0, 0]) - p,
                         "rejected_ids": int(z["length"][0, 1]) - p}
    last = a.warmup + a.steps
    if rc != 0 or not steps or steps[-1][1] != last:
        return {**res, "error": f"exit {rc}, {len(steps)} step lines; see {out / f'{a.mode}-ours.log'}"}
    res["said"] = [s[:140] for _, s in lines if s.startswith(("pairs:", "model.compile", "torch_compile"))][:2]
    at = {s: t for t, s, *_ in steps}
    res["step_s"] = (at[last] - at[a.warmup]) / (last - a.warmup)  # line k is said once step k + 1 is queued
    # the trainer's own clock: positions computed / tok/s (its rows trimmed to a multiple of 64)
    t = res.get("tokens")
    if t:
        said = [s for _, s in lines]
        if any(s.startswith("pairs: each pair's prompt runs once") for s in said):  # dpo.share_prompt: the
            computed = t["prompt_ids"] + t["chosen_ids"] + t["rejected_ids"] + 1  # prompt's last token runs twice
        elif any(s.startswith("pairs: padding-free") for s in said):
            computed = 2 * t["prompt_ids"] + t["chosen_ids"] + t["rejected_ids"]
        else:  # padded rows, trimmed to a multiple of 64
            computed = 2 * min(a.seq_len, -(-(t["prompt_ids"] + max(t["chosen_ids"], t["rejected_ids"])) // 64) * 64)
        clock = [computed / tps for _, s, _, tps, _ in steps if s > a.warmup]
        res["step_s_clock"] = round(sum(clock) / len(clock), 4)
        if res["step_s"] < 0.5 * res["step_s_clock"]:  # the lines came in a burst (buffered): the wall says nothing
            res.update(step_s=res["step_s_clock"], step_s_from="tok/s (step lines buffered)")
    peak = steps[-1][4]
    res.update(last_loss=steps[-1][2], peak_gib=float(peak[1]) if peak and a.device == "cuda" else None)
    return res


# --- TRL (run as `--peer trl|trl-liger|trl-pre` in a subprocess) --------------------------------------------------

def peer(a, work: Path) -> None:
    import copy
    import dataclasses

    import torch
    import trl
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    cuda = a.device == "cuda"
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    tok = AutoTokenizer.from_pretrained(work / "model")
    cfg = AutoConfig.from_pretrained(work / "model")
    cfg.use_cache = False
    torch.manual_seed(0)
    if a.mode == "qlora":  # random bf16 weights saved once, loaded back in NF4 as from_pretrained does
        weights = work / "weights"
        if not (weights / "config.json").exists():
            with torch.device(dev):
                AutoModelForCausalLM.from_config(cfg, dtype=dt).save_pretrained(work / "weights.tmp")
            os.rename(work / "weights.tmp", weights)
            if cuda:
                torch.cuda.empty_cache()
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=dt)
        model = AutoModelForCausalLM.from_pretrained(weights, dtype=dt, quantization_config=q, use_cache=False,
                                                     device_map={"": 0} if cuda else "cpu", attn_implementation="sdpa")
    else:
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dt, attn_implementation="sdpa")
    print(f"TRL's model: {type(model).__name__}, {str(model.dtype)}, "
          f"{sum(type(m).__name__ == 'Linear4bit' for m in model.modules())} 4-bit linears", flush=True)
    ds = load_dataset("json", data_files=str(work / "pairs.jsonl"), split="train")
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
                if state.global_step == a.warmup:
                    torch.cuda.reset_peak_memory_stats()
            times.append(time.perf_counter())

    want = dict(output_dir=str(work / f"{a.peer}-out"), per_device_train_batch_size=1, gradient_accumulation_steps=1,
                learning_rate=5e-6, lr_scheduler_type="constant", max_steps=a.warmup + a.steps, logging_steps=1,
                save_strategy="no", report_to=[], bf16=cuda, fp16=False, beta=0.1, loss_type=["sigmoid"],
                max_length=None, use_liger_kernel=a.peer == "trl-liger", precompute_ref_log_probs=a.peer == "trl-pre",
                gradient_checkpointing=False, optim="adamw_torch_fused", dataloader_num_workers=0,
                use_cpu=not cuda, seed=42)
    dropped = sorted(set(want) - {f.name for f in dataclasses.fields(DPOConfig)})
    need = {"beta", "loss_type", "max_length", "use_liger_kernel", "precompute_ref_log_probs"}  # what the rows are
    assert not need & set(dropped), f"this TRL's DPOConfig lacks {sorted(need & set(dropped))}"
    print(f"TRL {trl.__version__}: DPOConfig lacks {dropped}, left out" if dropped else f"TRL {trl.__version__}")
    want = {k: v for k, v in want.items() if k not in dropped}
    lora = None if a.mode == "full" else LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                    target_modules=LORA_TARGETS)
    ref = None  # LoRA: the adapters disabled; trl-pre: precomputed; else a frozen copy (Axolotl passes model_ref)
    if a.mode == "full" and a.peer != "trl-pre":
        ref = copy.deepcopy(model).eval().requires_grad_(False)
    tr = DPOTrainer(model=model, ref_model=ref, args=DPOConfig(**want), train_dataset=ds, processing_class=tok,
                    callbacks=[Clock()], peft_config=lora)
    lengths = {k: len(v) for k, v in tr.train_dataset[0].items() if k.endswith("_ids")}
    print("TRL trains", lengths, flush=True)  # checked against the pair's lengths by the caller (not fatal here)
    tr.train()
    if cuda:
        torch.cuda.synchronize()
    times.append(time.perf_counter())
    steady = times[a.warmup:]
    losses = [h["loss"] for h in tr.state.log_history if "loss" in h]

    print("RESULT " + json.dumps({
        "row": a.peer, "system": f"TRL {trl.__version__} DPOTrainer" + {"trl": "", "trl-liger": " + Liger DPO loss",
                                                                         "trl-pre": " precompute_ref"}[a.peer],
        "rc": 0, "tokens": lengths, "step_s": (steady[-1] - steady[0]) / (len(steady) - 1),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "last_loss": losses[-1] if losses else None}), flush=True)


def run_peer(a, row: str, work: Path, out: Path, env: dict) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), "--peer", row, "--work", str(work), "--mode", a.mode,
            "--device", a.device, "--warmup", str(a.warmup), "--steps", str(a.steps), "--prompt", str(a.prompt),
            "--chosen", str(a.chosen), "--rejected", str(a.rejected)]
    env = {**env, "CUDA_VISIBLE_DEVICES": ""} if a.device == "cpu" else env
    rc, lines = run_logged(argv, out / f"{a.mode}-{row}.log", a.timeout, env)
    found = [json.loads(s[len("RESULT "):]) for _, s in lines if s.startswith("RESULT ")]
    return found[-1] if rc == 0 and found else {"row": row, "rc": rc, "error": f"see {out / f'{a.mode}-{row}.log'}"}


# --- the table ----------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    a = args_of(argv)
    if a.peer:
        peer(a, Path(a.work))
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"dpo-bench-{a.mode}-", dir=a.tmp))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    want = {"prompt_ids": a.prompt, "chosen_ids": a.chosen, "rejected_ids": a.rejected}
    pair = a.prompt + a.chosen + a.rejected
    results = []
    try:
        build_inputs(a, work)
        print(f"mode {a.mode} ({'tiny Llama' if a.device == 'cpu' else SHAPE[a.mode]} shape, random weights), pair "
              f"{want}, warm-up {a.warmup} + {a.steps} timed steps; temp dir {work}", flush=True)
        for row in a.rows.split(","):
            t0 = time.perf_counter()
            r = run_ours(a, work, out, env) if row == "ours" else run_peer(a, row, work, out, env)
            r.update(mode=a.mode, device=a.device, row_wall_s=round(time.perf_counter() - t0, 1))
            if r.get("step_s"):
                r["step_s"] = round(r["step_s"], 4)
                r["pair_tokens_per_s"] = round(pair / r["step_s"])
            if "tokens" in r and r["tokens"] != want:
                r["error"] = f"trained {r['tokens']}, not {want}"
            results.append(r)
            print("RESULT " + json.dumps(r), flush=True)
            with open(out / "results.jsonl", "a") as f:
                f.write(json.dumps(r) + "\n")
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    ours = next((r["step_s"] for r in results if r["row"] == "ours" and r.get("step_s")), None)
    print(f"\n{'row':10} {'system':38} {'s/step':>8} {'pair tok/s':>10} {'peak GiB':>8} {'last loss':>9} "
          f"{'/ ours':>7}  tokens (prompt, chosen, rejected)")
    for r in results:
        s = r.get("step_s")
        cells = (f"{s:8.3f} {r['pair_tokens_per_s']:10,d} {r['peak_gib'] or float('nan'):8.2f} "
                 f"{r['last_loss'] if r['last_loss'] is not None else float('nan'):9.4f} "
                 f"{s / ours if ours else float('nan'):7.2f}" if s else f"{'FAILED: ' + r.get('error', ''):>46}")
        t = r.get("tokens") or {}
        print(f"{r['row']:10} {r.get('system', '?')[:38]:38} {cells}  "
              f"{tuple(t.get(k) for k in ('prompt_ids', 'chosen_ids', 'rejected_ids'))}"
              + ("  NOT THE SAME PAIR" if t and t != want else ""))
    liger = next((r["step_s"] for r in results if r["row"] == "trl-liger" and r.get("step_s")), None)
    if ours and liger:
        print(f"TRL-liger step / ours: {liger / ours:.2f}x")
    return 0 if results and all(r.get("step_s") for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
