"""Axolotl 067b021's image-text formats (its ProcessingStrategy classes) as records: each format's role markers and the
media tokens never trained, picked as Axolotl's get_processing_strategy picks them: by the chat template's name, else
the processor's class, else the base format (media tokens only, every other token trained, as Axolotl warns).
Formats not written here are refused in one line. adapter/data/sft/multimodal.py labels its micro-batches by them.
"""
from __future__ import annotations

from dataclasses import dataclass

from adapter.errors import bad
from adapter.models.image_text import UNBUILT_PROCESSORS, UNBUILT_TEMPLATES

# role markers: (role, start, end, include_start, include_end); an empty end runs to the end of the sequence, "<eos>"
# is the tokenizer's EOS id
Marker = tuple[str, str, str, bool, bool]


@dataclass(frozen=True)
class Strategy:
    """One of Axolotl's ProcessingStrategy classes as data: its role markers and the tokens never trained."""
    markers: tuple[Marker, ...] = ()
    media: tuple[str, ...] = ("<processor.image_token>",)  # token strings; "<processor.x>" / "<tokenizer.x>": that
    # object's attribute x (a token, a token's id, or a list of ids), skipped where it has none
    soft_token_fallback: int | None = None  # Gemma 3: <image_soft_token>'s id where the vocabulary lacks it


def _turns(fmt: str, end: str, roles: tuple[str, ...], names: dict[str, str] | None = None) -> tuple[Marker, ...]:
    names = names or {}
    return tuple((r, fmt.format(names.get(r, r)), end, False, True) for r in roles)


_CHATML = _turns("<|im_start|>{}\n", "<|im_end|>", ("system", "user", "assistant"))
_LLAMA_ROLES = ("system", "user", "assistant", "ipython", "tool")
# Pixtral's [/INST] ends the user turn and opens the assistant's: the user's end is not consumed
_INST = (("user", "[INST]", "[/INST]", False, False), ("assistant", "[/INST]", "<eos>", False, True))
STRATEGIES: dict[str, Strategy] = {
    "base": Strategy(),
    "qwen2_vl": Strategy(_CHATML, ("<|image_pad|>",)),
    "qwen3_5": Strategy(_CHATML, ("<|image_pad|>", "<|video_pad|>")),
    # Gemma 3's template folds the system turn into the first user turn: no system marker
    "gemma3": Strategy(_turns("<start_of_turn>{}\n", "<end_of_turn>", ("assistant", "user"), {"assistant": "model"}),
                       ("<tokenizer.boi_token>", "<image_soft_token>"), soft_token_fallback=262144),
    "llama3_2_vision": Strategy(_turns("<|start_header_id|>{}<|end_header_id|>\n\n", "<|eot_id|>", _LLAMA_ROLES)),
    "llama4": Strategy(_turns("<|header_start|>{}<|header_end|>\n\n", "<|eot|>", _LLAMA_ROLES)),
    # Gemma 4: its turn markers; every media token and delimiter the processor and tokenizer name
    "gemma4": Strategy(_turns("<|turn>{}\n", "<turn|>", ("assistant", "user", "system"), {"assistant": "model"}),
                       ("<processor.image_token>", "<tokenizer.image_token_id>", "<tokenizer.audio_token_id>",
                        "<processor.boi_token>", "<processor.eoi_token>", "<processor.boa_token>",
                        "<processor.eoa_token>", "<processor.video_token_id>")),
    "pixtral": Strategy(_INST),
    "mistral_v7_tekken": Strategy((("system", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", False, True), *_INST)),
    "smolvlm2": Strategy((), ("<image>",)),
    "glm4v": Strategy((), ("<|image|>", "<|begin_of_image|>", "<|end_of_image|>", "<|video|>", "<|begin_of_video|>",
                           "<|end_of_video|>")),
    "internvl": Strategy((), ("<processor.image_ids>",)),
    "paddleocr_vl": Strategy((("user", "User:", "Assistant:\n", False, False),
                              ("assistant", "Assistant:\n", "<eos>", False, True))),
}
# the formats Axolotl picks by the processor's class where the chat template names none of the above (PaddleOCR-VL's
# before the template: Axolotl's model-support registry)
BY_PROCESSOR = {"SmolVLMProcessor": "smolvlm2", "Glm4vProcessor": "glm4v", "Glm46VProcessor": "glm4v",
                "InternVLProcessor": "internvl", "PaddleOCRVLProcessor": "paddleocr_vl"}


def strategy_name(chat_template: str | None, processor) -> str:
    """Axolotl's choice of format: the chat template's name, else the processor's class, else "base"."""
    if chat_template in UNBUILT_TEMPLATES:
        raise bad("chat_template", chat_template, f"the {chat_template} image-text format (its role markers and media "
                  "tokens) is not built for processor_type runs", f"use one of {', '.join(STRATEGIES)}")
    cls = type(processor).__name__
    if cls == "PaddleOCRVLProcessor":
        return BY_PROCESSOR[cls]
    if chat_template in STRATEGIES:
        return chat_template
    if chat_template == "gemma4_unified":  # Gemma 4's turns and media tokens (Axolotl's subclass changes nothing)
        return "gemma4"
    if cls in UNBUILT_PROCESSORS:
        raise bad("processor_type", cls, f"{cls}'s image-text format (its media tokens) is not built",
                  "run this config with Axolotl")
    return BY_PROCESSOR.get(cls, "base")


def media_ids(strategy: Strategy, processor) -> list[int]:
    """The token ids never trained besides padding: the format's media tokens, resolved as Axolotl resolves them."""
    tok = processor.tokenizer
    out = []
    for m in strategy.media:
        if m.startswith("<processor.") or m.startswith("<tokenizer."):
            owner, attr = (processor, m[11:-1]) if m.startswith("<processor.") else (tok, m[11:-1])
            m = getattr(owner, attr, None)
            if m is None:
                continue
            if isinstance(m, (list, tuple)):  # ids already (InternVL's image_ids)
                out += [int(i) for i in m if i is not None]
                continue
            if isinstance(m, int):  # an id (Gemma 4's image_token_id, ...)
                out += [m] if m != getattr(tok, "unk_token_id", None) else []
                continue
        i = tok.convert_tokens_to_ids(m)
        if i is None or i == getattr(tok, "unk_token_id", None):
            if strategy.soft_token_fallback is not None and m == "<image_soft_token>":
                out.append(strategy.soft_token_fallback)
            continue
        out.append(int(i))
    return out


def boundaries(strategy: Strategy, tok) -> list[tuple[str, list[int], list[int], bool, bool]]:
    """The markers as token ids (`encode(..., add_special_tokens=False)`; "<eos>": the EOS id); a marker whose start
    or end encodes to nothing is dropped (Axolotl's _build_role_boundaries)."""
    out = []
    for role, start, end, inc_start, inc_end in strategy.markers:
        eos = getattr(tok, "eos_token_id", None)
        end_ids = ([eos] if eos is not None else []) if end == "<eos>" else \
            tok.encode(end, add_special_tokens=False) if end else []
        if end and not end_ids:
            continue
        start_ids = tok.encode(start, add_special_tokens=False)
        if start_ids:
            out.append((role, start_ids, end_ids, inc_start, inc_end))
    return out


def role_keep(ids: list[int], bounds, roles: set[str], train_on_eos: str) -> list[bool]:
    """Axolotl's _compute_role_keep_mask for one row: scanning left to right, the longest start marker at a position
    (the first declared on a tie) opens a turn that runs to its end marker (or the sequence's end); a trained role's
    content is kept, its start marker where include_start, its end marker where include_end and train_on_eos is
    "turn" or "all" ("last": only the last trained turn's); "all" keeps other roles' end markers too. An end marker
    not included is not consumed (it may open the next turn)."""
    n, keep, j = len(ids), [False] * len(ids), 0
    last = None

    def at(k, seq):
        return bool(seq) and k + len(seq) <= n and ids[k:k + len(seq)] == seq

    while j < n:
        best = None
        for b in bounds:
            if at(j, b[1]) and (best is None or len(b[1]) > len(best[1])):
                best = b
        if best is None:
            j += 1
            continue
        role, start, end, inc_start, inc_end = best
        content = j + len(start)
        after, found = n, False
        if end:
            k = content
            while k < n and not at(k, end):
                k += 1
            after, found = (k + len(end), True) if k < n else (n, False)
        stop = after - len(end) if found else after
        if role in roles:
            if inc_start:
                keep[j:content] = [True] * (content - j)
            keep[content:stop] = [True] * (stop - content)
            if found and inc_end and train_on_eos not in ("none", "last"):
                keep[stop:after] = [True] * (after - stop)
            if found and inc_end and train_on_eos == "last":
                last = (stop, after)
        elif found and inc_end and train_on_eos == "all":
            keep[stop:after] = [True] * (after - stop)
        j = after - len(end) if found and not inc_end and end else after
    if train_on_eos == "last" and last is not None:
        keep[last[0]:last[1]] = [True] * (last[1] - last[0])
    return keep


__all__ = ["Marker", "Strategy", "STRATEGIES", "BY_PROCESSOR", "strategy_name", "media_ids", "boundaries", "role_keep"]
