"""Exit signals in one process (adapter/train/preempt.py) and how `nd-adapter train` names a failed job's cause
(adapter/train/spawn.py), without training: the handler's two modes, a rank that ends with its parent, and which
rank's traceback or line the user sees."""
from __future__ import annotations

import os
import signal
import time

import pytest

from adapter.train import preempt, spawn


@pytest.fixture
def fresh(monkeypatch):
    """The module's process-wide state as a new process has it; the handlers put back afterwards."""
    for name, value in {"_received": None, "_at_once": False, "_raised": False, "_caught": {}}.items():
        monkeypatch.setattr(preempt, name, value)
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    for s in before:  # as a new process has them (an earlier in-process run may have left its handler here)
        signal.signal(s, signal.SIG_DFL)
    yield
    for s, h in before.items():
        signal.signal(s, h)


def test_before_the_loop_a_signal_stops_at_once_and_in_it_is_only_noted(fresh):
    preempt.catch(["SIGUSR1"])
    preempt.stop_at_once()
    with pytest.raises(preempt.Stopped) as e:
        signal.raise_signal(signal.SIGUSR1)
    assert e.value.signal == "SIGUSR1" and preempt.received() == "SIGUSR1"
    signal.raise_signal(signal.SIGUSR1)  # a second one changes nothing
    preempt.stop_later()
    signal.raise_signal(signal.SIGUSR1)
    assert preempt.received() == "SIGUSR1"


def test_a_signal_noted_before_stop_at_once_raises_there(fresh):
    preempt.catch(["SIGUSR2"])
    signal.raise_signal(signal.SIGUSR2)  # e.g. delivered as the rank unblocked it, before the worker ran
    with pytest.raises(preempt.Stopped):
        preempt.stop_at_once()


def test_catch_hands_back_the_signals_it_no_longer_names(fresh):
    preempt.catch(["SIGUSR1", "SIGUSR2"])
    preempt.catch(["SIGUSR2"])  # the config's own list replaces the defaults
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGUSR2) is preempt._handler


def test_a_process_ends_with_its_parent():
    """A grandchild that follows its parent dies (SIGKILL) as soon as that parent is killed."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # the "launcher"
        os.close(r)
        grandchild = os.fork()
        if grandchild == 0:  # the "rank"
            preempt.follow_parent()
            os.write(w, b"%d\n" % os.getpid())
            time.sleep(60)
            os._exit(0)
        time.sleep(60)
        os._exit(0)
    os.close(w)
    rank = int(os.read(r, 64).split()[0])
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    deadline = time.monotonic() + 10
    while spawn._running(rank) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not spawn._running(rank)


def _leave(tmp_path, rank: int, *, line: str | None = None, trace: str | None = None) -> None:
    if line is not None:
        (tmp_path / f"rank{rank}.txt").write_text(line)
    if trace is not None:
        (tmp_path / f"rank{rank}.traceback").write_text(trace)
        time.sleep(0.01)  # the order the ranks wrote them in


def test_a_killed_rank_is_the_cause_and_no_traceback_is_shown(tmp_path, capsys):
    _leave(tmp_path, 0, trace="Traceback ...\nRuntimeError: Connection reset by peer")
    assert spawn._failed([1, -9], str(tmp_path)) == 1
    err = capsys.readouterr().err
    assert err == "nd-adapter: error: rank 1 was killed by SIGKILL (out of memory, or killed from outside?); the " \
                  "other ranks were stopped\n"


def test_the_first_traceback_is_shown_once_with_one_line(tmp_path, capsys):
    _leave(tmp_path, 1, trace="Traceback ...\nValueError: the bug")
    _leave(tmp_path, 0, trace="Traceback ...\nRuntimeError: Connection closed by peer")
    assert spawn._failed([1, 1, None], str(tmp_path)) == 1
    err = capsys.readouterr().err
    assert "the bug" in err and "Connection closed" not in err and err.count("Traceback") == 1
    assert err.splitlines()[-1] == "nd-adapter: error: rank 1 failed (traceback above); the other ranks were stopped"


def test_a_rank_that_said_why_wins(tmp_path, capsys):
    _leave(tmp_path, 1, line="nd-adapter: error: data.files=...: no such file")
    _leave(tmp_path, 0, trace="Traceback ...\nRuntimeError: Connection closed by peer")
    assert spawn._failed([1, 2], str(tmp_path)) == 2
    assert capsys.readouterr().err == "nd-adapter: error: data.files=...: no such file\n"
