"""Why a shared fixture failed, said again at the very end of the run (tests/conftest.py prints it there), where a
CI log clipped in the middle still shows it."""
from __future__ import annotations

import pytest

WHY_KEY = pytest.StashKey[list]()  # the session's reasons, in the order they came


def say_at_the_end(config: pytest.Config, why: str) -> None:
    """Keep `why` for the run's last lines."""
    config.stash.setdefault(WHY_KEY, []).append(why)
