"""Axolotl's three ND-parallel example configs, unchanged, through `nd-adapter rehearse` (their exact layouts on CPU
processes with a tiny model of the same family), with their hub model and hub dataset (`tatsu-lab/alpaca`) in a
local HF cache. `plan` for the same files is tested in tests/unit/test_axolotl.py.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.hub import add_to_hub_cache

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests/fixtures/axolotl"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from adapter.demo.build import train_tokenizer

    root = tmp_path_factory.mktemp("hf")
    home = root / "home"
    tok = train_tokenizer(out_dir=root / "tokenizer", vocab_size=1024)  # a real snapshot ships its tokenizer
    for repo, model in (("meta-llama/Llama-3.1-8B", "llama-3.1-8b"), ("Qwen/Qwen3-8B", "qwen3-8b"),
                        ("NousResearch/Meta-Llama-3.1-8B", "llama-3.1-8b")):
        src = root / "src" / model
        if not src.exists():
            src.mkdir(parents=True)
            shutil.copyfile(ROOT / "configs/models" / model / "config.json", src / "config.json")
            for f in tok.iterdir():
                shutil.copyfile(f, src / f.name)
        add_to_hub_cache(home, repo, src)
    rows = [{"instruction": f"Name the number after {i}.", "input": "" if i % 2 else f"{i}",
             "output": f"The number after {i} is {i + 1}." * (1 + i % 5)} for i in range(96)]
    data = root / "alpaca" / "data"
    data.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{**r, "text": ""} for r in rows]), data / "train-00000-of-00001.parquet")
    add_to_hub_cache(home, "tatsu-lab/alpaca", root / "alpaca", kind="datasets")
    return home


@pytest.mark.parametrize("name, procs", [("qwen3-8b-fsdp-tp-cp.yaml", 8), ("llama3-8b-ringmaster-cp.yaml", 8),
                                         ("llama-3_1-8b-hsdp-tp.yaml", 16)])
def test_axolotl_example_rehearses_unchanged(hf_home, tmp_path, name, procs):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "ND_ADAPTER_CACHE": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, "-m", "adapter", "rehearse", "--config", str(FIXTURES / name), "--steps", "2",
                        "--seq-len", "128"],
                       capture_output=True, text=True, timeout=1500, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"rehearsing on {procs} CPU processes" in p.stdout and "saved at step 1 and resumed" in p.stdout
    assert "Traceback" not in p.stdout + p.stderr
