"""The CPU demo's checkpoint: a tokenizer trained on the shipped text and a random tiny Llama that HF loads."""
from __future__ import annotations

import hashlib
import json

import pytest

from adapter.demo import build as demo
from adapter.errors import UserError


def test_asset_text_is_intact():
    raw = demo.DEMO_TEXT.read_bytes()
    assert 100_000 <= len(raw) <= 300_000
    readme = (demo.ASSETS / "README.md").read_text()
    assert hashlib.sha256(raw).hexdigest() in readme
    chapters = demo.chapters()
    assert len(chapters) == 50 and chapters[0].startswith("In the beginning God created the heaven and the earth.")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return demo.build_demo(tmp_path_factory.mktemp("demo"), vocab_size=512, hidden=32, layers=2, heads=4,
                           kv_heads=2, seed=0)


def test_hf_loads_and_generates(built):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(built["model"]))
    model = AutoModelForCausalLM.from_pretrained(str(built["model"]))
    text = "And God said, Let there be light: and there was light."
    ids = tok(text, return_tensors="pt")
    assert ids["input_ids"][0, 0].item() == tok.bos_token_id  # BOS added, EOS left to the data pipeline
    assert tok.decode(ids["input_ids"][0], skip_special_tokens=True) == text
    assert (len(tok), tok.eos_token_id) == (512, model.config.eos_token_id)
    out = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, ids["input_ids"].shape[1] + 5) and out.dtype == torch.int64
    cfg = json.loads((built["model"] / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and not cfg["tie_word_embeddings"]
    assert json.loads((built["model"] / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "PreTrainedTokenizerFast"
    assert (built["model"] / "model.safetensors").is_file() and (built["model"] / "generation_config.json").is_file()


def test_arch_and_data_pipeline_accept_it(built, tmp_path):
    from adapter.data import open_dataset
    from adapter.models.arch import load_arch

    arch = load_arch(built["model"])
    assert (arch.family, arch.hidden_size, arch.num_kv_heads, arch.vocab_size) == ("llama", 32, 2, 512)
    ds = open_dataset(built["data"], built["model"], tmp_path / "cache", 128, progress=False)
    assert len(ds.cache.doc_offsets) == 51 and len(ds) > 100


def test_same_seed_same_weights(built, tmp_path):
    again = demo.make_tiny_llama(tmp_path / "m", tokenizer_dir=built["tokenizer"], hidden=32, heads=4, kv_heads=2)
    assert (again / "model.safetensors").read_bytes() == (built["model"] / "model.safetensors").read_bytes()
    tied = demo.make_tiny_llama(tmp_path / "tied", 600, hidden=32, heads=4, kv_heads=4, tie=True)
    from adapter.models.arch import load_arch

    arch = load_arch(tied)
    assert arch.tie_embeddings and arch.vocab_size == 600 and arch.num_kv_heads == 4


def test_refuses_to_overwrite(built):
    with pytest.raises(UserError, match=r"^out_dir=.*already exists and is not empty"):
        demo.make_tiny_llama(built["model"], 512)
    assert not list(built["model"].parent.glob(".model.tmp-*"))
