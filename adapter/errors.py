"""One exception type for every mistake a user can make.

The CLI prints `UserError` as a single line and exits with status 2; anything else is a bug in nd-adapter and keeps
its traceback. Messages always name the key, the value and the fix, so the user never has to read our source.
"""
from __future__ import annotations

from typing import Any

EXIT_USAGE = 2
EXIT_REQUEUE = 75  # sysexits' EX_TEMPFAIL ("try again later"): stopped on a signal, resumable with --resume
MAX_SHOWN = 160  # characters of a value a message shows
# Where a training process leaves its one-line error for `nd-adapter train`'s launcher (adapter/train/spawn.py),
# which prints the first failed rank's line when rank 0 left none.
ERROR_DIR = "ND_ADAPTER_ERROR_DIR"


class UserError(Exception):
    """Bad input: a config key, a file, a flag. `str(err)` is the whole one-line message."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # one line, always


class DivergedError(RuntimeError):
    """Training produced an inf/NaN loss or gradient norm: not a bug, so one line and exit status 2 like bad input
    (the fix is in the config: learning rate, warmup), with the last good checkpoint left as `latest`."""


def bad(key: str, value: Any, problem: str, fix: str) -> UserError:
    """Build the canonical message: `key=value: problem. Fix: fix`."""
    try:
        shown = str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)
    except ValueError:  # an integer beyond Python's digit limit for str()
        shown = f"<a {value.bit_length()}-bit integer>"
    if len(shown) > MAX_SHOWN:  # a 300-character path or a 400-digit number, named by its ends
        shown = f"{shown[:MAX_SHOWN // 2]}...{shown[-20:]} ({len(shown)} characters)"
    return UserError(f"{key}={shown}: {problem}. Fix: {fix}")
