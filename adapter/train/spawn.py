"""`nd-adapter train` / `rehearse`: start one process per rank on this machine, running the same worker that
launch/train.py runs under `deepspeed` or `torchrun`.

Checks that need no processes run first (config, architecture, data files, checkpoint), so most mistakes end as
one line and exit status 2 before anything starts. If a worker still fails, the others are stopped and the job
returns that worker's status (2 for a UserError, which the worker prints as one line); of the tracebacks a failure
leaves on several ranks (the others' collectives break when one rank dies), only the first rank's is shown, and
none when a rank was killed from outside (one line names it).

Exit signals (`checkpoint.exit_signals`: SIGTERM, SIGUSR1), sent to this launcher alone or to every process of the
job (SLURM, systemd, a container runtime's process group), end the job the same way, with status 75 (requeue):
- before every rank is in its training loop there is nothing to save: this launcher ends the job at once (the
  ranks are stopped, then killed, so none reports another's end) and says so in one line;
- later it passes the signal on to every rank, which finish the step they are in, save and exit
  (adapter/train/preempt.py).
The fork server blocks them (it ends with this launcher), and ranks start with them blocked until their handlers
are in, so none is lost and none kills a rank still starting. Ranks end by themselves when this launcher dies
(preempt.follow_parent), even from SIGKILL.

Ranks on CPUs (rehearsals; machines without GPU devices) fork from one server process that imported torch,
Megatron-Core, DeepSpeed and the trainer once: a fresh interpreter spends ~6 s of CPU on those imports, and a
rehearsal's 8 or 16 ranks share a laptop's few cores (16 ranks on 2 cores: ~50 s before any work). The server
initialises nothing, so each rank starts as a fresh one would after its imports. GPU ranks stay separate
interpreters (CUDA must not be touched before a fork).
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import multiprocessing.forkserver
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
from adapter.train import ckpt_info, preempt
from adapter.train.preempt import parse
from adapter.train.preflight import preflight

GRACE_S = 3.0  # how long the other ranks may take to end on their own after the first one failed
STOP_GRACE_S = 30.0  # stopping on a signal: how long the other ranks may take to end after the first one did
PARENT = "ND_ADAPTER_PARENT"  # the launcher's pid, for ranks it starts as interpreters (preempt.follow_parent)
# blocked in the fork server, which ends with its launcher (its "alive" pipe closes) and must not die of a signal
# meant for the job (SLURM's, systemd's, a shell's Ctrl-C or hang-up go to every process); its ranks unblock them
SERVER_BLOCKED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
PORT_RETRY = "ND_ADAPTER_PORT_RETRY"  # set for the ranks: rank 0 may end with EXIT_PORT_TAKEN instead of failing
EXIT_PORT_TAKEN = 98  # EADDRINUSE's number: another process took MASTER_PORT first; the ranks start again
PORT_ATTEMPTS = 3
PORT_NOTE = "nd-adapter: MASTER_PORT was taken by another process"  # a notice, not the run's error
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
        print(f"{PORT_NOTE} before rank 0 bound it; starting the {nproc} rank(s) again on another port",
              file=sys.stderr, flush=True)
    return code


def _spawn_once(nproc: int, worker_args: list[str], *, cpu: bool, exit_signals, module: str, retry: bool) -> int:
    port = str(free_port())
    procs = []
    errors = tempfile.TemporaryDirectory(prefix="nd-adapter-errors-")
    exits, stop = parse(exit_signals), {}
    forwarded = _forward(exits, procs, stop)  # until a rank exists, a signal ends the job here (preempt.Stopped)
    try:
        for rank in range(nproc):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                   "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                   ERROR_DIR: errors.name, **({PORT_RETRY: "1"} if retry else {})}
            env.setdefault("OMP_NUM_THREADS", "1")
            if cpu:
                env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
            if cpu or not any(Path(d).exists() for d in GPU_DEVICES):
                procs.append(_Forked(module, worker_args, env, exit_signals))  # blocked in the server already
            else:  # the rank starts with the exit signals blocked (exec keeps the mask) and unblocks them once its
                env[PARENT] = str(os.getpid())  # handlers are in: one sent meanwhile waits instead of killing it
                mask = signal.pthread_sigmask(signal.SIG_BLOCK, exits)
                try:
                    procs.append(subprocess.Popen([sys.executable, "-m", module, *worker_args], env=env))
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            if stop:  # it came while the ranks were starting: they have nothing to save (below)
                break
        while True:
            codes = [p.poll() for p in procs]
            if any(getattr(p, "orphaned", False) for p in procs):  # nothing watches them now: SIGKILL, not the
                _stop(procs, grace_s=0.0)  # SIGTERM that has ranks save a checkpoint whose end no one would see
                print("nd-adapter: error: the process that forked the ranks (multiprocessing's fork server) died "
                      "(out of memory, or killed from outside?); the ranks were stopped", file=sys.stderr, flush=True)
                return 1
            if stop and not all(Path(errors.name, f"rank{r}{preempt.TRAINING}").exists() for r in range(nproc)):
                _halt(procs)  # before step 1 (some rank is not in its training loop): nothing to save, no wait
                print(f"nd-adapter: stopped by {stop['signal']} before step 1: nothing to save (exit status "
                      f"{EXIT_REQUEUE}: requeue)", file=sys.stderr, flush=True)
                return EXIT_REQUEUE
            if (stop or EXIT_REQUEUE in codes) and any(c is not None for c in codes):
                return _stopped(procs, errors.name, stop.get("signal"))  # the ranks end together
            if codes[0] == EXIT_PORT_TAKEN and retry:  # the others wait on a store nobody serves: stop them
                _stop(procs, grace_s=0.0)
                return EXIT_PORT_TAKEN
            if any(c not in (None, 0) for c in codes):
                deadline = time.monotonic() + GRACE_S  # a collective stop (divergence) ends every rank by itself
                while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                    time.sleep(0.1)
                deadline = time.monotonic() + GRACE_S  # one that has left its word is on its way out: its status
                while time.monotonic() < deadline and any(p.poll() is None and _said(errors.name, r)  # tells which
                                                          for r, p in enumerate(procs)):
                    time.sleep(0.1)
                codes = [p.poll() for p in procs]  # as the ranks ended themselves, before the rest are stopped here
                _stop(procs, grace_s=0.0)  # not by an exit signal: the user would read it as a stop
                return _failed(codes, errors.name)
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:  # Ctrl-C: the ranks got it too
        _halt(procs)
        print("nd-adapter: interrupted; the ranks were stopped (nothing saved since the last checkpoint)",
              file=sys.stderr, flush=True)
        raise
    except BaseException:  # a rank that could not be started: the others must not run on
        _stop(procs)
        raise
    finally:
        for sig, previous in forwarded.items():
            signal.signal(sig, previous)
        errors.cleanup()


def _stopped(procs: list, errors: str, name: str | None) -> int:
    """The end of a stop on an exit signal, once a rank has ended: the others end within STOP_GRACE_S (they passed
    the save's last barrier too), else they are killed (one blocked in a collective with a rank that left). Status
    75 when every rank stopped so, else the failure's."""
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    codes = [p.poll() for p in procs]
    _stop(procs, grace_s=0.0)
    if all(c == 0 for c in codes):  # the signal came during the last step: the run ended as planned
        return 0
    if any(c not in (None, EXIT_REQUEUE) for c in codes):
        return _failed(codes, errors)
    if not Path(errors, "rank0.txt").is_file():  # rank 0 was killed before it could say how the run stopped
        said = [f for r in range(len(procs)) if (f := Path(errors, f"rank{r}.txt")).is_file()]
        print(said[0].read_text() if said else f"nd-adapter: stopped by {name or 'a signal'} (exit status "
              f"{EXIT_REQUEUE}: requeue)", file=sys.stderr, flush=True)
    return EXIT_REQUEUE


def _said(errors: str, rank: int) -> bool:
    """Whether `rank` left its line or its traceback (adapter/train/worker.py)."""
    return any(Path(errors, f"rank{rank}.{kind}").is_file() for kind in ("txt", "traceback"))


def _failed(codes: list[int | None], errors: str) -> int:
    """Say why the job failed, given each rank's status as it ended by itself (None: stopped here), and return the
    job's status. The cause is, in order: a rank that said why (status 2, a UserError: its one line), a rank killed
    from outside (the others died of its absence), the rank whose traceback came first (the others' collectives
    broke after it), the lowest failed rank."""
    failed = [c for c in codes if c not in (None, 0)]
    killed = [r for r, c in enumerate(codes) if c is not None and c < 0]
    traced = sorted(Path(errors).glob("rank*.traceback"), key=lambda f: f.stat().st_mtime_ns)
    first = (codes.index(2) if 2 in codes else killed[0] if killed else
             int(traced[0].stem[4:]) if traced else next(r for r, c in enumerate(codes) if c not in (None, 0)))
    left, trace = Path(errors, f"rank{first}.txt"), Path(errors, f"rank{first}.traceback")
    if Path(errors, "rank0.txt").is_file():  # rank 0 printed its line and left this mark
        pass
    elif left.is_file():  # rank 0 was stopped before it could say why
        print(left.read_text(), file=sys.stderr, flush=True)
    elif trace.is_file() and not killed:  # a failure in this rank's own code
        print(trace.read_text().rstrip(), file=sys.stderr)
        print(f"nd-adapter: error: rank {first} failed (traceback above); the other ranks were stopped",
              file=sys.stderr, flush=True)
    else:  # it died without a word: killed, out of memory, a crash in native code
        how = (f"was killed by {signal.Signals(-codes[first]).name} (out of memory, or killed from outside?)"
               if codes[first] < 0 else f"ended with status {codes[first]} (its output above says why)")
        print(f"nd-adapter: error: rank {first} {how}; the other ranks were stopped", file=sys.stderr, flush=True)
    return 2 if 2 in failed else (codes[first] if (codes[first] or 0) > 0 else 1)


def forkserver(env: dict, preload=PRELOAD) -> mp.context.BaseContext:
    """The forkserver context. Its server (one per process, shared by every caller: the first one's `preload` and
    settings hold) is started on first use with `preload` imported under `env`'s import-time settings (IMPORT_ENV)
    and the imports' warnings silenced; a child calls `default_warnings` first."""
    global _context
    if _context is None:
        from multiprocessing import forkserver, resource_tracker

        saved = dict(os.environ)
        os.environ.update({k: env[k] for k in IMPORT_ENV if k in env})
        os.environ["PYTHONWARNINGS"] = "ignore"  # the imports' warnings (no Apex, no TE), which the ranks silence too
        try:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(list(preload))
            resource_tracker.ensure_running()  # first: it unblocks SIGTERM and SIGINT when it starts
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SERVER_BLOCKED)  # kept by the server's exec
            try:
                forkserver.ensure_running()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
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


def _run_rank(module: str, args: list[str], env: dict, exit_signals=()) -> None:
    """A forked rank: this rank's environment and arguments, then `python -m module` as a fresh process runs it.
    It ends with the server, and handles its exit signals before it unblocks the signals the server blocks: one
    sent meanwhile is noted, not lost. The heap it inherits (the server's imports: torch, DeepSpeed, Megatron-Core,
    transformers) is frozen out of the garbage collector: it is never garbage, and DeepSpeed's ZeRO-3 set-up calls
    gc.collect(), which would otherwise walk those millions of objects (~1 s of a CPU rank's start)."""
    gc.freeze()
    preempt.follow_parent()
    # multiprocessing hands every child the write end of the pipe whose end tells the server that its launcher
    # is gone: kept here, it would keep the server, and so this rank, alive after the launcher was killed
    server = getattr(mp.forkserver, "_forkserver", None)
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    preempt.catch(exit_signals)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SERVER_BLOCKED)
    os.environ.clear()
    os.environ.update(env)
    default_warnings()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class _Forked:
    """A rank forked from the server, answering the subprocess.Popen calls `_spawn_once` makes (exit codes as
    Popen's: negative for a signal).

    The server, not this process, is the rank's parent and reports its status. If the server dies (the OOM killer,
    a kill from outside), multiprocessing reports status 255 for every rank: such a rank is `orphaned` (its own
    status is unknown; it ends with the server, preempt.follow_parent) and, while it still runs (`poll` None),
    stopped here by its pid."""

    def __init__(self, module: str, args: list[str], env: dict, exit_signals=()):
        self.proc = forkserver(env).Process(target=_run_rank, args=(module, args, env, list(exit_signals)))
        self.proc.start()
        self.orphaned = False

    def poll(self) -> int | None:
        code = self.proc.exitcode
        if code == 255 and not _running(_server_pid()):  # what multiprocessing says once its server is gone
            self.orphaned = True
            return None if _running(self.proc.pid) else code
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


def _server_pid() -> int | None:
    from multiprocessing import forkserver

    return forkserver._forkserver._forkserver_pid


def _kill(pid: int | None) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, TypeError):
        pass


def _running(pid: int | None) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    if pid is None:
        return False
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
    """End the ranks still running: SIGKILL, after `grace_s` seconds of SIGTERM (an exit signal, which a rank in
    its training loop answers at its next step boundary, adapter/train/preempt.py; one waiting in a collective on
    a dead rank never gets there)."""
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


def _halt(procs: list) -> None:
    """Kill the ranks without a word from any: all are stopped (SIGSTOP) before any is killed, so none sees
    another's end (a broken store or collective, which native code reports with a stack) and says so."""
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)
    for p in procs:
        p.wait()


def _forward(signals: list[signal.Signals], procs: list[subprocess.Popen], stop: dict) -> dict:
    """The exit signals sent to this launcher go on to every rank, which then stop cleanly (adapter/train/preempt.py)
    instead of this process dying and leaving them running; `stop["signal"]` is the first one. One that comes
    before any rank was started raises preempt.Stopped."""
    def send(signum, frame):
        name = signal.Signals(signum).name
        if not procs and not stop:  # none started yet: the job ends here, at once
            stop["signal"] = name
            raise preempt.Stopped(name)
        stop.setdefault("signal", name)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    return {sig: signal.signal(sig, send) for sig in signals}


def main(args) -> int:
    preempt.catch(preempt.DEFAULT_SIGNALS)  # until the config names the run's own
    try:
        preempt.stop_at_once()  # before the ranks start, an exit signal ends the job here, at once
        cfg = source.load_config(args.config, world_size=args.nproc, overrides=config.parse_sets(args.set))
        preempt.catch(cfg.checkpoint.exit_signals)
        preflight(resolve_run(cfg), resume=ckpt_info.resumes(cfg, args.resume))
        worker_args = ["--config", args.config] + (["--resume"] if args.resume else [])
        for item in args.set or []:
            worker_args += ["--set", item]
        if args.max_steps is not None:
            worker_args += ["--max-steps", str(args.max_steps)]
        try:
            return spawn(args.nproc or cfg.world_size, worker_args, exit_signals=cfg.checkpoint.exit_signals)
        finally:  # its ranks have ended: the job ends now, not once the server's interpreter is torn down
            _kill(_server_pid())
    except preempt.Stopped as e:  # before any rank started; once they run, spawn passes the signals on
        print(f"nd-adapter: stopped by {e.signal} before the ranks started: nothing to save (exit status "
              f"{EXIT_REQUEUE}: requeue)", file=sys.stderr, flush=True)
        return EXIT_REQUEUE
