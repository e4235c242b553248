"""The `nd-adapter` command line in this process: its exit status and what it printed."""
from __future__ import annotations

import contextlib
import io

from adapter.cli import main
from adapter.train.spawn import PORT_NOTE


def run_cli(*argv: str) -> tuple[int, str, str]:
    """`nd-adapter *argv`: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def said(stderr: str) -> list[str]:
    """The lines of `stderr` that are the run's own, less spawn's notice that it started the ranks again on another
    port (a race with other jobs on the node, which the run survived and a test cannot prevent)."""
    return [ln for ln in stderr.strip().splitlines() if not ln.startswith(PORT_NOTE)]
