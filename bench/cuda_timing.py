"""The kernel benches' one timer (GPU host): CUDA events around `iters` calls after a warm-up, so what is timed is
the GPU's work with the launches queued back to back, as in a training step."""
from __future__ import annotations


def ms_per_call(fn, iters: int = 20, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters
