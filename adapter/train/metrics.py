"""Throughput, MFU and memory, printed one line per step and optionally sent to TensorBoard / Weights & Biases.

MFU = tokens/s/GPU · model FLOPs per token / the GPU's dense bf16 peak; the FLOPs are adapter/models/counts.py's
(`flops_per_token`), the one formula every number in this project is computed with.
"""
from __future__ import annotations

import resource
import time
from typing import Any

import torch

from adapter.train.preflight import check_sinks

# Dense bf16 tensor-core peaks (no sparsity). Matched as substrings of torch.cuda.get_device_name().
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12))


def peak_flops(device_name: str | None = None) -> float | None:
    """Peak bf16 FLOP/s of this GPU (or of `device_name`); None on CPU or an unlisted GPU, and then no MFU is shown."""
    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    name = device_name.upper()
    return next((v for key, v in PEAK_BF16_FLOPS if key in name), None)


def mfu(tokens_per_s_per_gpu: float, flops_per_tok: float, peak: float | None) -> float | None:
    return None if not peak else tokens_per_s_per_gpu * flops_per_tok / peak


def tokens_per_s_per_gpu(tokens_per_step: int, seconds: float, world_size: int) -> float:
    """`tokens_per_step` counts the whole job's tokens (global batch × seq_len); TP/CP ranks share them."""
    return tokens_per_step / seconds / world_size


class StepClock:
    """Step times read off the device's own timeline (CUDA events; wall clock on CPU), so timing a step never makes
    the host wait for the GPU. A step's time is the period from the previous step's end (or from this step's start
    after `reset`, e.g. following a checkpoint save) to its end; read it once the step's results are on the host."""

    def __init__(self, cuda: bool):
        self.cuda, self._last = cuda, None

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def begin(self) -> None:
        if self._last is None:
            self._last = self._mark()

    def end(self):
        """Mark the end of the current step; returns a handle for `seconds`."""
        prev, self._last = self._last, self._mark()
        return prev, self._last

    def reset(self) -> None:
        self._last = None

    @staticmethod
    def seconds(handle) -> float:
        prev, mark = handle
        if isinstance(mark, float):
            return mark - prev
        mark.synchronize()
        return prev.elapsed_time(mark) / 1e3


class HostReadback:
    """A device tensor's values on the host without draining the GPU's queue: a non-blocking copy into pinned memory
    and an event behind it. `values()` waits for that event only, so the kernels queued after it keep the GPU busy
    (`.item()` or `float(tensor)` would wait for the whole stream, i.e. for everything queued since)."""

    def __init__(self, tensor):
        self._event = None
        if tensor.device.type == "cuda":
            self._host = tensor.detach().to("cpu", non_blocking=True)  # pinned destination: an async copy
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor.detach().clone()

    def values(self) -> list[float]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


def peak_memory_bytes() -> int:
    """Peak allocated GPU memory on CUDA (what the memory model predicts); peak RSS of this process on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def memory_summary() -> str:
    """What the memory model is checked against: the allocator's peaks and what the device has in use in all
    (CUDA context, NCCL and cuBLAS workspaces are outside the allocator)."""
    free, total = torch.cuda.mem_get_info()
    g = 2**30
    return (f"memory: peak allocated {torch.cuda.max_memory_allocated() / g:.2f} GiB, peak reserved "
            f"{torch.cuda.max_memory_reserved() / g:.2f} GiB, device in use {(total - free) / g:.2f} of "
            f"{total / g:.2f} GiB")


def format_step(step: int, *, loss: float, lr: float, grad_norm: float | None = None,
                tokens_per_s_gpu: float | None = None, mfu: float | None = None, peak_mem: int | None = None,
                total_steps: int | None = None, trained_tokens_per_s_gpu: float | None = None) -> str:
    """One grep-friendly line; fields that are unknown (e.g. MFU on CPU) are left out rather than shown as 0."""
    parts = [f"step {step}" + (f"/{total_steps}" if total_steps else ""), f"loss {loss:.4f}", f"lr {lr:.3e}"]
    if grad_norm is not None:
        parts.append(f"grad_norm {grad_norm:.3f}")
    if tokens_per_s_gpu is not None:
        parts.append(f"{tokens_per_s_gpu:,.0f} tok/s/GPU")
    if trained_tokens_per_s_gpu is not None and tokens_per_s_gpu is not None \
            and trained_tokens_per_s_gpu < tokens_per_s_gpu:  # said only when some tokens are not trained (SFT)
        parts.append(f"{trained_tokens_per_s_gpu:,.0f} trained tok/s/GPU")
    if mfu is not None:
        parts.append(f"MFU {100 * mfu:.1f}%")
    if peak_mem is not None:
        parts.append(f"peak_mem {peak_mem / 2**30:.2f} GiB")
    return " | ".join(parts)


class MetricsSink:
    """TensorBoard and/or W&B on global rank 0; a no-op elsewhere or when not asked for.

    W&B honours its own environment (WANDB_MODE=offline, WANDB_DIR, ...), so offline runs need no code here.
    """

    def __init__(self, rank: int, *, tensorboard_dir: str | None = None, wandb_project: str | None = None,
                 run_name: str | None = None, config: dict[str, Any] | None = None, wandb_entity: str | None = None,
                 wandb_mode: str | None = None):
        self._tb = self._wandb = None
        check_sinks(tensorboard_dir, wandb_project)  # on every rank, so no rank trains on alone
        if rank != 0:
            return
        if tensorboard_dir:  # optional packages (nd-adapter[logging]): imported only when asked for
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=tensorboard_dir)
        if wandb_project:
            import wandb

            self._wandb = wandb.init(project=wandb_project, name=run_name, config=config or {}, entity=wandb_entity,
                                     mode=wandb_mode)

    @property
    def active(self) -> bool:
        return self._tb is not None or self._wandb is not None

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        values = {k: float(v) for k, v in metrics.items() if v is not None}
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._tb = self._wandb = None


__all__ = ["PEAK_BF16_FLOPS", "peak_flops", "mfu", "tokens_per_s_per_gpu",
           "StepClock", "HostReadback", "peak_memory_bytes", "memory_summary", "format_step", "MetricsSink"]
