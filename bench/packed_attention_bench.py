"""Packed-document attention, forward + backward, four ways (GPU host):

    python bench/packed_attention_bench.py                     # 2×4k (8 docs), 1×16k (16 docs), 1×32k (32 docs)
    python bench/packed_attention_bench.py --shapes 1x16384x16 --iters 20

Variants, on the same q/k/v (Llama-3.2-1B heads: 32 query, 8 KV, head_dim 64, bf16):
  dense causal        SDPA is_causal over whole sequences (documents ignored: the speed to match)
  dense doc mask      SDPA with a [b, 1, s, s] bool document mask (what data.document_mask did before)
  varlen (ours)       adapter.kernels.varlen over cu_seqlens: FlashAttention-2 varlen, GQA without repeating K/V
  flex + BlockMask    compiled flex_attention with a causal & same-document BlockMask
plus "varlen, max=seq" (the same kernel told every document may be a whole sequence long: the cost of a static
bound). Document lengths vary (uniform in [L/2, 3L/2], scaled to fill each sequence). Prints a table, then one
`RESULT {json}` line; ms are per fwd+bwd, TFLOP/s count the causal work the documents need.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def doc_lengths(seq: int, docs: int, seed: int) -> list[int]:
    """`docs` lengths summing to `seq`, each within about [L/2, 3L/2] of L = seq/docs."""
    import random

    rng = random.Random(seed)
    raw = [rng.uniform(0.5, 1.5) for _ in range(docs)]
    lens = [max(1, int(seq * r / sum(raw))) for r in raw]
    lens[-1] += seq - sum(lens)
    return lens


def causal_flops(lengths: list[int], heads: int, head_dim: int) -> float:
    """fwd + bwd matmul FLOPs of causal attention over sequences of these lengths (bwd = 2.5× fwd)."""
    return 3.5 * sum(4 * n * n / 2 for n in lengths) * heads * head_dim


def render(rows: list[dict]) -> str:
    head = f"{'shape':>16} {'variant':>18} {'ms fwd+bwd':>11} {'TFLOP/s':>8} {'peak GiB':>9} {'max |Δ|':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        diff = r["max_diff_vs_varlen"]
        lines.append(f"{r['shape']:>16} {r['variant']:>18} {r['ms']:>11.3f} {r['tflops']:>8.1f} "
                     f"{r['peak_extra_gib']:>9.2f} {'-' if diff is None else f'{diff:.2e}':>9}")
    return "\n".join(lines)


def bench_shape(b: int, s: int, n: int, a) -> list[dict]:
    """All variants on one BATCHxSEQxDOCS shape."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from adapter.kernels.thd import document_attention_mask, pack_batch
    from adapter.kernels.varlen import varlen_attention

    flex = torch.compile(flex_attention, dynamic=False)
    dev = a.device
    dt = torch.bfloat16 if dev == "cuda" else torch.float32  # CPU: a smoke run of the script (CI), no timings
    cuda = dev == "cuda"
    h, g, d, scale = a.heads, a.kv_heads, a.head_dim, a.head_dim ** -0.5
    lens = [doc_lengths(s, n, seed=i) for i in range(b)]
    seg = torch.tensor([[i for i, m in enumerate(row) for _ in range(m)] for row in lens])
    _, params = pack_batch({"tokens": seg, "labels": seg, "loss_mask": torch.ones(b, s), "segment_ids": seg})
    params, seg = params.to(dev), seg.to(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, m, d, device=dev, dtype=dt, generator=gen) for m in (h, g, g, h))
    bhsd = lambda *ts: [t.transpose(1, 2) for t in ts]  # noqa: E731
    flat = lambda *ts: [t.flatten(0, 1) for t in ts]  # noqa: E731
    block_mask = create_block_mask(lambda bi, hi, qi, ki: (qi >= ki) & (seg[bi, qi] == seg[bi, ki]), b, None, s, s,
                                   device=dev)
    mask = {}

    variants = {
        "dense causal": lambda q, k, v: F.scaled_dot_product_attention(
            *bhsd(q, k, v), is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2),
        "dense doc mask": lambda q, k, v: F.scaled_dot_product_attention(
            *bhsd(q, k, v), attn_mask=mask["doc"], scale=scale, enable_gqa=True).transpose(1, 2),
        "varlen (ours)": lambda q, k, v: varlen_attention(
            *flat(q, k, v), params.cu_local, params.max_host, scale).view(b, s, h, d),
        "flex + BlockMask": lambda q, k, v: flex(
            *bhsd(q, k, v), block_mask=block_mask, scale=scale, enable_gqa=True).transpose(1, 2),
        "varlen, max=seq": lambda q, k, v: varlen_attention(
            *flat(q, k, v), params.cu_local, s, scale).view(b, s, h, d),
    }
    flops = causal_flops([m for row in lens for m in row], h, d)
    rows, outs = [], {}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for name, fn in variants.items():
        if a.variants and name not in a.variants:
            continue
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        if name == "dense doc mask":
            mask["doc"] = ~document_attention_mask(seg)  # built inside its row: its memory counts there
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        for i in range(a.warmup + a.iters):
            if i == a.warmup:
                sync()
                t0 = time.perf_counter()
            for x in xs:
                x.grad = None
            out = fn(*xs)
            out.backward(dout)
        sync()
        ms = (time.perf_counter() - t0) / a.iters * 1e3
        work = causal_flops([s] * b, h, d) if name == "dense causal" else flops
        rows.append({"shape": f"{b}x{s} {n}docs", "variant": name, "ms": round(ms, 3),
                     "tflops": round(work / ms / 1e9, 1),
                     "peak_extra_gib": round((torch.cuda.max_memory_allocated() - base) / 2**30, 2) if cuda else 0.0})
        outs[name] = out.detach().float()
        mask.clear()
        del xs, out
    for r in rows:  # dense causal computes other maths (documents ignored): no comparison
        r["max_diff_vs_varlen"] = None if r["variant"] == "dense causal" or "varlen (ours)" not in outs else \
            (outs[r["variant"]] - outs["varlen (ours)"]).abs().max().item()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["2x4096x8", "1x16384x16", "1x32768x32"],
                    help="BATCHxSEQxDOCS_PER_SEQUENCE")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", nargs="*", help="only these (default: all)")
    ap.add_argument("--device", default="cuda", help="cpu: smoke-run the script (fp32, timings meaningless)")
    a = ap.parse_args(argv)

    import torch

    rows = []
    for shape in a.shapes:
        rows += bench_shape(*(int(x) for x in shape.split("x")), a)
        if a.device == "cuda":
            torch.cuda.empty_cache()
    print(render(rows))
    device = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    print("RESULT", json.dumps({"bench": "packed_attention", "heads": a.heads, "kv_heads": a.kv_heads,
                                "head_dim": a.head_dim, "dtype": "bf16" if a.device == "cuda" else "fp32",
                                "torch": torch.__version__, "device": device, "rows": rows}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
