"""Small OS helpers shared by conversion and training (kept here so neither package imports the other)."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adapter.errors import UserError, bad

EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
BELOW_EPHEMERAL = 12_000  # how many ports under the kernel's ephemeral range `free_port` draws from


def free_port() -> int:
    """A TCP port free on this host right now (for MASTER_PORT of locally spawned process groups), drawn at random
    from the ports just below the kernel's ephemeral range. A port the kernel hands out (bind to 0) is the very kind
    every gloo connection of every other job on the node takes too: two CI runs lost their rendezvous that way (a
    store port reused, "Connection reset by peer"). Below that range only another explicit choice can collide."""
    low = 32_768
    with contextlib.suppress(OSError, ValueError):
        low = int(EPHEMERAL.read_text().split()[0])
    rng = random.SystemRandom()
    if low - BELOW_EPHEMERAL >= 1_024:
        for _ in range(64):
            port = rng.randrange(low - BELOW_EPHEMERAL, low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # an unusual range (or every draw taken): let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def atomic_write_text(path: Path, text: str, *, tmp_prefix: str = ".", durable: bool = True) -> None:
    """Readers see the old content or the new, never a torn file: write beside it, fsync (if durable), rename. A
    failed write (a full disk) leaves nothing behind."""
    tmp = path.with_name(f"{tmp_prefix}{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(e: BaseException | None) -> bool:
    """Whether `e` or an exception it came from is a full disk or an exhausted quota. Libraries wrap it
    (datasets' DatasetGenerationError) or drop its errno (pyarrow's OSError says it only in words)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and (e.errno in DISK_FULL or any(
                text in str(e) for text in ("No space left on device", "Disk quota exceeded"))):
            return True
        e = e.__cause__ or e.__context__
    return False


def tree_bytes(d: Path) -> int:
    """Bytes of the files under `d` (0 when it is gone)."""
    total = 0
    for base, _, files in os.walk(d):
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except OSError:
                pass
    return total


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def free_bytes(d: Path) -> int | None:
    try:
        return shutil.disk_usage(d).free
    except OSError:
        return None


def build_once(root: Path, name: str, build: Callable[[Path], dict[str, Any]], *, builder: bool,
               barrier: Callable[[], None] | None, unseen: tuple[str, str, str]) -> Path:
    """`root/name`, a directory built once by the `builder` rank and reused by every rank and restart.

    The builder fills a temporary directory beside it (`build(tmp)` returns its manifest) and renames it into
    place, so no reader ever sees half of it; a build error is left in `name.error` and raised on every rank.
    `barrier`, when given, is called exactly once on each rank after the builder finished. `unseen` = (key, what,
    fix) for the one-line error when the builder's result is not visible here (node-local storage); its key and
    what also name a root that cannot be written and a disk (or quota) that fills up during the build: the partial
    directory is removed, and one line says what it needed or had written and what was free."""
    final, failed = root / name, root / f"{name}.error"
    key, what, fix = unseen
    error: Exception | None = None
    if builder and not (final / "manifest.json").is_file():
        tmp: Path | None = None
        free = None
        try:
            try:
                root.mkdir(parents=True, exist_ok=True)
                failed.unlink(missing_ok=True)
                free = free_bytes(root)
                tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
            except OSError as e:
                if disk_full(e):
                    raise
                raise bad(key, str(root), f"cannot write {what} there ({e.strerror or e})",
                          f"point {key} at a writable directory") from None
            manifest = build(tmp)
            atomic_write_text(tmp / "manifest.json", json.dumps(manifest, indent=1) + "\n")
            try:
                os.rename(tmp, final)  # atomic publish; a concurrent identical build may have won
            except OSError:
                if not (final / "manifest.json").is_file():
                    raise
        except Exception as e:
            error = e  # tell the waiting ranks why, instead of leaving them hanging or without the directory
            if not isinstance(e, UserError) and disk_full(e):
                written = tree_bytes(tmp) if tmp is not None else 0
                if tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                error = _no_room(e, root, key, what, written, free)
            try:
                atomic_write_text(failed, json.dumps({"user": isinstance(error, UserError), "message": str(error)}))
            except OSError:
                pass  # the disk is full: the builder still says why; the others find no directory and say so
        finally:
            if tmp is not None:
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
    raise bad(key, str(root), f"{what} {final.name} made by the builder rank is not visible here", fix)


def _no_room(e: BaseException, root: Path, key: str, what: str, written: int, free: int | None) -> UserError:
    """The one line for a disk (or quota) that filled up while `what` was being written under `root`: what a
    pre-check (check_room) found it needs and has, else what was written and what was free when the build started
    (files still open in this process may hold their space until it exits)."""
    seen, x = set(), e
    while x is not None and id(x) not in seen and getattr(x, "needed", None) is None:
        seen.add(id(x))
        x = x.__cause__ or x.__context__
    if x is not None and getattr(x, "needed", None) is not None:
        size = [f"it needs {human_bytes(x.needed)}, {human_bytes(x.free)} are free"]
    else:
        size = [f"{human_bytes(written)} were written when it filled"] if written else []
        size += [f"{human_bytes(free)} were free when it started"] if free is not None else []
    return bad(key, str(root), f"no space left on the disk (or quota) while writing {what}"
               f"{' (' + ', '.join(size) + ')' if size else ''}; the partial output was removed",
               f"free space there, or point {key} at a disk with room for it")


def check_room(d: Path, needed: int) -> None:
    """Before writing `needed` bytes into `d`: a disk with less free raises a full disk's OSError carrying
    `needed` and `free` (build_once turns it into one line naming both); a quota is only found by the write."""
    free = free_bytes(d)
    if free is not None and free < needed:
        err = OSError(errno.ENOSPC, f"No space left on device: {needed} bytes needed, {free} free", str(d))
        err.needed, err.free = needed, free  # type: ignore[attr-defined]
        raise err
