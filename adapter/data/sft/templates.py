"""Chat templates: which jinja string renders a dataset, and which of its tokens are trained.

Trained spans come from the rendered text itself, so any template works, with or without `{% generation %}`
markers: the conversation is rendered once as it is, and once per inspected turn with that turn's content replaced
by each of two sentinels whose first and last characters differ. Where the renderings start and stop differing
is exactly where the turn's rendered content sits (role headers and separators are identical in all three), even
when the template trims, escapes or re-orders content. The whole text is tokenised once with offsets; a token is
trained when it carries any character of a trained span (transformers' assistant mask uses the same rule). Unlike
rendering growing prefixes (Axolotl's `find_turn`), this never assumes a prefix renders as the start of the whole.

End of turn, as Axolotl's `train_on_eos`: the first EOS within the 4 tokens after a turn's content is that turn's
EOS; `turn` trains it after trained turns, `all` after every turn, `last` only the last one found, `none` never.
Axolotl's `eot_tokens` (e.g. Gemma's <end_of_turn>) are found the same way and trained per `train_on_eot` (default:
train_on_eos); without them the EOS is the end-of-turn token.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from adapter.errors import UserError, bad

IGNORE = -100
# Axolotl's `chat_template:` choices, each the jinja file Axolotl ships under that name, copied byte for byte into
# chat_templates/ (axolotl-ai-cloud/axolotl @ 067b021c8b87, src/axolotl/utils/chat_templates/templates/*.jinja; its
# ChatTemplate enum in src/axolotl/utils/schemas/enums.py names them): a name renders exactly as Axolotl renders it.
SHIPPED_DIR = Path(__file__).with_name("chat_templates")
BUILTIN = {f.stem: f.read_text(encoding="utf-8") for f in sorted(SHIPPED_DIR.glob("*.jinja"))}
CHATML = BUILTIN["chatml"]  # <|im_start|>{role}\n{content}<|im_end|>\n per message
FALLBACK = "tokenizer_default_fallback_"
SENTINELS = ("\x01", "\x02")  # one character each: they differ in their first and in their last character
EOS_WINDOW = 4  # the EOS must be among the first 4 tokens after the content (Axolotl: |eos - end| <= 3)
DEFAULT_ROLES = {"human": "user", "user": "user", "assistant": "assistant", "gpt": "assistant", "system": "system",
                 "tool": "tool"}
_SPECIAL_LITERAL = re.compile(r"<\|[A-Za-z0-9_]+\|>")


def _read_jinja(value: str, key: str) -> str:
    if "{" in value:
        return value
    path = Path(value)
    if not path.is_file():
        raise bad(key, value, "neither a jinja template (no {% or {{ in it) nor an existing file",
                  "give the template text or the path of a .jinja file")
    return path.read_text(encoding="utf-8")


def _tokenizer_template(tok) -> str | None:
    t = getattr(tok, "chat_template", None)
    if isinstance(t, dict):  # named templates: the default one renders conversations
        t = t.get("default")
    return t if isinstance(t, str) and t.strip() else None


def resolve_template(choice: str | None, jinja: str | None, tok, prefix: str) -> str:
    """The jinja string for Axolotl's `chat_template` / `chat_template_jinja` pair, whose keys are spelled
    `{prefix}chat_template` in errors ("" top level, "data." native, "datasets[0]." per entry). Refuses templates
    whose <|...|> tokens the vocabulary lacks: adding them needs new embedding rows."""
    key = f"{prefix}chat_template"
    choice = check_choice(choice, jinja, prefix)
    own = _tokenizer_template(tok)
    if choice == "jinja":
        if jinja is None:
            raise bad(key, choice, "needs chat_template_jinja", "set chat_template_jinja")
        template = _read_jinja(jinja, f"{key}_jinja")
    elif choice == "tokenizer_default":
        if own is None:
            raise bad(key, choice, "the tokenizer has no chat template",
                      "set chat_template: chatml (or tokenizer_default_fallback_chatml) or chat_template_jinja")
        template = own
    elif choice.startswith(FALLBACK):
        template = own or BUILTIN[choice.removeprefix(FALLBACK)]
    else:
        template = BUILTIN[choice]
    check_template_tokens(template, tok, key, choice)
    return template


def check_choice(choice: str | None, jinja: str | None, prefix: str) -> str:
    """The `chat_template` choice a dataset renders with (tokenizer_default when unset), refused in one line when
    nd-adapter has no template of that name or when it is given beside chat_template_jinja; no tokenizer needed,
    so `plan` says it too."""
    key = f"{prefix}chat_template"
    if jinja is not None and choice not in (None, "jinja"):
        raise bad(key, choice, "chat_template_jinja is also given",
                  "drop chat_template (chat_template_jinja alone means chat_template: jinja) or the jinja")
    choice = "jinja" if jinja is not None else (choice or "tokenizer_default")
    if choice in ("jinja", "tokenizer_default") or choice.removeprefix(FALLBACK) in BUILTIN:
        return choice
    raise bad(key, choice, "not a chat template Axolotl or nd-adapter ships",
              f"use tokenizer_default, tokenizer_default_fallback_<name>, jinja (with chat_template_jinja) or a "
              f"name: {', '.join(BUILTIN)}")


def check_template_tokens(template: str, tok, key: str, choice: str) -> None:
    vocab = tok.get_vocab()
    for literal in sorted(set(_SPECIAL_LITERAL.findall(template))):
        if literal not in vocab or len(tok(literal, add_special_tokens=False)["input_ids"]) != 1:
            raise bad(key, choice, f"the template writes {literal}, which is not one token of this tokenizer "
                      "(the markers of the template must be tokens of the vocabulary)",
                      "add it under tokens: (Axolotl's key), or use the tokenizer's own template "
                      "(tokenizer_default) or a chat_template_jinja written with tokens the vocabulary has")


def _lcp(a: str | list[int], b: str | list[int]) -> int:
    """Length of the common prefix, by bisection over slice comparisons (C speed on long conversations)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _lcs(a: str | list[int], b: str | list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0 or a[len(a) - n:] == b[len(b) - n:]:
        return n
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[len(a) - mid:] == b[len(b) - mid:]:
            lo = mid
        else:
            hi = mid
    return lo


class ChatFormatter:
    """Conversation rows -> (input_ids, labels with -100, whether a trained turn had no EOS after it)."""

    def __init__(self, entry, tok, template: str | None, *, train_on_inputs: bool, where: str,
                 eot_tokens: list[str] | None = None, eot_key: str = "eot_tokens"):
        """`template` None: `tok` is a mistral-common tokenizer (data.mistral_common) that encodes the turns to ids
        itself; turns are then found by the same sentinel swap over token ids (Axolotl's find_turn does exactly
        that), and the EOS alone ends a turn (Axolotl's MistralStrategy: mistral-common has no EOT tokens)."""
        self.tok, self.template, self.where = tok, template, where
        self.part_kinds = ("text",) if template is not None else ("text", "thinking")  # mistral-common: ThinkChunk
        self.field = entry.field_messages
        self.field_system, self.field_tools = entry.field_system, entry.field_tools
        self.mapping = {"role": "role", "content": "content", **(entry.message_property_mappings or {})}
        self.roles = ({src: dst for dst, sources in entry.roles.items() for src in sources} if entry.roles
                      else dict(DEFAULT_ROLES))
        self.train_roles = {self.roles.get(r, r) for r in (entry.roles_to_train
                                                           if entry.roles_to_train is not None else ["assistant"])}
        # roles the mapping does not name pass to the template as written (Axolotl's `roles.get(role, role)`);
        # the last row's are kept in `outside`, for the run's first lines
        self.named = set(self.roles) | set(self.roles.values()) | self.train_roles
        self.outside: list[str] = []
        self.train_on_eos = entry.train_on_eos or "turn"
        self.train_on_inputs = train_on_inputs
        self.drop_system = entry.drop_system_message
        self.eos = tok.eos_token_id
        train_on_eot = entry.train_on_eot or self.train_on_eos
        # as Axolotl: tokens the template never writes drop
        eot = [t for t in (eot_tokens or []) if template is not None and t in template]
        if tok.eos_token in eot or not eot_tokens or template is None:
            if train_on_eot != self.train_on_eos:  # one token, two rules (Axolotl raises the same conflict)
                raise bad(f"{where}.train_on_eot", train_on_eot, f"the end-of-turn token is the EOS "
                          f"({tok.eos_token}) here, so it cannot differ from train_on_eos={self.train_on_eos}",
                          "drop train_on_eot or make them equal")
        self.eot: list[tuple[set[int], str]] = []  # (token ids, train option) of each end marker besides the EOS
        ids = set()
        for t in eot:
            enc = tok.encode(t, add_special_tokens=False)
            if len(enc) != 1:
                raise bad(eot_key, eot_tokens, f"{t!r} is {len(enc)} tokens of this tokenizer, not one",
                          "add it to the tokenizer as a special token (special_tokens) or name the one that is")
            ids.add(enc[0])
        if ids - {self.eos}:
            self.eot.append((ids, train_on_eot))

    # --- rows -> turns ------------------------------------------------------------------------------------------
    def turns(self, row: dict[str, Any], idx: int) -> list[dict[str, Any]]:
        msgs = row.get(self.field)
        if not isinstance(msgs, list):
            raise bad(f"{self.where}.field_messages", self.field, f"row {idx} has no list of messages there",
                      "point field_messages at the column that holds each conversation's messages")
        if not msgs:
            raise bad(self.where, f"row {idx}", f"its list of messages ({self.field}) is empty",
                      "remove the row or give it its conversation")
        sources = set(self.mapping.values())
        turns = []
        self.outside = []
        for n, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise bad(f"{self.where}.field_messages", self.field, f"row {idx} message {n} is not a mapping",
                          "store each message as an object with a role and a content field")
            turn = {k: v for k, v in m.items() if k not in sources and v is not None}  # e.g. tool_calls pass through
            for dst, src in self.mapping.items():
                if m.get(src) is not None:
                    turn[dst] = m[src]
            if "role" not in turn:
                raise bad(f"{self.where}.message_property_mappings", self.mapping,
                          f"row {idx} message {n} has no {self.mapping['role']!r} field (its keys: {sorted(m)})",
                          "map role (and content) onto the message's field names, e.g. {role: from, content: value}")
            if not isinstance(turn["role"], str):
                raise bad(f"{self.where}.message_property_mappings", self.mapping, f"row {idx} message {n}'s "
                          f"{self.mapping['role']!r} is {type(turn['role']).__name__}, not a role name",
                          "map role onto the field that holds the role's name (roles: maps names)")
            content = turn.get("content")
            other = next((p.get("type") for p in content
                          if isinstance(p, dict) and p.get("type") not in self.part_kinds),
                         None) if isinstance(content, list) else None
            if other is not None:  # Axolotl's templates write a placeholder token for it (gemma3: <start_of_image>)
                raise bad(self.where, f"row {idx}", f"message {n} has a part of type {other!r}: image and audio "
                          "datasets go through a processor and a vision tower; nd-adapter trains the language model "
                          "on text",
                          "give text conversations (content a string, or text parts only), or train this dataset "
                          "with Axolotl")
            turn["role"] = self.roles.get(turn["role"], turn["role"])
            if turn["role"] not in self.named:
                self.outside.append(turn["role"])
            turns.append(turn)
        system = row.get(self.field_system)
        if turns[0]["role"] != "system" and system is not None:
            turns.insert(0, {"role": "system", "content": system})
        if self.drop_system and turns[0]["role"] == "system":
            turns = turns[1:]
        return turns

    def render(self, turns, tools, idx: int) -> str:
        kw = {"tools": tools} if tools else {}
        try:
            return self.tok.apply_chat_template(turns, chat_template=self.template, tokenize=False,
                                                add_generation_prompt=False, **kw)
        except UserError:
            raise
        except Exception as e:  # the template's own raise_exception(...) or a jinja error on this row's data
            raise bad(self.where, f"row {idx}", f"the chat template failed on it: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}", "fix the row or use a template that accepts it")

    def encode(self, turns, tools, idx: int) -> list[int]:
        """mistral-common's ids of the conversation (its own encoding of the instruct format; finetuning mode)."""
        try:
            return list(self.tok.apply_chat_template(turns, tools=tools or None, tokenize=True,
                                                     return_dict=False))
        except UserError:
            raise
        except Exception as e:  # mistral-common's validation (roles, order, the last turn the assistant's)
            raise bad(self.where, f"row {idx}", f"mistral-common refused it: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}", "fix the row (a conversation ending with the "
                      "assistant's turn, roles user/assistant/system/tool)")

    def token_span(self, turns, i: int, tools, ids: list[int], idx: int) -> tuple[int, int]:
        """[first, after) of turn i's content in `ids`: where they differ from the ids with that turn's content
        swapped for a sentinel (common prefix and suffix, over both sentinels): `content_span` over token ids."""
        first, back = len(ids), len(ids)
        for sentinel in SENTINELS:
            other = self.encode([*turns[:i], {"role": turns[i]["role"], "content": sentinel}, *turns[i + 1:]],
                                tools, idx)
            first = min(first, _lcp(ids, other))
            back = min(back, _lcs(ids, other))
        return first, max(first, len(ids) - back)

    def content_span(self, turns, i: int, tools, text: str, idx: int) -> tuple[int, int]:
        """[start, end) of turn i's rendered content in `text` (the rendering of `turns`): where it differs from the
        rendering with that turn replaced by its role and a sentinel content alone, as Axolotl's `find_turn` builds
        its dummy turn, so what else the turn carries (its reasoning_content, tool calls) is trained with it."""
        start, end_back = len(text), len(text)
        for sentinel in SENTINELS:
            swapped = [*turns[:i], {"role": turns[i]["role"], "content": sentinel}, *turns[i + 1:]]
            other = self.render(swapped, tools, idx)
            start = min(start, _lcp(text, other))
            end_back = min(end_back, _lcs(text, other))
        return start, max(start, len(text) - end_back)

    # --- one conversation -> tokens and labels ------------------------------------------------------------------
    def __call__(self, row: dict[str, Any], idx: int) -> tuple[list[int], list[int], bool]:
        turns = self.turns(row, idx)
        tools = row.get(self.field_tools)
        if self.template is None:  # mistral-common: ids directly, turns found over ids
            ids = self.encode(turns, tools, idx)
        else:
            text = self.render(turns, tools, idx)
            enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = list(enc["input_ids"])
            offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
            starts, ends = offsets[:, 0], offsets[:, 1]
        labels = [IGNORE] * len(ids)
        found, eos_missing = {}, False  # end marker -> its last index found (train option "last")
        for i, turn in enumerate(turns):
            trained = self.train_on_inputs or turn["role"] in self.train_roles
            if not trained and "all" not in (self.train_on_eos, *(o for _, o in self.eot)):
                continue
            if self.template is None:
                first, after = self.token_span(turns, i, tools, ids, idx)
            else:
                s, e = self.content_span(turns, i, tools, text, idx)
                first = int(np.searchsorted(ends, s, side="right"))  # first token ending after s
                after = int(np.searchsorted(starts, e, side="left"))  # past the last token starting before e
                if e <= s:  # empty content: nothing trained, its EOS may still follow
                    first = after = int(np.searchsorted(starts, s, side="left"))
            if trained:
                for j in range(first, after):
                    labels[j] = ids[j]
            window = ids[after:after + EOS_WINDOW]
            ended = False
            for n, (marks, option) in enumerate(((({self.eos} if self.eos is not None else set()),
                                                  self.train_on_eos), *self.eot)):
                k = next((after + j for j, t in enumerate(window) if t in marks), -1)
                if k < 0:
                    continue
                ended, found[n] = True, k
                if option == "all" or (option == "turn" and trained):
                    labels[k] = ids[k]
            eos_missing |= trained and not ended
        for n, (_, option) in enumerate(((None, self.train_on_eos), *self.eot)):
            if option == "last" and found.get(n, -1) >= 0:
                labels[found[n]] = ids[found[n]]
        return ids, labels, eos_missing and self.train_on_eos != "none"


__all__ = ["CHATML", "BUILTIN", "ChatFormatter", "resolve_template", "check_choice", "check_template_tokens"]
