"""Small OS helpers shared by conversion and training (kept here so neither package imports the other)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adapter.errors import UserError, bad


def free_port() -> int:
    """A TCP port free on this host right now (for MASTER_PORT of locally spawned process groups)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def atomic_write_text(path: Path, text: str, *, tmp_prefix: str = ".", durable: bool = True) -> None:
    """Readers see the old content or the new, never a torn file: write beside it, fsync (if durable), rename."""
    tmp = path.with_name(f"{tmp_prefix}{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def build_once(root: Path, name: str, build: Callable[[Path], dict[str, Any]], *, builder: bool,
               barrier: Callable[[], None] | None, unseen: tuple[str, str, str]) -> Path:
    """`root/name`, a directory built once by the `builder` rank and reused by every rank and restart.

    The builder fills a temporary directory beside it (`build(tmp)` returns its manifest) and renames it into
    place, so no reader ever sees half of it; a build error is left in `name.error` and raised on every rank.
    `barrier`, when given, is called exactly once on each rank after the builder finished. `unseen` = (key, what,
    fix) for the one-line error when the builder's result is not visible here (node-local storage)."""
    final, failed = root / name, root / f"{name}.error"
    error: Exception | None = None
    if builder and not (final / "manifest.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        failed.unlink(missing_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            manifest = build(tmp)
            atomic_write_text(tmp / "manifest.json", json.dumps(manifest, indent=1) + "\n")
            try:
                os.rename(tmp, final)  # atomic publish; a concurrent identical build may have won
            except OSError:
                if not (final / "manifest.json").is_file():
                    raise
        except Exception as e:
            error = e  # tell the waiting ranks why, instead of leaving them hanging or without the directory
            atomic_write_text(failed, json.dumps({"user": isinstance(e, UserError), "message": str(e)}))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if barrier is not None:
        barrier()
    if error is not None:
        raise error
    if (final / "manifest.json").is_file():
        return final
    if failed.is_file():
        why = json.loads(failed.read_text())
        raise (UserError if why["user"] else RuntimeError)(why["message"])
    key, what, fix = unseen
    raise bad(key, str(root), f"{what} {final.name} made by the builder rank is not visible here", fix)
