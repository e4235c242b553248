"""tokenizer_use_mistral_common: conversations encoded by mistral-common (transformers' MistralCommonBackend in
finetuning mode, as Axolotl's HFMistralTokenizer), each trained turn found as Axolotl's find_turn finds it: the
conversation up to that turn against the same with the turn's content swapped for a dummy, over token ids."""
from __future__ import annotations

import pytest

from adapter import config
from adapter.config.schema_data import DatasetEntry
from adapter.data.sft import formats, templates
from adapter.data.sft.prepare import check_choices, load_tokenizer
from adapter.errors import UserError
from tests.helpers.sft_data import MISTRAL_CONV, axolotl_cfg, runs, tekken_model

pytest.importorskip("mistral_common")

CONV = MISTRAL_CONV


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tekken_model(tmp_path_factory.mktemp("tekken"))


def formatter(model, tmp_path, **entry):
    cfg = axolotl_cfg(model, [{"path": "x", "type": "chat_template", **entry}], tmp_path,
                      tokenizer_use_mistral_common=True)
    assert cfg.data.mistral_common
    tok = load_tokenizer(cfg, model, 362)
    e = cfg.data.datasets[0]
    return templates.ChatFormatter(e, tok, None, train_on_inputs=False, where="datasets[0]"), tok


def axolotl_labels(tok, turns):
    """Axolotl's ChatTemplateStrategy on a mistral-common tokenizer, written out: each assistant turn's span from
    the first and last differing ids of turns[:i+1] against the same with "[[dummy_message]]" as its content, then
    the first EOS at or after the span's end (train_on_eos: turn)."""
    enc = lambda t: list(tok.apply_chat_template(t, tokenize=True, return_dict=False))  # noqa: E731
    ids = enc(turns)
    labels = [-100] * len(ids)
    for i, t in enumerate(turns):
        if t["role"] != "assistant":
            continue
        full, dummy = enc(turns[:i + 1]), enc([*turns[:i], {"role": "assistant", "content": "[[dummy_message]]"}])
        start = next(j for j in range(min(len(full), len(dummy))) if full[j] != dummy[j])
        end = next(len(full) - k for k in range(min(len(full), len(dummy))) if full[-1 - k] != dummy[-1 - k])
        labels[start:end] = ids[start:end]
        eos = ids.index(tok.eos_token_id, end)
        labels[eos] = ids[eos]
    return ids, labels


def test_turns_are_masked_as_axolotl_masks_them(model, tmp_path):
    f, tok = formatter(model, tmp_path)
    ids, labels, eos_missing = f({"messages": CONV}, 0)
    assert (ids, labels) == axolotl_labels(tok, CONV) and not eos_missing
    assert [text for text, trained in runs(ids, labels, tok) if trained] == ["the answer</s>", "in the end</s>"]
    assert ids[0] == tok.bos_token_id and "[INST]" in tok.decode(ids[:20])  # mistral-common's own encoding


def test_the_axolotl_keys_and_what_cannot_go_with_them(model, tmp_path):
    magistral = tekken_model(tmp_path / "Magistral-Small-tiny")
    cfg = axolotl_cfg(magistral, [{"path": "x", "type": "chat_template"}], tmp_path, chat_template="chatml")
    assert cfg.data.mistral_common and cfg.data.chat_template is None  # Axolotl turns it on for Magistral
    assert any("Magistral" in n for n in cfg.notes) and any("chat_template: not used" in n for n in cfg.notes)
    off = axolotl_cfg(magistral, [{"path": "x", "type": "chat_template"}], tmp_path,
                      tokenizer_use_mistral_common=False)
    assert not off.data.mistral_common
    with pytest.raises(UserError, match=r"^tokenizer_use_mistral_common=True: .* tokens needs the HF tokenizer"):
        axolotl_cfg(model, [{"path": "x", "type": "chat_template"}], tmp_path, tokenizer_use_mistral_common=True,
                    tokens=["<x>"])
    (tmp_path / "corpus.jsonl").write_text('{"text": "a b c"}\n')
    with pytest.raises(UserError, match=r"^tokenizer_use_mistral_common=True: .* pretraining_dataset needs the HF"):
        config.build({"base_model": str(model), "tokenizer_use_mistral_common": True, "learning_rate": 1e-5,
                      "pretraining_dataset": [{"path": str(tmp_path / "corpus.jsonl")}]}, env={})
    alpaca = axolotl_cfg(model, [{"path": "x", "type": "alpaca"}], tmp_path, tokenizer_use_mistral_common=True)
    with pytest.raises(UserError, match=r"^datasets\[0\]\.type='alpaca': tokenizer_use_mistral_common encodes"):
        check_choices(alpaca)


def test_thinking_parts_as_magistral_think_examples_write_them(tmp_path):
    """Axolotl's magistral/think example: content as parts, the assistant's reasoning a `thinking` part, which
    mistral-common (v13) encodes between [THINK] and [/THINK]; the turn, reasoning and answer, is trained as
    Axolotl's find_turn finds it (the whole content swapped for its dummy); an image part is still refused."""
    f, tok = formatter(tekken_model(tmp_path / "v13", "v13"), tmp_path)
    conv = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "hi there"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "the answer"},
                                              {"type": "text", "text": "in the end"}]}]
    ids, labels, _ = f({"messages": conv}, 0)
    assert (ids, labels) == axolotl_labels(tok, conv)
    assert [t for t, trained in runs(ids, labels, tok) if trained] == ["[THINK]the answer[/THINK]in the end</s>"]
    conv[1]["content"].append({"type": "image", "image": "x.png"})
    with pytest.raises(UserError, match=r"message 1 has a part of type 'image'"):
        f({"messages": conv}, 0)


def test_a_conversation_mistral_common_refuses_is_one_line(model, tmp_path):
    f, _ = formatter(model, tmp_path)
    with pytest.raises(UserError, match=r"^datasets\[0\]='row 3': mistral-common refused it: .*Expected last role"):
        f({"messages": CONV[:4]}, 3)


def test_without_a_mistral_common_tokenizer_file_one_line(tmp_path):
    from tests.helpers.sft_data import tiny_model

    plain = tiny_model(tmp_path / "plain")
    cfg = axolotl_cfg(plain, [{"path": "x", "type": "chat_template"}], tmp_path, tokenizer_use_mistral_common=True)
    with pytest.raises(UserError, match=r"^tokenizer_use_mistral_common=True: .* has no mistral-common tokenizer"):
        load_tokenizer(cfg, plain, 1024)


def test_native_key(model, tmp_path):
    with pytest.raises(UserError, match=r"no token can be added"):
        config.build({"model": {"path": str(model)}, "data": {"mistral_common": True, "tokens": ["<x>"]}}, env={})
    cfg = config.build({"model": {"path": str(model)}, "data": {"mistral_common": True, "datasets": [
        {"path": "x", "type": "chat_template"}]}}, env={})
    e = DatasetEntry(path="x", type="chat_template")
    assert formats.kind_of(e, "data.datasets[0]") == "chat_template" and cfg.data.mistral_common


def test_preprocess_end_to_end(model, tmp_path, capsys):
    """An Axolotl YAML as the mistral examples write it, through `nd-adapter preprocess`: mistral-common's ids in
    the cache, the assistant turns (and their EOS) trained; a second run reuses the cache."""
    import json

    from adapter import cli
    from tests.helpers.sft_data import write_jsonl

    rows = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CONV}] * 3)
    raw = {"base_model": str(model), "tokenizer_use_mistral_common": True, "sequence_len": 128,
           "learning_rate": 1e-5, "datasets": [{"path": str(rows), "type": "chat_template"}],
           "dataset_prepared_path": str(tmp_path / "prepared")}
    (tmp_path / "run.yaml").write_text(json.dumps(raw))
    assert cli.main(["preprocess", "--config", str(tmp_path / "run.yaml"), "--debug", "--samples", "1"]) == 0
    out = capsys.readouterr().out
    assert "(built)" in out and "('[INST]', -100)" in out and "('</s>', 2)" in out
    assert cli.main(["preprocess", "--config", str(tmp_path / "run.yaml")]) == 0
    assert "(reused)" in capsys.readouterr().out
