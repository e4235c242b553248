"""Where a run's first weights come from, and the cache of converted pre-trained weights.

A run names a converted checkpoint (`model.checkpoint`), or fine-tunes from the HF weights in `model.path`
(Axolotl's `base_model`), or starts from random weights: only when that path holds no weights (a bare config.json,
as the bench configs) or `model.init: random` says so. Pre-trained weights are converted once, at tp=1 (it loads at
any tp), into a cache entry named by the checkpoint's identity: config.json and the weight index as text, every
weight and side file's name, size and mtime, the vocab padding and this module's format version. The entry is
published by a directory rename (hf_to_megatron's own), so a reader sees all of it or nothing, and every later run
and every rank reuses it: the builder is global rank 0 for a shared cache, local rank 0 per node for a node-local
one (as adapter/data/token_cache). Before the run prepares its data, all ranks check the converter's per-chunk
checksums (each a share); a damaged entry is converted again, a missing one simply built.

`resolve` and `describe` read only the file system (no torch), so `plan` uses them too.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from adapter.errors import UserError, bad

CACHE_VERSION = 1  # bump when the conversion's output changes: old entries are then simply not found
# adapter/convert/megatron_io's names, repeated so this module stays importable without torch
TRACKER, META, RELEASE = "latest_checkpointed_iteration.txt", "nd_adapter.json", "release"
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE = ("model.safetensors", "pytorch_model.bin")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")


def model_dir(path: str | Path) -> Path:
    p = Path(path)
    return p.parent if p.is_file() else p


def weight_files(directory: Path) -> tuple[Path | None, list[Path]]:
    """(index file or None, weight files) as HF loads them; ([], no index) for a directory without weights."""
    for name in INDEXES:
        index = directory / name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise bad("model.path", str(index), "not a valid weight index (no weight_map)",
                          "re-download the checkpoint")
            return index, [directory / s for s in shards]
    for name in SINGLE:
        if (directory / name).is_file():
            return None, [directory / name]
    return None, sorted(directory.glob("*.safetensors"))


def cache_root(cfg) -> Path:
    root = cfg.model.cache_dir or os.environ.get("ND_ADAPTER_CACHE") or "~/.cache/nd-adapter"
    return Path(root).expanduser()


def _stat(p: Path) -> tuple[str, int, int]:
    try:
        st = p.stat()
    except FileNotFoundError:
        raise bad("model.path", str(p.parent), f"missing weight file {p.name} (the index lists it)",
                  "download the complete checkpoint")
    return p.name, st.st_size, st.st_mtime_ns


def identity(directory: Path, index: Path | None, files: list[Path], vocab_divisible_by: int) -> str:
    """The cache key: cheap (stat and two small files), so every rank and `plan` compute it without reading weights."""
    side = [p for p in sorted(directory.iterdir()) if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES)
            and not p.name.startswith(".")]
    doc = {"v": CACHE_VERSION, "config": (directory / "config.json").read_text(),
           "index": index.read_text() if index else None, "weights": [_stat(f) for f in files],
           "side": [_stat(p) for p in side], "vocab_divisible_by": vocab_divisible_by, "dtype": "as stored"}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def _label(directory: Path) -> str:
    """A readable entry name: the model's directory name, or `org--name` for an HF hub cache snapshot."""
    parts = directory.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        name = parts[-3].removeprefix("models--")
    else:
        name = directory.resolve().name
    return re.sub(r"[^\w.\-]+", "_", name)[:60] or "model"


def complete(entry: Path) -> bool:
    """Published by hf_to_megatron's rename, so present means complete; damage is found by the load's checksums."""
    return (entry / META).is_file() and (entry / TRACKER).is_file() and (entry / RELEASE / "metadata.json").is_file()


@dataclass(frozen=True)
class WeightsSource:
    kind: str                      # "checkpoint" (model.checkpoint), "pretrained" (model.path's weights), "random"
    model_dir: str
    checkpoint: str | None = None  # the converted directory loaded: model.checkpoint or the cache entry
    cached: bool = False           # pretrained: the cache entry exists (no conversion to do)
    source_bytes: int = 0          # pretrained: bytes of HF weights (what a conversion reads and about what it writes)
    dtype: str | None = None
    reason: str = ""               # random: why
    node_local: bool = False

    @property
    def to_convert(self) -> bool:
        return self.kind == "pretrained" and not self.cached


def resolve(cfg) -> WeightsSource:
    """Decide, from the config and the file system alone, which weights the run starts from."""
    m = cfg.model
    directory = model_dir(m.path)
    if m.checkpoint:
        if m.init == "random":
            raise bad("model.init", "random", f"conflicts with model.checkpoint={m.checkpoint!r}",
                      "drop one of them")
        return WeightsSource("checkpoint", str(directory), checkpoint=m.checkpoint)
    if m.init == "random":
        return WeightsSource("random", str(directory), reason="model.init: random")
    index, files = weight_files(directory)
    if not files:
        if m.init == "pretrained":
            raise bad("model.init", "pretrained", f"{directory} holds no weights (no *.safetensors or "
                      "pytorch_model*.bin, only a config)", "point model.path (base_model) at a checkpoint with its "
                      "weights, name a converted one in model.checkpoint, or set model.init: random")
        return WeightsSource("random", str(directory), reason=f"{directory} holds a config.json but no weights")
    key = identity(directory, index, files, m.vocab_divisible_by)
    entry = cache_root(cfg) / "weights" / f"{_label(directory)}-{key}"
    try:
        hf = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        hf = {}
    return WeightsSource("pretrained", str(directory), checkpoint=str(entry), cached=complete(entry),
                         source_bytes=sum(_stat(f)[1] for f in files), dtype=hf.get("dtype") or hf.get("torch_dtype"),
                         node_local=m.cache_node_local)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def describe(w: WeightsSource, seed: int) -> str:
    """The run's first line, in words: which weights it starts from (and whether it converts them first)."""
    if w.kind == "checkpoint":
        return f"weights: from the converted checkpoint {w.checkpoint} (model.checkpoint)"
    if w.kind == "random":
        return (f"weights: RANDOM initialisation (seed {seed}), not pre-trained weights: {w.reason}")
    what = f"the pre-trained weights in {w.model_dir} ({_gb(w.source_bytes)}{', ' + w.dtype if w.dtype else ''})"
    where = f"{w.checkpoint}{' on every node' if w.node_local else ''}"
    if w.cached:
        return f"weights: fine-tuning from {what}, converted once before; reusing {where}"
    return (f"weights: fine-tuning from {what}; converting them once for Megatron-Core into {where} "
            "(later runs and every rank reuse it)")


# --- in the training processes (collective) ---------------------------------------------------------------------

def _agree(error: BaseException | None) -> None:
    """Raise on every rank when any rank failed (one rank's error must not leave the others waiting or loading)."""
    import torch.distributed as dist

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
    from adapter.convert.ops import hf_to_megatron

    entry = Path(w.checkpoint)
    entry.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(entry.parent).free
    if free < 1.05 * w.source_bytes:
        raise bad("model.cache_dir", str(entry.parent), f"converting needs about {_gb(w.source_bytes)} free there, "
                  f"it has {_gb(free)}", "free space, or set model.cache_dir (ND_ADAPTER_CACHE) to a larger disk")
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
                log(f"weights: converted {_gb(w.source_bytes)} in {time.perf_counter() - t0:.1f} s into {entry}")
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
    from adapter.convert.megatron_io import DamagedCheckpoint
    from adapter.convert.ops import check_checksums_collectively

    try:
        check_checksums_collectively(path)
    except DamagedCheckpoint as e:
        if w.kind != "pretrained":
            raise
        if rank == 0:
            log(f"weights: the converted copy is damaged ({e}); converting again")
        path = prepare(w, cfg, rank=rank, log=log, rebuild=True)
    return path


def load(model, path: str | None) -> None:
    """The run's first weights into the plain GPTModel (before DeepSpeed wraps it); nothing for random init.
    Collective; `path` comes from `ready`, which checked it."""
    if path is not None:
        from adapter.convert.ops import load_megatron_checkpoint

        load_megatron_checkpoint(model, path, check=False)


__all__ = ["WeightsSource", "resolve", "describe", "prepare", "ready", "load", "weight_files", "cache_root", "complete"]
