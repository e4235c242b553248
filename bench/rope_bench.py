"""RoPE forward + backward, compiled: angles in (cos/sin computed inside the kernel, per element) against cos/sin
tables computed once (GPU host only).

    python bench/rope_bench.py                 # the 1B shape's q and k: [4096, 2, 32 | 8, 64]

Why: in the 1B profile the compiled RoPE kernels ran ~104 µs forward and ~79 µs backward per layer for ~85 MB of
traffic each (~25 µs at the H200's bandwidth); the fused kernel evaluates cos and sin for every element of every
head, not once per position.
"""
from __future__ import annotations

import argparse
import sys

from cuda_timing import ms_per_call  # bench/ is on the path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args(argv)
    import torch

    def angles(t, freqs):
        rot = freqs.shape[-1]
        x, rest = t[..., :rot].float(), t[..., rot:]
        x1, x2 = x.chunk(2, dim=-1)
        out = x * freqs.cos() + torch.cat((-x2, x1), dim=-1) * freqs.sin()
        return torch.cat((out.to(t.dtype), rest), dim=-1)

    def tables(t, cos, sin):
        rot = cos.shape[-1]
        x, rest = t[..., :rot].float(), t[..., rot:]
        x1, x2 = x.chunk(2, dim=-1)
        out = x * cos + torch.cat((-x2, x1), dim=-1) * sin
        return torch.cat((out.to(t.dtype), rest), dim=-1)

    inv = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))
    f = torch.outer(torch.arange(a.seq, device="cuda").float(), inv)
    freqs = torch.cat([f, f], -1)[:, None, None, :]
    cos, sin = freqs.cos(), freqs.sin()
    q = torch.randn(a.seq, 2, 32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(a.seq, 2, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fa, ft = torch.compile(angles, dynamic=False), torch.compile(tables, dynamic=False)
    for name, run in (("angles in (now)", lambda: (fa(q, freqs).sum() + fa(k, freqs).sum()).backward()),
                      ("cos/sin tables", lambda: (ft(q, cos, sin).sum() + ft(k, cos, sin).sum()).backward())):
        print(f"{name:18s} {ms_per_call(run, a.iters) * 1e3:8.1f} µs per q+k forward+backward (incl. sums)")
    print("equal:", torch.equal(fa(q, freqs), ft(q, cos, sin)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
