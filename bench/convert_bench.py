"""Conversion benchmark (not run in CI): Llama-3.1-8B-shaped random bf16 checkpoint -> Megatron tp=2 -> HF.

Measures wall time and GB/s of each direction against copies of the same input in the same run, alternated with
the conversions (`shutil.copyfile`, and copy+fsync since the converters fsync before their atomic rename), the
converters' peak RSS (each runs in its own interpreter and reports its VmHWM), and checks the round trip is bit-exact.

    python bench/convert_bench.py --dir /tmp/convbench --repeat 2   # full size: 16 GB per copy, ~50 GB of disk
    python bench/convert_bench.py --dir /tmp/convbench --scale 0.05  # smoke run, seconds
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adapter.convert import hf_io  # noqa: E402

LLAMA31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, head_dim=128)


def config(scale: float) -> dict:
    c = dict(LLAMA31_8B)
    if scale != 1:
        r = lambda x, m: max(m, int(round(x * scale / m)) * m)  # noqa: E731
        c.update(hidden_size=r(4096, 128), intermediate_size=r(14336, 128), num_hidden_layers=max(2, round(32 * scale)),
                 vocab_size=max(1000, int(128256 * scale)))
        c["num_attention_heads"] = c["hidden_size"] // 128
        c["num_key_value_heads"] = min(8, c["num_attention_heads"])
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False, "dtype": "bfloat16",
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}, **c}


def hf_items(c: dict) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    h, f, v, d = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    items = [("model.embed_tokens.weight", (v, h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        items += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)),
                  (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                  (p + "self_attn.o_proj.weight", (h, q)), (p + "post_attention_layernorm.weight", (h,)),
                  (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                  (p + "mlp.down_proj.weight", (h, f))]
    items += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return [(n, s, torch.bfloat16) for n, s in items]


def generate(out: Path, c: dict) -> int:
    """Random bf16 safetensors in 5 GB shards, one tensor at a time (values from a shifted random pool)."""
    out.mkdir(parents=True)
    pool = torch.randn(64 * 2**20, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    state = {"i": 0}
    items = hf_items(c)
    shapes = {n: s for n, s, _ in items}

    def produce(name):
        shape = shapes[name]
        n = torch.Size(shape).numel()
        start = (state["i"] * 7919) % (pool.numel() // 2)
        state["i"] += 1
        reps = -(-(start + n) // pool.numel())
        src = pool if reps == 1 else pool.repeat(reps)
        return [src[start:start + n].view(shape).clone()]  # one block

    hf_io.write_safetensors_sharded(out, items, produce, shard_size=5 * 10**9)
    (out / "config.json").write_text(json.dumps(c, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 128000, "eos_token_id": 128001}))
    return sum(torch.Size(s).numel() * 2 for _, s, _ in items)


def copy_tree(src: Path, dst: Path, sync: bool) -> None:
    """The baseline: every file of `src` (recursively, hidden ones too) with shutil.copyfile."""
    for p in sorted(src.rglob("*")):
        q = dst / p.relative_to(src)
        if p.is_dir():
            continue
        q.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, q)
        if sync:
            with open(q, "rb+") as f:
                os.fsync(f.fileno())


def child(code: str) -> tuple[float, float, int]:
    """Run `code` in a fresh interpreter: (wall seconds incl. interpreter start and imports, seconds of `code`
    alone, peak RSS in bytes). VmHWM, not ru_maxrss: that one keeps the parent's high-water mark across exec."""
    script = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r})\n"
              "from adapter.convert.to_hf import megatron_to_hf\n"
              "from adapter.convert.to_megatron import hf_to_megatron\n"
              f"t = time.perf_counter()\n{code}\nprint('TIME', time.perf_counter() - t)\n"
              "print('RSS', next(ln.split()[1] for ln in open('/proc/self/status') if ln.startswith('VmHWM')))")
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode:
        raise SystemExit(f"child failed:\n{r.stderr[-3000:]}")
    out = dict(ln.split() for ln in r.stdout.splitlines() if ln.startswith(("TIME", "RSS")))
    return wall, float(out["TIME"]), int(out["RSS"]) * 1024


def tensor_digests(d: Path) -> dict[str, str]:
    ck = hf_io.HFCheckpoint(d)
    return {n: hashlib.blake2b(ck.get(n).view(-1).view(torch.uint8).numpy(), digest_size=16).hexdigest()
            for n in ck.names()}


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="scratch dir (deleted at the end unless --keep)")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the model (e.g. 0.05 for a smoke run)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--no-check", action="store_true", help="skip the bit-exact round-trip check (reads 2x size)")
    ap.add_argument("--repeat", type=int, default=1, help="copy/convert rounds per direction (min and median)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    work = args.dir
    if work.exists():
        raise SystemExit(f"{work} exists; give a fresh --dir")
    src, cp, meg, back = (work / n for n in ("hf", "copy", "megatron", "hf_back"))

    def copy_s(tree: Path, sync: bool) -> float:
        t = timed(lambda: copy_tree(tree, cp, sync))
        shutil.rmtree(cp)
        return t

    try:
        c = config(args.scale)
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        nbytes = generate(src, c)
        t_gen = time.perf_counter() - t0
        gb = nbytes / 1e9
        # Each direction alternates copies of its own input (same bytes, same page-cache state) with conversions,
        # `--repeat` times, then one more copy: plain shutil.copyfile, and copy+fsync (the converters fsync before
        # their atomic rename). The disk of a shared VM is noisy, so min and median are reported.
        def direction(inp: Path, out: Path, code: str) -> dict:
            plain, sync, conv = [], [], []
            for _ in range(args.repeat):
                if out.exists():  # before the copies: keeps the disk peak at 3x the model
                    shutil.rmtree(out)
                plain.append(copy_s(inp, False))
                sync.append(copy_s(inp, True))
                conv.append(child(code))
            sync.append(copy_s(inp, True))
            walls, rss = [w for w, _, _ in conv], max(r for _, _, r in conv)
            med = statistics.median
            return {"s": [round(w, 1) for w in walls], "in_process_s": [round(c, 1) for _, c, _ in conv],
                    "copy_s": [round(x, 1) for x in plain], "copy_fsync_s": [round(x, 1) for x in sync],
                    "gbps_best": round(gb / min(walls), 2), "copy_gbps_best": round(gb / min(plain), 2),
                    "vs_copy (min/min, median/median)": [round(min(walls) / min(plain), 2),
                                                         round(med(walls) / med(plain), 2)],
                    "vs_copy_fsync (min/min, median/median)": [round(min(walls) / min(sync), 2),
                                                               round(med(walls) / med(sync), 2)],
                    "peak_rss_gb": round(rss / 1e9, 2)}

        fwd = direction(src, meg, f"hf_to_megatron({str(src)!r}, {str(meg)!r}, tp={args.tp}, progress=False)")
        bwd = direction(meg, back, f"megatron_to_hf({str(meg)!r}, {str(back)!r}, progress=False)")
        exact = None if args.no_check else tensor_digests(src) == tensor_digests(back)
        res = {"gb": round(gb, 2), "params_b": round(nbytes / 2 / 1e9, 3), "tp": args.tp, "scale": args.scale,
               "cpus": os.cpu_count(), "load_avg_start_end": [round(load0, 1), round(os.getloadavg()[0], 1)],
               "generate_s": round(t_gen, 1), "hf_to_megatron": fwd, "megatron_to_hf": bwd,
               "round_trip_bit_exact": exact}
        print(json.dumps(res, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
