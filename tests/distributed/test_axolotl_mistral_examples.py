"""Axolotl's Ministral 3 QLoRA example (examples/ministral3/ministral3-3b-qlora.yaml, copied unchanged from
axolotl-ai-cloud/axolotl at 067b021 as tests/fixtures/axolotl/ministral3-3b-qlora.yaml): tokenizer_use_mistral_common
on an image-text checkpoint (Mistral3ForConditionalGeneration, the transformers engine, text data), its base in NF4.
Unchanged but for the local dataset path, with the model's real config.json and a small tekken.json in a local HF
cache, it rehearses (a tiny model of its config, its layout, a checkpoint and a resume) with its chats encoded by
mistral-common."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.axolotl_home import cli, localised, make_home, offline_env, write_jsonl
from tests.helpers.hub import add_to_hub_cache
from tests.helpers.sft_data import tekken_model

pytest.importorskip("mistral_common")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
REPO = "mistralai/Ministral-3-3B-Reasoning-2512"


def test_ministral3_qlora_example_rehearses_with_mistral_common(tmp_path):
    home = make_home(tmp_path, models=[REPO])
    src = tmp_path / "src" / REPO.replace("/", "--")
    shutil.copy(tekken_model(tmp_path / "tekken") / "tekken.json", src / "tekken.json")
    add_to_hub_cache(home, REPO, src)
    rows = [{"messages": [{"role": "user", "content": f"Name the number after {i}."},
                          {"role": "assistant", "content": f"The number after {i} is {i + 1}."}]} for i in range(64)]
    cfg = localised(ROOT / "tests/fixtures/axolotl/ministral3-3b-qlora.yaml", tmp_path / "run.yaml",
                    {0: write_jsonl(tmp_path / "data/chats.jsonl", rows)})
    env = offline_env(home, tmp_path)
    code, out, err = cli(["preprocess", "--config", str(cfg), "--debug", "--samples", "1"], env, tmp_path)
    assert code == 0, err[-3000:]
    assert "('[INST]', -100)" in out and "('</s>', 2)" in out, out[-3000:]  # mistral-common's ids, masked
    code, out, err = cli(["rehearse", "--config", str(cfg), "--steps", "2", "--seq-len", "128"], env, tmp_path)
    assert code == 0, err[-3000:]
    assert "Mistral3ForConditionalGeneration" in out and "NF4" in out and "rehearsal ok" in out, out[-3000:]
