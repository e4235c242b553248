"""KTO's labelled rows for `rl: kto`, as Axolotl 067b021 renders them and TRL 1.8.0's KTOTrainer tokenises them.

Axolotl's KTO types (its prompt_strategies.kto.llama3 and .chatml modules; `type: llama3.ultra` etc.) write a
prompt string in the template's own markup (an optional `system` turn, the user turn from `prompt` / `instruction`
/ `question`, or argilla_chat's first message, then the assistant header) and a completion string (the answer, or
argilla_chat's second message, followed by the template's end-of-turn); `label` is kept. Axolotl drops a row
whose prompt plus completion (tokenised without special tokens) exceeds `sequence_len`. TRL, given those strings (not
conversational), appends the tokenizer's EOS to a completion that does not end with it, tokenises the prompt and the
prompt + completion (with the tokenizer's special tokens) and takes the completion's ids as what follows the
prompt's (preference.tokenize's rule); its collator joins prompt and completion and truncates at `max_length`
(= sequence_len), keeping the start.

Stored per row: the prompt's ids and the completion's ids (each padded to seq_len), their lengths and the label, so
the loop can join any prompt with any completion: a row's own sequence, and TRL's KL rows (row i's prompt with row
i−1's completion inside a micro-batch: adapter/train/kto.py), in the order they are trained: Axolotl shuffles the
merged rows once with its seed (`shuffle_merged_datasets`, on by default; here the seed's permutation, as SFT's
prepare.py, not the datasets library's) and TRL's KTOConfig then samples them in that order every epoch (its KL
pairs are fixed neighbours in it), so the loop reads them in order (adapter/train/batches.py).

Held out as for the other objectives (Axolotl's utils/data/rl.py): `test_datasets` prepared the same way, else
`val_set_size` rows from the tail of that shuffled order (train_test_split with shuffle=False), both sides kept in
it: TRL evaluates its eval rows in order too, their KL rows built the same way (adapter/train/kto.evaluate).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from adapter.data.sft import formats, sources
from adapter.data.sft.preference import PairData, prepare_pairs, split, tokenize
from adapter.data.sft.preference import debug_lines as pair_lines
from adapter.data.sft.prepare import (
    cache_key,
    load_tokenizer,
    names,
    pad_id,
    prepared_root,
    resolve_all,
)
from adapter.errors import bad
from adapter.osutil import build_once

VERSION = 2  # 2: the held-out rows (val_set_size / test_datasets)
# (system turn, user turn + assistant header, end of the answer) of Axolotl's two KTO templates
MARKUP = {"llama3": ("<|start_header_id|>system<|end_header_id|>\n\n{}<|eot_id|>",
                     "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|><|start_header_id|>assistant"
                     "<|end_header_id|>\n\n", "<|eot_id|>"),
          "chatml": ("<|im_start|>system\n{}<|im_end|>\n", "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
                     "<|im_end|>")}
USER_FIELD = {"argilla": "instruction", "intel": "question", "prompt_pairs": "prompt", "ultra": "prompt"}


def render(row: dict, kind: str) -> tuple[str, str, bool]:
    """(prompt, completion, label) of one row, as Axolotl's KTO transform `kind` (e.g. llama3.ultra) renders it."""
    template, strategy = kind.split(".")
    system, user, end = MARKUP[template]
    if strategy == "argilla_chat":  # no system turn
        return user.format(row["completion"][0]["content"]), row["completion"][1]["content"] + end, bool(row["label"])
    head = system.format(row["system"]) if row.get("system") else ""
    return head + user.format(row[USER_FIELD[strategy]]), row["completion"] + end, bool(row["label"])


class KTODataset:
    """The prepared rows: item i is {tokens, labels, loss_mask, position_ids} [1, seq_len] of its own sequence,
    and kto_prompt, kto_completion [1, seq_len], kto_len [1, 2] (prompt, completion tokens), kto_label [1, 1], pair
    [1, 1] (i)."""

    def __init__(self, d: Path, seq_len: int, part: str = "rows"):
        z = np.load(d / f"{part}.npz")
        self.prompt, self.completion, self.lengths, self.labels = z["prompt"], z["completion"], z["length"], z["label"]
        self.rows, self.seq_len, self.pad = z["rows"], seq_len, int(z["pad"])

    def __len__(self) -> int:
        return len(self.prompt)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        tok, mask = join(self.prompt[i], self.completion[i], self.lengths[i], self.seq_len, self.pad)
        return {**targets(tok[None], mask[None]), "kto_prompt": self.prompt[i][None].astype(np.int64),
                "kto_completion": self.completion[i][None].astype(np.int64),
                "kto_len": self.lengths[i][None].astype(np.int64),
                "kto_label": np.full((1, 1), float(self.labels[i]), np.float32),
                "pair": np.full((1, 1), i, np.int64)}  # the row's index: a full fine-tune's reference table


def join(prompt: np.ndarray, completion: np.ndarray, lengths, seq: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [seq], completion mask [seq]) of prompt + completion cut at seq (TRL's collator, keep_start)."""
    p, c = int(lengths[0]), int(lengths[1])
    ids = np.concatenate([prompt[:p], completion[:c]])[:seq]
    tok = np.full(seq, pad, np.int64)
    tok[:len(ids)] = ids
    mask = np.zeros(seq, np.float32)
    mask[p:len(ids)] = 1
    return tok, mask


def targets(tok: np.ndarray, completion: np.ndarray) -> dict[str, np.ndarray]:
    """Next-token targets of rows [n, seq]: loss_mask[t] marks that token t+1 is a completion token."""
    n, seq = tok.shape
    return {"tokens": tok, "labels": np.concatenate([tok[:, 1:], tok[:, :1] * 0], axis=1),
            "loss_mask": np.concatenate([completion[:, 1:], np.zeros((n, 1), np.float32)], axis=1),
            "position_ids": np.broadcast_to(np.arange(seq, dtype=np.int64), tok.shape).copy()}


def fits(tok, prompt: str, completion: str, seq_len: int) -> bool:
    """Axolotl's drop filter for KTO rows (utils/data/rl.py `_drop_long_sequences`)."""
    return sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in (prompt, completion)) <= seq_len


def _rows(cfg, tok, resolved, vocab_size: int, hf_dir: Path, first: int = 0):
    """(prompts, completions, lengths, labels, stats) of the rows of `resolved` that fit (each id array padded)."""
    seq, pad = cfg.seq_len, (pad_id(tok) if tok.pad_token_id is None else int(tok.pad_token_id))
    prompts, completions, lengths, labels, stats = [], [], [], [], []
    for n, (entry, where, kind, src) in enumerate(resolved, first):
        ds = sources.load(src, entry, hf_dir)
        formats.check_columns(entry, kind, list(ds.column_names), where, src.location)
        kept = dropped = 0
        for i, row in enumerate(ds):
            try:
                prompt, completion, label = render(row, kind)
            except (KeyError, TypeError, IndexError) as e:
                raise bad(f"{where}.path", src.location, f"row {i} is not a row of {kind} ({type(e).__name__}: {e})",
                          f"give the columns {', '.join(formats.required_columns(entry, kind))}") from None
            if not fits(tok, prompt, completion, seq):
                dropped += 1
                continue
            p, c, _ = tokenize(tok, prompt, completion, completion)
            p, c = p[:seq], c[:seq]
            if max(p + c, default=0) >= vocab_size:
                raise bad(f"{where}.path", src.location, f"row {i} has a token id outside the model's {vocab_size} "
                          "embedding rows", "use the model's own tokenizer")
            for store, ids in ((prompts, p), (completions, c)):
                a = np.full(seq, pad, np.int32)
                a[:len(ids)] = ids
                store.append(a)
            lengths.append([len(p), len(c)])
            labels.append(label)
            kept += 1
        stats.append({"dataset": n, "type": kind, "path": src.location, "rows": len(ds), "dropped_too_long": dropped,
                      "kept": kept})
    return prompts, completions, lengths, labels, stats


def _build(cfg, resolved, test, tokenizer_dir: Path, vocab_size: int, out: Path) -> dict:
    tok = load_tokenizer(cfg, tokenizer_dir, vocab_size)
    pad = pad_id(tok) if tok.pad_token_id is None else int(tok.pad_token_id)
    k = names(cfg)[1]
    parts = []
    for which, entries, first in (("datasets", resolved, 0), ("test_datasets", test, len(resolved))):
        if not entries:
            continue
        rows = _rows(cfg, tok, entries, vocab_size, out / "hf", first)
        if not rows[0]:
            raise bad(k(which), "...", f"no row fits sequence_len {cfg.seq_len}", "raise sequence_len")
        parts.append(rows)
    prompts, completions, lengths, labels, stats = parts[0]
    n = len(prompts)
    train, held = split(cfg, n, len(resolved), shuffled=True, held=not test)
    sets = {"rows": (np.stack(prompts), np.stack(completions), np.asarray(lengths), np.asarray(labels, bool), train)}
    if test:
        t_p, t_c, t_l, t_lab, t_stats = parts[1]
        stats = stats + t_stats
        sets["val"] = (np.stack(t_p), np.stack(t_c), np.asarray(t_l), np.asarray(t_lab, bool), np.arange(len(t_p)))
    elif len(held):
        sets["val"] = (*sets["rows"][:4], held)
    for name, (p, c, ln, lab, idx) in sets.items():
        np.savez(out / f"{name}.npz", prompt=p[idx], completion=c[idx], length=ln[idx], label=lab[idx], rows=idx,
                 pad=np.asarray(pad))
    val = sets["val"][4] if "val" in sets else []
    manifest = {"v": VERSION, "seq_len": cfg.seq_len, "datasets": stats, "pairs": len(train), "val_pairs": len(val),
                "val_source": "test_datasets" if test else "val_set_size",
                "desirable": int(np.asarray(labels, bool)[train].sum()), "chat_template": None}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def prepare_kto(cfg, tokenizer_dir, vocab_size: int, *, builder: bool = True, barrier=None) -> PairData:
    """The prepared rows of `cfg.data.datasets`, built once on the `builder` rank (prepare.prepare's contract)."""
    tokenizer_dir = Path(tokenizer_dir)
    resolved, test = resolve_all(cfg), resolve_all(cfg, test=True)
    root = prepared_root(cfg)
    name = f"kto{VERSION}-{cache_key(cfg, resolved, tokenizer_dir, vocab_size, test)}"
    reused = (root / name / "manifest.json").is_file()
    final = build_once(root, name, lambda tmp: _build(cfg, resolved, test, tokenizer_dir, vocab_size, tmp),
                       builder=builder, barrier=barrier,
                       unseen=(names(cfg)[1]("prepared_path"), "the prepared rows", "put it on storage shared with "
                               "the builder rank"))
    m = json.loads((final / "manifest.json").read_text())
    val = KTODataset(final, cfg.seq_len, "val") if (final / "val.npz").is_file() else None
    return PairData(KTODataset(final, cfg.seq_len), m, None, final, reused, val)  # type: ignore[arg-type]


def debug_lines(data: PairData, tok, samples: int = 3) -> list[str]:
    """The first rows in training order: each token with its label (-100 outside the completion)."""
    out = []
    for i in range(min(samples, len(data.train))):
        item = data.train[i]
        t, m = item["tokens"][0], item["loss_mask"][0]
        n = int(item["kto_len"][0].sum())
        label = "desirable" if item["kto_label"][0, 0] else "undesirable"
        shown = [f"({tok.decode([int(x)])!r}, {int(x) if j and m[j - 1] else -100})" for j, x in enumerate(t[:n])]
        out.append(f"row {i} {label} ({n} tokens, {int(m.sum())} completion): " + " ".join(shown))
    return out


def prepare_rows(cfg, tokenizer_dir, vocab_size: int, *, builder: bool = True, barrier=None,
                 progress: bool = True) -> PairData:
    """The prepared preference data of any `rl:` objective: KTO's labelled rows, or the other objectives' pairs
    (adapter/data/sft/preference.py)."""
    if cfg.objective == "kto":
        return prepare_kto(cfg, tokenizer_dir, vocab_size, builder=builder, barrier=barrier)
    return prepare_pairs(cfg, tokenizer_dir, vocab_size, builder=builder, barrier=barrier, progress=progress)


def any_debug_lines(data: PairData, tok, samples: int = 3) -> list[str]:
    """`nd-adapter preprocess --debug` of either kind of prepared preference data."""
    return debug_lines(data, tok, samples) if isinstance(data.train, KTODataset) else pair_lines(data, tok, samples)


__all__ = ["render", "KTODataset", "join", "targets", "fits", "prepare_kto", "debug_lines", "prepare_rows",
           "any_debug_lines"]
