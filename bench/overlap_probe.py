"""Probe (GPU host): does the MoE shape's AdamW update overlap with a forward's GEMMs on another stream?

    python bench/overlap_probe.py

Times, on one GPU: a forward-like sequence of the MoE shape's kernels (8 layers: QKV, attention, O, router, two
grouped expert GEMMs; the output layer), the flat AdamW step (bf16 states), and both at once on two streams with
each priority arrangement. Question it answers: whether running the optimizer beside the next step's forward can
hide its ~20 ms of the MoE shape's step.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> int:
    import torch
    import torch.nn.functional as F
    from adamw_bench import moe_optimizer
    from cuda_timing import ms_per_call

    cfg = json.loads((ROOT / "configs/models/qwen3-30b-a3b-8l-shape/config.json").read_text())
    dev, bf = "cuda", torch.bfloat16
    _, opt = moe_optimizer(cfg, deposit=False)

    s, h, e, f, k = 4096, 2048, 128, 768, 8
    x = torch.randn(s, h, device=dev, dtype=bf)
    wqkv = torch.randn(5120, h, device=dev, dtype=bf) * 0.02
    wo = torch.randn(h, 4096, device=dev, dtype=bf) * 0.02
    wr = torch.randn(e, h, device=dev, dtype=bf) * 0.02
    w1 = torch.randn(e, 2 * f, h, device=dev, dtype=bf) * 0.02
    w2 = torch.randn(e, h, f, device=dev, dtype=bf) * 0.02
    head = torch.randn(cfg["vocab_size"], h, device=dev, dtype=bf) * 0.02
    offs = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * (s * k // e)

    def forward():
        y = x
        for _ in range(cfg["num_hidden_layers"]):
            qkv = y @ wqkv.t()
            q = qkv[:, :4096].view(1, s, 32, 128).transpose(1, 2)
            kk = qkv[:, 4096:4608].view(1, s, 4, 128).transpose(1, 2)
            v = qkv[:, 4608:].view(1, s, 4, 128).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, kk, v, is_causal=True, enable_gqa=True)
            y = y + a.transpose(1, 2).reshape(s, 4096) @ wo.t()
            logits = y @ wr.t()
            idx = logits.topk(k, dim=-1).indices.view(-1).argsort()
            t = y.repeat_interleave(k, 0)[idx]
            g = torch._grouped_mm(t, w1.transpose(-2, -1), offs=offs)
            g = F.silu(g[:, :f]) * g[:, f:]
            o = torch._grouped_mm(g, w2.transpose(-2, -1), offs=offs)
            y = y + o.view(s, k, h).sum(1)
        return y @ head.t()

    def timed(fn):
        return ms_per_call(fn, 5, warmup=2)

    hi, lo, lo2 = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=0)
    rows = {}

    def on(stream, fn):
        def run():
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
        return run

    def both(cs, os_, order="opt first"):
        def run():
            cur = torch.cuda.current_stream()
            cs.wait_stream(cur)
            os_.wait_stream(cur)
            first, second = ((os_, opt.step), (cs, forward)) if order == "opt first" else \
                ((cs, forward), (os_, opt.step))
            for st, fn in (first, second):
                with torch.cuda.stream(st):
                    fn()
            cur.wait_stream(cs)
            cur.wait_stream(os_)
        return run

    rows["forward alone (high-priority stream)"] = timed(on(hi, forward))
    rows["forward alone (default priority)"] = timed(on(lo, forward))
    rows["3 x forward alone (a step's GEMM work)"] = timed(on(hi, lambda: [forward() for _ in range(3)]))
    rows["AdamW step alone (norm + update)"] = timed(on(lo, opt.step))
    rows["both: forward high priority, opt low"] = timed(both(hi, lo))
    rows["both: equal priority, opt queued first"] = timed(both(lo2, lo))
    rows["both: equal priority, forward queued first"] = timed(both(lo2, lo, "fwd first"))

    def both3():
        cur = torch.cuda.current_stream()
        hi.wait_stream(cur)
        lo.wait_stream(cur)
        with torch.cuda.stream(lo):
            opt.step()
        with torch.cuda.stream(hi):
            for _ in range(3):
                forward()
        cur.wait_stream(hi)
        cur.wait_stream(lo)
    rows["both: 3 x forward high, opt low"] = timed(both3)
    print(torch.cuda.get_device_name(), torch.__version__)
    for name, ms in rows.items():
        print(f"{name:50s} {ms:8.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
