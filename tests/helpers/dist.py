"""Run a function in N fresh gloo processes (not pytest's forks, so no torch/deepspeed state leaks into pytest; not
daemons, since torch_dist checkpoint writers start child processes of their own).

On CPU machines the processes fork from one forkserver per pytest session (adapter/train/spawn.forkserver) that
has imported torch, Megatron-Core, DeepSpeed and the trainer once: a fresh interpreter spends ~6 s of CPU on those
imports, which was most of the suite's time on two cores (~50 call sites, 1-16 ranks each). The server initialises
nothing (no CUDA, no process group), so each child starts as a spawned one would after its imports. With CUDA
visible the processes are spawned.

`fn(rank, world, *args)` must be a module-level function (spawn pickles it by reference). Its return values come
back in rank order; an exception in any rank fails the caller with that rank's traceback.
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from adapter.osutil import free_port
from adapter.train.spawn import PRELOAD as RANK_PRELOAD
from adapter.train.spawn import default_warnings, forkserver


def _child(fn: Callable, rank: int, world: int, port: int, args: tuple, q) -> None:
    gc.freeze()  # the preloaded imports are never garbage: DeepSpeed's gc.collect() calls skip them (spawn._run_rank)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
        default_warnings()  # forked from the forkserver, which silenced its imports' warnings
    try:
        q.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - ship every failure to the parent
        q.put((rank, False, traceback.format_exc()))


PRELOAD = [*RANK_PRELOAD, "adapter.train.engine", "adapter.convert.to_megatron", "tests.helpers.hf"]
_ctx = None


def _context():
    """On CPU machines the forkserver `nd-adapter train` forks its CPU ranks from (adapter/train/spawn.py), with
    DeepSpeed told it has no GPU (its accelerator is chosen at import); with CUDA visible, spawn (CUDA must not be
    touched before a fork)."""
    global _ctx
    if _ctx is None:
        import torch

        _ctx = mp.get_context("spawn") if torch.cuda.is_available() else forkserver({"DS_ACCELERATOR": "cpu"}, PRELOAD)
    return _ctx


class _PortTaken(Exception):
    """The rendezvous port `free_port` found was taken before rank 0's store bound it (EADDRINUSE)."""


def run_workers(fn: Callable, world: int, *args: Any, timeout: float = 180) -> list[Any]:
    """`fn(rank, world, *args)` on `world` ranks, their results in rank order. A run whose store could not bind its
    port (another process took it after `free_port` let it go: a race the whole suite met once) starts again on a
    new port: nothing ran past the rendezvous."""
    for _ in range(2):
        try:
            return _run_once(fn, world, args, timeout)
        except _PortTaken:
            continue
    return _run_once(fn, world, args, timeout)


def _run_once(fn: Callable, world: int, args: tuple, timeout: float) -> list[Any]:
    ctx = _context()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, args, q), daemon=False) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, ok, value = q.get(timeout=1)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs)
                        if r not in results and p.exitcode not in (None, 0)]
                if dead:  # killed or crashed before reporting (e.g. OOM, segfault): do not wait out the timeout
                    raise AssertionError(f"rank {dead[0][0]} exited with code {dead[0][1]} before reporting")
                if time.monotonic() > deadline:
                    raise AssertionError(f"timed out after {timeout}s; ranks reported: {sorted(results)}")
                continue
            if not ok:
                if "EADDRINUSE" in str(value) and not results:
                    raise _PortTaken(value)
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:  # on failure the other ranks are likely stuck in a collective: do not wait for them
            p.join(timeout=10 if len(results) == world else 0)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world)]
