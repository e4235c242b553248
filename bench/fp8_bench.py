"""FP8 linear (adapter/kernels/fp8.py) against a bf16 linear at the Llama-3.2-1B/3B layer shapes, on one GPU: forward +
both gradients of `linear(rms_norm(x))` compiled as one graph (so the casts fuse as they do in a compiled layer).

    python bench/fp8_bench.py [--tokens 8192]

Prints ms per shape for bf16 and fp8 and their ratio, and each one's relative error against fp32.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_timing import ms_per_call  # noqa: E402 (bench/ is on the path)

from adapter.kernels.fp8 import RECIPES, fp8_linear  # noqa: E402

SHAPES = {"1b": {"qkv": (2048, 3072), "proj": (2048, 2048), "fc1": (2048, 16384), "fc2": (8192, 2048)},
          "3b": {"qkv": (3072, 5120), "proj": (3072, 3072), "fc1": (3072, 16384), "fc2": (8192, 3072)}}

LAYERS = {"1b": 16, "3b": 28}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    m = args.tokens
    kinds = (("bf16", F.linear), *((r, lambda x, w, r=r: fp8_linear(x, w, r)) for r in RECIPES))
    print(f"{'shape':10s} {'k→n':>12s} " + " ".join(f"{k[:13] + ' ms':>16s} {'×':>5s} {'err':>8s}" for k, _ in kinds))
    total = {(mdl, k): 0.0 for mdl in SHAPES for k, _ in kinds}
    for model, shapes in SHAPES.items():
        for name, (k, n) in shapes.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16).requires_grad_()
            nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
            g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            xs, ws = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
            y = F.linear(F.rms_norm(xs, (k,), nw.float()), ws)
            y.backward(g.float())
            ref = (y.detach(), xs.grad, ws.grad)
            row = []
            for kind, lin in kinds:
                torch._dynamo.reset()  # one graph per shape and kind (else the recompile limit falls back to eager)
                f = torch.compile(lambda x, w, lin=lin, k=k, nw=nw: lin(F.rms_norm(x, (k,), nw), w), dynamic=False)

                def step(f=f, x=x, w=w, g=g):
                    x.grad = w.grad = None
                    f(x, w).backward(g)
                ms = ms_per_call(step)
                x.grad = w.grad = None
                y = f(x, w)
                y.backward(g)
                err = max(((a.float() - b).norm() / b.norm()).item() for a, b in zip((y, x.grad, w.grad), ref))
                row += [ms, err]
                total[model, kind] += ms
            print(f"{model}-{name:7s} {f'{k}→{n}':>12s} " + " ".join(
                f"{row[2 * i]:16.3f} {row[0] / row[2 * i]:5.2f} {row[2 * i + 1]:8.1e}" for i in range(len(kinds))))
    for (model, kind), ms in total.items():
        layers = LAYERS[model]
        print(f"{model} layer linears (norm+linear, fwd+bwd), {kind}: {ms:.3f} ms, "
              f"× {total[model, 'bf16'] / ms:.2f}; ×{layers} layers: saves "
              f"{layers * (total[model, 'bf16'] - ms):.1f} ms/step")


if __name__ == "__main__":
    main()
