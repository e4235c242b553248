"""Run a function in N fresh gloo processes (spawned, so no torch/deepspeed state leaks into pytest).

`fn(rank, world, *args)` must be a module-level function (spawn pickles it by reference). Its return values come
back in rank order; an exception in any rank fails the caller with that rank's traceback.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable, rank: int, world: int, port: int, args: tuple, q) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    try:
        q.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - ship every failure to the parent
        q.put((rank, False, traceback.format_exc()))


def run_workers(fn: Callable, world: int, *args: Any, timeout: float = 180) -> list[Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, ok, value = q.get(timeout=timeout)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
