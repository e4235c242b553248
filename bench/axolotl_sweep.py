"""Axolotl's examples past `plan`: every example YAML of an Axolotl checkout that plans unchanged (as in
bench/axolotl_examples.py) also through `nd-adapter preprocess` and `nd-adapter rehearse --steps 2`, with local data
standing in for each hub dataset and a small tokenizer standing in for each base model's: every example that
plans should also prepare its data and rehearse its layout.

    python bench/axolotl_sweep.py --axolotl ~/src/axolotl [--only 'qwen3/*'] [--jobs 8] [--out results.json]

What stands in, so that nothing is downloaded (HF_HUB_OFFLINE=1):
  - each base model: its config.json (tests/helpers/axolotl_home.py's table) and one small byte-level tokenizer,
    which also carries every <|...|> marker of the chat templates nd-adapter ships, the special_tokens and
    eot_tokens the examples name, and chatml as its own chat template (for `tokenizer_default`);
  - each `datasets` / `test_datasets` / `pretraining_dataset` entry: a small JSONL whose columns fit the entry's
    `type` (alpaca's instruction/input/output, chat_template's messages under field_messages with the entry's
    message_property_mappings and roles, completion text under `field`, long enough for `min_sample_len`,
    input_output segments, chat_template.default preference pairs, a reward model's Bradley-Terry pairs,
    pre-tokenised input_ids). The YAML is
    otherwise unchanged; it runs from a working directory of its own holding a link to the checkout's
    deepspeed_configs/, as a user runs an example from a checkout.

Each example's commands run in their own processes; `--jobs N` runs N examples at once (a rehearsal itself starts
the config's world size of CPU processes; `--nproc` is given only where the example leaves its world size open,
as Axolotl's expert-parallel files do). Every failure is classified:
  stand-in  a refusal about the data's columns or rows: the stand-in data is wrong (this script's fault);
  refusal   one line, exit 2: a limitation nd-adapter states (listed with its line);
  crash     a traceback, an internal error, another exit status, or the rehearsal refusing the checkpoint it wrote
            itself: a bug in nd-adapter (its last traceback lines).
A DeepSpeed op build racing another process over ~/.cache/torch_extensions is retried once.
Not a test: a survey to re-run as nd-adapter grows.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fnmatch
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAGES = ("plan", "preprocess", "rehearse")
DATA_KEYS = ("datasets", "test_datasets", "pretraining_dataset")
SIZE_KEYS = ("dp_replicate_size", "dp_shard_size", "context_parallel_size", "tensor_parallel_size",
             "expert_parallel_size")
WORLD_UNKNOWN = "the world size is not known"
# a refusal naming a dataset entry and its columns or rows: what the stand-in data got wrong
STAND_IN = re.compile(r"^nd-adapter: error: (?:test_)?(?:datasets|pretraining_dataset)\S*[=:].*"
                      r"(?:column|row \d|segment|not text|field_messages|field_chosen|field_rejected|no examples|"
                      r"empty)")


# a one-line refusal of the rehearsal's own checkpoint (its temporary directory): nd-adapter's bug, not the config's
OWN = re.compile(r"nd-rehearse-")
# a JIT build of DeepSpeed's CPU shared-memory op racing another process over ~/.cache/torch_extensions: retried once
ENV = re.compile(r"torch_extensions.*\block\b|file_baton")


def first_key(err: str) -> str:
    m = re.match(r"nd-adapter: (?:error|internal error): ([^=:]+)", err)
    return m.group(1).strip() if m else err[:60]


# ---------------------------------------------------------------------------------------------------- stand-ins


def _messages(entry: dict, i: int, *, system: bool = True, last_assistant: bool = True) -> list[dict]:
    """A conversation in the entry's words: its message_property_mappings' keys, its roles' first names."""
    keys = {"role": "role", "content": "content", **(entry.get("message_property_mappings") or {})}
    roles = entry.get("roles") or {}
    sharegpt = keys["role"] == "from" and not roles  # SlimOrca / FineTome: from human|gpt|system, value

    def name(role: str) -> str:
        if roles.get(role):
            return roles[role][0]
        return {"user": "human", "assistant": "gpt"}.get(role, role) if sharegpt else role

    turns = [("system", "You answer briefly.")] if system and i % 2 == 0 else []
    turns += [("user", f"Name the number after {i}."),
              ("assistant", f"The number after {i} is {i + 1}. " * (1 + i % 4))]
    if i % 3 == 0:
        turns += [("user", f"And the one before {i}?"), ("assistant", f"It is {i - 1}.")]
    if not last_assistant:
        turns = turns[:-1]
    return [{keys["role"]: name(role), keys["content"]: text} for role, text in turns]


def rows_needed(raw: dict) -> int:
    """Enough short rows for the rehearsal's two steps of packed samples at its sequence length (the file's, at most
    512), the file's micro-batch and accumulation, on up to four data-parallel ranks (a stand-in row is ~30 tokens
    of the small tokenizer); no more, or a held-out share of them makes each rehearsal's evals long."""
    def num(key: str, default: int) -> int:
        v = raw.get(key)
        return v if isinstance(v, int) and v > 0 else default
    seq = min(num("sequence_len", 2048), 512)  # the rehearsal's sequence (adapter/train/rehearse.py)
    tokens = 2 * 4 * num("micro_batch_size", 1) * num("gradient_accumulation_steps", 1) * seq
    return max(64, min(20000, tokens // 30 if raw.get("sample_packing") else 0))


def stand_in_rows(entry: dict, raw: dict, n: int = 64) -> list[dict]:
    """Rows whose columns fit the entry's type (adapter/data/sft/formats.py, preference.py)."""
    from tests.helpers.axolotl_home import alpaca_rows, long_rows

    t = entry.get("type")
    if isinstance(t, dict):  # Axolotl's custom user-defined format: its fields named in the mapping
        return [{t.get("field_instruction", "instruction"): r["instruction"], t.get("field_input", "input"): r["input"],
                 t.get("field_output", "output"): r["output"]} for r in alpaca_rows(n)]
    if t is None and "pretraining_dataset" not in entry.get("_key", ""):
        return [{"input_ids": [1 + (i * 7 + j) % 900 for j in range(40 + i % 50)]} for i in range(n)]
    if t in (None, "completion", "pretrain") or entry.get("_key") == "pretraining_dataset":
        field = entry.get("field") or entry.get("text_column") or "text"
        need = int(raw.get("min_sample_len") or 0)
        if need:  # documents that survive min_sample_len (a word is ~3 tokens of the small tokenizer)
            return long_rows(8, need * 2 // 5 + 2000, field)  # enough for a round of a few ranks' samples
        return long_rows(n, 120, field)
    if raw.get("rl") == "kto":  # Axolotl's KTO types (adapter/data/sft/preference_kto.py): a user field, the
        # completion and a label; argilla_chat: a two-turn conversation as the completion
        from adapter.data.sft.preference_kto import USER_FIELD

        strategy = str(t).rsplit(".", 1)[-1]
        if strategy == "argilla_chat":
            return [{"completion": [{"role": "user", "content": f"Name the number after {i}."},
                                    {"role": "assistant", "content": f"It is {i + 1 + i % 2}."}],
                     "label": i % 2 == 0} for i in range(n)]
        return [{USER_FIELD.get(strategy, "prompt"): f"Name the number after {i}.", "system": "Be brief.",
                 "completion": f"It is {i + 1 + i % 2}.", "label": i % 2 == 0} for i in range(n)]
    if t == "bradley_terry.chat_template":  # a reward model's pairs (adapter/data/sft/preference_bt.py)
        return [{"system": "Be brief.", "input": f"Name the number after {i}.",
                 "chosen": f"The number after {i} is {i + 1}.", "rejected": f"It is {i + 7}."} for i in range(n)]
    if t == "chat_template.argilla":  # rl: orpo's rows: chosen and rejected conversations (preference_orpo.py)
        def talk(i: int, answer: str) -> list[dict]:
            return [{"role": "user", "content": f"Name the number after {i}."},
                    {"role": "assistant", "content": answer}]
        return [{"chosen": talk(i, f"The number after {i} is {i + 1}."), "rejected": talk(i, f"It is {i + 7}.")}
                for i in range(n)]
    if t == "chat_template.default" or t.startswith("chat_template.") and raw.get("rl"):
        keys = {"role": "role", "content": "content", **(entry.get("message_property_mappings") or {})}
        fm = entry.get("field_messages") or "messages"
        roles = entry.get("roles") or {}
        asst = (roles.get("assistant") or ["assistant"])[0]

        def answer(text: str) -> dict:
            return {keys["role"]: asst, keys["content"]: text}
        return [{fm: _messages(entry, i, last_assistant=False),
                 entry.get("field_chosen") or "chosen": answer(f"The number after {i} is {i + 1}."),
                 entry.get("field_rejected") or "rejected": answer(f"It is {i + 7}, I think.")} for i in range(n)]
    if t.startswith("chat_template"):
        return [{entry.get("field_messages") or "messages": _messages(entry, i)} for i in range(n)]
    if t == "stepwise_supervised":  # a process reward model's rows (adapter/data/sft/formats.py)
        from tests.helpers.prm import rows as step_rows

        return step_rows(n)
    if t == "input_output":
        return [{"segments": [{"label": False, "text": f"Q: what follows {i}?\n"},
                              {"label": True, "text": f"A: {i + 1}.\n"}]} for i in range(n)]
    if t.startswith("alpaca") or t in ("instruct",):
        return alpaca_rows(n)
    return alpaca_rows(n)  # an unknown type: nd-adapter names it in its refusal


def entries(raw: dict) -> list[tuple[str, int | None, dict]]:
    out: list[tuple[str, int | None, dict]] = []
    for key in DATA_KEYS:
        val = raw.get(key)
        if isinstance(val, dict):
            out.append((key, None, val))
        elif isinstance(val, list):
            out += [(key, i, e) for i, e in enumerate(val) if isinstance(e, dict)]
    return out


def localise(example: Path, work: Path, axolotl: Path) -> Path:
    """The example's YAML in `work`, unchanged but for each dataset entry's `path` (a stand-in JSONL; the hub-only
    `data_files` and `name` dropped), beside a link to the checkout's deepspeed_configs/."""
    from tests.helpers.axolotl_home import write_jsonl

    raw = yaml.safe_load(example.read_text())
    for key, i, entry in entries(raw):
        rows = stand_in_rows({**entry, "_key": key}, raw, n=rows_needed(raw))
        entry["path"] = str(write_jsonl(work / "data" / f"{key}-{i or 0}.jsonl", rows))
        entry.pop("data_files", None)
        entry.pop("name", None)
        entry.pop("data_dir", None)
        entry.pop("revision", None)
        if entry.get("ds_type") not in (None, "json"):
            entry.pop("ds_type")
    if (axolotl / "deepspeed_configs").is_dir():
        (work / "deepspeed_configs").symlink_to(axolotl / "deepspeed_configs")
    out = work / example.name
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


def extra_tokens(examples: list[Path]) -> list[str]:
    """Tokens a real base model's tokenizer has that the small one lacks: the <|...|> markers of every shipped chat
    template and the special_tokens / eot_tokens the examples name."""
    from adapter.data.sft.templates import _SPECIAL_LITERAL, BUILTIN

    found = {t for tpl in BUILTIN.values() for t in _SPECIAL_LITERAL.findall(tpl)}
    for ex in examples:
        try:
            raw = yaml.safe_load(ex.read_text()) or {}
        except yaml.YAMLError:
            continue
        found |= {v for v in (raw.get("special_tokens") or {}).values() if isinstance(v, str)}
        found |= {v for v in raw.get("eot_tokens") or [] if isinstance(v, str)}
    return sorted(found)


def make_sweep_home(root: Path, examples: list[Path]) -> Path:
    """tests/helpers/axolotl_home.py's make_home, the tokenizer also carrying `extra_tokens` and chatml as its own
    chat template."""
    from transformers import AutoTokenizer

    from adapter.data.sft.templates import CHATML
    from tests.helpers.axolotl_home import MODELS, model_config, tokenizer
    from tests.helpers.hub import add_to_hub_cache

    tok_dir = tokenizer(root)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    tok.add_tokens([t for t in extra_tokens(examples) if t not in tok.get_vocab()], special_tokens=True)
    tok.chat_template = CHATML
    tok.save_pretrained(str(tok_dir))
    home = root / "home"
    for repo in MODELS:
        src = root / "src" / repo.replace("/", "--")
        src.mkdir(parents=True, exist_ok=True)
        (src / "config.json").write_text(json.dumps(model_config(repo)))
        for f in tok_dir.iterdir():
            shutil.copyfile(f, src / f.name)
        add_to_hub_cache(home, repo, src)
    return home


# ---------------------------------------------------------------------------------------------------- running


def classify(code: int, out: str, err: str) -> dict[str, Any]:
    """pass / stand-in / refusal / crash, the first error line, and a crash's last traceback lines."""
    if code == 0 and "Traceback" not in out + err:
        return {"result": "pass"}
    text = (err.strip() or out.strip()).splitlines()
    refusal = next((ln for ln in text if ln.startswith("nd-adapter: error:")), None)
    tb = "Traceback (most recent call last)" in out + err or "internal error" in err
    if code == 2 and refusal and not tb:
        kind = "stand-in" if STAND_IN.match(refusal) else "refusal"
        if OWN.search(refusal):  # the rehearsal refusing what it wrote itself: a bug
            kind = "crash"
        return {"result": kind, "line": refusal}
    lines = (out + "\n" + err).strip().splitlines()
    if "Traceback (most recent call last)" in out + err:
        start = max(i for i, ln in enumerate(lines) if "Traceback (most recent call last)" in ln)
        tail = lines[start:][-12:]
        exc = next((ln for ln in reversed(lines[start:]) if re.match(r"^\S*(Error|Exception)\b|^\w+(\.\w+)*: ", ln)),
                   tail[-1] if tail else "")
    else:
        tail, exc = lines[-12:], (refusal or (lines[-1] if lines else f"exit {code}"))
    return {"result": "crash", "line": exc.strip(), "exit": code, "tail": tail}


def world_size(raw: dict) -> int:
    """The smallest world the example's explicit sizes ask for (Axolotl: ep within dp_shard, times the rest)."""
    n = 1
    for key in SIZE_KEYS:
        n *= int(raw.get(key) or 1)
    return n


def run_example(rel: str, example: Path, axolotl: Path, home: Path, tmp: Path, timeout: int,
                seq_len: int | None = None) -> dict[str, Any]:
    from tests.helpers.axolotl_home import cli, offline_env

    work = tmp / rel.replace("/", "__").rsplit(".", 1)[0]
    work.mkdir(parents=True)
    res: dict[str, Any] = {"example": rel}
    try:
        cfg = localise(example, work, axolotl)
        env = offline_env(home, work)
        t0 = time.monotonic()
        try:
            code, out, err = cli(["preprocess", "--config", str(cfg)], env, work, timeout=timeout)
        except subprocess.TimeoutExpired:
            code, out, err = 124, "", f"timed out after {timeout}s"
        res["preprocess"] = {**classify(code, out, err), "seconds": round(time.monotonic() - t0, 1)}
        if res["preprocess"]["result"] != "pass":
            return res
        argv = ["rehearse", "--config", str(cfg), "--steps", "2", *(["--seq-len", str(seq_len)] if seq_len else [])]
        t0 = time.monotonic()
        for attempt in range(3):
            try:
                code, out, err = cli(argv, env, work, timeout=timeout)
            except subprocess.TimeoutExpired:
                code, out, err = 124, "", f"timed out after {timeout}s"
            if attempt < 2 and code == 2 and WORLD_UNKNOWN in err and "--nproc" not in argv:
                n = world_size(yaml.safe_load(example.read_text()))
                res["nproc"] = n
                argv += ["--nproc", str(n)]
                continue
            if attempt < 2 and code != 0 and ENV.search(err) and not res.get("retried"):
                res["retried"] = "the torch_extensions build raced another process"
                continue
            break
        m = re.search(r"rehearsing on (\d+) CPU processes", out)
        res["rehearse"] = {**classify(code, out, err), "seconds": round(time.monotonic() - t0, 1),
                           "processes": int(m.group(1)) if m else None}
        ok = re.search(r"^rehearsal ok: .*$", out, re.M)
        if ok:
            res["rehearse"]["said"] = ok.group(0)[:200]
        return res
    except Exception as e:  # noqa: BLE001 - this script's own failure, reported as such
        res["script"] = f"{type(e).__name__}: {e}"
        return res
    finally:
        shutil.rmtree(work, ignore_errors=True)


def plan_all(examples: dict[str, Path], axolotl: Path, gpus_per_node: int) -> dict[str, dict[str, Any]]:
    """`plan` of each unchanged example, in this process, from the checkout (as bench/axolotl_examples.py)."""
    from adapter.cli import main as cli

    out: dict[str, dict[str, Any]] = {}
    cwd = os.getcwd()
    os.chdir(axolotl)
    try:
        for rel, ex in examples.items():
            o, e = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
                try:
                    code = cli(["plan", str(ex), "--gpus-per-node", str(gpus_per_node)])
                except SystemExit as x:
                    code = x.code if isinstance(x.code, int) else 1
                except Exception:  # noqa: BLE001 - a crash of plan is a finding
                    import traceback
                    traceback.print_exc()
                    code = 1
            out[rel] = classify(code, o.getvalue(), e.getvalue())
    finally:
        os.chdir(cwd)
    return out


def stage_of(r: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The stage that failed and its result, or None when all passed."""
    for s in STAGES:
        if s in r and r[s]["result"] != "pass":
            return s, r[s]
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--axolotl", required=True, type=Path, help="a checkout of axolotl-ai-cloud/axolotl")
    ap.add_argument("--only", action="append", help="glob over paths under examples/ (repeatable), e.g. 'qwen3/*'")
    ap.add_argument("--jobs", type=int, default=1, help="examples run at once")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="for plan, as bench/axolotl_examples.py")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per command")
    ap.add_argument("--seq-len", type=int, help="rehearse --seq-len (default: the rehearsal's own, the config's)")
    ap.add_argument("--out", type=Path, help="write every result as JSON (rewritten as each example ends)")
    ap.add_argument("--deadline", type=float, help="seconds from the start after which no further example starts "
                    "(those left are recorded as not run, and listed): a sweep that must end inside a time limit")
    a = ap.parse_args()
    axolotl = a.axolotl.resolve()
    found = sorted(p for p in (axolotl / "examples").rglob("*") if p.suffix in (".yml", ".yaml"))
    examples = {str(p.relative_to(axolotl / "examples")): p for p in found}
    if a.only:
        examples = {k: v for k, v in examples.items() if any(fnmatch.fnmatch(k, g) for g in a.only)}
    if not examples:
        print("no example matches", file=sys.stderr)
        return 2
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="nd-sweep-") as tmp_name:
        tmp = Path(tmp_name)
        home = make_sweep_home(tmp, list(examples.values()))
        os.environ.update({"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
        plans = plan_all(examples, axolotl, a.gpus_per_node)
        results = {rel: {"example": rel, "plan": plans[rel]} for rel in examples}
        todo = [rel for rel in examples if plans[rel]["result"] == "pass"]
        print(f"{len(todo)} of {len(examples)} plan unchanged; preprocess and rehearse them, {a.jobs} at a time",
              flush=True)
        def job(rel: str) -> dict[str, Any]:
            if a.deadline is not None and time.monotonic() - started > a.deadline:
                return {"example": rel, "not_run": f"not started: past --deadline {a.deadline:g}s"}
            return run_example(rel, examples[rel], axolotl, home, tmp / "work", a.timeout, a.seq_len)

        def write() -> None:
            if a.out:
                part = a.out.with_name(a.out.name + ".part")
                part.write_text(json.dumps([results[rel] for rel in examples], indent=1) + "\n")
                part.replace(a.out)

        write()
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
            futures = {pool.submit(job, rel): rel for rel in todo}
            for fut in concurrent.futures.as_completed(futures):
                r = {**results[futures[fut]], **fut.result()}
                results[r["example"]] = r
                failed = stage_of(r)
                secs = "/".join(f"{r[s].get('seconds', 0):.0f}s" for s in ("preprocess", "rehearse") if s in r)
                write()
                if "script" in r:
                    print(f"SCRIPT {r['example']}: {r['script']}", flush=True)
                elif "not_run" in r:
                    print(f"skip {r['example']}: {r['not_run']}", flush=True)
                elif failed:
                    print(f"FAIL {r['example']} [{failed[0]}, {failed[1]['result']}] ({secs}): {failed[1]['line']}",
                          flush=True)
                    for ln in failed[1].get("tail", [])[-6:]:
                        print(f"       {ln}", flush=True)
                else:
                    print(f"ok   {r['example']} ({secs}, {r['rehearse'].get('processes')} processes)", flush=True)
    rows = [results[rel] for rel in examples]
    print(f"\n{len(rows)} examples in {time.monotonic() - started:.0f}s")
    for s in STAGES:
        ran = [r for r in rows if s in r]
        print(f"{sum(r[s]['result'] == 'pass' for r in ran):4d} of {len(ran):4d} pass `{s}`")
    groups: Counter[tuple[str, str, str]] = Counter()
    for r in rows:
        failed = stage_of(r)
        if failed and failed[0] != "plan":
            line = failed[1]["line"]
            groups[(failed[0], failed[1]["result"], first_key(line) if failed[1]["result"] != "crash" else
                    re.sub(r"nd-rehearse-[^'/ ]+", "nd-rehearse-*", line)[:110])] \
                += 1
    for (stage, kind, key), n in sorted(groups.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {n:4d}  {stage} {kind}: {key}")
    for kind in ("stand-in", "refusal", "crash"):
        hits = [(r, f) for r in rows if (f := stage_of(r)) and f[0] != "plan" and f[1]["result"] == kind]
        if hits:
            print(f"\n{kind} ({len(hits)}):")
        for r, (stage, res) in hits:
            print(f"  {r['example']} [{stage}]: {res['line']}")
            for ln in res.get("tail", [])[-6:] if kind == "crash" else []:
                print(f"      {ln}")
    not_run = [r for r in rows if "not_run" in r]
    if not_run:
        print(f"\nnot run ({len(not_run)}, past --deadline): " + " ".join(r["example"] for r in not_run))
    scripts = [r for r in rows if "script" in r]
    for r in scripts:
        print(f"  script error {r['example']}: {r['script']}")
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if scripts else 0


if __name__ == "__main__":
    raise SystemExit(main())
