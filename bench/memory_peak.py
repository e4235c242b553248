"""What is alive at the GPU memory peak of a profiled window, and which lines allocated it.

    python bench/memory_peak.py profile/memory-rank0.pickle [--top 25]

Reads the CUDA caching allocator's snapshot that `logging.profile_steps` writes on CUDA (adapter/train/profile.py:
torch.cuda.memory's history of every allocation and free over the window, with Python frames). Replays the window's
events to find its peak of allocated bytes (what torch.cuda.max_memory_allocated reports), then lists the blocks
alive there: those allocated before the window (weights, gradients, optimizer states, anything kept across steps)
as one line, the rest grouped by the first frame outside torch (the line in nd-adapter, transformers, PEFT or
Liger that asked for them). To compare runs (ours and a peer's), profile both and read the two lists side by side.
"""
from __future__ import annotations

import argparse
import pickle
from collections import defaultdict

GIB = 2**30
_INTERNAL = ("/torch/", "site-packages/torch", "<frozen", "<string>", "/contextlib.py", "/functools.py")


def site(frames: list[dict]) -> str:
    """The first frame outside torch (and Python's own plumbing): who asked for the block."""
    for f in frames or []:
        name = f.get("filename", "")
        if name.endswith(".py") and not any(tag in name for tag in _INTERNAL):  # C++ frames come first ("??")
            short = name.split("site-packages/")[-1].split("/work/main/")[-1]
            return f"{short}:{f.get('line')} {f.get('name')}"
    return "(torch internals)"


def at_peak(snapshot: dict, device: int = 0) -> dict:
    """{peak, before_window (bytes alive at the peak that were allocated before the window), by_site {site: (count,
    bytes)}} for `device`."""
    trace = snapshot["device_traces"][device]
    end = sum(b["size"] for seg in snapshot["segments"] if seg.get("device", 0) == device
              for b in seg["blocks"] if b["state"] == "active_allocated")
    net = sum(e["size"] if e["action"] == "alloc" else -e["size"] for e in trace
              if e["action"] in ("alloc", "free_completed"))
    cur = base = end - net  # allocated when the window began
    peak, peak_at = cur, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            cur += e["size"]
        elif e["action"] == "free_completed":
            cur -= e["size"]
        if cur > peak:
            peak, peak_at = cur, i
    live: dict[int, dict] = {}
    before = base
    for e in trace[:peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            if live.pop(e["addr"], None) is None:
                before -= e["size"]  # a block from before the window, freed in it
    by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in live.values():
        s = by_site[site(e.get("frames", []))]
        s[0] += 1
        s[1] += e["size"]
    return {"peak": peak, "before_window": before, "by_site": {k: tuple(v) for k, v in by_site.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshot", help="memory-rank<r>.pickle from logging.profile_steps (CUDA)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", type=int, default=0)
    a = ap.parse_args(argv)
    with open(a.snapshot, "rb") as f:
        r = at_peak(pickle.load(f), a.device)
    print(f"peak allocated {r['peak'] / GIB:.2f} GiB; allocated before the window and alive there "
          f"{r['before_window'] / GIB:.2f} GiB")
    rows = sorted(r["by_site"].items(), key=lambda kv: -kv[1][1])
    for where, (count, size) in rows[:a.top]:
        print(f"{size / GIB:8.3f} GiB  {count:5d}  {where}")
    rest = sum(v[1] for _, v in rows[a.top:])
    if rest:
        print(f"{rest / GIB:8.3f} GiB         ({len(rows) - a.top} more sites)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
