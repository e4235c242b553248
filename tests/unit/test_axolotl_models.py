"""tests/fixtures/axolotl/models.json: every base model Axolotl's examples name resolves to a config.json that
transformers reads (but the remote-code and non-transformers checkpoints, which it cannot read here)."""
from __future__ import annotations

import json

import pytest

from tests.helpers.axolotl_home import MODELS, TABLE, model_config

ENTRIES = {k: v for k, v in json.loads(TABLE.read_text()).items() if not k.startswith("_")}


def test_each_entry_says_where_it_comes_from():
    assert ENTRIES and all(e["source"] and "base" in e and "config" in e for e in ENTRIES.values())
    assert set(ENTRIES) <= set(MODELS)


@pytest.mark.parametrize("repo", sorted(ENTRIES))
def test_entry_is_a_config_transformers_reads(repo, tmp_path):
    from transformers import AutoConfig

    conf = model_config(repo)
    (tmp_path / "config.json").write_text(json.dumps(conf))
    if "auto_map" in conf:  # built by its own code, which this cache does not hold
        with pytest.raises(OSError, match=r"\.py"):
            AutoConfig.from_pretrained(tmp_path, trust_remote_code=True)
        return
    if "model_type" not in conf:  # mamba_ssm's format, not transformers'
        with pytest.raises(ValueError, match="model_type"):
            AutoConfig.from_pretrained(tmp_path)
        return
    got = AutoConfig.from_pretrained(tmp_path)
    assert got.model_type == conf["model_type"] and got.architectures == conf["architectures"]
