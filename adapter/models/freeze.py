"""Which parameters a run trains: Axolotl's `unfrozen_parameters` (native `model.unfrozen_parameters`), regexes over
the HF model's parameter names; everything they do not match is frozen (no gradient, no optimizer state).

Axolotl's rules (its utils/freeze.py): a pattern is matched from the start of the name (`re.match`), a `.` is a
literal dot (except in `.+`), and a trailing `[start:end]` (or `[i]`) trains only those rows of the first dimension.
nd-adapter trains Megatron's tensors, some of which hold several HF parameters (q, k and v in `linear_qkv`, gate and
up in `linear_fc1`, the input norm with `linear_qkv` in checkpoints): such a tensor is trained when all its HF
parameters are, frozen when none is, and a pattern that splits it is refused in one line. Row ranges are honoured
on the embedding and an untied LM head (their rows are vocabulary rows on every TP rank) and refused elsewhere. A
pattern that matches nothing is refused too: it is a typo or a parameter the model does not have (unless what it
names further in is trained by the other patterns: `refuse_unmatched`).

Torch-free: `plan` counts the trained parameters' gradients and states from here, and the engine sets
`requires_grad` (and the row masks) from the same answer.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from adapter.errors import UserError, bad
from adapter.models.arch import ModelArch, padded_vocab_size
from adapter.models.families import table_for
from adapter.models.mapping import LAYER, Rule, Vocab, hf_shape

# Megatron's local layer spec names the two pre-norms differently from the checkpoint's (TE-style) keys
_LOCAL = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
          "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
_RANGE = re.compile(r"^(.+)\[([0-9]*)(?::([0-9]*))?\]$")


@dataclass(frozen=True)
class Pattern:
    text: str
    regex: re.Pattern
    rows: tuple[int, int | None] | None  # [start, end) of the first dimension; end None: to the end


def parse(patterns: list[str], key: str) -> list[Pattern]:
    out = []
    for i, text in enumerate(patterns):
        if not isinstance(text, str) or not text:
            raise bad(f"{key}[{i}]", text, "must be a regex over parameter names", "e.g. ^model.layers.1[0-9].")
        name = text
        rows: tuple[int, int | None] | None = None
        m = _RANGE.match(text)
        if m:
            name, start, end = m.groups()
            if end is None:
                if not start.isdecimal():
                    raise bad(f"{key}[{i}]", text, "a row range is [start:end] or [index]", "e.g. [:32000]")
                rows = (int(start), int(start) + 1)
            else:
                rows = (int(start or 0), int(end) if end else None)
        try:
            regex = re.compile(re.sub(r"\.(?!\+)", r"\\.", name))  # Axolotl's rule: a dot is a dot
        except re.error as e:
            raise bad(f"{key}[{i}]", text, f"not a valid regex ({e})", "fix the pattern")
        out.append(Pattern(text, regex, rows))
    return out


@dataclass(frozen=True)
class Tensor:
    """One Megatron parameter tensor of the built model and whether it is trained."""
    name: str                           # module parameter name in GPTModel (decoder.layers.3.mlp.linear_fc1.weight)
    hf: tuple[str, ...]                 # the HF parameters it holds
    numel: int                          # elements of the whole (unsharded) tensor
    tp_axis: int | None                 # the axis TP splits (None: replicated on every TP rank)
    trained: bool
    rows: tuple[int, int] | None = None  # only these rows are trained (vocabulary rows)

    def local_numel(self, tp: int) -> int:
        return self.numel // tp if self.tp_axis is not None else self.numel


def module_name(rule: Rule, layer: int | None) -> str:
    """The GPTModel parameter name of a table rule's tensor (for one layer)."""
    if not rule.per_layer:
        return rule.megatron
    rest = rule.megatron[len(LAYER):]
    return f"{LAYER}{layer}.{_LOCAL.get(rest, rest)}"


def _numel(rule: Rule, arch: ModelArch, padded: int) -> int:
    if isinstance(rule, Vocab):
        return padded * arch.hidden_size
    return sum(math.prod(hf_shape(spec, arch)) for _, spec in rule.hf)


def resolve(arch: ModelArch, patterns: list[str] | None, key: str = "model.unfrozen_parameters", *,
            vocab_divisible_by: int = 128) -> list[Tensor]:
    """Every parameter tensor of the model with whether it is trained (all of them when `patterns` is None)."""
    parsed = parse(patterns, key) if patterns is not None else None
    padded = padded_vocab_size(arch.vocab_size, 1, vocab_divisible_by)
    used = [False] * len(parsed or [])
    out = []
    for rule in table_for(arch):
        for layer in range(arch.num_layers) if rule.per_layer else (None,):
            names = tuple(rule.hf_names(layer))
            rows = None
            if parsed is None:
                trained = True
            else:
                hits = []
                for n in names:
                    matched = [j for j, p in enumerate(parsed) if p.regex.match(n)]
                    for j in matched:
                        used[j] = True
                    hits.append(matched)
                if any(hits) and not all(hits):
                    on = [n for n, h in zip(names, hits) if h]
                    off = [n for n, h in zip(names, hits) if not h]
                    raise bad(key, parsed[next(j for h in hits for j in h)].text, f"trains {', '.join(on)} but not "
                              f"{', '.join(off)}, which nd-adapter keeps in one tensor with it (Megatron's "
                              f"{module_name(rule, layer)})", "unfreeze all of them or none")
                trained = all(hits)
                ranges = [parsed[j].rows for h in hits for j in h]
                if trained and any(r is not None for r in ranges):
                    if not isinstance(rule, Vocab) or any(r is None for r in ranges) or len(set(ranges)) > 1:
                        raise bad(key, next(parsed[j].text for h in hits for j in h if parsed[j].rows),
                                  "row ranges are honoured on embed_tokens and lm_head only, one range each",
                                  "unfreeze the whole parameter, or give its rows in one pattern")
                    first = ranges[0]
                    assert first is not None  # every range is given (checked above)
                    start, end = first[0], arch.vocab_size if first[1] is None else min(first[1], arch.vocab_size)
                    if start >= end:
                        raise bad(key, next(parsed[j].text for h in hits for j in h), "an empty row range",
                                  f"give rows within 0..{arch.vocab_size}")
                    rows = (start, end)
            out.append(Tensor(module_name(rule, layer), names, _numel(rule, arch, padded), rule.tp_axis, trained,
                              rows))
    if parsed is not None:
        tied = " (lm_head is tied to embed_tokens in this model)" if arch.tie_embeddings else ""
        refuse_unmatched(parsed, used, {n: t.trained for t in out for n in t.hf}, key, arch.architecture, tied)
        if not any(t.trained for t in out):
            raise bad(key, patterns, "leaves nothing to train", "unfreeze at least one parameter")
    return out


class UnmatchedPattern(UserError):
    """`refuse_unmatched`'s line, with the pattern it names (the rehearsal leaves out patterns that name layers its
    tiny copy lacks: adapter/train/rehearse.py)."""

    def __init__(self, message: str, pattern: str):
        super().__init__(message)
        self.pattern = pattern


def refuse_unmatched(parsed: list[Pattern], used: list[bool], trained: dict[str, bool], key: str, model: str,
                     tied: str = "") -> None:
    """One line for a pattern that matches no parameter name from its start: a typo, or a parameter the model does
    not have. Except where every name it finds further in (`search`) is trained by the other patterns (Axolotl's
    Mistral Small 4 example lists `embed_tokens` beside `model.language_model.*`): Axolotl skips such a pattern
    silently, and what it names is trained anyway, so it is honoured."""
    for p, hit in zip(parsed, used):
        found = [n for n in trained if p.regex.search(n)]
        if not hit and not (found and all(trained[n] for n in found)):
            note = tied if "lm_head" in p.text else ""
            raise UnmatchedPattern(str(bad(key, p.text, f"matches no parameter of {model}{note}",
                                           "names look like model.layers.0.mlp.down_proj.weight or "
                                           "model.embed_tokens.weight")), p.text)


def describe(tensors: list[Tensor], arch: ModelArch, key: str) -> str:
    """The run's first line about it: how much is trained."""
    def hf_numel(t: Tensor) -> int:  # the vocabulary without Megatron's padding rows
        vocab = t.name.endswith(("word_embeddings.weight", "output_layer.weight"))
        return arch.vocab_size * arch.hidden_size if vocab else t.numel
    trained = [t for t in tensors if t.trained]
    rows = [f"{t.hf[0]} rows {t.rows[0]}:{t.rows[1]}" for t in trained if t.rows]
    return (f"{key}: {len(trained)} of {len(tensors)} tensors trained ({sum(map(hf_numel, trained)) / 1e6:.2f} M of "
            f"{sum(map(hf_numel, tensors)) / 1e6:.2f} M parameters" + (f"; only {', '.join(rows)}" if rows else "")
            + "); the rest frozen: no gradients, no optimizer states")


def trained_local(tensors, arch: ModelArch, tp: int, *, vocab_divisible_by: int = 128) -> int:
    """Elements of the trained `tensors` (`resolve`'s) one TP rank holds: what gradients and optimizer states are
    kept for."""
    padded = padded_vocab_size(arch.vocab_size, tp, vocab_divisible_by)
    total = 0
    for t in tensors:
        if t.trained:
            numel = padded * arch.hidden_size if t.name.endswith(("word_embeddings.weight", "output_layer.weight")) \
                else t.numel
            total += numel // tp if t.tp_axis is not None else numel
    return total


__all__ = ["Pattern", "Tensor", "parse", "resolve", "module_name", "describe", "trained_local", "refuse_unmatched",
           "UnmatchedPattern"]
