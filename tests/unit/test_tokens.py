"""Axolotl's `tokens:` without training (tests/distributed/test_tokens.py trains them): a token the vocabulary
already has adds nothing, new ones grow the run's vocabulary and change the prepared data's cache, the rows the
native engine writes are transformers' resize_token_embeddings' own (both initialisations, tied or not), and the
configs Axolotl refuses are refused in one line."""
from __future__ import annotations

import json

import pytest

from adapter.data.sft.prepare import cache_key, load_tokenizer, resolve_all
from adapter.errors import UserError
from adapter.models import source, vocab
from adapter.models.announce import announce
from adapter.models.resolved import resolve_run
from tests.helpers.sft_data import axolotl_cfg, tiny_model, write_jsonl

CHAT = [{"messages": [{"role": "user", "content": "hi <|im_start|> <think>"}, {"role": "assistant", "content": "yo"}]}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tokens"))  # 1024 tokens, chatml's markers among them


def _cfg(model, tmp_path, **top):
    data = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    return axolotl_cfg(model, [{"path": str(data), "type": "chat_template"}], tmp_path, chat_template="chatml", **top)


def test_a_token_the_vocabulary_has_adds_nothing_and_says_so(model, tmp_path):
    cfg = _cfg(model, tmp_path, tokens=["<|im_start|>"])
    run = resolve_run(cfg)
    assert run.vocab is not None and run.vocab.added == () and not run.vocab.resized and run.arch.vocab_size == 1024
    assert "tokens: <|im_start|> already in the vocabulary: nothing added" in "\n".join(announce(run))
    assert len(load_tokenizer(cfg, model, 1024)) == 1024


def test_new_tokens_grow_the_vocabulary_and_the_data_key(model, tmp_path):
    plain = _cfg(model, tmp_path)
    cfg = _cfg(model, tmp_path, tokens=["<think>", "<|im_start|>", "<think>", "</think>"])
    run = resolve_run(cfg)
    g = run.vocab
    assert (g.added, g.ids, g.rows, g.new_rows, g.mean) == (("<think>", "</think>"), (1024, 1025), 1024, 1026, False)
    assert run.arch.vocab_size == 1026 and source.vocab_rows(cfg) == 1026
    tok = load_tokenizer(cfg, model, 1026)  # transformers' tokenizer agrees with the count from tokenizer.json
    assert len(tok) == 1026 and tok.convert_tokens_to_ids(["<think>", "</think>"]) == [1024, 1025]
    assert 1024 in tok("hi <think>")["input_ids"]
    assert cache_key(plain, resolve_all(plain), model, 1024) != cache_key(cfg, resolve_all(cfg), model, 1026)
    rounded = resolve_run(_cfg(model, tmp_path, tokens=["<think>"], resize_token_embeddings_to_32x=True,
                               mean_resizing_embeddings=True)).vocab
    assert (rounded.tokenizer_len, rounded.new_rows, rounded.mean) == (1025, 1056, True)


@pytest.mark.parametrize("tie", [False, True])
def test_native_rows_are_transformers_resize_token_embeddings(tmp_path, tie):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    conf = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, tie_word_embeddings=tie)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(conf).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    for mean in (False, True):
        ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
        emb = ref.get_input_embeddings().weight.detach().clone()
        head = ref.get_output_embeddings().weight.detach().clone()
        torch.manual_seed(3)
        ref.resize_token_embeddings(43, mean_resizing=mean)
        new_emb, new_head = vocab.added_rows(raw, emb, None if tie else head, 43, mean=mean, seed=3)
        assert torch.equal(new_emb, ref.get_input_embeddings().weight[40:].detach())
        assert new_head is None if tie else torch.equal(new_head, ref.get_output_embeddings().weight[40:].detach())


def test_refused_as_axolotl_refuses(model, tmp_path):
    lora = {"adapter": "lora", "lora_target_modules": ["q_proj"], "tokens": ["<think>"]}
    with pytest.raises(UserError, match=r"^lora_modules_to_save=\['embed_tokens'\]: adding tokens with an adapter "
                       r".*Fix: set it to \['embed_tokens', 'lm_head'\]"):
        resolve_run(_cfg(model, tmp_path, lora_modules_to_save=["embed_tokens"], **lora))
    assert resolve_run(_cfg(model, tmp_path, lora_modules_to_save=["embed_tokens", "lm_head"], **lora)).vocab.resized
    with pytest.raises(UserError, match=r"^tokens=\{'bos_token': '<s>'\}: must be a list .*go under special_tokens"):
        _cfg(model, tmp_path, tokens={"bos_token": "<s>"})  # the archived examples' form: Axolotl's schema refuses it


def test_new_special_tokens_grow_the_vocabulary_in_axolotl_s_order(model, tmp_path):
    """A special token the vocabulary lacks (a new pad token, new chat markers) was refused; Axolotl adds it (named
    ones, then `tokens`, then additional_special_tokens) and resizes the embedding, so nd-adapter does too: the
    ids counted from tokenizer.json are the ones transformers' tokenizer gives after Axolotl's own calls."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    specials = {"pad_token": "<|pad|>", "eos_token": "<|im_end|>", "additional_special_tokens": ["<tool>", "<x>"]}
    cfg = _cfg(model, tmp_path, special_tokens=specials, tokens=["<think>", "<tool>"])
    run = resolve_run(cfg)
    g = run.vocab
    ref = AutoTokenizer.from_pretrained(str(model))  # Axolotl 067b021's loaders/tokenizer.py, call for call
    for k in ("pad_token", "eos_token"):
        ref.add_special_tokens({k: AddedToken(specials[k], rstrip=False, lstrip=False, normalized=False)})
    ref.add_tokens([AddedToken(t, rstrip=False, lstrip=False, normalized=False) for t in ("<think>", "<tool>")])
    ref.add_special_tokens({"additional_special_tokens": specials["additional_special_tokens"]})
    want = {t: ref.convert_tokens_to_ids(t) for t in ("<|pad|>", "<think>", "<tool>", "<x>")}
    assert dict(zip(g.added, g.ids)) == want and g.new_rows == len(ref) == 1028, (g, want)
    assert g.specials == ("<|pad|>", "<tool>", "<x>") and run.arch.vocab_size == 1028
    tok = load_tokenizer(cfg, model, 1028)
    assert len(tok) == len(ref) and tok.pad_token_id == want["<|pad|>"] and tok.eos_token == "<|im_end|>"
    assert "special_tokens and tokens: 4 new token(s)" in "\n".join(announce(run))
    # an adapter must train the new rows of a trained token in full (Axolotl's rule); a new pad token alone need not
    lora = {"adapter": "lora", "lora_target_modules": ["q_proj"]}
    with pytest.raises(UserError, match=r"^lora_modules_to_save=None|^lora_modules_to_save=\[\]"):
        resolve_run(_cfg(model, tmp_path, special_tokens={"additional_special_tokens": ["<x>"]}, **lora))
    assert resolve_run(_cfg(model, tmp_path, special_tokens={"pad_token": "<|pad|>"}, **lora)).vocab.resized
    known = resolve_run(_cfg(model, tmp_path, special_tokens={"eos_token": "<|im_end|>"}))
    assert known.vocab is None and known.arch.vocab_size == 1024  # a token it has: nothing grows, nothing said
