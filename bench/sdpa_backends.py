"""Causal attention forward + backward per torch SDPA backend, at a model shape's heads (GPU host only).

    python bench/sdpa_backends.py              # Llama-3.2-1B heads (32 q / 8 kv, d 64) and 3B (24 / 8, d 128)
    python bench/sdpa_backends.py --shape siglip   # SigLIP's vision tower: 16 heads of d 72, bidirectional

Why: attention was ~22 ms of the ~125 ms 1B step (cuDNN's kernels, chosen by SDPA); this says whether another
backend does the same work faster, with GQA through `enable_gqa` and with K/V repeated to the query heads.
"""
from __future__ import annotations

import argparse
import sys

from cuda_timing import ms_per_call  # bench/ is on the path

SHAPES = {"1b": (32, 8, 64), "3b": (24, 8, 128), "siglip": (16, 16, 72)}
BIDIRECTIONAL = ("siglip",)  # a vision tower's attention: every patch sees every patch


def fwd_bwd(q, k, v, gqa: bool, causal: bool = True) -> None:
    import torch.nn.functional as F

    if not gqa:
        rep = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa).sum().backward()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shape", choices=sorted(SHAPES), action="append", help="default: 1b and 3b")
    a = ap.parse_args(argv)
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for shape in a.shape or ["1b", "3b"]:
        h, kv, d = SHAPES[shape]
        causal = shape not in BIDIRECTIONAL
        flops = 3.5 * 4 * a.batch * a.seq ** 2 * h * d / (2 if causal else 1)  # backward 2.5x forward
        q = torch.randn(a.batch, h, a.seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(a.batch, kv, a.seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            for gqa in (True, False) if kv < h else (False,):
                row = f"{shape} {backend.name:20s} gqa={gqa!s:5s}"
                try:
                    with sdpa_kernel([backend]):
                        ms = ms_per_call(lambda: fwd_bwd(q, k, v, gqa, causal), a.iters)  # noqa: B023 (called at once)
                    print(f"{row} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s")
                except RuntimeError as e:
                    print(f"{row} unavailable: {str(e).splitlines()[0][:80]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
