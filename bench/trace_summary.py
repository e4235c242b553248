"""Where did the time go? A one-screen digest of a torch-profiler Chrome trace from `logging.profile_steps`.

    python bench/trace_summary.py profile/trace-rank0.json.gz [--top 20]

Prints the profiled window's wall time, how much of it the GPU was busy (union of kernel intervals over all
streams), GPU time by kernel family, compute-stream time inside each `nd.*` phase, the NCCL time no other kernel
overlaps, GPU idle per phase, the host waits (syncs, blocking copies) with the Python frames that caused them, and
the top kernels. `--host nd.forward` adds where the host's time goes inside that phase (the forward of a step bound
by the CPU): its outermost torch ops and CUDA runtime calls by count and time, and the project's and Megatron's Python
functions by inclusive time.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict

FAMILIES = (("nccl", re.compile(r"nccl", re.I)),
            ("attention", re.compile(r"flash|fmha|attention|cudnn.*sdpa", re.I)),
            ("gemm", re.compile(r"gemm|nvjet|sm90_xmma|cutlass|cublas", re.I)),
            ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
            ("fused (triton)", re.compile(r"^triton", re.I)),
            ("copy/cast", re.compile(r"copy|memcpy|memset|cat|CatArray|fill", re.I)),
            ("reduce/norm", re.compile(r"reduce|norm|softmax|cross_entropy|nll", re.I)),
            ("elementwise", re.compile(r"elementwise|vectorized|unrolled", re.I)))


def family(name: str) -> str:
    return next((fam for fam, rx in FAMILIES if rx.search(name)), "other")


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _gaps(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, end = [], None
    for a, b in sorted(intervals):
        if end is not None and a > end:
            out.append((end, a))
        end = b if end is None else max(end, b)
    return out


def _overlap(a: float, b: float, x: float, y: float) -> float:
    return max(0.0, min(b, y) - max(a, x))


WAITS = re.compile(r"^cuda(StreamSynchronize|DeviceSynchronize|EventSynchronize|Memcpy|MemcpyAsync)$")


def host_waits(events: list[dict], min_us: float = 300.0) -> list[tuple[float, str, str]]:
    """(ms, runtime call, innermost non-torch Python frames) for each host call that blocked at least min_us."""
    waits = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"
             and WAITS.match(str(e.get("name", ""))) and e.get("dur", 0) >= min_us]
    frames = [e for e in events if e.get("ph") == "X" and e.get("cat") == "python_function"]
    out = []
    for w in sorted(waits, key=lambda e: e["ts"]):
        around = sorted((f for f in frames if f.get("tid") == w.get("tid") and f["ts"] <= w["ts"]
                         and f["ts"] + f["dur"] >= w["ts"] + w["dur"]), key=lambda f: -f["ts"])
        names = [f["name"] for f in around if not f["name"].startswith(("torch/", "<built-in"))][:3]
        out.append((w["dur"] / 1e3, w["name"], " < ".join(names)))
    return out


def summarize(events: list[dict], top: int = 20) -> dict:
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    phases = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("nd.")]
    gpu_phases = [e for e in phases if e.get("cat") == "gpu_user_annotation"]
    cpu_phases = [e for e in phases if e.get("cat") != "gpu_user_annotation"]
    if not kernels:
        return {"error": "no GPU kernels in this trace"}
    t0 = min(e["ts"] for e in kernels + cpu_phases)
    t1 = max(e["ts"] + e["dur"] for e in kernels + cpu_phases)
    busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    by_family, by_name, by_stream = defaultdict(float), defaultdict(lambda: [0.0, 0]), defaultdict(float)
    for e in kernels:
        by_family[family(e["name"])] += e["dur"]
        by_name[e["name"]][0] += e["dur"]
        by_name[e["name"]][1] += 1
        by_stream[e.get("tid")] += e["dur"]
    compute_stream = max(by_stream, key=by_stream.get)
    phase_gpu = defaultdict(float)
    spans = gpu_phases or cpu_phases
    for p in spans:  # compute-stream kernel time that starts inside each phase's span
        a, b = p["ts"], p["ts"] + p["dur"]
        phase_gpu[p["name"]] += sum(e["dur"] for e in kernels if e.get("tid") == compute_stream and a <= e["ts"] < b)
    phase_cpu = defaultdict(float)
    for p in cpu_phases:
        phase_cpu[p["name"]] += p["dur"]
    nccl = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if family(e["name"]) == "nccl"]
    other = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if family(e["name"]) != "nccl"]
    exposed = union_length(nccl + other) - union_length(other)  # time only NCCL kept the GPU busy
    idle = defaultdict(float)
    gaps = _gaps([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    for p in spans:
        idle[p["name"]] += sum(_overlap(a, b, p["ts"], p["ts"] + p["dur"]) for a, b in gaps)
    return {"window_ms": (t1 - t0) / 1e3, "gpu_busy_ms": busy / 1e3, "gpu_busy_frac": busy / (t1 - t0),
            "kernel_ms": sum(e["dur"] for e in kernels) / 1e3,
            "families_ms": {k: v / 1e3 for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])},
            "phases_cpu_ms": {k: v / 1e3 for k, v in phase_cpu.items()},
            "phases_gpu_ms": {k: v / 1e3 for k, v in phase_gpu.items()},
            "nccl_exposed_ms": exposed / 1e3, "idle_in_phase_ms": {k: v / 1e3 for k, v in idle.items()},
            "host_waits": [(round(ms, 2), name, where) for ms, name, where in host_waits(events)],
            "top": [(n[:110], round(t / 1e3, 2), c) for n, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])
                    [:top]]}


def _outermost(events: list[dict]) -> list[dict]:
    """The events not nested inside another of the list on their thread (events are [ts, ts + dur] intervals)."""
    out, end = [], {}
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end.get(e.get("tid"), float("-inf")):
            out.append(e)
            end[e.get("tid")] = e["ts"] + e["dur"]
    return out


def host_digest(events: list[dict], phase: str, top: int = 25) -> list[str]:
    """Where the host's time goes inside every span of `phase` (CPU side): outermost torch ops, CUDA runtime calls,
    and adapter/ and megatron/ Python functions (inclusive), each as total ms, calls."""
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e.get("name") == phase
             and e.get("cat") != "gpu_user_annotation"]
    inside = [e for e in events if e.get("ph") == "X" and any(a <= e["ts"] and e["ts"] + e["dur"] <= b
                                                               for a, b in spans)]
    total = sum(b - a for a, b in spans)
    lines = [f"host inside {phase}: {len(spans)} spans, {total / 1e3:.1f} ms"]
    groups = (("outermost torch ops", _outermost([e for e in inside if e.get("cat") == "cpu_op"])),
              ("CUDA runtime calls", [e for e in inside if e.get("cat") == "cuda_runtime"]),
              ("Python (adapter/, megatron/; inclusive)", [e for e in inside if e.get("cat") == "python_function"
                                                          and re.search(r"(^|/)(adapter|megatron)/", e["name"])]))
    for title, evs in groups:
        agg = defaultdict(lambda: [0.0, 0])
        for e in evs:
            agg[e["name"]][0] += e["dur"]
            agg[e["name"]][1] += 1
        lines.append(f"  {title}: {len(evs)} calls, {sum(e['dur'] for e in evs) / 1e3:.1f} ms")
        lines += [f"    {t / 1e3:8.2f} {c:6d}  {n[:100]}" for n, (t, c) in
                  sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]]
    return lines


def render(s: dict) -> str:
    if "error" in s:
        return s["error"]
    lines = [f"window {s['window_ms']:.1f} ms | GPU busy {s['gpu_busy_ms']:.1f} ms ({100 * s['gpu_busy_frac']:.0f}%) "
             f"| kernel time, all streams {s['kernel_ms']:.1f} ms",
             "families (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in s["families_ms"].items()),
             "phases, CPU span (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in s["phases_cpu_ms"].items()),
             "phases, compute-stream GPU (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in s["phases_gpu_ms"].items()),
             f"NCCL not overlapped by other kernels: {s['nccl_exposed_ms']:.1f} ms",
             "GPU idle inside each phase (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in s["idle_in_phase_ms"].items()),
             f"host waits >= 0.3 ms ({len(s['host_waits'])}):"]
    lines += [f"  {ms:8.2f}  {name}  {where}" for ms, name, where in s["host_waits"]]
    lines += ["top kernels (ms, calls):"]
    lines += [f"  {t:8.2f} {c:5d}  {n}" for n, t, c in s["top"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--host", default=None, help="a phase (nd.forward): where the host's time goes inside it")
    a = ap.parse_args(argv)
    opener = gzip.open if a.trace.endswith(".gz") else open
    with opener(a.trace, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    print(render(summarize(events, a.top)))
    if a.host:
        print("\n".join(host_digest(events, a.host, a.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
