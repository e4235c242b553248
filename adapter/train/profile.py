"""Optional torch-profiler window over a few training steps (Megatron-LM's --profile-step-start/--profile-step-end).

Before anything is tuned, see where the time goes: this writes, per profiled rank, a gzipped Chrome trace
(open in Perfetto or chrome://tracing; `bench/trace_summary.py` digests it) and the op table sorted by GPU time; on
CUDA also where the memory goes: the caching allocator's history over the window (torch.cuda.memory's snapshot,
`memory-rank{r}.pickle`: open it at pytorch.org/memory_viz; `bench/memory_peak.py` lists what is alive at the
window's peak and which lines allocated it). Nothing is imported or recorded unless `logging.profile_steps` is set.
"""
from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import torch


class StepProfiler:
    """Records steps start..end (inclusive, 1-based) on the ranks in `ranks`."""

    def __init__(self, steps: tuple[int, int] | None, out_dir: str | None, rank: int, ranks: tuple[int, ...] = (0,)):
        self.start, self.end = steps if steps else (0, -1)
        self.active = steps is not None and rank in ranks
        self.dir, self.rank, self._prof = Path(out_dir or "profile"), rank, None

    def begin(self, step: int) -> None:
        if self.active and step == self.start:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            # with_stack: the Python frames around each host wait (a `.to()`, `bool(tensor)`, a device sync) name
            # the line that drained the GPU's queue; `bench/trace_summary.py` lists them
            self._prof = torch.profiler.profile(activities=acts, with_stack=True)
            if torch.cuda.is_available():  # every allocation and free of the window, with its Python frames
                torch.cuda.memory._record_memory_history(max_entries=500_000)
            self._prof.__enter__()

    def finish(self, step: int) -> bool:
        """Stop and write the trace after the window's last step; True if it did (that took time off the step)."""
        if self._prof is None or step != self.end:
            return False
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        if torch.cuda.is_available():
            torch.cuda.memory._dump_snapshot(str(self.dir / f"memory-rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        trace = self.dir / f"trace-rank{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=90)
        (self.dir / f"ops-rank{self.rank}.txt").write_text(table)
        return True

