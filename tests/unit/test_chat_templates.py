"""The chat templates Axolotl ships by name (its `chat_template:` choices): every one is shipped, and each renders a
conversation to exactly the text Axolotl's own jinja renders (tests/fixtures/axolotl/chat_templates_rendered.json:
Axolotl's files at 067b021 rendered with plain jinja2 as transformers' apply_chat_template renders them, by
tests/fixtures/axolotl/render_chat_templates.py). The ChatML-style ones (chatml, qwen_25, qwen3) then mask as
Axolotl trains them on a tokenizer without special handling; a name neither ships, and image parts, are refused
in one line."""
from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import pytest

from adapter.config.schema_data import DatasetEntry
from adapter.data.sft import templates
from adapter.errors import UserError
from tests.helpers.sft_data import runs, tiny_model

ROOT = Path(__file__).resolve().parents[2]
RENDERED = json.loads((ROOT / "tests/fixtures/axolotl/chat_templates_rendered.json").read_text())
IMS, IME = "<|im_start|>", "<|im_end|>"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The small test tokenizer with every <|...|> marker the shipped templates write as one token (resolving a
    template checks that), and the fixture's BOS and EOS."""
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tiny_model(tmp_path_factory.mktemp("chat-templates")))
    markers = sorted({m for text in templates.BUILTIN.values() for m in re.findall(r"<\|[A-Za-z0-9_]+\|>", text)})
    t.add_special_tokens({"additional_special_tokens": markers})
    assert {k: t.special_tokens_map[k] for k in RENDERED["special_tokens"]} == RENDERED["special_tokens"]
    return t


def test_every_choice_axolotl_names_is_shipped():
    named = set(RENDERED["choices"]) - {"jinja", "tokenizer_default"}
    assert len(named) == 35 and named <= set(templates.BUILTIN)
    assert set(templates.BUILTIN) == set(RENDERED["rendered"])  # and phi_4, a file Axolotl ships beside them


@pytest.mark.parametrize("name", sorted(RENDERED["rendered"]))
def test_each_renders_as_axolotl_s_jinja(tok, monkeypatch, name):
    import transformers.utils.chat_template_utils as ctu

    class Clock(datetime):  # strftime_now's clock, as the fixture's (llama3_2_vision, llama4, mistral_v7_tekken)
        @classmethod
        def now(cls, tz=None):
            return datetime.fromisoformat(RENDERED["now"])

    monkeypatch.setattr(ctu, "datetime", Clock)
    want = RENDERED["rendered"][name]
    template = templates.resolve_template(name, None, tok, "")
    f = templates.ChatFormatter(DatasetEntry(path="x", type="chat_template"), tok, template, train_on_inputs=False,
                                where="d")
    row = {"messages": RENDERED["conversations"][want["conversation"]]}
    assert f.render(f.turns(row, 0), None, 0) == want["text"]


CONV = {"messages": [{"role": "user", "content": "Who was first?"}, {"role": "assistant", "content": "Adam."},
                     {"role": "user", "content": "And then?"}, {"role": "assistant", "content": "Eve."}]}
QWEN_SYSTEM = f"{IMS}system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.{IME}\n"
HEAD = f"{IMS}user\nWho was first?{IME}\n{IMS}assistant\n"
MID = f"{IME}\n{IMS}user\nAnd then?{IME}\n{IMS}assistant\n"


@pytest.mark.parametrize("name, want", [
    ("chatml", [(HEAD, False), ("Adam.", True), (MID, False), ("Eve.", True), (f"{IME}\n", False)]),
    # Qwen2.5: its default system prompt when the conversation has none
    ("qwen_25", [(QWEN_SYSTEM + HEAD, False), ("Adam.", True), (MID, False), ("Eve.", True), (f"{IME}\n", False)]),
    # Qwen3: an empty thinking block opens the answer after the last question, as the template's header
    ("qwen3", [(HEAD, False), ("Adam.", True), (MID + "<think>\n\n</think>\n\n", False), ("Eve.", True),
               (f"{IME}\n", False)]),
])
def test_chatml_style_templates_train_the_assistant_turns(tok, name, want):
    e = DatasetEntry(path="x", type="chat_template", chat_template=name)
    template = templates.resolve_template(name, None, tok, "datasets[0].")
    ids, labels, _ = templates.ChatFormatter(e, tok, template, train_on_inputs=False, where="datasets[0]")(CONV, 0)
    assert runs(ids, labels, tok) == want


def test_unknown_names_and_image_parts_are_one_line(tok):
    with pytest.raises(UserError, match=r"^datasets\[0\]\.chat_template='qwen9': not a chat template Axolotl or "
                                        r"nd-adapter ships\. Fix: use tokenizer_default, .* a name: alpaca, aya, "):
        templates.check_choice("qwen9", None, "datasets[0].")
    assert templates.check_choice("tokenizer_default_fallback_qwen3", None, "") == "tokenizer_default_fallback_qwen3"
    image = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}
    f = templates.ChatFormatter(DatasetEntry(path="x", type="chat_template"), tok,
                                templates.resolve_template("gemma3", None, tok, ""), train_on_inputs=False, where="d")
    with pytest.raises(UserError, match=r"^d='row 3': message 0 has a part of type 'image': image and audio "
                                        r"datasets go through a processor"):
        f(image, 3)
