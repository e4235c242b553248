"""Per-process entry: what `launch/train.py` runs under deepspeed/torchrun, and what `nd-adapter train` spawns."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path

from adapter import config
from adapter.errors import ERROR_DIR, EXIT_REQUEUE, EXIT_USAGE, DivergedError, UserError
from adapter.models import source
from adapter.models.resolved import resolve_run
from adapter.train import ckpt_info, preempt
from adapter.train.spawn import EXIT_PORT_TAKEN, PARENT, PORT_RETRY


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="launch/train.py", description="nd-adapter training process")
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    ap.add_argument("--rehearse", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", "--local-rank", type=int, help="set by the deepspeed launcher")
    return ap.parse_args(argv)


def quiet_third_party() -> None:
    """Megatron, DeepSpeed and torch warn about optional kernels and deprecations at every rank: keep the log
    readable."""
    for category in (FutureWarning, UserWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(torch|megatron|deepspeed)\.")
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|CUDA_DEVICE_MAX_CONNECTIONS|cuda_graph).*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


def main(argv=None) -> int:
    """A rank's whole life: it ends with its launcher, and an exit signal before the training loop ends it at once
    (adapter/train/preempt.py; under `nd-adapter train` the launcher does that)."""
    preempt.follow_parent(int(os.environ[PARENT]) if os.environ.get(PARENT) else None)
    _catch(preempt.DEFAULT_SIGNALS)  # until the config names the run's own
    try:
        if not os.environ.get(ERROR_DIR):
            preempt.stop_at_once(on_stuck=_stuck)
        return _main(argv)
    except preempt.Stopped as e:
        _stopped_early(e.signal)
        return EXIT_REQUEUE
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the terminal's job: `nd-adapter train` says it once
        if not os.environ.get(ERROR_DIR):
            raise
        return 130


def _stopped_early(name: str) -> None:
    if not _said:  # once: `_stuck` may say it too
        _said.append(name)
        _report(int(os.environ.get("RANK", 0)), f"nd-adapter: stopped by {name} before step 1: nothing to save "
                                                f"(exit status {EXIT_REQUEUE}: requeue)")


def _stuck(name: str) -> None:
    """A signal before the training loop that the main thread did not act on (blocked in native code), or acted on
    but is still ending: end the rank now, as `Stopped` would have."""
    _stopped_early(name)
    os._exit(EXIT_REQUEUE)


_said: list[str] = []


def _main(argv=None) -> int:
    args = parse(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    rank = int(os.environ.get("RANK", 0))
    quiet_third_party()
    try:
        world = int(os.environ.get("WORLD_SIZE", 1))
        overrides = config.parse_sets(args.set)
        if args.max_steps is not None:
            overrides["optimizer.max_steps"] = args.max_steps
        cfg = source.load_config(args.config, world_size=world, overrides=overrides)
        _catch(cfg.checkpoint.exit_signals)
        resolved = resolve_run(cfg)  # once per process: everything below reads this record
        if not args.rehearse:  # deepspeed/torchrun start this without `nd-adapter train`'s preflight
            args.resume = ckpt_info.resumes(cfg, args.resume)  # --resume, or auto_resume over a checkpoint
            ckpt_info.check_dir(cfg, args.resume)
        # Large one-off allocations (the optimizer step's fp32 gradient partition) otherwise fail on fragmentation
        # with memory free in total (a Mistral-7B shape on one H200 did: docs/BENCHMARKS.md, 2026-12-01, "the
        # one-GPU memory check"); torchtitan sets the same. Read at CUDA's first allocation, so here.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        if cfg.parallelism.tp_size > 1:  # Megatron's TP/SP comm is issued in order with compute; without TP it would
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # only serialise ZeRO's side-stream collectives
        import torch  # after the allocator's setting; and DeepSpeed picks its accelerator when it is first imported

        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from adapter.train import rehearse
        from adapter.train.engine import init_distributed
        from adapter.train.trainer import run

        timeout = cfg.dist_timeout_s  # an explicit $DEEPSPEED_TIMEOUT (minutes) wins over the default
        if "dist_timeout_s" not in cfg.model_fields_set and os.environ.get("DEEPSPEED_TIMEOUT"):
            timeout = None
        try:
            init_distributed(timeout)
        except torch.distributed.DistNetworkError as e:  # MASTER_PORT taken between its choice and rank 0's bind
            if rank == 0 and "EADDRINUSE" in str(e) and os.environ.get(PORT_RETRY):
                return EXIT_PORT_TAKEN  # `nd-adapter train` starts every rank again on another port
            raise
        log = lambda s: print(s, flush=True)  # noqa: E731
        if args.rehearse:
            rehearse.in_process(resolved, rank, steps=args.steps, seq_len=args.seq_len, workdir=args.workdir, log=log)
        else:
            result = run(resolved, resume=args.resume, log=log)
            if result.preempted:
                where = (f"checkpoint {result.checkpoint} saved; continue with --resume" if result.checkpoint else
                         "no checkpoint.dir, nothing saved")
                _report(rank, f"nd-adapter: stopped by {result.preempted} after step {result.final_step}: {where} "
                              f"(exit status {EXIT_REQUEUE}: requeue)")
                return EXIT_REQUEUE
        return 0
    except UserError as e:
        _report(rank, f"nd-adapter: error: {e}")
        return EXIT_USAGE
    except DivergedError as e:
        _report(rank, f"nd-adapter: training stopped: {e}")
        return EXIT_USAGE
    except Exception:
        return _failed(rank)


def _catch(names) -> None:
    """Handle `names` as exit signals, then let them in: a launcher may start this process with them blocked
    (adapter/train/spawn.py), so that one sent before the handler was in waits for it instead of killing it."""
    preempt.catch(names)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, preempt.parse(names))


def _failed(rank: int) -> int:
    """An unexpected error. After an exit signal it is the stop's: another rank that ended first (before step 1, or
    killed) broke the collective this one was in. Otherwise the traceback is this rank's to show: printed, or left
    for `nd-adapter train`, which shows only the first rank's (the others' collectives break after it) and none
    when a rank was killed from outside (its one line says what happened)."""
    name = preempt.received()  # a Python call: a signal that came while native code ran is handled here
    if name is not None:
        _report(rank, f"nd-adapter: stopped by {name}; another rank ended first (before step 1, or killed), so "
                      f"nothing was saved (exit status {EXIT_REQUEUE}: requeue; --resume continues from the last "
                      "complete checkpoint)")
        return EXIT_REQUEUE
    if not os.environ.get(ERROR_DIR):
        raise
    Path(os.environ[ERROR_DIR], f"rank{rank}.traceback").write_text(traceback.format_exc())
    return 1


def _report(rank: int, line: str) -> None:
    """One line for the user. Rank 0 prints it; every rank also leaves it, first, for `nd-adapter train`'s local
    launcher, which prints the first failed rank's line only when rank 0 left none (so an error only one rank sees
    still reaches the user, and a collective one is said once)."""
    if os.environ.get(ERROR_DIR):
        Path(os.environ[ERROR_DIR], f"rank{rank}.txt").write_text(line)
    if rank == 0:
        print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
