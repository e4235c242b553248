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
