"""Dataset types -> tokens and labels (-100 = not trained), as Axolotl builds them, one batched `map` function each.

  completion    text column (`field`, default text): tokenised with the tokenizer's own specials, EOS appended,
                cut into consecutive chunks of seq_len; everything trained.
  alpaca        instruction / input / output in Axolotl's instruct prompt (`alpaca:chat|chatml|phi`: its other
                AlpacaPrompter styles); the prompt (BOS included) is masked unless train_on_inputs, the output
                and the EOS after it are trained. Prompt and output are tokenised apart and truncated to seq_len
                each, as Axolotl does.
  chat_template messages rendered by a chat template (templates.py).
  input_output  `segments: [{label, text}]`, each tokenised without specials, trained where label is true.
  stepwise_supervised  a process reward model's rows (prompt, completions: the steps, labels: each step's class),
                as Axolotl's stepwise strategy: each step and `step_separator` tokenised apart, the step's last
                token labelled with its class (the labels are classes here, not token ids: model.num_labels).
  (no type)     pre-tokenised rows: input_ids, optional labels (-100 = masked; absent = all trained) and
                attention_mask (0 = padding, dropped).
Every returned row is one example; labels follow the HF convention (aligned with input_ids, unshifted).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapter.errors import bad

IGNORE = -100
# Axolotl's AlpacaPrompter (axolotl/prompters.py): a system line, then the turn, per style (`alpaca:<style>`)
ALPACA_SYSTEM = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                 "Write a response that appropriately completes the request.")
ALPACA_SYSTEM_NO_INPUT = "Below is an instruction that describes a task. Write a response that appropriately " \
    "completes the request."
ALPACA_STYLES = {  # style: (system format, turn with input, turn without input)
    "instruct": ("{system}\n\n", "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
                 "### Instruction:\n{instruction}\n\n### Response:\n"),
    "chat": ("SYSTEM: {system}\n", "USER: {instruction}\n{input}\nASSISTANT:", "USER: {instruction}\nASSISTANT:"),
    "chatml": ("<|im_start|>system\n{system}<|im_end|>\n",
               "<|im_start|>user\n{instruction}\n{input}<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n"),
    "phi": ("<|system|>\n{system}<|end|>\n", "<|user|>\n{instruction}<|end|>{input}<|assistant|>",
            "<|user|>\n{instruction}<|end|>\n<|assistant|>\n"),
}


def alpaca_prompt(style: str, instruction: str, input: str) -> str:
    system, turn, bare = ALPACA_STYLES[style]
    if input:
        return system.format(system=ALPACA_SYSTEM) + turn.format(instruction=instruction, input=input)
    return system.format(system=ALPACA_SYSTEM_NO_INPUT) + bare.format(instruction=instruction)


ALPACA_NO_INPUT = alpaca_prompt("instruct", "{instruction}", "")
TYPES = ("completion", "alpaca", "chat_template", "input_output", "stepwise_supervised")
STEPWISE = "stepwise_supervised"
STEP_KEYS = {"step_separator", "max_completion_length", "train_on_last_step_only"}
PREFERENCE = "chat_template.default"  # Axolotl's preference type for rl: dpo (adapter/data/sft/preference.py)
ARGILLA = "chat_template.argilla"  # Axolotl's ORPO preference type (prompt_strategies/orpo/chat_template.py)
BRADLEY_TERRY = "bradley_terry.chat_template"  # Axolotl's reward-model pairs (prompt_strategies/bradley_terry)
# the preference type each objective reads (Axolotl loads ipo's and simpo's from prompt_strategies/dpo)
PAIR_TYPES = {"dpo": PREFERENCE, "ipo": PREFERENCE, "simpo": PREFERENCE, "orpo": ARGILLA, "reward": BRADLEY_TERRY}
# Axolotl's KTO types (prompt_strategies/kto/{llama3,chatml}.py): template.strategy (adapter/data/sft/preference_kto.py)
KTO_TYPES = tuple(f"{t}.{s}" for t in ("llama3", "chatml") for s in ("argilla", "argilla_chat", "intel",
                                                                      "prompt_pairs", "ultra"))
KTO_COLUMNS = {"argilla": ["instruction", "completion", "label"], "argilla_chat": ["completion", "label"],
               "intel": ["question", "completion", "label"], "prompt_pairs": ["prompt", "completion", "label"],
               "ultra": ["prompt", "completion", "label"]}
PAIR_KEYS = {"field_chosen", "field_rejected"}
PRETOKENISED = "pretokenised"
CHAT_KEYS = {"field_messages", "field_system", "field_tools", "message_property_mappings", "roles", "roles_to_train",
             "train_on_eos", "train_on_eot", "chat_template", "chat_template_jinja", "drop_system_message"}


def kind_of(entry, where: str, objective: str = "sft") -> str:
    """The entry's type, checked: one line for an unknown or deprecated one, keys that belong to another type, or
    a type of the other objective (preference pairs for DPO, examples for SFT)."""
    t = entry.type
    if t is None:
        kind = PRETOKENISED
    elif t == "sharegpt" or t.startswith("sharegpt:"):
        raise bad(f"{where}.type", t, "sharegpt is deprecated in Axolotl and not supported",
                  "use type: chat_template with message_property_mappings: {role: from, content: value} and "
                  "field_messages: conversations")
    elif t.startswith("alpaca:"):
        if t.split(":", 1)[1] not in ALPACA_STYLES:
            raise bad(f"{where}.type", t, "not one of Axolotl's alpaca prompt styles",
                      f"use one of {', '.join('alpaca:' + s for s in ALPACA_STYLES)} (or alpaca: instruct)")
        kind = "alpaca"
    elif t in (PREFERENCE, ARGILLA, BRADLEY_TERRY) or (objective == "kto" and t in KTO_TYPES):
        kind = t  # (Axolotl's DPO strategies share the KTO types' names: under rl: dpo they are another type)
    elif t not in TYPES:
        raise bad(f"{where}.type", t, "unknown dataset type",
                  f"use one of {', '.join(TYPES)}, or leave type out for pre-tokenised rows (input_ids, labels)")
    else:
        kind = t
    if objective == "kto" and kind not in KTO_TYPES:
        raise bad(f"{where}.type", t, "rl: kto trains on labelled rows of one of Axolotl's KTO types (its "
                  "prompt_strategies/kto)", f"use one of {', '.join(KTO_TYPES)}")
    want = PAIR_TYPES.get(objective)
    if want is not None and kind != want:
        what = "reward_model: true" if objective == "reward" else f"rl: {objective}"
        home = {ARGILLA: "orpo", BRADLEY_TERRY: "bradley_terry"}.get(want, "dpo")
        raise bad(f"{where}.type", t, f"{what} trains on preference pairs of type {want} (Axolotl loads "
                  f"{what}'s types from its prompt_strategies/{home})",
                  f"use type: {want}" + {PREFERENCE: " (field_messages, field_chosen, field_rejected)",
                                         BRADLEY_TERRY: " (system, input, chosen, rejected)"}.get(
                      want, " (chosen and rejected conversations, optional system / prompt)"))
    if want is None and kind in (PREFERENCE, ARGILLA, BRADLEY_TERRY):
        user = {PREFERENCE: "rl: dpo, ipo or simpo", ARGILLA: "rl: orpo", BRADLEY_TERRY: "reward_model: true"}[kind]
        raise bad(f"{where}.type", t, f"{kind} is a preference type (for {user})", "set that, or use type: "
                  "chat_template")
    given = {k for k in entry.model_fields_set if getattr(entry, k) is not None}
    # a reward model's rows: the template and drop_system_message are read (Axolotl's bradley_terry prompter takes them)
    bt_keys = {"chat_template", "chat_template_jinja", "drop_system_message"} if kind == BRADLEY_TERRY else set()
    stray = sorted(given & CHAT_KEYS - bt_keys) if kind not in ("chat_template", PREFERENCE) else []
    stray += sorted(given & PAIR_KEYS) if kind != PREFERENCE else []
    if kind != STEPWISE:  # (a stepwise key at its default, as a config written back out holds it, says nothing)
        stray += sorted(k for k in given & STEP_KEYS if getattr(entry, k) != type(entry).model_fields[k].default)
    if entry.field is not None and kind != "completion":
        stray.append("field")
    if stray:
        raise bad(f"{where}.{stray[0]}", getattr(entry, stray[0]), f"only applies to type "
                  f"{_home_of(stray[0])}"
                  f", not {t}",
                  "remove it or change the entry's type")
    return kind


def _home_of(key: str) -> str:
    """The type an entry key belongs to."""
    return ("completion" if key == "field" else PREFERENCE if key in PAIR_KEYS else STEPWISE if key in STEP_KEYS
            else "chat_template")


def required_columns(entry, kind: str) -> list[str]:
    return {"completion": [entry.field or "text"], "alpaca": ["instruction", "output"],
            "chat_template": [entry.field_messages], "input_output": ["segments"],
            STEPWISE: ["prompt", "completions", "labels"],
            PREFERENCE: [entry.field_messages, entry.field_chosen, entry.field_rejected],
            ARGILLA: ["chosen", "rejected"], BRADLEY_TERRY: ["system", "input", "chosen", "rejected"],
            **{k: KTO_COLUMNS[k.split(".")[1]] for k in KTO_TYPES},
            PRETOKENISED: ["input_ids"]}[kind]


def check_columns(entry, kind: str, columns: list[str], where: str, source: str) -> None:
    for col in required_columns(entry, kind):
        if col not in columns:
            key = {"completion": "field", "chat_template": "field_messages"}.get(kind, "type")
            fix = (f"set {key} to the column that holds it" if key != "type" else
                   "use a dataset with that column or the type that matches its columns")
            if kind == PRETOKENISED:
                fix = "set type (completion, alpaca, chat_template, input_output) to match the rows"
            raise bad(f"{where}.{key}", getattr(entry, key, None) if key != "type" else entry.type,
                      f"{source} has no column {col!r} (its columns: {', '.join(columns)})", fix)


def _text(value: Any, where: str, column: str, idx: int, *, optional: bool = False) -> str:
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise bad(where, f"row {idx}", f"column {column!r} is {type(value).__name__}, not text",
                  "fix the row or point the entry at the right column")
    return value


def make_formatter(kind: str, entry, tok, *, seq_len: int, train_on_inputs: bool, where: str,
                   chat=None, classes: int | None = None) -> Callable[[dict[str, list], list[int]], dict[str, list]]:
    """A batched map function: columns of a batch + row indices -> input_ids, labels, eos_missing and (chat) the
    roles outside the entry's role mapping, per example."""
    eos, bos = tok.eos_token_id, tok.bos_token_id

    def out(rows: list[tuple]) -> dict[str, list]:
        return {"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows],
                "eos_missing": [r[2] for r in rows], "other_roles": [r[3] if len(r) > 3 else [] for r in rows]}

    if kind == "completion":
        field, cap = entry.field or "text", seq_len * 64

        def completion(batch, idx):
            texts = [t for t, i in zip(batch[field], idx) if _text(t, where, field, i)]
            rows = []
            for ids in tok(texts, truncation=True, max_length=cap)["input_ids"] if texts else []:
                ids = list(ids)
                if ids and ids[-1] != eos and len(ids) < cap and eos is not None:
                    ids.append(eos)
                rows += [(ids[k:k + seq_len], ids[k:k + seq_len], False) for k in range(0, len(ids), seq_len)]
            return out(rows)
        return completion

    if kind == "alpaca":
        style = entry.type.split(":", 1)[1] if ":" in entry.type else "instruct"

        def alpaca(batch, idx):
            inputs = batch.get("input") or [None] * len(idx)
            prompts, outputs = [], []
            for ins, inp, o, i in zip(batch["instruction"], inputs, batch["output"], idx):
                ins, inp, o = (_text(ins, where, "instruction", i), _text(inp, where, "input", i, optional=True),
                               _text(o, where, "output", i))
                prompts.append(alpaca_prompt(style, ins, inp))
                outputs.append(o)
            p_ids = tok(prompts, truncation=True, max_length=seq_len)["input_ids"]
            nonempty = [o for o in outputs if o]
            o_iter = iter(tok(nonempty, truncation=True, max_length=seq_len)["input_ids"] if nonempty else [])
            rows = []
            for p, o in zip(p_ids, outputs):
                p, r = list(p), list(next(o_iter)) if o else []  # Axolotl: an empty output gets no tokens, no EOS
                if r and r[-1] != eos and len(r) < seq_len and eos is not None:
                    r.append(eos)
                if r and bos is not None and r[0] == bos:
                    r = r[1:]
                rows.append((p + r, (p if train_on_inputs else [IGNORE] * len(p)) + r, False))
            return out(rows)
        return alpaca

    if kind == "chat_template":
        def chat_template(batch, idx):
            names = list(batch)
            return out([(*chat({k: batch[k][j] for k in names}, i), chat.outside) for j, i in enumerate(idx)])
        return chat_template

    if kind == "input_output":
        def input_output(batch, idx):
            rows = []
            for segs, i in zip(batch["segments"], idx):
                if not isinstance(segs, list):
                    raise bad(where, f"row {i}", "segments is not a list", "write segments: [{label, text}, ...]")
                ids: list[int] = []
                labels: list[int] = []
                for n, seg in enumerate(segs):
                    if not isinstance(seg, dict) or not isinstance(seg.get("label"), bool) or \
                            not isinstance(seg.get("text"), str):
                        raise bad(where, f"row {i} segment {n}", "needs a boolean label and a text",
                                  "write each segment as {label: true|false, text: ...}")
                    piece = tok(seg["text"], add_special_tokens=False)["input_ids"]
                    ids += piece
                    labels += piece if seg["label"] or train_on_inputs else [IGNORE] * len(piece)
                rows.append((ids, labels, False))
            return out(rows)
        return input_output

    if kind == STEPWISE:
        return _stepwise(entry, tok, seq_len=seq_len, where=where, classes=classes, out=out)

    def pretokenised(batch, idx):
        rows = []
        labels_col, mask_col = batch.get("labels"), batch.get("attention_mask")
        for j, i in enumerate(idx):
            ids = batch["input_ids"][j]
            labels = labels_col[j] if labels_col is not None else None
            mask = mask_col[j] if mask_col is not None else None
            if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise bad(where, f"row {i}", "input_ids is not a list of token ids", "store input_ids as [int, ...]")
            for name, col in (("labels", labels), ("attention_mask", mask)):
                if col is not None and (not isinstance(col, list) or len(col) != len(ids)):
                    raise bad(where, f"row {i}", f"{name} does not match input_ids in length",
                              f"give one {name} value per token")
            labels = list(ids) if labels is None else list(labels)
            if mask is not None:
                keep = [k for k, m in enumerate(mask) if m]
                ids, labels = [ids[k] for k in keep], [labels[k] for k in keep]
            rows.append((list(ids), labels, False))
        return out(rows)
    return pretokenised


def _stepwise(entry, tok, *, seq_len: int, where: str, classes: int | None, out):
    """Axolotl 067b021's StepwiseSupervisedPromptTokenizingStrategy (after TRL's PRMTrainer.tokenize_row): the prompt
    and each step tokenised without specials, `step_separator`'s tokens after every step, the step's label (its
    class: a bool counts 0/1) on the separator's last token, -100 elsewhere; the steps cut to max_completion_length,
    the tokenizer's BOS before the prompt where it has one, the whole cut to sequence_len. A row whose labels do not
    pair with its steps, or a class outside model.num_labels, is one line (Axolotl would misalign or fail later)."""
    sep = tok.encode(entry.step_separator, add_special_tokens=False)
    last_only, cap, bos = entry.train_on_last_step_only, entry.max_completion_length, tok.bos_token_id

    def stepwise(batch, idx):
        rows = []
        for prompt, steps, labels, i in zip(batch["prompt"], batch["completions"], batch["labels"], idx):
            prompt = _text(prompt, where, "prompt", i)
            if not isinstance(steps, list) or not isinstance(labels, list) or len(steps) != len(labels) or not steps:
                raise bad(where, f"row {i}", "completions and labels must be lists of the same length, one label per "
                          "step", "give each step its label (true/false or a class number)")
            if any(isinstance(x, float) or not isinstance(x, (bool, int)) or not 0 <= int(x) < (classes or 2)
                   for x in labels):
                raise bad(where, f"row {i}", f"its labels {labels[:8]} are not classes 0 to {(classes or 2) - 1}",
                          "label each step true/false or with a class below model.num_labels (num_labels)")
            classes_of = [int(x) for x in labels]
            if last_only:
                classes_of = [IGNORE] * (len(classes_of) - 1) + classes_of[-1:]
            ids: list[int] = []
            tags: list[int] = []
            for step, c in zip(steps, classes_of):
                piece = tok(_text(step, where, "completions", i), add_special_tokens=False)["input_ids"] + sep
                ids += piece
                tags += [IGNORE] * (len(piece) - 1) + [c]
            if cap:
                ids, tags = ids[:cap], tags[:cap]
            head = ([bos] if bos is not None else []) + tok(prompt, add_special_tokens=False)["input_ids"]
            rows.append(((head + ids)[:seq_len], ([IGNORE] * len(head) + tags)[:seq_len], False))
        return out(rows)
    return stepwise


__all__ = ["TYPES", "STEPWISE", "PRETOKENISED", "ALPACA_STYLES", "ALPACA_NO_INPUT", "alpaca_prompt", "kind_of",
           "required_columns", "check_columns", "make_formatter"]
