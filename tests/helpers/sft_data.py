"""A tiny model directory for the SFT data tests: the demo's byte-level BPE tokenizer (BOS, EOS and chatml's
markers as specials) beside a config.json; weights only where a test runs the model."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from adapter import config

VOCAB = 1024  # enough merges that words and their leading space become one token (the boundary cases)


def tiny_model(root: Path, vocab: int = VOCAB, weights: bool = False) -> Path:
    from adapter.demo.build import DEMO_TEXT, make_tiny_llama, train_tokenizer

    tok = train_tokenizer([DEMO_TEXT], root / "tok", vocab_size=vocab)
    if weights:
        return make_tiny_llama(root / "model", tokenizer_dir=tok, hidden=32, layers=1, heads=4, kv_heads=2, seed=0)
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, architectures=["LlamaForCausalLM"]).save_pretrained(tok)
    return tok


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


WORDS = "red green blue small large quick slow bright dark warm cold soft".split()


def varied_pairs(n: int = 24) -> list[dict]:
    """Preference pairs (chat_template.default rows) whose prompts and answers differ in length, so every
    micro-batch's stream has its own length (the GPU tests of compiled layers on changing lengths)."""
    return [{"messages": [{"role": "user", "content": f"Describe the {WORDS[i % 12]} thing {i}" + " again" * (i % 7)}],
             "chosen": {"role": "assistant", "content": " ".join(WORDS[: 2 + i % 9]) + "."},
             "rejected": {"role": "assistant", "content": f"No {i}" + " idea" * (1 + i % 4)}} for i in range(n)]


def axolotl_cfg(model: Path, datasets: list[dict], root: Path, **top: Any):
    """An Axolotl-dialect RunConfig (as a user's YAML would give it), prepared data under root/prepared."""
    raw = {"base_model": str(model), "sequence_len": 128, "datasets": datasets, "learning_rate": 1e-5,
           "dataset_prepared_path": str(root / "prepared"), **top}
    return config.build(raw, env={})


def runs(ids, labels, tok) -> list[tuple[str, bool]]:
    """Decoded runs of consecutive tokens that are all trained or all not: the readable form of a mask."""
    out: list[tuple[str, bool]] = []
    group: list[int] = []
    flag = None
    for t, lab in zip(ids, labels):
        trained = lab != -100
        if flag is not None and trained != flag:
            out.append((tok.decode(group), flag))
            group = []
        group.append(int(t))
        flag = trained
    if group:
        out.append((tok.decode(group), flag))
    return out


MISTRAL_CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"},
                {"role": "assistant", "content": "the answer"}, {"role": "user", "content": "more"},
                {"role": "assistant", "content": "in the end"}]  # for tekken_model's tokenizer


def tekken_model(root: Path, version: str = "v7") -> Path:
    """A Mistral model directory whose tokenizer is mistral-common's alone (tekken.json, no tokenizer.json): the 256
    bytes and a few merges behind mistral-common's control tokens ([INST], [SYSTEM_PROMPT], ...: ids below 100);
    v13 (Magistral's generation, with [THINK]) lists them in the file, as its tokenizers do."""
    import base64

    from mistral_common.tokens.tokenizers.base import SpecialTokens
    from transformers import MistralConfig

    root.mkdir(parents=True, exist_ok=True)
    merges = [b" t", b"he", b" the", b"in", b"er", b"an"]
    vocab = [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(), "token_str": None} for i in range(256)]
    vocab += [{"rank": 256 + j, "token_bytes": base64.b64encode(m).decode(), "token_str": m.decode()}
              for j, m in enumerate(merges)]
    pattern = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    conf = {"pattern": pattern, "num_vocab_tokens": len(vocab), "default_vocab_size": 100 + len(vocab),
            "default_num_special_tokens": 100, "version": version}
    tekken = {"config": conf, "vocab": vocab, "version": 1, "type": "Tekken"}
    if version != "v7":
        tekken["special_tokens"] = [{"rank": i, "token_str": t.value, "is_control": True}
                                    for i, t in enumerate(SpecialTokens)]
    (root / "tekken.json").write_text(json.dumps(tekken))
    MistralConfig(vocab_size=100 + len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, architectures=["MistralForCausalLM"]
                  ).save_pretrained(root)
    return root
