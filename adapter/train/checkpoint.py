"""Checkpoints around a DeepSpeed engine that a crash during save cannot corrupt, and that a resume refuses when
they were damaged since.

Every rank writes into a temporary tag (`tmp-global_stepN`); after all ranks are done, one rank writes the run's
record (`nd_adapter.json`, adapter/train/ckpt_info.py) there, renames it to `global_stepN`, then replaces `latest`
(DeepSpeed's own pointer: a text file holding the tag) and only then prunes old checkpoints. Until `latest` moves,
it names the previous complete checkpoint; leftover `tmp-*` directories, and this lineage's orphans newer than
`latest`, are removed by the next save. The rename is safe because DeepSpeed's file names inside a tag carry only
ranks (`zero_pp_rank_{dp}_mp_rank_{mp:02d}_{model,optim}_states.pt`), never the tag.

Integrity: each file is checksummed (CRC-32) from the bytes handed to it as it is written, and fsynced; the record
lists every file with its size and checksum, and itself ends with the checksum of its own text. A load checks
them all before anything is read: the ranks split the files, so each file is read once, and all of them refuse
together in one line naming the first file that is not as written (a rank that refused alone would leave the
others waiting in the load's collectives). Rotation (`keep_last`), the orphans' cleanup and a save over an
existing step touch only checkpoints of the run's own lineage: a fresh start opens one, a resume continues the
checkpoint's.

The directory must be shared by all ranks (or, with DeepSpeed's `use_node_local_storage`, local to each node, then
local rank 0 renames and each node's record lists its own files). With exact HSDP the replicas' ranks map to the
same file names: pass `save_ranks` so one replica writes and the others only join the collectives.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import socket
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from deepspeed import comm as dist

from adapter.errors import UserError, bad
from adapter.osutil import atomic_write_text
from adapter.patches.zero import experts_from_master
from adapter.train import ckpt_info
from adapter.train.ckpt_files import WriteFailed, agree, checksummed, cpu_loads, node_local, verified
from adapter.train.ckpt_info import FILES, LATEST, LINEAGE, RECORD, crc32, lineage_of, pointer, record_text
from adapter.train.optim import FORMAT, FlatAdamW, check_state_dtype, name_of, state_dtype_of

TMP = "tmp-"
STOPPED_EARLY = "stopped_early.json"  # beside the checkpoints: early stopping ended the run (write_stopped_early)
_OURS = "nd_adapter"  # our key in DeepSpeed's client_state: step and this rank's RNG states


# --- RNG --------------------------------------------------------------------------------------------------------

def capture_rng() -> dict[str, Any]:
    """This rank's RNG states: python, numpy, torch CPU, CUDA, and Megatron's TP tracker when loaded."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    tracker = _megatron_tracker()
    if tracker is not None:
        state["megatron"] = tracker.get_states()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker = _megatron_tracker()
    if tracker is not None and state.get("megatron"):
        tracker.set_states(state["megatron"])


def _megatron_tracker():
    """Only if Megatron is already imported: this module must not pull it in."""
    mod = sys.modules.get("megatron.core.tensor_parallel.random")
    return mod.get_cuda_rng_tracker() if mod is not None else None


# --- directory bookkeeping --------------------------------------------------------------------------------------

def tag_for(step: int) -> str:
    return f"global_step{step}"


def latest_tag(save_dir: str | Path) -> str | None:
    """The checkpoint a resume continues: what `latest` names, or, when `latest` is missing or empty, the newest
    complete checkpoint (adapter/train/ckpt_info.resume_tag); None when there is none."""
    return ckpt_info.resume_tag(save_dir)


def _remove(path: Path) -> None:
    """Rename first, so a crash mid-delete leaves a `tmp-` leftover rather than a half checkpoint with a real tag."""
    doomed = path.with_name(f"{TMP}deleting-{path.name}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _clean(save_dir: Path, lineage: str | None) -> None:
    for p in save_dir.glob(f"{TMP}*"):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    last = ckpt_info.step_of(pointer(save_dir))
    if last is not None:  # renamed but never pointed to: a crash between rename and `latest`
        for step, p in ckpt_info.steps(save_dir).items():
            if step > last and lineage is not None and lineage_of(p) == lineage:
                _remove(p)


def _prune(save_dir: Path, keep_last: int | None, protect: int | None = None, lineage: str | None = None) -> None:
    """Keep the newest `keep_last` of this lineage; a protected step (the best checkpoint) counts among them and
    stays, as HF's rotation keeps its best_model_checkpoint. The newest one (what `latest` names) always stays, and
    so does every checkpoint of another lineage (another run's, or one saved before lineages were recorded)."""
    last = ckpt_info.step_of(pointer(save_dir))
    if not keep_last or last is None or lineage is None:
        return
    kept = sorted(s for s, p in ckpt_info.steps(save_dir).items() if s <= last and (s == last or
                                                                                    lineage_of(p) == lineage))
    others = [s for s in kept if s != protect]
    room = max(1, keep_last - (len(others) < len(kept)))
    for step in others[:-room]:
        if step != last:
            _remove(save_dir / tag_for(step))


def keep_only_best(save_dir: str | Path, best: int, lineage: str | None) -> list[str]:
    """HF's end of a run with save_total_limit 1 and a best checkpoint: every other checkpoint of this lineage is
    deleted and `latest` names the best (HF leaves only the best checkpoint's directory, which a resume then takes).
    Leader only; returns the deleted tags."""
    root = Path(save_dir)
    if not (root / tag_for(best)).is_dir():
        return []
    atomic_write_text(root / LATEST, tag_for(best), tmp_prefix=TMP)
    gone = []
    for step, p in sorted(ckpt_info.steps(root).items()):
        if step != best and lineage is not None and lineage_of(p) == lineage:
            _remove(p)
            gone.append(p.name)
    return gone


def write_stopped_early(save_dir: str | Path, step: int, lineage: str | None, patience: int) -> None:
    """Leader only: that early stopping ended this lineage's run after `step` (STOPPED_EARLY), so a --resume of it
    says the run has finished instead of training to the same stop again."""
    atomic_write_text(Path(save_dir) / STOPPED_EARLY, json.dumps({"step": step, LINEAGE: lineage,
                                                                  "patience": patience}), tmp_prefix=TMP)


def stopped_early(save_dir: str | Path, lineage: str | None, patience: int | None) -> int | None:
    """The step early stopping ended this lineage's run at, when it did with this patience; else None."""
    try:
        mark = json.loads((Path(save_dir) / STOPPED_EARLY).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(mark, dict) or mark.get(LINEAGE) != lineage or mark.get("patience") != patience:
        return None
    return mark.get("step") if isinstance(mark.get("step"), int) else None


@contextmanager
def _writes(engine, enabled: bool) -> Iterator[None]:
    """A rank that must not write still runs save_checkpoint (it has collectives); DeepSpeed gates the writes on
    these two flags."""
    saved = engine.save_non_zero_checkpoint, engine.save_zero_checkpoint
    if not enabled:
        engine.save_non_zero_checkpoint = engine.save_zero_checkpoint = False
    try:
        yield
    finally:
        engine.save_non_zero_checkpoint, engine.save_zero_checkpoint = saved


def run_lineage(engine) -> str:
    """Collective on a fresh engine: the run's lineage, which its saves record. A resume took the checkpoint's
    (load); a fresh start opens a new one, drawn on rank 0."""
    if getattr(engine, "_nd_lineage", None) is None:
        engine._nd_lineage = agree(uuid.uuid4().hex[:16] if dist.get_rank() == 0 else None)
    return engine._nd_lineage


def _collective_broke(e: BaseException) -> bool:
    """A collective failed because another rank went away (gloo says so in a plain RuntimeError, NCCL in a
    DistBackendError), not because of this rank's disk or a bug."""
    text = str(e)
    return isinstance(e, torch.distributed.DistError) or any(
        s in text for s in ("closed by peer", "reset by peer", "Broken pipe", "gloo", "NCCL", "timed out", "Timed out"))


def _failure(root: Path, step: int, e: BaseException) -> UserError:
    """The one line for a save that did not finish: the disk when a file could not be written, else the other ranks
    (a collective broke: a rank was killed or died), never the disk for that."""
    cause = e.__cause__ if isinstance(e, WriteFailed) else e
    text = f"{cause.__class__.__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    kept = pointer(root)
    after = ("the partial one is removed, " + (f"{kept} is the last complete checkpoint (--resume continues from "
                                                f"it)" if kept else "no earlier checkpoint exists"))
    if isinstance(e, (WriteFailed, OSError)):
        return bad("checkpoint.dir", str(root), f"writing the checkpoint of step {step} failed ({text}); {after}",
                   "free space there (lower checkpoint.keep_last, save less often) or use another directory")
    return bad("checkpoint.dir", str(root), f"the checkpoint of step {step} was not finished: another rank stopped "
               f"during the save ({text}); {after}", "see what ended that rank (its own error, the out-of-memory "
               "killer, the scheduler), then --resume")


# --- save / load ------------------------------------------------------------------------------------------------

def save(engine, save_dir: str | Path, step: int, client_state: dict[str, Any] | None = None, *,
         keep_last: int | None = None, save_ranks: Callable[[int], bool] | None = None,
         trained_only: bool = False, record: dict[str, Any] | None = None, protect: int | None = None) -> Path:
    """Collective: every rank calls it. Returns the published checkpoint directory.

    `client_state` (e.g. {"sampler": sampler.state_dict()}) is stored per rank along with `step` and this rank's
    RNG states. `record`: what the run says of itself (layout, model; adapter/train/ckpt_info.py reads it without
    torch), written beside the files as `nd_adapter.json` with the step, the lineage and every file's size and
    CRC-32. `trained_only`: leave out frozen parameters (a LoRA run's base, which it reloads from the converted
    weights). `keep_last`: keep that many newest checkpoints of this lineage (None/0 keeps all), and the step
    `protect` names among them (the best checkpoint). `save_ranks(global_rank)` says which ranks write files
    (default: all). Saving the step `latest` already names in this lineage does nothing; a step another lineage
    saved is refused in one line, not replaced.
    """
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0):
        raise bad("checkpoint.keep_last", keep_last, "must be a non-negative integer", "use e.g. 3, or 0 to keep all")
    if getattr(engine.checkpoint_engine, "is_decoupled", lambda: False)():
        raise bad("checkpoint_engine", type(engine.checkpoint_engine).__name__, "a decoupled engine writes after"
                  " save_checkpoint returns, so the rename could publish a half-written checkpoint",
                  "use DeepSpeed's default (torch) checkpoint engine")
    rank = dist.get_rank()
    local = node_local(engine)
    fs_leader = engine.local_rank == 0 if local else rank == 0
    root, tag = Path(save_dir), tag_for(step)
    lineage = run_lineage(engine)
    said = None  # the leader's word before anything is written: "done", or why not
    if fs_leader:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file where the directory should be (preflight says so before a CLI run starts)
            said = str(bad("checkpoint.dir", str(root), f"cannot be made a directory ({e.__class__.__name__}: "
                           f"{e.strerror or e})", "name a directory (it is made if missing)"))
        else:
            _clean(root, lineage)
            if (root / tag).exists() and lineage_of(root / tag) != lineage:
                said = str(bad("checkpoint.dir", str(root), f"holds {tag} of another run, which the save of this run's "
                               f"step {step} would replace", "train into another directory, or move that checkpoint "
                               "away (--resume continues a run in its own lineage)"))
            elif pointer(root) == tag:
                said = "done"
    said = agree(said)
    if said == "done":
        return root / tag
    if said is not None:
        raise UserError(said)
    state = {**(client_state or {}), _OURS: {"step": step, "rng": capture_rng(), "optimizer": optimizer_name(engine),
                                             "state_dtype": state_dtype_of(engine.optimizer)}}
    sums: dict[str, dict] = {}
    try:
        with _writes(engine, save_ranks is None or bool(save_ranks(rank))), \
                checksummed(engine, root / (TMP + tag), sums):
            engine.save_checkpoint(str(root), tag=TMP + tag, client_state=state, save_latest=False,  # ends in a barrier
                                   exclude_frozen_parameters=trained_only)
    except (WriteFailed, OSError, RuntimeError) as e:  # a full disk, EIO, a vanished mount; a broken collective
        shutil.rmtree(root / (TMP + tag), ignore_errors=True)
        if isinstance(e, (WriteFailed, OSError)) or _collective_broke(e):
            raise _failure(root, step, e) from e
        raise
    host = socket.gethostname() if local else None
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (host, sums))
    failed = None
    if fs_leader:
        try:
            _publish(root, tag, step, record, lineage, {k: v for h, part in every if h == host
                                                         for k, v in part.items()})
        except OSError as e:
            shutil.rmtree(root / (TMP + tag), ignore_errors=True)
            failed = str(_failure(root, step, e))
        else:
            try:
                _prune(root, keep_last, protect, lineage)
            except OSError:  # an old checkpoint that could not be deleted stays: the safe side
                pass
    failed = agree(failed)
    if failed is not None:
        raise UserError(failed)
    return root / tag


def _publish(root: Path, tag: str, step: int, record: dict[str, Any] | None, lineage: str,
             files: dict[str, dict]) -> None:
    """The leader's part, once every rank's files are written: the record with every file's size and checksum (the
    few files DeepSpeed copies in without its checkpoint engine, its recovery scripts, are read for theirs), the
    rename, `latest`."""
    tmp = root / (TMP + tag)
    for p in sorted(tmp.rglob("*")):
        name = p.relative_to(tmp).as_posix()
        if p.is_file() and name not in files and name != RECORD:
            files[name] = {"bytes": p.stat().st_size, "crc32": crc32(p)}
    text = record_text({**(record or {}), "step": step, LINEAGE: lineage, FILES: dict(sorted(files.items()))})
    atomic_write_text(tmp / RECORD, text, tmp_prefix=TMP)
    if (root / tag).exists():  # an older branch of this lineage's history reused this step number
        _remove(root / tag)
    os.rename(tmp, root / tag)
    _fsync_dir(root)
    atomic_write_text(root / LATEST, tag, tmp_prefix=TMP)


def _fsync_dir(path: Path) -> None:
    """The rename reaches the disk before `latest` names it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def optimizer_name(engine) -> str:
    """`optimizer.name` of the engine's optimizer (adapter/train/optim.py)."""
    return name_of(engine.optimizer)


def load(engine, load_dir: str | Path, *, tag: str | None = None, restore_rng_state: bool = True,
         trained_only: bool = False, arch=None, tp_rank: int = 0, tp: int = 1, ep: int = 1,
         ep_rank: int = 0) -> tuple[int, dict[str, Any]] | None:
    """Collective. Load `tag` (default: what `latest` names; when `latest` is missing or empty, the newest complete
    checkpoint) into a freshly built engine, after checking every file against the sizes and CRC-32s recorded when
    it was written (`ckpt_files.verified`): a damaged checkpoint is refused in one line naming the file, before
    anything of it is loaded.

    Returns (step, client_state) or None when the directory has no checkpoint. At the layout it was saved with,
    DeepSpeed loads its own files and this rank's RNG states come back (unless told not to). At another layout
    (another world size, tp, partitioning or optimizer), given the model's `arch` and this rank's place in TP,
    adapter/train/reshard.py places the saved weights and moments; the RNG streams then start afresh. Another
    model is refused before anything is loaded, with a UserError naming the first difference. The engine's later
    saves continue the checkpoint's lineage.
    """
    root = Path(load_dir)
    explicit = tag is not None
    tag = tag if explicit else latest_tag(root)
    if tag is None:
        return None
    key, value = ("tag", tag) if explicit else ("load_dir", str(root))
    ckpt = root / tag
    if not ckpt.is_dir():
        newest = ckpt_info.newest_complete(root)
        raise bad(key, value, f"checkpoint directory {ckpt} does not exist",
                  "pass a tag that exists (global_stepN)" if explicit else
                  f"delete `{LATEST}` to resume from the newest complete checkpoint ({newest})" if newest else
                  "restore the directory `latest` points to")
    record = verified(engine, ckpt, key, value)
    mine = Path(engine._get_ckpt_name(str(root), tag))
    meta = torch.load(mine, map_location="cpu", weights_only=False, mmap=True) if mine.is_file() else None
    saved_ep = (record or {}).get("layout", {}).get("ep", 1)
    if meta is None or not _same_layout(engine, meta) or saved_ep != ep:
        loaded = _load_resharded(engine, ckpt, key, value, arch, tp_rank, tp, record, ep, ep_rank)
        engine._nd_lineage = (record or {}).get(LINEAGE)
        return loaded
    _check_match(engine, meta, key, value, trained_only)
    with cpu_loads(engine):  # torchao's 4-bit states are tensor subclasses
        path, client = engine.load_checkpoint(str(root), tag=tag, load_module_strict=not trained_only)
    if path is None:
        raise RuntimeError(f"DeepSpeed did not load {ckpt}")
    experts_from_master(engine.optimizer)
    ours = client.pop(_OURS, None)
    if ours is None:
        raise bad(key, value, "not saved by nd-adapter (no step/RNG record)", "load it with DeepSpeed directly")
    if restore_rng_state:
        restore_rng(ours["rng"])
    engine._nd_lineage = (record or {}).get(LINEAGE)
    return int(ours["step"]), client


def _same_layout(engine, meta: dict) -> bool:
    """Whether DeepSpeed's own load fits: this rank's files exist with the same partitioning and optimizer kind."""
    saved_flat = isinstance(meta.get("optimizer"), dict) and meta["optimizer"].get("format") == FORMAT
    return ((meta.get("dp_world_size"), meta.get("mp_world_size")) == (engine.seq_dp_world_size, engine.mp_world_size)
            and saved_flat == isinstance(engine.optimizer, FlatAdamW))


def _load_resharded(engine, ckpt: Path, key: str, value: str, arch, tp_rank: int, tp: int, record: dict | None,
                    ep: int, ep_rank: int) -> tuple[int, dict[str, Any]]:
    from adapter.train import reshard  # only a resume at another layout needs it

    if record is None or "layout" not in record or arch is None:
        found = len(list(ckpt.glob("*model_states.pt")))
        raise bad(key, value, f"saved with another parallel layout ({found} model-state file(s)) by a version of "
                  "nd-adapter that did not record it, so it cannot be resharded", "resume with the layout it was "
                  "saved with")
    if record["model"]["architecture"] != arch.architecture:
        raise bad(key, value, f"it holds a {record['model']['architecture']} model, this run trains "
                  f"{arch.architecture}", "resume with the model it was saved with, or save into a new directory")
    client = reshard.load(engine, ckpt, arch, tp_rank=tp_rank, tp=tp, key=key, value=value, ep=ep, ep_rank=ep_rank,
                          saved_ep=record["layout"].get("ep", 1))
    ours = client.pop(_OURS, None)
    if ours is None:
        raise bad(key, value, "not saved by nd-adapter (no step record)", "load it with DeepSpeed directly")
    return int(ours["step"]), client


def _check_match(engine, meta: dict, key: str, value: str, trained_only: bool = False) -> None:
    there, here = (meta.get(_OURS) or {}).get("optimizer", "adamw"), optimizer_name(engine)
    if there != here:
        raise bad(key, value, f"its optimizer state is {there}'s; this run uses {here}",
                  f"resume with optimizer.name: {there} (as it was saved)")
    check_state_dtype((meta.get(_OURS) or {}).get("state_dtype", "fp32"), engine.optimizer, key, value)
    if meta.get("param_shapes") is not None:
        saved = {k: tuple(v) for group in meta["param_shapes"] for k, v in group.items()}
        here = {k: tuple(v) for group in engine._get_zero_param_shapes() for k, v in group.items()}
    else:
        saved = {k: tuple(v.shape) for k, v in (meta.get("module") or {}).items() if hasattr(v, "shape")}
        here = {k: tuple(v.shape) for k, v in engine.module.state_dict().items() if hasattr(v, "shape")}
        if trained_only:  # DeepSpeed left out the frozen parameters but kept the buffers (bitsandbytes' absmax,
            # SCB) and a tied weight's second name: entries this model holds untrained are not the run's to compare
            trained = {n for n, p in engine.module.named_parameters() if p.requires_grad}
            saved = {k: v for k, v in saved.items() if k in trained or k not in here}
            here = {k: v for k, v in here.items() if k in trained}
    diffs = [f"{k}: {saved.get(k, 'missing')} there, {here.get(k, 'missing')} here"
             for k in sorted(saved.keys() | here.keys()) if saved.get(k) != here.get(k)]
    if diffs:
        more = f" (and {len(diffs) - 2} more)" if len(diffs) > 2 else ""
        raise bad(key, value, "checkpoint does not match this model: " + "; ".join(diffs[:2]) + more,
                  "resume with the model it was trained from, or save into a new directory")


__all__ = ["capture_rng", "restore_rng", "latest_tag", "tag_for", "save", "load"]
