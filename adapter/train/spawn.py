"""`nd-adapter train` / `rehearse`: start one process per rank on this machine, running the same worker that
launch/train.py runs under `deepspeed` or `torchrun`.

Checks that need no processes run first (config, architecture, data files, checkpoint), so most mistakes end as
one line and exit status 2 before anything starts. If a worker still fails, the others are stopped and the job
returns that worker's status (2 for a UserError, which the worker prints as one line). The run's exit signals
(SIGTERM, SIGUSR1) are passed on to every rank, which stop together after a checkpoint: status 75 (requeue).

Ranks on CPUs (rehearsals; machines without GPU devices) fork from one server process that imported torch,
Megatron-Core, DeepSpeed and the trainer once: a fresh interpreter spends ~6 s of CPU on those imports, and a
rehearsal's 8 or 16 ranks share a laptop's few cores (16 ranks on 2 cores: ~50 s before any work). The server
initialises nothing, so each rank starts as a fresh one would after its imports. GPU ranks stay separate
interpreters (CUDA must not be touched before a fork).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from adapter import config
from adapter.errors import ERROR_DIR, EXIT_REQUEUE, bad
from adapter.models import source
from adapter.models.resolved import resolve_run
from adapter.osutil import free_port
from adapter.train.preempt import parse
from adapter.train.preflight import preflight

GRACE_S = 3.0  # how long the other ranks may take to end on their own after the first one failed
PORT_RETRY = "ND_ADAPTER_PORT_RETRY"  # set for the ranks: rank 0 may end with EXIT_PORT_TAKEN instead of failing
EXIT_PORT_TAKEN = 98  # EADDRINUSE's number: another process took MASTER_PORT first; the ranks start again
PORT_ATTEMPTS = 3
PRELOAD = ("torch", "torch.distributed", "deepspeed", "megatron.core", "transformers", "adapter.train.trainer")
IMPORT_ENV = ("CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR", "OMP_NUM_THREADS")  # read when those modules are imported
GPU_DEVICES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")  # NVIDIA, ROCm, WSL: ranks there stay separate interpreters


def spawn(nproc: int, worker_args: list[str], *, cpu: bool = False, exit_signals: list[str] = (),
          module: str = "adapter.train.worker") -> int:
    """Start `nproc` ranks of `module` on this host and wait for them. MASTER_PORT is a port free when chosen; if
    another process binds it before rank 0 does (a busy shared node), rank 0 says so (EXIT_PORT_TAKEN) before any
    work and every rank starts again on another port, up to PORT_ATTEMPTS times."""
    if nproc < 1:
        raise bad("--nproc", nproc, "must be at least 1", "pass the number of processes to start")
    for attempt in range(PORT_ATTEMPTS):
        code = _spawn_once(nproc, worker_args, cpu=cpu, exit_signals=exit_signals, module=module,
                           retry=attempt + 1 < PORT_ATTEMPTS)
        if code != EXIT_PORT_TAKEN:
            return code
        print(f"nd-adapter: MASTER_PORT was taken by another process before rank 0 bound it; starting the "
              f"{nproc} rank(s) again on another port", file=sys.stderr, flush=True)
    return code


def _spawn_once(nproc: int, worker_args: list[str], *, cpu: bool, exit_signals, module: str, retry: bool) -> int:
    port = str(free_port())
    procs = []
    errors = tempfile.TemporaryDirectory(prefix="nd-adapter-errors-")
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               ERROR_DIR: errors.name, **({PORT_RETRY: "1"} if retry else {})}
        env.setdefault("OMP_NUM_THREADS", "1")
        if cpu:
            env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
        if cpu or not any(Path(d).exists() for d in GPU_DEVICES):
            procs.append(_Forked(module, worker_args, env))
        else:
            procs.append(subprocess.Popen([sys.executable, "-m", module, *worker_args], env=env))
    forwarded = _forward(exit_signals, procs)
    try:
        while True:
            codes = [p.poll() for p in procs]
            if any(getattr(p, "orphaned", False) for p in procs):  # nothing watches them now: SIGKILL, not the
                _stop(procs, grace_s=0.0)  # SIGTERM that has ranks save a checkpoint whose end no one would see
                print("nd-adapter: error: the process that forked the ranks (multiprocessing's fork server) died "
                      "(out of memory, or killed from outside?); the ranks were stopped", file=sys.stderr, flush=True)
                return 1
            if EXIT_REQUEUE in codes:  # stopping on a signal: every rank saves and ends at the same step
                for p in procs:
                    p.wait()
                codes = [p.returncode for p in procs]
                if all(c == EXIT_REQUEUE for c in codes):
                    return EXIT_REQUEUE
            if codes[0] == EXIT_PORT_TAKEN and retry:  # the others wait on a store nobody serves: stop them
                _stop(procs)
                return EXIT_PORT_TAKEN
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                first = next(r for r, c in enumerate(codes) if c not in (None, 0))
                deadline = time.monotonic() + GRACE_S  # a collective stop (divergence) ends every rank by itself
                while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                    time.sleep(0.1)
                # a rank killed from outside (before we stop the rest) is the cause; the others died of its absence
                killed = [r for r, p in enumerate(procs) if (p.poll() or 0) < 0]
                first = killed[0] if killed else first
                _stop(procs)
                # every rank's own end: a rank that said why (status 2) wins over one that crashed on its way out
                # (a native thread torn down at exit can abort a rank that was already ending)
                codes = [p.returncode for p in procs]
                failed = [c for c in codes if c not in (None, 0)]
                first = codes.index(2) if 2 in codes else first
                left = Path(errors.name, f"rank{first}.txt")
                said = Path(errors.name, "rank0.txt").is_file()  # rank 0 prints its line and leaves this mark
                if not said and left.is_file():  # rank 0 was stopped before it could say why
                    print(left.read_text(), file=sys.stderr, flush=True)
                elif not left.is_file():  # it died without a word: killed, out of memory, a crash in native code
                    how = (f"was killed by {signal.Signals(-codes[first]).name} (out of memory, or killed from "
                           "outside?)" if codes[first] < 0 else f"ended with status {codes[first]} (its output above "
                           "says why)")
                    print(f"nd-adapter: error: rank {first} {how}; the other ranks were stopped", file=sys.stderr,
                          flush=True)
                return 2 if 2 in failed else (failed[0] if failed[0] > 0 else 1)
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(procs)
        raise
    finally:
        for sig, previous in forwarded.items():
            signal.signal(sig, previous)
        errors.cleanup()


def forkserver(env: dict, preload=PRELOAD) -> mp.context.BaseContext:
    """The forkserver context. Its server (one per process, shared by every caller: the first one's `preload` and
    settings hold) is started on first use with `preload` imported under `env`'s import-time settings (IMPORT_ENV)
    and the imports' warnings silenced; a child calls `default_warnings` first."""
    global _context
    if _context is None:
        from multiprocessing import forkserver

        saved = dict(os.environ)
        os.environ.update({k: env[k] for k in IMPORT_ENV if k in env})
        os.environ["PYTHONWARNINGS"] = "ignore"  # the imports' warnings (no Apex, no TE), which the ranks silence too
        try:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(list(preload))
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _context = ctx
    return _context


_context = None


def default_warnings() -> None:
    """Python's default warning filters in a forked child, not the server's "ignore"."""
    sys.warnoptions.clear()
    warnings.resetwarnings()
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category, append=True)


def _run_rank(module: str, args: list[str], env: dict) -> None:
    """A forked rank: this rank's environment and arguments, then `python -m module` as a fresh process runs it."""
    os.environ.clear()
    os.environ.update(env)
    default_warnings()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class _Forked:
    """A rank forked from the server, answering the subprocess.Popen calls `_spawn_once` makes (exit codes as
    Popen's: negative for a signal).

    The server, not this process, is the rank's parent and reports its status. If the server dies (the OOM killer,
    a kill from outside), multiprocessing reports status 255 for every rank while they run on, orphaned: such a rank
    is `orphaned` and still running (`poll` None) until it is stopped here by its pid."""

    def __init__(self, module: str, args: list[str], env: dict):
        self.proc = forkserver(env).Process(target=_run_rank, args=(module, args, env))
        self.proc.start()
        self.orphaned = False

    def poll(self) -> int | None:
        code = self.proc.exitcode
        if code == 255 and _running(self.proc.pid):  # what multiprocessing says once its server is gone
            self.orphaned = True
            return None
        return code

    def wait(self) -> int:
        self.proc.join()
        deadline = time.monotonic() + 10 * GRACE_S  # an orphan is reaped by init, not by us: wait for it to go
        while self.orphaned and _running(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.proc.exitcode

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def send_signal(self, signum: int) -> None:
        try:
            os.kill(self.proc.pid, signum)
        except ProcessLookupError:  # it ended meanwhile
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)  # by pid: multiprocessing's own skips a rank it has a status for (255)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (macOS): as far as kill says


def _stop(procs: list[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    """End the ranks still running. SIGTERM first, though it is an exit signal that asks a rank to finish its step
    (adapter/train/preempt.py): one waiting in a collective on a dead rank never will, so SIGKILL follows after
    `grace_s` (0: SIGKILL alone)."""
    if grace_s > 0:
        for p in procs:
            if p.poll() is None:
                p.terminate()
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _forward(names: list[str], procs: list[subprocess.Popen]) -> dict:
    """The exit signals sent to this launcher go on to every rank, which then stop cleanly (adapter/train/preempt.py)
    instead of this process dying and leaving them running."""
    def send(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    return {sig: signal.signal(sig, send) for sig in parse(names)}


def main(args) -> int:
    cfg = source.load_config(args.config, world_size=args.nproc, overrides=config.parse_sets(args.set))
    preflight(resolve_run(cfg), resume=args.resume)
    worker_args = ["--config", args.config] + (["--resume"] if args.resume else [])
    for item in args.set or []:
        worker_args += ["--set", item]
    if args.max_steps is not None:
        worker_args += ["--max-steps", str(args.max_steps)]
    return spawn(args.nproc or cfg.world_size, worker_args, exit_signals=cfg.checkpoint.exit_signals)
