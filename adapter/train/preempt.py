"""Preemption: the signals a cluster sends before it kills a job (SLURM's `--signal`, Kubernetes' SIGTERM) end the run
at a step boundary with a complete checkpoint and a status a launcher can requeue on, as Megatron-LM's
`--exit-signal-handler` does.

A handler only notes the signal. Each step carries the note to every rank inside its own all-reduce (a MAX over
the world, read one step late with the step's other numbers: no extra host wait), so all ranks see it at the same
step, whichever of them the signal reached first; they finish the step they are in, save, and exit with
`EXIT_REQUEUE`. A second signal changes nothing: the save goes on, and the checkpoint's atomic rename
(adapter/train/checkpoint.py) keeps the last complete one if the job is killed during it.
"""
from __future__ import annotations

import signal

from adapter.errors import EXIT_REQUEUE


def parse(names: list[str]) -> list[signal.Signals]:
    """`checkpoint.exit_signals` (the config has checked and spelled them) as signals."""
    return [signal.Signals[n] for n in names]


class Preemption:
    """Installs the handlers (main thread only); `received` is the first signal's name, or None."""

    def __init__(self, names: list[str]):
        self.signals = parse(names)
        self.received: str | None = None
        self._previous = {}
        for sig in self.signals:
            try:
                self._previous[sig] = signal.signal(sig, self._note)
            except ValueError:  # not the main thread (an in-process test harness): nothing to install
                pass

    def _note(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


__all__ = ["EXIT_REQUEUE", "Preemption", "parse"]
