"""The cache of converted pre-trained weights: built once, checked by every rank, loaded into the model.

Which entry a run uses (and whether it exists) is decided torch-free by adapter/models/source.resolve. Here the
entry is built -- converted at tp=1 (it loads at any tp), published by a directory rename (hf_to_megatron's own), so
a reader sees all of it or nothing -- by global rank 0 for a shared cache, local rank 0 per node for a node-local
one (as adapter/data/token_cache). Before the run prepares its data, all ranks check the converter's per-chunk
checksums (each a share); a damaged entry is converted again, a missing one simply built.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from adapter.convert.load import check_checksums_collectively, load_megatron_checkpoint
from adapter.convert.megatron_io import DamagedCheckpoint
from adapter.convert.to_megatron import hf_to_megatron
from adapter.errors import UserError, bad
from adapter.models.source import WeightsSource, complete, gb


def _agree(error: BaseException | None) -> None:
    """Raise on every rank when any rank failed (one rank's error must not leave the others waiting or loading)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, None if error is None else (isinstance(error, UserError), str(error)))
        first = next((x for x in every if x is not None), None)
    else:
        first = None
    if error is not None:
        raise error
    if first is not None:
        raise (UserError if first[0] else RuntimeError)(first[1])


def _is_builder(w: WeightsSource, rank: int) -> bool:
    return int(os.environ.get("LOCAL_RANK", rank)) == 0 if w.node_local else rank == 0


def _build(w: WeightsSource, cfg, *, progress: bool) -> None:
    entry = Path(w.checkpoint)
    entry.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(entry.parent).free
    if free < 1.05 * w.source_bytes:
        raise bad("model.cache_dir", str(entry.parent), f"converting needs about {gb(w.source_bytes)} free there, "
                  f"it has {gb(free)}", "free space, or set model.cache_dir (ND_ADAPTER_CACHE) to a larger disk")
    hf_to_megatron(w.model_dir, entry, tp=1, vocab_divisible_by=cfg.model.vocab_divisible_by, overwrite=True,
                   progress=progress)


def prepare(w: WeightsSource, cfg, *, rank: int, log=print, rebuild: bool = False) -> str | None:
    """Collective: the converted directory to load (building the cache entry first if missing, or if `rebuild`).
    None for random initialisation."""
    if w.kind != "pretrained":
        return w.checkpoint
    entry = Path(w.checkpoint)
    error = None
    if _is_builder(w, rank) and (rebuild or not complete(entry)):
        t0 = time.perf_counter()
        try:
            _build(w, cfg, progress=rank == 0)
            if rank == 0:
                log(f"weights: converted {gb(w.source_bytes)} in {time.perf_counter() - t0:.1f} s into {entry}")
        except Exception as e:  # noqa: BLE001 - shared with the waiting ranks below, then re-raised
            error = e
    _agree(error)  # also the barrier: nobody loads before the builder published
    if not complete(entry):
        raise bad("model.cache_dir", str(entry.parent), f"the converted weights {entry.name} made by the builder rank "
                  "are not visible here", "put model.cache_dir on storage shared by all ranks, or set "
                  "model.cache_node_local: true")
    return str(entry)


def ready(w: WeightsSource, cfg, *, rank: int, log=print) -> str | None:
    """Collective: the converted directory the run loads, built if missing and its checksums checked by all ranks
    (each a share) -- before the run's data is prepared, so a damaged checkpoint costs no tokenising. A damaged
    cache entry is converted again (the writer reads every chunk back); a damaged `model.checkpoint` is the user's
    to fix. None for random initialisation."""
    path = prepare(w, cfg, rank=rank, log=log)
    if path is None:
        return None
    try:
        check_checksums_collectively(path)
    except DamagedCheckpoint as e:
        if w.kind != "pretrained":
            raise
        if rank == 0:
            log(f"weights: the converted copy is damaged ({e}); converting again")
        path = prepare(w, cfg, rank=rank, log=log, rebuild=True)
    return path


def load(model, path: str | None) -> bool:
    """The run's first weights into the plain GPTModel (before DeepSpeed wraps it); nothing for random init.
    Collective; `path` comes from `ready`, which checked it. Whether anything was loaded."""
    if path is not None:
        load_megatron_checkpoint(model, path, check=False)
    return path is not None


__all__ = ["prepare", "ready", "load"]
