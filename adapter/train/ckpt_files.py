"""A training checkpoint's files, as written and as read back: every file DeepSpeed writes is checksummed (CRC-32)
from the bytes handed to it and fsynced; before a load the ranks split the files listed in the record and check
them, so each is read once, and refuse together in one line naming the first that is not as written
(adapter/train/checkpoint.py saves and loads through these; ckpt_info.py holds the record's format)."""
from __future__ import annotations

import os
import socket
import threading
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from deepspeed import comm as dist

from adapter.errors import UserError
from adapter.train import ckpt_info
from adapter.train.ckpt_info import FILES, crc32


class CrcFile:
    """What torch.save writes into: each block goes to the file and into its CRC-32, so the checksum costs no second
    read. A large block (torch.save hands over each tensor's storage whole) is checksummed on a helper thread while
    it is written (zlib and the write both release the GIL), so the write takes max(write, CRC), not their sum; the
    block is not handed back before its checksum is done."""

    OVERLAP = 1 << 20  # smaller blocks (the pickled structure, small tensors) are checksummed inline

    def __init__(self, f):
        self.f, self.crc, self.size = f, 0, 0

    def write(self, block) -> int:
        view = memoryview(block)
        self.size += view.nbytes
        if view.nbytes < self.OVERLAP:
            self.crc = zlib.crc32(view, self.crc)
            return self.f.write(view)
        out = [self.crc]
        helper = threading.Thread(target=lambda: out.__setitem__(0, zlib.crc32(view, out[0])), name="nd-ckpt-crc")
        helper.start()
        try:
            return self.f.write(view)
        finally:
            helper.join()
            self.crc = out[0]

    def flush(self) -> None:
        self.f.flush()


class WriteFailed(Exception):
    """A checkpoint file could not be written (ENOSPC, EFBIG, EIO, a vanished mount): the cause is the disk."""


@contextmanager
def checksummed(engine, tag_dir: Path, sums: dict[str, dict]) -> Iterator[None]:
    """Every file the engine's checkpoint engine writes under `tag_dir` gets its size and CRC-32 into `sums` and is
    fsynced before the save goes on. DeepSpeed's default engine writes through `CrcFile` (one pass); any other
    engine, or one whose `save` was replaced, writes as it does and the file is read back once for its checksum."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    ce = engine.checkpoint_engine
    own = ce.__dict__.get("save")
    inner = ce.save
    stream = type(ce) is TorchCheckpointEngine and own is None

    def save(state_dict, path):
        try:
            if stream:
                with open(path, "wb") as f:
                    out = CrcFile(f)
                    torch.save(state_dict, out, _use_new_zipfile_serialization=ce.zipfile_serialization)
                    f.flush()
                    os.fsync(f.fileno())
                entry = {"bytes": out.size, "crc32": f"{out.crc:08x}"}
            else:
                inner(state_dict, path)
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
                entry = {"bytes": os.path.getsize(path), "crc32": crc32(Path(path))}
        except (OSError, RuntimeError) as e:  # torch.save's stream errors are RuntimeErrors
            raise WriteFailed(path) from e
        sums[Path(os.path.relpath(path, tag_dir)).as_posix()] = entry

    ce.save = save
    try:
        yield
    finally:
        if own is None:
            del ce.save
        else:
            ce.save = own


@contextmanager
def cpu_loads(engine) -> Iterator[None]:
    """DeepSpeed's loads read each file with `map_location=lambda storage, loc: storage`, which torch.load refuses
    for tensor subclasses (torchao's 4-bit AdamW states in a file saved without ZeRO partitions): the same
    placement, named "cpu", which torch accepts for every tensor."""
    ce = engine.checkpoint_engine
    own = ce.__dict__.get("load")
    inner = ce.load

    def load(path, map_location=None):
        return inner(path, map_location="cpu" if callable(map_location) else map_location)

    ce.load = load
    try:
        yield
    finally:
        if own is None:
            del ce.load
        else:
            ce.load = own


def agree(value):
    """Collective: the first non-None of every rank's `value`, in rank order, on every rank."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return next((v for v in every if v is not None), None)


def node_local(engine) -> bool:
    fn = getattr(engine, "use_node_local_storage", None)
    return bool(fn()) if callable(fn) else False


def verified(engine, ckpt: Path, key: str, value: str) -> dict | None:
    """Collective. The checkpoint's record (None: saved before nd-adapter wrote one), once its own checksum, every
    listed file's presence and size (stat) and every file's CRC-32 (read) are as written. The ranks that see the
    directory split the files, so each is read once, on as many ranks as read it in parallel (the load then reads
    its files again, mostly from the page cache); all ranks refuse together, naming the first file not as written.
    A checkpoint saved before files were recorded loads unchecked."""
    found = record = None
    try:
        record = ckpt_info.read_record(ckpt, key, value)
        if record is not None and FILES in record:
            names = sorted(record[FILES])
            share, peers = _share(engine)
            ckpt_info.check_files(ckpt, record, key, value, sums=names[share::peers])
    except UserError as e:
        found = str(e)
    found = agree(found)
    if found is not None:
        raise UserError(found)
    if (record is None or FILES not in record) and dist.get_rank() == 0:
        warnings.warn(f"{ckpt} records no checksums of its files (saved by an older nd-adapter): loaded unchecked",
                      UserWarning, stacklevel=3)
    return record


def _share(engine) -> tuple[int, int]:
    """(this rank's index, how many ranks) among those that read the same checkpoint directory: all of them, or,
    with node-local storage, this node's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if not node_local(engine):
        return rank, world
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    peers = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    return peers.index(rank), len(peers)


__all__ = ["CrcFile", "WriteFailed", "checksummed", "cpu_loads", "agree", "node_local", "verified"]
