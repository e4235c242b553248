"""A tiny, self-contained Llama checkpoint for the CPU rehearsal: no hub, no network.

The tokenizer is trained on the public-domain text in adapter/demo/data/ and the weights are random but seeded, so
every machine builds the same checkpoint. Everything is written into a temporary sibling directory and renamed into
place, so an interrupted build never leaves a directory that looks like a checkpoint.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from adapter.errors import bad

ASSETS = Path(__file__).with_name("data")
DEMO_TEXT = ASSETS / "genesis_kjv.txt"  # 50 chapters, one per blank-line-separated paragraph
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"  # Llama-3 spellings, so prompts look familiar
IM_START, IM_END = "<|im_start|>", "<|im_end|>"  # chatml's turn markers, so chat fine-tuning needs no new rows
CHAT_DATA = ASSETS / "chat_genesis.jsonl"  # messages-style conversations for the fine-tuning leg
ALPACA_DATA = ASSETS / "alpaca_genesis.jsonl"  # instruction / input / output rows


def _fresh_dir(out_dir: str | Path, key: str) -> tuple[Path, Path]:
    """Refuse to overwrite; return (final, temp) with temp on the same filesystem for an atomic rename."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise bad(key, str(out), "already exists and is not empty", "remove it or choose another directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out, Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))


def _publish(tmp: Path, out: Path) -> Path:
    if out.exists():
        out.rmdir()  # empty (checked in _fresh_dir)
    os.replace(tmp, out)
    return out


def train_tokenizer(text_files: Iterable[str | Path] = (DEMO_TEXT,), out_dir: str | Path = "tokenizer",
                    vocab_size: int = 2048, model_max_length: int = 2048) -> Path:
    """Byte-level BPE (GPT-2/Llama-3 style: no unknown tokens), BOS added by the post-processor, EOS left to the
    data pipeline, which appends it once per document. chatml's <|im_start|>/<|im_end|> are special tokens too, so
    `chat_template: chatml` works on the demo model (the tokenizer ships no chat template of its own)."""
    files = [str(f) for f in text_files]
    for f in files:
        if not Path(f).is_file():
            raise bad("text_files", f, "no such file", "pass existing UTF-8 text files")
    if vocab_size < 256 + 4:
        raise bad("vocab_size", vocab_size, "byte-level BPE needs the 256 bytes plus BOS, EOS and the two chatml "
                  "markers", "use at least 260")
    out, tmp = _fresh_dir(out_dir, "out_dir")
    try:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train(files, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, IM_START, IM_END],
                                             show_progress=False,
                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        bos = tok.token_to_id(BOS)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)])
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                additional_special_tokens=[IM_START, IM_END],
                                model_max_length=model_max_length).save_pretrained(tmp)
        cfg_path = tmp / "tokenizer_config.json"  # transformers 5 writes its new class name; 4.x only knows this one
        cfg = json.loads(cfg_path.read_text())
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
        return _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def make_tiny_llama(out_dir: str | Path, vocab_size: int | None = None, *, tokenizer_dir: str | Path | None = None,
                    hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, ffn: int | None = None,
                    max_positions: int = 2048, seed: int = 0, tie: bool = False, dtype: str = "float32",
                    device: str = "cpu") -> Path:
    """Random-weight LlamaForCausalLM in HF format (safetensors in `dtype`, config, generation config, tokenizer).
    `device="cuda"` initialises large shapes on the GPU (the weights are the same kind of random, not the same bits).

    GQA (kv_heads < heads) and an untied head by default so the demo exercises the converter's harder paths.
    """
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir)) if tokenizer_dir is not None else None
    if vocab_size is None:
        if tok is None:
            raise bad("vocab_size", None, "neither vocab_size nor tokenizer_dir given", "pass one of them")
        vocab_size = len(tok)
    if tok is not None and len(tok) > vocab_size:
        raise bad("vocab_size", vocab_size, f"smaller than the tokenizer's {len(tok)} tokens",
                  "leave vocab_size unset to use the tokenizer's size")
    if hidden % heads or heads % kv_heads:
        raise bad("heads", heads, f"needs hidden={hidden} divisible by heads and heads by kv_heads={kv_heads}",
                  "pick matching sizes")
    out, tmp = _fresh_dir(out_dir, "out_dir")
    try:
        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn or 4 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
            rms_norm_eps=1e-5, tie_word_embeddings=tie, hidden_act="silu",
            bos_token_id=tok.bos_token_id if tok is not None else None,
            eos_token_id=tok.eos_token_id if tok is not None else None,
            pad_token_id=tok.eos_token_id if tok is not None else None)
        config.architectures = ["LlamaForCausalLM"]
        torch.manual_seed(seed)
        with torch.device(device):
            model = LlamaForCausalLM(config).to(torch.float32).eval()
        model.to(getattr(torch, dtype)).save_pretrained(tmp, safe_serialization=True)
        del model
        if tok is not None:
            tok.save_pretrained(tmp)
            for name in ("tokenizer.json", "tokenizer_config.json"):  # keep the portable files as trained
                src = Path(tokenizer_dir) / name
                if src.exists():
                    shutil.copyfile(src, tmp / name)
        return _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def chapters(text_file: str | Path = DEMO_TEXT) -> list[str]:
    """Blank-line-separated paragraphs: the same document split the data pipeline uses for .txt files."""
    return [p.strip() for p in re.split(r"\n\s*\n", Path(text_file).read_text(encoding="utf-8")) if p.strip()]


def write_demo_jsonl(out_file: str | Path, text_file: str | Path = DEMO_TEXT) -> Path:
    """One JSON object {"text": chapter} per line, for exercising the jsonl reader on the demo text."""
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps({"text": c}, ensure_ascii=False) + "\n" for c in chapters(text_file)),
                   encoding="utf-8")
    os.replace(tmp, out)
    return out


def build_demo(out_dir: str | Path, *, vocab_size: int = 2048, **model_kwargs) -> dict[str, Path]:
    """Tokenizer + tiny Llama + jsonl corpus under out_dir; reuses parts already built (they are written atomically)."""
    root = Path(out_dir)
    tok_dir, model_dir, data = root / "tokenizer", root / "model", root / "data" / "genesis.jsonl"
    if not (tok_dir / "tokenizer.json").exists():
        train_tokenizer([DEMO_TEXT], tok_dir, vocab_size=vocab_size)
    if not (model_dir / "config.json").exists():
        make_tiny_llama(model_dir, tokenizer_dir=tok_dir, **model_kwargs)
    if not data.exists():
        write_demo_jsonl(data)
    return {"tokenizer": tok_dir, "model": model_dir, "data": data}


__all__ = ["DEMO_TEXT", "CHAT_DATA", "ALPACA_DATA", "train_tokenizer",
           "make_tiny_llama", "chapters", "write_demo_jsonl", "build_demo"]
