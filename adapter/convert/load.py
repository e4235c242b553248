"""A converted (or Megatron-LM saved) torch_dist checkpoint into a GPTModel at the run's TP, its checksums checked
collectively first."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from adapter.convert import megatron_io as mio
from adapter.errors import UserError, bad


def load_megatron_checkpoint(model, ckpt_dir: str | Path, *, strict: bool = True, check: bool = True) -> dict:
    """Load a converted (or Megatron-LM saved) torch_dist checkpoint into a GPTModel at the run's TP.

    Collective: call on every rank after parallel_state is initialised, on the plain GPTModel (before DeepSpeed
    partitions it, or inside zero.GatheredParameters). The model may pad its vocab differently from the checkpoint
    (Megatron's allow_shape_mismatch zero-fills or drops padding rows) as long as it covers the real vocab.
    Returns the checkpoint's nd_adapter.json metadata ({} for checkpoints without it). `check=False` skips the
    checksum check (the caller ran `check_checksums_collectively` already, e.g. before its data was prepared).
    """
    root = Path(ckpt_dir)
    path = mio.resolve_ckpt_dir(root)
    meta = json.loads((root / mio.META).read_text()) if (root / mio.META).exists() else {}
    if check:
        _check_checksums_collectively(root, meta)
    if meta and getattr(model, "vocab_size", meta["vocab_size"]) < meta["vocab_size"]:
        raise bad("padded_vocab", model.vocab_size, f"smaller than the checkpoint's vocab {meta['vocab_size']}",
                  f"build the model with padded_vocab >= {meta['vocab_size']} (the converter used "
                  f"{meta['padded_vocab_size']})")
    stored = mio.DistCheckpointReader(path).md.state_dict_metadata
    sd = model.sharded_state_dict()
    for k, v in list(sd.items()):
        if isinstance(v, ShardedObject) and v.unique_key not in stored:
            del sd[k]  # e.g. TE's extra state, absent from a local-spec conversion
        elif isinstance(v, ShardedTensor) and v.key not in stored:
            raise bad("megatron", str(path), f"checkpoint lacks {v.key}, which the model has",
                      "build the model with the checkpoint's architecture (nd_adapter.json / hf/config.json)")
        elif (isinstance(v, ShardedTensor) and not v.allow_shape_mismatch
              and tuple(stored[v.key].size) != v.global_shape):
            raise bad(v.key, list(stored[v.key].size),
                      f"checkpoint shape differs from the model's {list(v.global_shape)}",
                      "build the model with the checkpoint's architecture (nd_adapter.json / hf/config.json)")
    try:
        state = dist_checkpointing.load(sd, str(path))
    except CheckpointingException as e:
        raise UserError(f"megatron={str(path)!r}: cannot load into this model ({e}). Fix: build the model with the "
                        "checkpoint's architecture") from None
    wanted = set(sd)
    state = {k: v for k, v in state.items() if k in wanted}  # drop common.pt's args / iteration
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("._extra_state")]
    if strict and (missing or unexpected):
        raise bad("megatron", str(path), f"state mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}",
                  "build the model with the checkpoint's architecture")
    return meta


def check_checksums_collectively(ckpt_dir: str | Path) -> None:
    """Collective: every rank hashes its share of a converted checkpoint's chunks; all raise together
    (`megatron_io.DamagedCheckpoint` naming the first damaged chunk)."""
    root = Path(ckpt_dir)
    meta = json.loads((root / mio.META).read_text()) if (root / mio.META).exists() else {}
    _check_checksums_collectively(root, meta)


def _check_checksums_collectively(root: Path, meta: dict) -> None:
    """Every rank hashes its share of the chunks; all ranks refuse together, naming the first damaged chunk."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    found: tuple[str, bool] | None = None
    try:
        recorded = mio.check_checksums(root, meta, rank=rank, world=world)
    except UserError as e:
        found, recorded = (str(e), isinstance(e, mio.DamagedCheckpoint)), True
    if world > 1:
        every: list = [None] * world
        dist.all_gather_object(every, found)
        found = next((x for x in every if x is not None), None)
    if found is not None:
        raise (mio.DamagedCheckpoint if found[1] else UserError)(found[0])
    if not recorded and meta and rank == 0:
        warnings.warn(f"{root} {mio.NO_CHECKSUMS}", UserWarning, stacklevel=3)


__all__ = ["load_megatron_checkpoint", "check_checksums_collectively"]
