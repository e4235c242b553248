"""Does a host->device copy of a pageable micro-batch wait for the GPU? Queue ~50 ms of GEMMs, then time the host
side of `tensor.to("cuda", non_blocking=True)` from pageable and from pinned memory, at sizes a micro-batch's
tensors have (a [2, 4096] int64 tensor is 64 KiB). A host time near the queued work would mean the copy drained the
stream first, so that the next forward started on an empty GPU queue. One H100 (2026-12-06, docs/BENCHMARKS.md): every
size up to 1 MiB returned at once from pageable memory (0.1-0.3 ms), and pinning it first cost more host time than it
saved, so adapter/train/batches.place copies pageable micro-batches with non_blocking.

    python3 bench/h2d_sync.py
"""
from __future__ import annotations

import time

import torch


def busy(a, n=40):
    for _ in range(n):
        a = a @ a
        a = a / a.norm()
    return a


def main():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    busy(a, 4)
    torch.cuda.synchronize()
    t = time.perf_counter()
    busy(a)
    torch.cuda.synchronize()
    work = time.perf_counter() - t
    print(f"queued GPU work: {work * 1e3:.1f} ms")
    for nbytes in (16 << 10, 64 << 10, 65 << 10, 256 << 10, 1 << 20):
        for kind in ("pageable", "pinned", "pin_memory() then copy"):
            host = torch.zeros(nbytes // 8, dtype=torch.int64)
            if kind == "pinned":
                host = host.pin_memory()
            torch.cuda.synchronize()
            busy(a)
            t = time.perf_counter()
            src = host.pin_memory() if kind.startswith("pin_memory") else host
            src.to("cuda", non_blocking=True)
            host_s = time.perf_counter() - t
            torch.cuda.synchronize()
            print(f"{nbytes >> 10:>5} KiB {kind:>22}: host {host_s * 1e3:7.2f} ms "
                  f"({'waited for the queue' if host_s > 0.5 * work else 'returned at once'})")


if __name__ == "__main__":
    main()
