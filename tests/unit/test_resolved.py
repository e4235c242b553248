"""The resolved run (adapter/models/resolved.py): resolved once, from the model the trainer builds, and what it says
(adapter/models/announce.py) is what plan prints."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from adapter import config
from adapter.errors import UserError
from adapter.models import announce, source
from adapter.models.resolved import ResolvedRun, resolve_run
from adapter.plan.build import build_plan

MODELS = Path(__file__).resolve().parents[2] / "configs/models"


def _cfg(path: Path | str, world: int = 1, **over):
    raw = {"model": {"path": str(path)}, "data": {"synthetic": True}, "seq_len": 256,
           "parallelism": {"dp_shard_size": 1}, **over}
    return config.build(raw, env={}, world_size=world)


def test_plan_reads_the_architecture_the_trainer_builds(tmp_path):
    """A converted checkpoint's hf/ is the model the run trains (source.hf_dir); plan used to read model.path's
    config.json instead, so a checkpoint converted from another model planned as the wrong one."""
    ckpt = tmp_path / "ckpt"
    (ckpt / source.HF_SUBDIR).mkdir(parents=True)
    shutil.copy(MODELS / "qwen3-8b/config.json", ckpt / source.HF_SUBDIR / "config.json")
    run = resolve_run(_cfg(MODELS / "llama-3.2-1b", model={"path": str(MODELS / "llama-3.2-1b"),
                                                             "checkpoint": str(ckpt)}))
    assert run.arch.family == "qwen3" and run.weights.kind == "checkpoint"
    assert build_plan(run).model["family"] == "qwen3"


def test_the_record_is_frozen_and_holds_every_decision():
    run = resolve_run(_cfg(MODELS / "llama-3.2-1b", lora={"r": 8, "alpha": 16, "target_linear": True}))
    assert isinstance(run, ResolvedRun) and run.zero_stage == 1 and run.flat_optimizer
    assert run.lora is not None and len(run.lora.target_names) == 7 and run.unfrozen is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.zero_stage = 3  # type: ignore[misc]
    with pytest.raises(UserError, match=r"^lora.r=0: "):  # refusals happen here, before any process
        resolve_run(_cfg(MODELS / "llama-3.2-1b", lora={"r": 0}))


def test_the_pad_row_is_held_only_where_transformers_holds_it():
    """nn.Embedding(padding_idx): untied models whose embedding trains (Phi-3's pad is its EOS)."""
    phi3 = MODELS / "phi-3-mini-4k"
    pad = json.loads((phi3 / "config.json").read_text())["pad_token_id"]
    assert resolve_run(_cfg(phi3)).pad_row == pad
    lora = {"r": 8, "target_modules": ["qkv_proj"]}
    assert resolve_run(_cfg(phi3, lora=lora)).pad_row is None  # the embedding is frozen
    assert resolve_run(_cfg(phi3, lora={**lora, "modules_to_save": ["embed_tokens"]})).pad_row == pad
    frozen = resolve_run(_cfg(phi3, model={"path": str(phi3), "unfrozen_parameters": ["^model.layers.1."]}))
    assert frozen.pad_row is None
    assert resolve_run(_cfg(MODELS / "llama-3.2-1b")).pad_row is None  # no pad_token_id (and tied)


def test_plan_notes_are_the_runs_announcements():
    moe = MODELS / "qwen3-30b-a3b"
    run = resolve_run(_cfg(moe, 2, seq_len=4096, parallelism={"dp_shard_size": 1, "tp_size": 2},
                           model={"path": str(moe), "output_router_logits": True}, hardware={"gpus_per_node": 2}))
    said = announce.announce(run)
    assert build_plan(run).notes[:len(said)] == said
    assert any(line.startswith("mixture of experts: 128 experts, top 8, load-balancing loss") for line in said)
    assert "optimizer: nd-adapter's flat AdamW (nothing to shard; fp32 master weights and moments, one launch per " \
           "parameter group; optimizer.impl: deepspeed for DeepSpeed's ZeRO-1)" in said
