"""All-or-nothing output directories: build in a hidden temp dir beside the target, rename at the end.

An interrupted or failed conversion leaves at most a `.NAME.tmp-*` directory (removed on any Python-level failure),
never a directory at the target path that looks complete.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from adapter.errors import bad


def check_target(target: str | Path, overwrite: bool, sources: tuple[Path, ...] = (), key: str = "out") -> Path:
    """Refuse before any work: existing target without --overwrite, or a target inside / equal to an input."""
    t = Path(target).absolute()
    for s in sources:
        s = Path(s).absolute()
        if t == s or s in t.parents or t in s.parents:
            raise bad(key, str(target), f"overlaps the input {s}", "write the output to a separate directory")
    if t.exists() or t.is_symlink():
        if not overwrite:
            raise bad(key, str(target), "already exists", "pass --overwrite to replace it, or choose another --out")
        if not t.is_dir():
            raise bad(key, str(target), "exists and is not a directory", "remove it or choose another --out")
    return t


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / "x")
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        fd = os.open(target.parent, os.O_RDONLY)  # make the rename itself durable
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
