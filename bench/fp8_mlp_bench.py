"""The MLP of one layer in fp8 (tensorwise), forward + backward compiled as one graph, with the whole-tensor amax
taken in one reduction or as row maxima first (`adapter.kernels.fp8.amax`); GPU host only.

    python bench/fp8_mlp_bench.py                # 1B and 3B shapes, 8192 tokens

Why: in the 1B profile the amax of the up-projection's input gradient ran as its own reduction over the SwiGLU
backward's output (~200 µs per layer at ~1.3 TB/s); a row-wise first stage can fuse into the kernel that makes it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_timing import ms_per_call  # noqa: E402 (bench/ is on the path)

from adapter.kernels import fp8  # noqa: E402

SHAPES = {"1b": (2048, 8192), "3b": (3072, 8192)}  # hidden, FFN
ROWS_FIRST = fp8.amax  # what training uses


def one_reduction(x):
    return x.abs().amax()


def mlp(x, w1, w2, norm):
    h = fp8.fp8_linear(F.rms_norm(x, (x.size(-1),), norm), w1)
    gate, up = h.chunk(2, dim=-1)
    return fp8.fp8_linear(F.silu(gate) * up, w2)


def fwd_bwd(step, x, w1, w2, norm, g) -> None:
    x.grad = w1.grad = w2.grad = None
    step(x, w1, w2, norm).backward(g)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args(argv)
    for shape, (h, f) in SHAPES.items():
        x = torch.randn(a.tokens, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w1 = (torch.randn(2 * f, h, device="cuda") / h ** 0.5).to(torch.bfloat16).requires_grad_()
        w2 = (torch.randn(h, f, device="cuda") / f ** 0.5).to(torch.bfloat16).requires_grad_()
        norm = torch.ones(h, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(a.tokens, h, device="cuda", dtype=torch.bfloat16)
        grads = {}
        for rows in (False, True):
            fp8.amax = ROWS_FIRST if rows else one_reduction
            torch._dynamo.reset()
            step = torch.compile(mlp, dynamic=False)
            ms = ms_per_call(lambda: fwd_bwd(step, x, w1, w2, norm, g), a.iters)  # noqa: B023 (called at once)
            grads[rows] = (x.grad.clone(), w1.grad.clone(), w2.grad.clone())
            print(f"{shape} amax {'row maxima first' if rows else 'one reduction':17s} {ms:7.3f} ms per MLP fwd+bwd")
        diffs = [((p.float() - q.float()).abs().max() / p.float().abs().max()).item()
                 for p, q in zip(grads[False], grads[True])]
        print(f"{shape} gradients x, w1, w2: max |difference| / max |value| " + ", ".join(f"{d:.1e}" for d in diffs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
