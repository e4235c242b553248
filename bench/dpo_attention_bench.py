"""The attention of one DPO pair, forward + backward, the ways nd-adapter can run it (GPU host):

    python bench/dpo_attention_bench.py                       # the DPO bench's pair: prompt 1062, answers 1080 / 1075
    python bench/dpo_attention_bench.py --prompt 512 --chosen 256 --rejected 300 --iters 50

Why: with each prompt once (`dpo.share_prompt`) a LoRA DPO step computed 25% fewer tokens than with padded rows but
ran only 8% faster, ~19% slower per token (docs/BENCHMARKS.md, 2026-12-05 16:50); the stream's attention runs
FlashAttention-2 varlen where the padded rows run SDPA, whose cuDNN backend was 1.8× flash on an H200 for 3B heads.
Variants, on the same q/k/v (Llama-3.1-8B heads: 32 query, 8 KV, head_dim 128, bf16):
  padded rows, SDPA        [2, longest] rows, causal: both answers with the prompt, padding included
  stream, varlen (ours)    adapter.kernels.varlen over thd.pairs_to_shared_stream's sequences (the prompt once)
  stream, SDPA split       the chosen sequence causal, the rejected answer's queries over prompt + its own keys
                           (bottom-right causal), two SDPA calls; K/V repeated for GQA (or SDPA's enable_gqa)
  stream, SDPA + varlen    the chosen sequence through SDPA, the rejected one through ours
Prints a table and one `RESULT {json}` line: ms per fwd+bwd (CUDA events, after warm-up), and each stream variant's
largest difference from ours.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def stream_inputs(p: int, c: int, r: int, heads: int, kv: int, d: int, device, dtype, seed: int = 0):
    """q/k/v of the shared stream [p + c + r, h, d] and its PackedDocs (thd.pairs_to_shared_stream's own)."""
    import torch

    from adapter.kernels.thd import pairs_to_shared_stream

    s = max(p + c, p + r)
    rows = {k: torch.zeros(2, s, dtype=torch.int64) for k in ("tokens", "labels", "loss_mask")}
    _, params = pairs_to_shared_stream(rows, torch.tensor([p + c, p + r]), torch.tensor([p]))
    g = torch.Generator(device="cpu").manual_seed(seed)
    t = p + c + r
    q, k, v = (torch.randn(t, h, d, generator=g).to(device, dtype) for h in (heads, kv, kv))
    return q, k, v, params.to(device)


def variants(p: int, c: int, r: int, d: int):
    """name -> fn(q, k, v) over the stream's q/k/v (the padded variant rebuilds its rows from them)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from adapter.kernels.varlen import packed_attention

    scale = d ** -0.5

    def sdpa(q, k, v, mask=None, causal=False, gqa=False):  # [t, h, d] -> [1, h, t, d] and back
        hq, hk = q.size(1), k.size(1)
        if not gqa:
            k, v = (x.repeat_interleave(hq // hk, 1) for x in (k, v))
        out = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), attn_mask=mask,
                                             is_causal=causal, scale=scale, **({"enable_gqa": True} if gqa else {}))
        return out[0].transpose(0, 1)

    def padded(q, k, v):
        s = max(p + c, p + r)
        rows = []
        for x in (q, k, v):
            chosen, rejected = x[:p + c], torch.cat([x[:p], x[p + c:]])
            rows.append(torch.stack([F.pad(chosen, (0, 0, 0, 0, 0, s - p - c)),
                                     F.pad(rejected, (0, 0, 0, 0, 0, s - p - r))]))
        hq, hk = q.size(1), k.size(1)
        kk, vv = (x.repeat_interleave(hq // hk, 2) for x in rows[1:])
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (rows[0], kk, vv)), is_causal=True,
                                              scale=scale)

    def ours(q, k, v, params):
        return packed_attention(q, k, v, params, scale=scale)

    def split(q, k, v, gqa=False):
        chosen = sdpa(q[:p + c], k[:p + c], v[:p + c], causal=True, gqa=gqa)
        keys, vals = torch.cat([k[:p], k[p + c:]]), torch.cat([v[:p], v[p + c:]])
        rejected = sdpa(q[p + c:], keys, vals, mask=causal_lower_right(r, p + r), gqa=gqa)
        return torch.cat([chosen, rejected])

    def hybrid(q, k, v):  # the long chosen sequence through SDPA (cuDNN where it runs), the rejected one through ours
        from adapter.kernels.varlen import varlen

        chosen = sdpa(q[:p + c], k[:p + c], v[:p + c], causal=True)
        keys, vals = torch.cat([k[:p], k[p + c:]]), torch.cat([v[:p], v[p + c:]])
        cu_q = torch.tensor([0, r], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, p + r], dtype=torch.int32, device=q.device)
        rejected = varlen(q[p + c:], keys, vals, cu_q, cu_k, (r, p + r), True, scale)
        return torch.cat([chosen, rejected])

    return {"padded rows, SDPA": padded, "stream, varlen (ours)": ours, "stream, SDPA split": split,
            "stream, SDPA split (enable_gqa)": lambda q, k, v: split(q, k, v, gqa=True),
            "stream, SDPA chosen + varlen rejected": hybrid}


def run(a) -> list[dict]:
    import torch

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    q0, k0, v0, params = stream_inputs(a.prompt, a.chosen, a.rejected, a.heads, a.kv_heads, a.head_dim, device,
                                       dtype)
    dout = torch.randn(q0.shape[0], a.heads, a.head_dim, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    out, ref = [], None
    for name, fn in variants(a.prompt, a.chosen, a.rejected, a.head_dim).items():
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        call = (lambda fn=fn, q=q, k=k, v=v: fn(q, k, v, params)) if "ours" in name else \
            (lambda fn=fn, q=q, k=k, v=v: fn(q, k, v))

        def step(call=call):
            o = call()
            grad = dout if o.dim() == 3 else torch.randn_like(o)
            o.backward(grad)
            return o

        o = step()
        diff = None
        if o.dim() == 3:  # a stream variant: compare with ours
            if ref is None or "ours" in name:
                ref = (o.detach(), q.grad.clone())
            diff = max((o.detach() - ref[0]).abs().max().item(), (q.grad - ref[1]).abs().max().item())
        ms = None
        if cuda:
            for _ in range(a.warmup):
                step()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(a.iters):
                step()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / a.iters
        out.append({"variant": name, "ms": ms, "max_diff_vs_ours": diff})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=1062)
    ap.add_argument("--chosen", type=int, default=1080)
    ap.add_argument("--rejected", type=int, default=1075)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args(argv)
    rows = run(a)
    for r in rows:
        ms = "-" if r["ms"] is None else f"{r['ms']:.3f}"
        diff = "-" if r["max_diff_vs_ours"] is None else f"{r['max_diff_vs_ours']:.2e}"
        print(f"{r['variant']:>40} {ms:>10} ms {diff:>10}")
    print("RESULT " + json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
