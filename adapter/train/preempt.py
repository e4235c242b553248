"""Preemption: the signals a cluster sends before it kills a job (SLURM's `--signal` and its SIGTERM at the end of
a job or step, Kubernetes' and systemd's SIGTERM) end the run with a status a launcher can requeue on
(`EXIT_REQUEUE`), as Megatron-LM's `--exit-signal-handler` does. They may reach one process or every process of
the job; either way the job ends the same.

One handler per process, in two modes:
- until the training loop (imports, config, process groups, weight conversion and loading, data preparation)
  there is nothing to save, so a stop should be at once. A process that asks for it (`stop_at_once`: a rank under
  torchrun or DeepSpeed's launcher, `nd-adapter train` before its ranks start) gets `Stopped` raised in its main
  thread at the first signal: it says one line and exits with `EXIT_REQUEUE`, and `finally` blocks still remove
  half-built caches (`Stopped` is a BaseException, like KeyboardInterrupt, so no `except Exception` swallows
  it). Ranks of `nd-adapter train` only note it: their launcher ends such a stop itself, by stopping and killing
  every rank (adapter/train/spawn.py), which also ends a rank blocked in native code that no handler reaches.
- from the training loop on (`stop_later`) the handler only notes the signal. Each step carries the
  note to every rank inside its own all-reduce (a MAX over the world, read one step late with the step's other
  numbers: no extra host wait), so all ranks see it at the same step, whichever of them the signal reached first;
  they finish the step they are in, save, and exit with `EXIT_REQUEUE`.
A second signal changes nothing: the save goes on, and the checkpoint's atomic rename
(adapter/train/checkpoint.py) keeps the last complete one if the job is killed during it.

`follow_parent` ends a rank when the process that started it dies (a launcher killed with SIGKILL or by the OOM
killer cannot pass anything on): such ranks would otherwise train on unobserved.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from adapter.config.schema import CheckpointSection
from adapter.errors import ERROR_DIR, EXIT_REQUEUE

# checkpoint.exit_signals' default (the schema's): handled until the config is read
DEFAULT_SIGNALS = tuple(CheckpointSection().exit_signals)
TRAINING = ".training"  # ERROR_DIR/rank{N}.training: rank N is in its training loop (stop_later)
STUCK_S = 5.0  # stop_at_once: how long the main thread may take to act on a signal before `on_stuck` ends it


class Stopped(BaseException):
    """An exit signal before training started: the process ends at once (nothing to save)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.signal = name


_received: str | None = None  # the first exit signal this process got
_at_once = False  # raise Stopped on it (before training), or only note it
_raised = False
_caught: dict[signal.Signals, object] = {}  # signals handled here -> the handler they had before


def parse(names) -> list[signal.Signals]:
    """`checkpoint.exit_signals` (the config has checked and spelled them) as signals."""
    return [signal.Signals[n] if isinstance(n, str) else signal.Signals(n) for n in names]


def _handler(signum, frame) -> None:
    global _received, _raised
    if _received is None:
        _received = signal.Signals(signum).name
    if _at_once and not _raised:
        _raised = True
        raise Stopped(_received)


def catch(names) -> dict:
    """From now on `names`, and no other signal this module handled, are exit signals of this process (main thread
    only; elsewhere nothing is installed). Returns the handlers they replace."""
    wanted = parse(names)
    for sig in [s for s in _caught if s not in wanted]:
        signal.signal(sig, _caught.pop(sig))
    previous = {}
    for sig in wanted:
        try:
            previous[sig] = signal.signal(sig, _handler)
        except ValueError:  # not the main thread (an in-process test harness)
            continue
        if previous[sig] is not _handler:
            _caught[sig] = previous[sig]
    return previous


def stop_at_once(on_stuck: Callable[[str], None] | None = None, stuck_s: float = STUCK_S) -> None:
    """Until `stop_later`, an exit signal raises `Stopped` (at once, if one came already). A Python handler runs
    only between bytecodes of the main thread, which may be blocked in native code for minutes (a store or a
    collective waiting for a rank that already left): `on_stuck(signal name)`, if given, is called from a thread
    `stuck_s` seconds after such a signal if the process still runs, and should end it."""
    global _at_once, _raised
    _at_once = True
    if on_stuck is not None:
        _watch(on_stuck, stuck_s)
    if _received is not None and not _raised:
        _raised = True
        raise Stopped(_received)


def _watch(on_stuck: Callable[[str], None], stuck_s: float) -> None:
    """Signals reach the thread started here through Python's wakeup fd, written by the C-level handler at once."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        os.close(r)
        os.close(w)
        return

    def watch():
        while True:
            for num in os.read(r, 64):
                if num in {s.value for s in _caught} and (_at_once or _raised):
                    time.sleep(stuck_s)
                    if _at_once or _raised:  # not in the training loop meanwhile, where it stops at a step
                        on_stuck(signal.Signals(num).name)
                    return

    threading.Thread(target=watch, name="nd-adapter-stop", daemon=True).start()


def stop_later() -> None:
    """From here on an exit signal is only noted (`received`): the training loop ends at a step boundary with a
    checkpoint. Under `nd-adapter train` the rank says so to its launcher (ERROR_DIR/rank{N}.training), which
    ends a stop before every rank got here by killing them: nothing to save, no reason to wait."""
    global _at_once
    _at_once = False
    if os.environ.get(ERROR_DIR):
        Path(os.environ[ERROR_DIR], f"rank{os.environ.get('RANK', 0)}{TRAINING}").touch()


def received() -> str | None:
    """The first exit signal this process got, or None."""
    return _received


class Preemption:
    """The run's exit signals, handled from `Trainer.setup` to `close` (`restore`); `received` is the first
    signal's name, or None."""

    def __init__(self, names: list[str]):
        self.signals = parse(names)
        self._previous = catch(names)

    @property
    def received(self) -> str | None:
        return _received

    def stop_at_step_boundaries(self) -> None:
        stop_later()

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
            if previous is not _handler:
                _caught.pop(sig, None)
        self._previous.clear()


# --- the parent's death ----------------------------------------------------------------------------------------
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def follow_parent(parent: int | None = None, poll_s: float = 1.0) -> None:
    """SIGKILL this process as soon as its parent (`parent`, or the parent it has now) ends. On Linux the kernel
    does it (prctl's PR_SET_PDEATHSIG: also while the process is blocked in native code, e.g. a collective);
    elsewhere a daemon thread polls the parent's pid. The parent is the launcher (torchrun's agent, DeepSpeed's
    `deepspeed.launcher.launch`, `nd-adapter train`) or, for ranks forked on CPUs, `nd-adapter train`'s fork
    server, which ends with its launcher. Linux ties the request to the thread that started this process: every
    launcher above starts its ranks from its main thread."""
    parent = parent or os.getppid()
    kernel = False
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            kernel = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            pass
    if not kernel:
        def watch():
            while os.getppid() == parent:
                time.sleep(poll_s)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="nd-adapter-parent", daemon=True).start()
    if os.getppid() != parent:  # it ended before the request
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["DEFAULT_SIGNALS", "EXIT_REQUEUE", "Preemption", "Stopped", "catch", "follow_parent", "parse", "received",
           "stop_at_once", "stop_later"]
