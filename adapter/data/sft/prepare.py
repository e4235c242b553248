"""SFT datasets -> tokenised, masked, packed train/val samples on disk, built once by one rank, reused by all.

The cache directory's name hashes everything that changes its contents: each source's files (path, size, mtime),
the tokenizer's files, the model's vocabulary size, seq_len and every data key that changes what is kept or
trained. The builder writes into a temporary directory beside it and renames it into place, so restarts and the
other ranks never see half a cache; a data error on the builder reaches every rank (token_cache.py's pattern).

Order of work, as Axolotl does it: tokenise and mask each entry; handle over-long examples (drop, truncate or
refuse); skip examples without a trained token (counted: they would give a 0/0 loss); concatenate the entries,
shuffle with the seed (shuffle_merged_datasets); hold out the tail as the validation set (val_set_size); pack.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from adapter.config import spell
from adapter.data.sft import formats, sources, templates
from adapter.data.sft.bins import SFTDataset, ragged_take, targets, write_split
from adapter.data.sft.order import merged_order, merged_shuffled
from adapter.data.sft.tokenizer import load_tokenizer
from adapter.data.token_cache import TOKENIZER_FILES
from adapter.errors import bad
from adapter.osutil import build_once, check_room

CACHE_VERSION = 1  # bump when the on-disk layout or the tokenisation rules change
TOKENIZER_KEY_FILES = (*TOKENIZER_FILES, "chat_template.jinja", "chat_template.json", "tekken.json")
RESULT_KEYS = ("train_on_inputs", "sample_packing", "eval_sample_packing", "excess_length_strategy", "val_set_size",
               "shuffle_merged_datasets", "chat_template", "chat_template_jinja", "special_tokens", "seed",
               "eot_tokens",
               "min_sample_len", "deduplicate")
PARALLEL_ROWS = 20_000  # below this, one process tokenises faster than starting workers


@dataclass
class SFTData:
    train: SFTDataset
    val: SFTDataset | None
    stats: dict[str, Any]
    chat_template: str | None          # the jinja the conversations were rendered with, for the exported tokenizer
    path: Path
    notes: list[str] = field(default_factory=list)  # what changes what is trained, for the run's first lines
    reused: bool = False

    def longest(self) -> int:
        """Tokens of the longest example, training and held-out (what a sliding attention window must cover)."""
        return max(part.longest() for part in (self.train, self.val) if part is not None)


def names(cfg) -> tuple[Callable[[int], str], Callable[[str], str]]:
    """How keys are spelled in messages: as the user wrote them (Axolotl top level, or native data.*)."""
    where = (lambda i: f"datasets[{i}]") if cfg.source == "axolotl" else (lambda i: f"data.datasets[{i}]")
    return where, (lambda k: spell(cfg, f"data.{k}"))


def top_prefix(cfg) -> str:
    return "" if cfg.source == "axolotl" else "data."


def resolve_all(cfg, test: bool = False) -> list[tuple[Any, str, str, sources.Source]]:
    """(entry, where, kind, source) per dataset (of test_datasets with `test`): types, keys and paths checked,
    nothing loaded (cheap, every rank)."""
    where, key = names(cfg)
    entries = cfg.data.test_datasets if test else cfg.data.datasets
    out = []
    for i, entry in enumerate(entries):
        at = f"{key('test_datasets')}[{i}]" if test else where(i)
        kind = formats.kind_of(entry, at, cfg.objective)
        out.append((entry, at, kind, sources.resolve(entry, at)))
    return out


def check(cfg) -> None:
    """Preflight: every entry's type, keys and source, before any process starts."""
    check_choices(cfg)
    resolve_all(cfg)
    resolve_all(cfg, test=True)
    val_fraction(cfg, None)


def check_choices(cfg) -> None:
    """What `plan` can refuse of the data from the config alone (no file, no tokenizer): each entry's type and
    every chat template named, top level and per entry, so a name preprocess would refuse is said at plan time."""
    where, key = names(cfg)
    d = cfg.data
    if d.chat_template is not None or d.chat_template_jinja is not None:
        templates.check_choice(d.chat_template, d.chat_template_jinja, top_prefix(cfg))
    for test, entries in ((False, d.datasets), (True, d.test_datasets)):
        for i, entry in enumerate(entries):
            at = f"{key('test_datasets')}[{i}]" if test else where(i)
            kind = formats.kind_of(entry, at, cfg.objective)
            if d.mistral_common and kind != "chat_template":
                raise bad(f"{at}.type", kind, f"{key('mistral_common')} encodes conversations (type: "
                          "chat_template) with mistral-common; other types and preference pairs through it are not "
                          "built", f"use type: chat_template, or set {key('mistral_common')}: false")
            if entry.chat_template is not None or entry.chat_template_jinja is not None:
                templates.check_choice(entry.chat_template, entry.chat_template_jinja, f"{at}.")


def prepared_root(cfg) -> Path:
    d = cfg.data
    return Path(d.prepared_path or d.cache_dir or Path(cfg.checkpoint.dir or ".") / "token-cache")


def cache_key(cfg, resolved, tokenizer_dir: Path, vocab_size: int, test=()) -> str:
    tok_files = [tokenizer_dir / n for n in TOKENIZER_KEY_FILES if (tokenizer_dir / n).is_file()]
    if not tok_files:
        raise bad("model.path", str(tokenizer_dir), "no tokenizer files there (tokenizer.json, tokenizer.model, ...)",
                  "point the model at an HF checkpoint directory that includes its tokenizer")
    d = cfg.data
    knobs = {k: getattr(d, k) for k in RESULT_KEYS}
    knobs["special_tokens"] = d.special_tokens.model_dump()
    knobs.update({"tokens": list(d.tokens)} if d.tokens else {})  # unset: older caches keep their names
    knobs.update({k: True for k in ("curriculum", "pack_in_order", "mistral_common") if getattr(d, k)})  # likewise
    for jinja in [d.chat_template_jinja] + [e.chat_template_jinja for e, *_ in [*resolved, *test]]:
        if jinja and "{" not in jinja and Path(jinja).is_file():  # a template file: its contents count
            knobs.setdefault("jinja_files", []).append(hashlib.sha256(Path(jinja).read_bytes()).hexdigest())
    doc = {"v": CACHE_VERSION, "seq_len": cfg.seq_len, "vocab": vocab_size, "knobs": knobs,
           "entries": [[e.model_dump(), src.identity()] for e, _, _, src in resolved],
           "test": [[e.model_dump(), src.identity()] for e, _, _, src in test]}
    h = hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode())
    for f in tok_files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:20]


def val_fraction(cfg, n: int | None) -> int:
    """Examples held out: a fraction < 1 of n (rounded up, as datasets' train_test_split) or a whole count."""
    v, (_, key) = cfg.data.val_set_size, names(cfg)
    if v >= 1 and v != int(v):
        raise bad(key("val_set_size"), v, "neither a fraction below 1 nor a whole number of examples",
                  "give e.g. 0.05 (5%) or 200 (examples)")
    if n is None:
        return 0
    count = int(v) if v >= 1 else math.ceil(v * n)
    if count >= n:
        raise bad(key("val_set_size"), v, f"holds out {count} of the {n} examples left after filtering, leaving "
                  "nothing to train on", f"use a smaller val_set_size (below {n}) or add data")
    return count


# --- tokenizer -----------------------------------------------------------------------------------------------------

# --- one entry -----------------------------------------------------------------------------------------------------

def _flat(ds, column: str, dtype) -> tuple[np.ndarray, np.ndarray]:
    import pyarrow.compute as pc  # heavy: imported where used (preflight reads this module; adapter/data/__init__.py)

    col = ds.with_format("arrow")[:][column].combine_chunks()
    lens = np.asarray(pc.list_value_length(col).fill_null(0), dtype=np.int64)
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    return np.asarray(col.flatten(), dtype=dtype), offsets


def _entry_examples(cfg, tok, entry, where: str, kind: str, src, workdir: Path, n: int, progress: bool):
    """Tokenise and mask one entry; returns flat ids, labels, offsets, eos_missing flags, its row count, the chat
    template used, whether the rows had a labels column and how many turns each role outside the entry's role
    mapping has."""
    import datasets  # heavy: imported where used (preflight reads this module; adapter/data/__init__.py)

    datasets.disable_progress_bars()  # reading a split is quick: its bars would only clutter a one-line error
    try:
        ds = sources.load(src, entry, workdir / "hf")
    finally:
        (datasets.enable_progress_bars if progress else datasets.disable_progress_bars)()
    formats.check_columns(entry, kind, list(ds.column_names), where, src.location)
    chat = None
    if kind == "chat_template" and cfg.data.mistral_common:  # mistral-common encodes the chat: no template
        chat = templates.ChatFormatter(entry, tok, None, train_on_inputs=cfg.data.train_on_inputs, where=where,
                                       eot_tokens=cfg.data.eot_tokens, eot_key=f"{top_prefix(cfg)}eot_tokens")
    elif kind == "chat_template":
        top = cfg.data
        if entry.chat_template is not None or entry.chat_template_jinja is not None:  # the entry's own wins
            template = templates.resolve_template(entry.chat_template, entry.chat_template_jinja, tok, f"{where}.")
        else:
            template = templates.resolve_template(top.chat_template, top.chat_template_jinja, tok, top_prefix(cfg))
        chat = templates.ChatFormatter(entry, tok, template, train_on_inputs=cfg.data.train_on_inputs, where=where,
                                       eot_tokens=cfg.data.eot_tokens, eot_key=f"{top_prefix(cfg)}eot_tokens")
    fn = formats.make_formatter(kind, entry, tok, seq_len=cfg.seq_len, train_on_inputs=cfg.data.train_on_inputs,
                                where=where, chat=chat, classes=cfg.model.num_labels)
    big = len(ds) >= PARALLEL_ROWS
    procs = cfg.data.num_proc or (min(8, os.cpu_count() or 1) if big else None)
    if not big:
        datasets.disable_progress_bars()
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),  # 4 bytes a token
                                  "labels": datasets.Sequence(datasets.Value("int32")),
                                  "eos_missing": datasets.Value("bool"),
                                  "other_roles": datasets.Sequence(datasets.Value("string"))})
    try:
        mapped = ds.map(fn, batched=True, with_indices=True, remove_columns=list(ds.column_names), features=features,
                        num_proc=procs if procs and procs > 1 else None, load_from_cache_file=False,
                        cache_file_name=str(workdir / f"map-{n}.arrow"), desc=f"{where} ({kind})")
    except UnicodeDecodeError as e:  # text stored in arrow files unchecked (a save_to_disk directory, parquet)
        raise bad(f"{where}.path", src.location, f"holds text that is not UTF-8 ({e.reason} at byte "
                  f"{e.object[e.start:e.start + 1].hex()!r} of a value)", "convert its text to UTF-8") from None
    ids, offsets = _flat(mapped, "input_ids", np.int32)
    labels, _ = _flat(mapped, "labels", np.int32)
    eos_missing = np.asarray(mapped.with_format("arrow")[:]["eos_missing"].combine_chunks()
                             .to_numpy(zero_copy_only=False), dtype=bool)
    roles = Counter(mapped.with_format("arrow")[:]["other_roles"].combine_chunks().flatten().to_pylist())
    return (ids, labels, offsets, eos_missing, len(ds), (chat.template if chat else None), "labels" in ds.column_names,
            dict(sorted(roles.items())))


def _filter(cfg, ids, labels, offsets, where: str, vocab_size: int, stats: dict):
    """Over-long examples per excess_length_strategy, then examples without a trained target; counted in stats."""
    _, key = names(cfg)
    s = cfg.seq_len
    if len(ids) and (ids.max() >= vocab_size or ids.min() < 0):
        bad_id = int(ids.max() if ids.max() >= vocab_size else ids.min())
        raise bad(f"{where}", f"token id {bad_id}", f"outside the model's vocabulary of {vocab_size}",
                  "use the model's own tokenizer (pre-tokenised rows must use its ids)")
    lengths = np.diff(offsets)
    stats["empty"] = int((lengths == 0).sum())  # no token at all (an empty text)
    over = lengths > s
    strategy = cfg.data.excess_length_strategy
    if over.any() and strategy == "raise":
        i = int(np.flatnonzero(over)[0])
        raise bad(key("excess_length_strategy"), "raise", f"{where} example {i} has {int(lengths[i])} tokens, more "
                  f"than sequence_len={s}", "raise sequence_len, or set excess_length_strategy: drop or truncate")
    short = lengths < (cfg.data.min_sample_len or 1)  # Axolotl keeps min_sample_len <= length
    keep = np.flatnonzero(~over & ~short) if strategy == "drop" else np.flatnonzero(~short)
    stats["dropped_too_long" if strategy == "drop" else "truncated"] = int(over.sum())
    if cfg.data.min_sample_len:
        stats["too_short"] = int((short & (lengths > 0)).sum())
    idx, offsets = ragged_take(offsets, keep, np.minimum(lengths[keep], s))
    ids, labels = ids[idx], labels[idx]
    tgt = targets(labels, offsets)
    trained = np.add.reduceat((tgt >= 0).astype(np.int64), offsets[:-1]) if len(tgt) else np.zeros(0, np.int64)
    trained = np.where(np.diff(offsets) > 0, trained, 0)
    ok = np.flatnonzero(trained > 0)
    stats["no_trained_token"] = int(len(keep) - len(ok))
    idx, offsets = ragged_take(offsets, ok)
    return ids[idx], tgt[idx], offsets


# --- build ---------------------------------------------------------------------------------------------------------

def _build(cfg, resolved, tokenizer_dir: Path, vocab_size: int, out: Path, progress: bool, test=()) -> dict:
    import datasets  # heavy: imported where used (preflight reads this module; adapter/data/__init__.py)

    was_on = datasets.is_progress_bar_enabled()
    (datasets.enable_progress_bars if progress else datasets.disable_progress_bars)()
    try:
        return _build_inner(cfg, resolved, tokenizer_dir, vocab_size, out, progress, test)
    finally:
        (datasets.enable_progress_bars if was_on else datasets.disable_progress_bars)()


def _dedupe(ids, tgt, offsets) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Identical examples (tokens and trained targets) kept once, the first; Axolotl hashes the raw rows instead,
    which differs only for rows that differ in columns the format does not read."""
    seen, keep = set(), []
    for i in range(len(offsets) - 1):
        a, b = offsets[i], offsets[i + 1]
        h = hashlib.blake2b(ids[a:b].tobytes() + b"\0" + tgt[a:b].tobytes(), digest_size=16).digest()
        if h not in seen:
            seen.add(h)
            keep.append(i)
    idx, off = ragged_take(offsets, np.asarray(keep, dtype=np.int64))
    return ids[idx], tgt[idx], off, len(offsets) - 1 - len(keep)


def _build_inner(cfg, resolved, tokenizer_dir, vocab_size, out: Path, progress: bool, test=()) -> dict:
    tok = load_tokenizer(cfg, tokenizer_dir, vocab_size)
    work = out / "work"
    ids, tgt, offsets, per_dataset, used_templates, eos_missing = _examples(cfg, tok, resolved, work, vocab_size,
                                                                             progress, first=0)
    n = len(offsets) - 1
    if n == 0:
        _, key = names(cfg)
        dropped = sum(s.get("dropped_too_long", 0) for s in per_dataset)
        short = sum(s.get("too_short", 0) for s in per_dataset)
        none = sum(s["no_trained_token"] for s in per_dataset)
        empty = sum(s.get("empty", 0) + (s["rows"] if not s["examples"] else 0) for s in per_dataset)
        seq, min_len = spell(cfg, "seq_len"), key("min_sample_len")
        why = [f"{empty} empty (no text)"] if empty else []
        why += [f"{dropped} longer than {seq}={cfg.seq_len} dropped"]
        why += [f"{short} shorter than {min_len}={cfg.data.min_sample_len} dropped"] if short else []
        fix = ["give the empty rows their text"] if empty else []
        fix += [f"lower {min_len}"] if short else []
        fix += [f"raise {seq} or set {key('excess_length_strategy')}: truncate",
                "check roles_to_train / train_on_inputs and the data's fields"]
        raise bad("datasets", [s["path"] for s in per_dataset], f"no example left after filtering "
                  f"({', '.join(why)}, {none} without a trained token)", "; ".join(fix))
    d = cfg.data
    duplicates = {}
    if d.deduplicate:  # before the split, as Axolotl does it
        ids, tgt, offsets, duplicates["train"] = _dedupe(ids, tgt, offsets)
        n = len(offsets) - 1
    test_parts = None
    if test:
        t_ids, t_tgt, t_off, t_stats, _, _ = _examples(cfg, tok, test, work, vocab_size, progress, first=len(resolved))
        if len(t_off) == 1:
            _, key = names(cfg)
            raise bad(key("test_datasets"), [st["path"] for st in t_stats], "no example left after filtering",
                      "check the test data's fields, sequence_len and roles_to_train")
        if d.deduplicate:
            t_ids, t_tgt, t_off, duplicates["test"] = _dedupe(t_ids, t_tgt, t_off)
        per_dataset += t_stats
        test_parts = (t_ids, t_tgt, t_off)
    shutil.rmtree(work, ignore_errors=True)
    order = merged_order(cfg, n, len(resolved))
    n_val = val_fraction(cfg, n)
    split = {"train": order[:n - n_val], "val": order[n - n_val:]}
    total = {k: sum(st.get(k, 0) for st in per_dataset) for k in
             ("rows", "examples", "dropped_too_long", "truncated", "too_short", "no_trained_token", "kept",
              "trained_tokens")}
    total["duplicates"] = sum(duplicates.values())
    result = {"version": CACHE_VERSION, "seq_len": cfg.seq_len, "datasets": per_dataset, "total": total,
              "pad_id": pad_id(tok), "eos_token": tok.eos_token, "eos_missing": eos_missing,
              "duplicates": duplicates, "val_source": "test_datasets" if test else "val_set_size",
              "merged_shuffled": merged_shuffled(cfg, len(resolved))}
    eval_pack = d.sample_packing if d.eval_sample_packing is None else d.eval_sample_packing
    tokens = len(ids) + (len(test_parts[0]) if test_parts is not None else 0)
    check_room(out, 8 * tokens + 16 * (n + 1 + (len(test_parts[2]) if test_parts is not None else 0)) + 4096)
    for name, pick in split.items():
        if name == "val" and not len(pick):
            continue
        idx, off = ragged_take(offsets, pick)
        result[name] = write_split(out / name, ids[idx], tgt[idx], off, cfg.seq_len,
                                   d.sample_packing if name == "train" else eval_pack, d.pack_in_order)
    if test_parts is not None:
        result["val"] = write_split(out / "val", *test_parts, cfg.seq_len, eval_pack, d.pack_in_order)
    chosen = None
    if used_templates:
        chosen = used_templates[0]
        if d.chat_template is not None or d.chat_template_jinja is not None:  # the top-level one is the model's
            chosen = templates.resolve_template(d.chat_template, d.chat_template_jinja, tok, top_prefix(cfg))
    result["chat_template"] = chosen
    result["chat_templates_used"] = len(set(used_templates))
    return result


def _examples(cfg, tok, resolved, work: Path, vocab_size: int, progress: bool, first: int):
    """Every entry tokenised, masked and filtered, concatenated: ids, targets, offsets, per-entry stats, the chat
    templates used and how many conversations lack an EOS after a trained turn."""
    parts, per_dataset, used_templates, eos_missing = [], [], [], 0
    for n, (entry, where, kind, src) in enumerate(resolved, start=first):
        ids, labels, offsets, missing, rows, template, has_labels, roles = _entry_examples(
            cfg, tok, entry, where, kind, src, work, n, progress)
        st = {"dataset": where, "path": src.location, "type": kind, "rows": rows, "examples": len(offsets) - 1,
              "labels_column": has_labels}
        if roles:
            st["other_roles"] = roles
        ids, tgt, offsets = _filter(cfg, ids, labels, offsets, where, vocab_size, st)
        st.update(kept=len(offsets) - 1, tokens=int(len(ids)), trained_tokens=int((tgt >= 0).sum()))
        per_dataset.append(st)
        parts.append((ids, tgt, offsets))
        eos_missing += int(missing.sum())
        if template is not None:
            used_templates.append(template)
        if progress:
            print(f"{where}: {rows} rows -> {st['kept']} examples kept of {st['examples']}", flush=True)
    ids = np.concatenate([p[0] for p in parts])
    tgt = np.concatenate([p[1] for p in parts])
    base = np.cumsum([0] + [len(p[0]) for p in parts])
    offsets = np.concatenate([[0]] + [p[2][1:] + b for p, b in zip(parts, base)]).astype(np.int64)
    return ids, tgt, offsets, per_dataset, used_templates, eos_missing


def pad_id(tok) -> int:
    for t in (tok.pad_token_id, tok.eos_token_id):
        if t is not None:
            return int(t)
    return 0


def notes_for(cfg, result: dict) -> list[str]:
    """Lines for the run's start: defaults and filtering that change what is trained."""
    d, (_, key), out = cfg.data, names(cfg), []
    kinds = {s["type"] for s in result["datasets"]}
    if kinds - {"completion", "pretokenised"} and "train_on_inputs" not in d.model_fields_set:  # rows masked as given
        out.append("prompts, system and user turns are not trained (train_on_inputs: false, the default)")
    dropped = sum(s.get("dropped_too_long", 0) for s in result["datasets"])
    truncated = sum(s.get("truncated", 0) for s in result["datasets"])
    none = sum(s["no_trained_token"] for s in result["datasets"])
    if dropped:
        default = "" if "excess_length_strategy" in d.model_fields_set else ", the default"
        out.append(f"{dropped} examples longer than sequence_len={cfg.seq_len} dropped "
                   f"({key('excess_length_strategy')}: drop{default}; truncate keeps their start)")
    if truncated:
        out.append(f"{truncated} examples longer than sequence_len={cfg.seq_len} truncated to it")
    if none:
        out.append(f"{none} examples without a trained token skipped (they would add nothing, or a 0/0 loss)")
    if result.get("eos_missing"):
        out.append(f"{result['eos_missing']} conversations have a trained turn with no EOS "
                   f"({result['eos_token']}) right after it: the model is not taught to stop there; set "
                   f"{key('special_tokens')}.eos_token to the template's end-of-turn token (e.g. <|im_end|>)")
    unlabelled = [s["dataset"] for s in result["datasets"]
                  if s["type"] == "pretokenised" and not s.get("labels_column")]
    if unlabelled:
        out.append(f"pre-tokenised rows without a labels column train every token ({', '.join(unlabelled)})")
    if d.pad_to_sequence_len is False:
        out.append(f"every sample is padded to sequence_len={cfg.seq_len} (fixed shapes): pad_to_sequence_len: "
                   "false is not applied")
    short = sum(s.get("too_short", 0) for s in result["datasets"])
    if short:
        out.append(f"{short} examples shorter than {key('min_sample_len')}={d.min_sample_len} dropped")
    dup = result.get("duplicates") or {}
    if dup:
        name = "dataset_exact_deduplication" if cfg.source == "axolotl" else "data.deduplicate"
        out.append(f"{name}: {dup.get('train', 0)} duplicate training examples dropped"
                   + (f", {dup['test']} in the test datasets" if "test" in dup else ""))
    if result.get("val") and result.get("val_source") == "test_datasets":
        out.append(f"eval set: {result['val']['examples']} examples from {key('test_datasets')}")
    elif result.get("val"):
        how = f"shuffled with seed {d.seed}" if result.get("merged_shuffled", d.shuffle_merged_datasets) else \
            "unshuffled"
        out.append(f"{key('val_set_size')}={d.val_set_size:g}: {result['val']['examples']} examples held out "
                   f"(the tail of the merged data, {how})")
    for s in result["datasets"]:
        if s.get("other_roles"):
            shown = ", ".join(f"{r!r} ({k} turns)" for r, k in s["other_roles"].items())
            out.append(f"{s['dataset']}: roles outside its role mapping: {shown}; passed to the chat template as "
                       f"written and trained only if roles_to_train lists them or train_on_inputs is on (Axolotl's "
                       f"rule); map them with {s['dataset']}.roles")
    if result.get("chat_templates_used", 0) > 1:
        out.append("the datasets use different chat templates; the exported tokenizer gets "
                   "the top-level (or first) one")
    return out


# --- the entry point -----------------------------------------------------------------------------------------------

def _open(cfg, d: Path, reused: bool) -> SFTData:
    m = json.loads((d / "manifest.json").read_text())
    if m["seq_len"] != cfg.seq_len:  # the key includes it; a mismatch means a hand-edited cache
        raise bad("data.prepared_path", str(d), "was prepared for another sequence_len", "remove it")
    val = SFTDataset(d / "val", cfg.seq_len, m["pad_id"]) if (d / "val").is_dir() else None
    stats = {k: m[k] for k in ("total", "datasets", "train", "val") if k in m}
    return SFTData(SFTDataset(d / "train", cfg.seq_len, m["pad_id"]), val, stats, m["chat_template"], d,
                   notes_for(cfg, m), reused)


def prepare(cfg, tokenizer_dir, vocab_size: int, *, builder: bool = True, barrier: Callable[[], None] | None = None,
            progress: bool = True) -> SFTData:
    """The prepared SFT data for `cfg.data.datasets`, built on the `builder` rank if missing; `vocab_size`: the
    model's embedding rows (every token id must be below it).

    Every rank calls this with the same arguments; `barrier`, when given, is called exactly once on each (after
    the builder finished). Pick the builder as global rank 0 for a shared prepared_path, or local rank 0 per node
    for node-local disks. A data error found by the builder is raised on every rank.
    """
    if not cfg.data.datasets:
        raise bad("data.datasets", [], "no SFT datasets given", "list them under datasets:")
    tokenizer_dir = Path(tokenizer_dir)
    resolved, test = resolve_all(cfg), resolve_all(cfg, test=True)
    val_fraction(cfg, None)
    root = prepared_root(cfg)
    key = cache_key(cfg, resolved, tokenizer_dir, vocab_size, test)
    reused = (root / f"sft-{key}" / "manifest.json").is_file()
    _, k = names(cfg)
    final = build_once(root, f"sft-{key}", lambda tmp: _build(cfg, resolved, tokenizer_dir, vocab_size, tmp, progress,
                                                               test),
                       builder=builder, barrier=barrier,
                       unseen=(k("prepared_path"), "the prepared data", "put it on storage shared with the builder "
                               "rank, or build with local rank 0 per node"))
    return _open(cfg, final, reused)


__all__ = ["SFTData", "prepare", "check", "check_choices", "prepared_root", "cache_key", "load_tokenizer"]
