"""Small OS helpers shared by conversion and training (kept here so neither package imports the other)."""
from __future__ import annotations

import os
import socket
from pathlib import Path


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
