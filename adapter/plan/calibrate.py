"""`nd-adapter calibrate`: short micro-benchmarks on this machine's GPUs, written as a hardware profile for `plan`.

    nd-adapter calibrate CONFIG --out h200-measured.json                         # one GPU
    torchrun --nproc-per-node 8 -m adapter calibrate CONFIG --out prof.json     # + NCCL at the plan's sizes

Measured: bf16 GEMMs at the model's shapes (its layers' four GEMMs at the config's tp, the LM head, 8192³) at two
token counts, fitted to the profile's rate law; causal SDPA forward+backward at the model's heads over three
sequence lengths; a device copy; and with several processes all-gather, reduce-scatter and all-reduce at the sizes
the run moves (one layer's parameters, one micro-batch's activations, 1 GB), fitted to latency + bytes/bandwidth
(intra-node when all ranks share a node, else the network per GPU). Not measured, kept from the base profile: the
host's costs, and the in-training efficiency of memory-bound kernels and of the optimizer step (a micro-benchmark
has no launch gaps); those two are scaled by the measured/base copy bandwidth. Every raw point goes into
`measurements`. The benchmark backend is injectable (`Bench`), so all of this runs in CPU tests with a fake.

Only the real backend (`TorchBench`) imports torch, when it is made: plan/ is torch-free, and this module is
imported with the rest of the command line.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from adapter import config
from adapter.config import RunConfig
from adapter.errors import bad
from adapter.models import source
from adapter.models.arch import ModelArch, padded_vocab_size
from adapter.models.counts import attention_flops, layer_gemms, local_params
from adapter.plan import hardware
from adapter.plan.hardware import Attention, Gemm, Link, Network, Profile

COLLECTIVES = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}   # bytes sent = factor·(n-1)/n·size


class Bench(Protocol):
    device: str
    world: int
    rank: int
    nodes: int

    def gemm(self, m: int, n: int, k: int, iters: int) -> float: ...
    def attention(self, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, iters: int) -> float: ...
    def copy(self, nbytes: int, iters: int) -> float: ...
    def collective(self, op: str, nbytes: int, iters: int) -> float: ...


def fit_saturating(points: list[tuple[tuple[float, ...], float]], grid: list[float]) -> tuple[float, float, float]:
    """rate ≈ R·Π d/(d + c): the c of `grid` with the least squared log error, R its geometric-mean fit.
    Returns (R, c, rms log error)."""
    best: tuple[float, float, float] | None = None
    for c in grid:
        logs = [math.log(rate) - sum(math.log(d / (d + c)) for d in dims) for dims, rate in points]
        mean = sum(logs) / len(logs)
        err = math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs))
        if best is None or err < best[2] - 1e-12:
            best = (math.exp(mean), c, err)
    assert best is not None, "an empty grid"  # the first c of any grid sets it
    return best


def fit_link(points: list[tuple[float, float]]) -> tuple[float, float]:
    """t ≈ latency + sent/busbw by least squares over (bytes sent, seconds); latency clamped at ≥ 0."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else my / mx
    lat = my - slope * mx
    if lat < 0:
        lat, slope = 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return 1 / slope, lat


def calibrate(cfg: RunConfig, arch: ModelArch, bench: Bench, base: Profile, iters: int = 10) -> Profile:
    tp, cp = cfg.parallelism.tp_size, cfg.parallelism.cp_size
    tokens = cfg.batch.micro_batch_size * cfg.seq_len // cp
    vocab = padded_vocab_size(arch.vocab_size, tp, cfg.model.vocab_divisible_by)
    shapes = []
    for m in sorted({max(256, tokens // 4), tokens}):
        shapes += layer_gemms(arch, m, tp) + [(m, vocab // tp, arch.hidden_size)]
    shapes.append((8192, 8192, 8192))
    gemms = [{"m": m, "n": n, "k": k, "seconds": bench.gemm(m, n, k, iters)} for m, n, k in shapes]
    for g in gemms:
        g["flops"] = 2 * g["m"] * g["n"] * g["k"] / g["seconds"]
    R, c, gerr = fit_saturating([((g["m"], g["n"], g["k"]), g["flops"]) for g in gemms], [8.0 * i for i in range(65)])

    heads, kvh = max(1, arch.num_heads // tp), max(1, arch.num_kv_heads // tp)
    spans = sorted({max(512, cfg.seq_len // 4), max(512, cfg.seq_len // 2), max(512, cfg.seq_len)})
    attn = []
    for s in spans:
        b = max(1, tokens // s)
        sec = bench.attention(b, s, heads, kvh, arch.head_dim, iters)
        flops = attention_flops(arch, seq_len=s, sequences=b, heads=heads, windows=[None])  # one causal layer
        attn.append({"batch": b, "seq": s, "heads": heads, "kv_heads": kvh, "head_dim": arch.head_dim,
                     "seconds": sec, "flops": flops / sec})
    A, s0, aerr = fit_saturating([((a["seq"],), a["flops"]) for a in attn], [32.0 * i for i in range(257)])

    nbytes = 1 << 30
    copy_s = bench.copy(nbytes, iters)
    hbm = 2 * nbytes / copy_s                          # read + write
    ratio = hbm / base.hbm_bytes_per_s
    update = {"gemm": Gemm(max_flops=R, half_dim=c), "attention": Attention(max_flops=A, half_seq=s0),
              "hbm_bytes_per_s": hbm, "elementwise_bytes_per_s": base.elementwise_bytes_per_s * ratio,
              "optimizer_bytes_per_s": base.optimizer_bytes_per_s * ratio}
    sources = dict(base.sources)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    sources.update({
        "gemm": f"calibrate on {bench.device}, {when}: {len(gemms)} bf16 GEMMs at the model's shapes (tp {tp}), "
                f"fit rms log error {gerr:.3f}",
        "attention": f"calibrate on {bench.device}, {when}: SDPA fwd+bwd at seq {spans}, fit rms log error {aerr:.3f}",
        "hbm_bytes_per_s": f"calibrate on {bench.device}, {when}: 1 GiB device copy",
        "elementwise_bytes_per_s": f"{base.name}'s figure × measured/base copy bandwidth ({ratio:.2f})",
        "optimizer_bytes_per_s": f"{base.name}'s figure × measured/base copy bandwidth ({ratio:.2f})"})
    measurements: dict[str, list[dict[str, Any]]] = {"gemm": gemms, "attention": attn,
                                                     "copy": [{"bytes": nbytes, "seconds": copy_s}]}

    if bench.world > 1:
        n = bench.world
        lp = local_params(arch, tp, cfg.model.vocab_divisible_by)
        sizes = sorted({2 * lp.layer, 2 * tokens * arch.hidden_size, 1 << 30})
        coll: list[dict[str, Any]] = []
        for op, factor in COLLECTIVES.items():
            for size in sizes:
                size -= size % (2 * n)                  # whole bf16 elements per rank
                sec = bench.collective(op, size, iters)
                coll.append({"op": op, "bytes": size, "seconds": sec, "sent": factor * (n - 1) / n * size,
                             "busbw": factor * (n - 1) / n * size / sec})
        bw, lat = fit_link([(x["sent"], x["seconds"]) for x in coll])
        measurements["collectives"] = coll
        where = f"calibrate on {n} × {bench.device} ({bench.nodes} node(s)), {when}: NCCL at the plan's sizes {sizes}"
        if bench.nodes == 1:
            update["intra_node"] = Link(busbw=bw, latency_s=lat)
            sources["intra_node"] = where
        else:
            update["inter_node"] = Network(busbw_per_gpu=bw / (n // bench.nodes), latency_s=lat)
            sources["inter_node"] = where + "; per GPU = ring busbw / GPUs per node"
    return base.model_copy(update={
        **update, "name": f"calibrated-{bench.device.lower().replace(' ', '-')}", "sources": sources,
        "measurements": measurements, "source_path": None,
        "description": f"measured by nd-adapter calibrate on {bench.world} × {bench.device}, {when}; "
                       f"host costs and what is not listed in sources from the {base.name} profile"})


def write_profile(prof: Profile, out: str) -> Path:
    """Atomically: a temp file beside the target, then rename (no half-written profile on disk)."""
    path = Path(out)
    if not path.parent.is_dir():
        raise bad("--out", out, "its directory does not exist", "create it or write elsewhere")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(prof.model_dump(exclude={"source_path"}), f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class TorchBench:
    """The real backend: CUDA events around bf16 work; NCCL over WORLD when started by torchrun."""

    def __init__(self) -> None:
        import torch  # the real bench only (module docstring)
        import torch.distributed
        import torch.nn.functional

        if not torch.cuda.is_available():
            raise bad("calibrate", "no CUDA", "it measures this machine's GPUs", "run it on the GPU machine")
        self.torch = torch
        self.world, self.rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        self.device = torch.cuda.get_device_name()
        self.nodes = max(1, self.world // int(os.environ.get("LOCAL_WORLD_SIZE", str(self.world))))
        if self.world > 1:
            torch.distributed.init_process_group("nccl")
            self.dist = torch.distributed

    def _time(self, fn: Callable[[], object], iters: int) -> float:
        t = self.torch
        for _ in range(3):
            fn()
        start, end = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
        if self.world > 1:
            self.dist.barrier()
        t.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        t.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters

    def gemm(self, m: int, n: int, k: int, iters: int) -> float:
        t = self.torch
        a, b = t.randn(m, k, device="cuda", dtype=t.bfloat16), t.randn(k, n, device="cuda", dtype=t.bfloat16)
        return self._time(lambda: a @ b, iters)

    def attention(self, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, iters: int) -> float:
        t = self.torch
        q = t.randn(batch, heads, seq, head_dim, device="cuda", dtype=t.bfloat16, requires_grad=True)
        k, v = (t.randn(batch, kv_heads, seq, head_dim, device="cuda", dtype=t.bfloat16, requires_grad=True)
                for _ in range(2))
        g = t.randn_like(q)

        def step() -> None:
            sdpa = t.nn.functional.scaled_dot_product_attention
            sdpa(q, k, v, is_causal=True, enable_gqa=kv_heads != heads).backward(g)
        return self._time(step, iters)

    def copy(self, nbytes: int, iters: int) -> float:
        t = self.torch
        src = t.empty(nbytes, dtype=t.uint8, device="cuda")
        dst = t.empty_like(src)
        return self._time(lambda: dst.copy_(src), iters)

    def collective(self, op: str, nbytes: int, iters: int) -> float:
        t, d, n = self.torch, self.dist, self.world
        full = t.empty(nbytes // 2, dtype=t.bfloat16, device="cuda")
        part = t.empty(nbytes // 2 // n, dtype=t.bfloat16, device="cuda")
        fn = {"all_gather": lambda: d.all_gather_into_tensor(full, part),
              "reduce_scatter": lambda: d.reduce_scatter_tensor(part, full),
              "all_reduce": lambda: d.all_reduce(full)}[op]
        return self._time(fn, iters)


def main(args: argparse.Namespace, flags: dict[str, Any], bench: Bench | None = None) -> int:
    """`flags`: the command line's world and GPU overrides (cli.py's, as for plan)."""
    if args.iters < 1:
        raise bad("--iters", args.iters, "must be at least 1", "e.g. --iters 10")
    cfg = source.load_config(args.config, overrides={**config.parse_sets(args.set), **flags})
    arch = source.arch_for(cfg)
    base = hardware.read(args.base, key="--base") if args.base else hardware.resolve(cfg.hardware,
                                                                                      Path(args.config).parent)
    if base is None:
        raise bad("--base", None, f"no shipped profile for gpu {cfg.hardware.gpu!r} to take the unmeasured parts "
                  "from", f"pass --base {' or '.join(hardware.shipped())}")
    bench = bench or TorchBench()
    prof = calibrate(cfg, arch, bench, base, iters=args.iters)
    if bench.rank == 0:
        path = write_profile(prof, args.out)
        print(f"nd-adapter: wrote {path} ({prof.name}; GEMM {prof.gemm.max_flops / 1e12:.0f} TFLOP/s max, "
              f"attention {prof.attention.max_flops / 1e12:.0f}, copy {prof.hbm_bytes_per_s / 1e12:.2f} TB/s"
              + (f", NCCL {prof.intra_node.busbw / 1e9:.0f} GB/s" if bench.world > 1 and bench.nodes == 1 else "")
              + f"). Use it: --set hardware.profile={path}")
    return 0
