"""Preference pairs for `rl: dpo` (and `ipo`, `simpo`; `orpo`'s rows: preference_orpo.py; a reward model's:
preference_bt.py), prepared as Axolotl
067b021 and TRL 1.8.0 prepare them, once, into the cache.

Axolotl's `chat_template.default` type (prompt_strategies/dpo/chat_template.py) renders three strings per row: the
prompt (the `field_messages` conversation through the chat template with the generation prompt), and the chosen and
rejected answers (each rendered after a dummy user turn, cut from where the answer's text starts, trailing
whitespace stripped). Axolotl then drops a pair whose prompt plus either answer (tokenised without special tokens)
exceeds `sequence_len` (its default excess_length_strategy). TRL's DPOTrainer, given those strings, appends the EOS
to an answer that does not end with it, tokenises the prompt and the prompt + answer (with the tokenizer's special
tokens) and takes the answer's ids as what follows the prompt's; its collator joins prompt and answer, truncates
the sequence to `max_length` (= sequence_len) keeping the start, and marks the answer's tokens as the completion.
`rl: ipo` is the same trainer. `rl: simpo` renders the same strings (Axolotl loads its types from
prompt_strategies/dpo) but TRL's CPOTrainer tokenises them as the ORPOTrainer does (the same `tokenize_row`:
preference_orpo.tokenize_orpo), so its cache has its own name.

Held out as Axolotl holds out for `rl:` runs (utils/data/rl.py): `test_datasets` prepared the same way, else
`val_set_size` pairs (a fraction rounded up, or a count) from the tail of the pairs in the order
`shuffle_merged_datasets` gives them (the seed's permutation, as SFT's split in prepare.py; Axolotl's
train_test_split with shuffle=False takes the tail of its shuffled merge).

Stored: tokens [pairs, 2, seq_len] (chosen then rejected, padded with the pad or EOS token as TRL pads) and the
completion mask beside them, for the training pairs and the held-out ones. An item gives the loop next-token
targets: `loss_mask[t]` marks that token t+1 is a completion token, so Σ loss_mask · log p(tokens[t+1]) is TRL's
per-sequence log-probability.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from jinja2.exceptions import TemplateError

from adapter.data.sft import formats, sources, templates
from adapter.data.sft.order import merged_order
from adapter.data.sft.preference_bt import tokenize_bt
from adapter.data.sft.preference_orpo import render_argilla, tokenize_orpo
from adapter.data.sft.prepare import (
    cache_key,
    load_tokenizer,
    names,
    pad_id,
    prepared_root,
    resolve_all,
    top_prefix,
    val_fraction,
)
from adapter.errors import bad
from adapter.osutil import build_once

VERSION = 2  # 2: the held-out pairs (val_set_size / test_datasets)
DUMMY_USER = {"role": "user", "content": "[[dummy_message]]"}  # Axolotl's, rendered before each answer
ROLES = {"user": ["user"], "assistant": ["assistant"], "system": ["system"], "tool": ["tool"]}


class PairDataset:
    """The prepared pairs: item i is {tokens, labels, loss_mask, position_ids, seq_mask}, each [2, seq_len] (chosen,
    rejected; seq_mask: every next-token target inside the sequence, prompt included),
    and `pair` [2, 1] (i: where a full fine-tune finds its precomputed reference, adapter/train/dpo.py)."""

    def __init__(self, d: Path, seq_len: int, part: str = "pairs"):
        z = np.load(d / f"{part}.npz")
        self.tokens, self.completion, self.seq_len = z["tokens"], z["completion"], seq_len
        self.rows = z["rows"]  # each pair's place among the prepared pairs (before the split), for --debug and tests
        self.length = z["length"]  # [pairs, 2] tokens of each sequence (ORPO's NLL covers all of the chosen one)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        tok = self.tokens[i].astype(np.int64)
        labels = np.concatenate([tok[:, 1:], tok[:, :1] * 0], axis=1)
        mask = np.concatenate([self.completion[i][:, 1:], np.zeros((2, 1), np.uint8)], axis=1).astype(np.float32)
        pos = np.broadcast_to(np.arange(self.seq_len, dtype=np.int64), tok.shape).copy()
        seq = (pos < self.length[i][:, None] - 1).astype(np.float32)  # predicts a token of the sequence
        return {"tokens": tok, "labels": labels, "loss_mask": mask, "position_ids": pos, "seq_mask": seq,
                "pair": np.full((2, 1), i, np.int64)}


def row_lengths(b):
    """Tokens of each row of a micro-batch of prepared pairs ([rows, seq] arrays or tensors): its seq_mask covers
    every position but a sequence's last."""
    return b["seq_mask"].sum(1) + 1


def shared_prefix(b):
    """[pairs] int64: each pair's leading tokens that both of its rows hold and neither trains on (its prompt, less
    the last token, which predicts a different first answer token in each row), from a [rows, seq] micro-batch of
    tensors, chosen rows first: what a shared stream runs once (adapter/kernels/thd.pairs_to_shared_stream). Every
    row keeps at least its last token of its own."""
    m = b["tokens"].shape[0] // 2
    both = lambda k: (b[k][:m], b[k][m:])  # noqa: E731
    (tc, tr), (lc, lr), (sc, sr) = both("tokens"), both("loss_mask"), both("seq_mask")
    same = (tc == tr) & (lc == 0) & (lr == 0) & (sc > 0) & (sr > 0)
    return same.long().cumprod(1).sum(1)


@dataclass
class PairData:
    train: PairDataset
    stats: dict[str, Any]
    chat_template: str | None
    path: Path
    reused: bool = False
    val: PairDataset | None = None
    notes: list[str] = field(default_factory=list)


def render(row: dict, entry, tok, template: str) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) strings of one row, as Axolotl's chat_template.default transform renders them."""
    props = entry.message_property_mappings or {"role": "role", "content": "content"}
    role_of = {src: target for target, srcs in (entry.roles or ROLES).items() for src in srcs}
    rk, ck = props.get("role", "role"), props.get("content", "content")
    messages = row[entry.field_messages]
    if isinstance(messages, str):
        messages = [{rk: "user", ck: messages}]
    messages = [{"role": role_of[m[rk]], "content": m[ck]} for m in messages]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, chat_template=template, tokenize=False)
    answers = []
    for key in (entry.field_chosen, entry.field_rejected):
        raw = row[key]
        msg = {rk: "assistant", ck: raw} if isinstance(raw, str) else raw if isinstance(raw, dict) else raw[-1]
        answer = {"role": role_of[msg[rk]], "content": msg[ck]}
        text = tok.apply_chat_template([DUMMY_USER, answer], add_generation_prompt=False, chat_template=template,
                                       tokenize=False)
        answers.append(text[text.find(answer["content"]):].rstrip())
    return prompt, answers[0], answers[1]


def fits(tok, prompt: str, chosen: str, rejected: str, seq_len: int) -> bool:
    """Axolotl's drop filter for DPO rows (utils/data/rl.py `_drop_long_sequences`)."""
    n = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in (prompt, chosen, rejected)]
    return n[0] + n[1] <= seq_len and n[0] + n[2] <= seq_len


def tokenize(tok, prompt: str, chosen: str, rejected: str) -> tuple[list[int], list[int], list[int]]:
    """TRL 1.8.0's tokenisation of a non-conversational pair: EOS appended where missing, then the answer's ids are
    those of prompt + answer after the prompt's."""
    eos = tok.eos_token
    p = tok(prompt)["input_ids"]
    out = [p]
    for answer in (chosen, rejected):
        answer = answer if answer.endswith(eos) else answer + eos
        out.append(tok(prompt + answer)["input_ids"][len(p):])
    return out[0], out[1], out[2]


def _pairs(cfg, tok, resolved, vocab_size: int, hf: Path, first: int = 0) -> tuple[list, list, list, list, str | None]:
    """(tokens, completion masks, lengths, per-dataset stats, the template) of the entries' pairs that fit: rendered
    and tokenised for DPO here, for ORPO as preference_orpo.py says."""
    seq, pad = cfg.seq_len, (pad_id(tok) if tok.pad_token_id is None else int(tok.pad_token_id))
    orpo = cfg.objective == "orpo"  # argilla rows, TRL's ORPO tokenisation
    cpo = cfg.objective in ("orpo", "simpo")  # CPOTrainer's tokenize_row is ORPOTrainer's
    bt = cfg.objective == "reward"  # Axolotl's bradley_terry.chat_template rows (preference_bt.py)
    tokens, completion, lengths, stats, template = [], [], [], [], None
    for n, (entry, where, kind, src) in enumerate(resolved, first):
        ds = sources.load(src, entry, hf)
        formats.check_columns(entry, kind, list(ds.column_names), where, src.location)
        own = entry.chat_template is not None or entry.chat_template_jinja is not None
        template = (templates.resolve_template(entry.chat_template, entry.chat_template_jinja, tok, f"{where}.") if own
                    else templates.resolve_template(cfg.data.chat_template, cfg.data.chat_template_jinja, tok,
                                                    top_prefix(cfg)))
        kept = dropped = 0
        for i, row in enumerate(ds):
            try:
                if bt:  # whole conversations, cut to sequence_len (preference_bt.py): each sequence is scored
                    (c_ids, r_ids), c_p, r_p = tokenize_bt(row, tok, template, seq, entry.drop_system_message), 0, 0
                else:
                    prompt, chosen, rejected = (render_argilla(row, tok, template) if orpo else
                                                render(row, entry, tok, template))
            except (KeyError, TypeError, IndexError) as e:
                raise bad(f"{where}.path", src.location, f"row {i} is not a preference pair of this entry's fields "
                          f"({type(e).__name__}: {e})", "give chosen and rejected conversations (user and assistant "
                          "turns, role and content)" if orpo else "give system, input, chosen and rejected strings"
                          if bt else "give field_messages, field_chosen and field_rejected (and roles / "
                          "message_property_mappings) as the rows spell them") from None
            except TemplateError as e:  # the template's own raise_exception (Gemma's: no system role)
                raise bad(where, f"row {i}", f"the chat template failed on it: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}", "set drop_system_message: true on this "
                          "dataset if it names the system role, or use a chat template that accepts the rows"
                          ) from None
            if not bt:  # (Axolotl cuts a reward model's pairs to sequence_len and drops none)
                if not fits(tok, prompt, chosen, rejected, seq):
                    dropped += 1
                    continue
                if cpo:
                    c_ids, c_p, r_ids, r_p = tokenize_orpo(tok, prompt, chosen, rejected, seq)
                else:
                    p, c, r = tokenize(tok, prompt, chosen, rejected)
                    c_ids, c_p, r_ids, r_p = p + c, len(p), p + r, len(p)
            t = np.full((2, seq), pad, np.int32)
            m = np.zeros((2, seq), np.uint8)
            for j, (ids, start) in enumerate(((c_ids, c_p), (r_ids, r_p))):
                ids = ids[:seq]  # TRL's collator: max_length, keep_start
                t[j, :len(ids)] = ids
                m[j, start:len(ids)] = 1
            if int(t.max()) >= vocab_size:
                raise bad(f"{where}.path", src.location, f"row {i} has token id {int(t.max())} outside the "
                          f"model's {vocab_size} embedding rows", "use the model's own tokenizer")
            tokens.append(t)
            completion.append(m)
            lengths.append([min(len(c_ids), seq), min(len(r_ids), seq)])
            kept += 1
        stats.append({"dataset": n, "type": kind, "path": src.location, "rows": len(ds), "dropped_too_long": dropped,
                      "kept": kept})
    return tokens, completion, lengths, stats, template


def split(cfg, n: int, datasets: int = 1, *, shuffled: bool = False,
          held: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) indices of n prepared rows of `datasets` datasets for val_set_size (none where `held` is
    off: test_datasets give them): the tail of the merged order (order.merged_order: the seed's permutation, or
    the rows in order); the training ones in their prepared order, or in the merged order where the rows are
    trained in it (`shuffled`: KTO, whose TRL trainer samples its rows in this order; data.curriculum)."""
    order = merged_order(cfg, n, datasets)
    n_val = val_fraction(cfg, n) if held else 0
    train = order[:n - n_val]
    return (train if shuffled or cfg.data.curriculum else np.sort(train)), order[n - n_val:]


def _build(cfg, resolved, test, tokenizer_dir: Path, vocab_size: int, out: Path, progress: bool) -> dict:
    tok = load_tokenizer(cfg, tokenizer_dir, vocab_size)
    tokens, completion, lengths, stats, template = _pairs(cfg, tok, resolved, vocab_size, out / "hf")
    k = names(cfg)[1]
    if not tokens:
        raise bad(k("datasets"), "...", f"no pair fits sequence_len {cfg.seq_len}", "raise sequence_len")
    parts = {}
    if test:
        t_tok, t_comp, t_len, t_stats, _ = _pairs(cfg, tok, test, vocab_size, out / "hf", first=len(resolved))
        if not t_tok:
            raise bad(k("test_datasets"), "...", f"no pair fits sequence_len {cfg.seq_len}", "raise sequence_len")
        stats += t_stats
        parts["val"] = (np.stack(t_tok), np.stack(t_comp), np.asarray(t_len), np.arange(len(t_tok)))
        train, val = split(cfg, len(tokens), len(resolved), held=False)
    else:
        train, val = split(cfg, len(tokens), len(resolved))
    tok_all, comp_all, len_all = np.stack(tokens), np.stack(completion), np.asarray(lengths)
    parts["pairs"] = (tok_all[train], comp_all[train], len_all[train], train)
    if val is not None and len(val):
        parts["val"] = (tok_all[val], comp_all[val], len_all[val], val)
    for name, (t, c, n, rows) in parts.items():
        np.savez(out / f"{name}.npz", tokens=t, completion=c, length=n, rows=rows)
    manifest = {"v": VERSION, "seq_len": cfg.seq_len, "datasets": stats, "pairs": len(train),
                "val_pairs": len(parts["val"][0]) if "val" in parts else 0,
                "val_source": "test_datasets" if test else "val_set_size", "chat_template": template}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def prepare_pairs(cfg, tokenizer_dir, vocab_size: int, *, builder: bool = True,
                  barrier: Callable[[], None] | None = None, progress: bool = True) -> PairData:
    """The prepared pairs of `cfg.data.datasets`, built once on the `builder` rank (prepare.prepare's contract);
    KTO's labelled rows: adapter/data/sft/preference_kto.prepare_kto (`prepare_rows` picks)."""
    tokenizer_dir = Path(tokenizer_dir)
    resolved, test = resolve_all(cfg), resolve_all(cfg, test=True)
    root = prepared_root(cfg)
    tag = {"simpo": "cpo", "reward": "bt"}.get(cfg.objective, "dpo")  # the tokenisation (types tell ORPO's apart)
    name = f"{tag}{VERSION}-{cache_key(cfg, resolved, tokenizer_dir, vocab_size, test)}"
    reused = (root / name / "manifest.json").is_file()
    k = names(cfg)[1]
    final = build_once(root, name, lambda tmp: _build(cfg, resolved, test, tokenizer_dir, vocab_size, tmp, progress),
                       builder=builder, barrier=barrier,
                       unseen=(k("prepared_path"), "the prepared pairs", "put it on storage shared with the builder "
                               "rank"))
    m = json.loads((final / "manifest.json").read_text())
    val = PairDataset(final, cfg.seq_len, "val") if (final / "val.npz").is_file() else None
    return PairData(PairDataset(final, cfg.seq_len), m, m["chat_template"], final, reused, val)


def stats_lines(data: PairData) -> list[str]:
    what = "rows" if "desirable" in data.stats else "pairs"  # KTO's labelled rows (preference_kto.py)
    out = [f"prepared {what}: {data.path} ({'reused' if data.reused else 'built'})"]
    for d in data.stats["datasets"]:
        out.append(f"  {d['dataset']} {d['type']} {d['path']}: {d['rows']} rows, {d['dropped_too_long']} over "
                   f"sequence_len dropped, {d['kept']} {what} kept")
    if what == "rows":
        out.append(f"  {data.stats['desirable']} desirable, {data.stats['pairs'] - data.stats['desirable']} "
                   "undesirable")
    if data.val is not None:
        k = "test_datasets" if data.stats.get("val_source") == "test_datasets" else "val_set_size"
        out.append(f"  held out ({k}): {len(data.val)} {what} for the eval, {len(data.train)} {what} to train on")
    return out


def debug_lines(data: PairData, tok, samples: int = 3) -> list[str]:
    """The first pairs: prompt, then each answer's (token, label) pairs (label -100 outside the completion); KTO's
    rows: preference_kto.debug_lines."""
    out = []
    scored = any(d["type"] == formats.BRADLEY_TERRY for d in data.stats["datasets"])  # a reward model's pairs
    for i in range(min(samples, len(data.train))):
        t, m = data.train.tokens[i], data.train.completion[i]
        for j, side in enumerate(("chosen", "rejected")):
            n = int(m[j].nonzero()[0].max()) + 1 if m[j].any() else 0
            pairs = [f"({tok.decode([int(x)])!r}, {int(x) if c else -100})" for x, c in zip(t[j][:n], m[j][:n])]
            what = "scored at its last token" if scored else f"{int(m[j].sum())} completion"
            out.append(f"pair {i} {side} ({n} tokens, {what}): " + " ".join(pairs))
    return out


__all__ = ["row_lengths", "PairDataset", "PairData", "render", "fits", "tokenize", "split", "prepare_pairs",
           "stats_lines", "debug_lines"]
