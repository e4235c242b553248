"""The `nd-adapter` command line in this process: its exit status and what it printed."""
from __future__ import annotations

import contextlib
import io

from adapter.cli import main


def run_cli(*argv: str) -> tuple[int, str, str]:
    """`nd-adapter *argv`: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()
