"""Attention kernels at the benchmark shapes: torch SDPA (cuDNN, FlashAttention-2) beside FlashAttention-4 (CuTe DSL).

Why: the Llama-3.2-1B step spends 23 ms of its ~134 in cuDNN's attention, whose backward runs at about a third of the
H100's peak (docs/BENCHMARKS.md, 2026-12-06); 1.2× the peer would need about 6 ms of that back. FlashAttention-4 ships
SM90 kernels (forward and backward, head dims to 256, GQA, soft-capping, windows) as Python over NVIDIA's CuTe DSL,
so it can travel to the GPU host as wheels. This measures, per shape, forward and forward+backward milliseconds of
each kernel on the same inputs, and each kernel's output and gradients against fp32 math attention.

usage (GPU host): python bench/attn_bench.py [--shapes 1b,gemma3-4b,...] [--iters 20]
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# batch, query heads, key/value heads, sequence, head dim, soft-cap (0: none): the one-GPU bench shapes at seq 4096
SHAPES = {
    "1b": (2, 32, 8, 4096, 64, 0.0),          # Llama-3.2-1B
    "gemma3-4b": (2, 8, 4, 4096, 256, 0.0),   # Gemma-3-4B (global layers)
    "phi4-mini": (2, 24, 8, 4096, 128, 0.0),  # Phi-4-mini
    "qwen3-moe": (1, 32, 4, 4096, 128, 0.0),  # Qwen3-30B-A3B, micro-batch 1
    "gemma2-softcap": (2, 16, 8, 4096, 256, 50.0),  # Gemma-2-9B's soft-capped scores
}


def _sdpa(backend):
    def run(q, k, v, softcap):
        if softcap:
            return None
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                               enable_gqa=True)
        return o.transpose(1, 2)
    return run


def _math_softcap(q, k, v, softcap):
    """What a compiled layer runs for soft-capped scores today (adapter/kernels/varlen.math_attention's maths)."""
    if not softcap:
        return None
    rep = q.size(2) // k.size(2)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
    s = (qh @ kh.transpose(-1, -2)) / math.sqrt(q.size(-1))
    s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return (torch.softmax(s.float(), -1).to(q.dtype) @ vh).transpose(1, 2)


def _fa4():
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # noqa: BLE001 - a bench: say why and go on with the others
        print(f"FlashAttention-4 not importable: {type(e).__name__}: {e}")
        return None

    def run(q, k, v, softcap):
        out = flash_attn_func(q, k, v, causal=True, softcap=softcap)
        return out[0] if isinstance(out, tuple) else out
    return run


def _time(fn, iters):
    """Median milliseconds of fn() over iters runs (CUDA events)."""
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _timings(fn, inputs, iters):
    """(forward ms, forward + backward ms) of one kernel on the same inputs."""
    q, k, v, g, cap = inputs
    return _time(lambda: fn(q, k, v, cap), iters), _time(lambda: fn(q, k, v, cap).backward(g), iters)


def _reference(q, k, v, softcap):
    """fp32 math attention, its output and gradients for the fixed upstream gradient."""
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    o = _math_softcap(qf, kf, vf, softcap) if softcap else _sdpa(SDPBackend.MATH)(qf, kf, vf, 0.0)
    return o, qf, kf, vf


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    torch.manual_seed(0)
    kernels = {"cuDNN SDPA": _sdpa(SDPBackend.CUDNN_ATTENTION), "FA2 SDPA": _sdpa(SDPBackend.FLASH_ATTENTION),
               "math (softcap)": _math_softcap}
    fa4 = _fa4()
    if fa4 is not None:
        kernels["FA4 (CuTe)"] = fa4
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "cuDNN", torch.backends.cudnn.version())
    print("| shape | kernel | fwd ms | fwd+bwd ms | fwd+bwd TFLOP/s | max |Δ| out, dq vs fp32 |")
    print("|---|---|---|---|---|---|")
    for name in a.shapes.split(","):
        b, h, hk, s, d, cap = SHAPES[name]
        q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        ro, rq, _, _ = _reference(q, k, v, cap)
        ro.backward(g.float())
        flop = 4 * b * h * s * s * d / 2 * 3.5  # causal: half the scores; backward 2.5× the forward
        for kname, fn in kernels.items():
            try:
                t0 = time.time()
                o = fn(q, k, v, cap)
                if o is None:
                    continue
                o.backward(g)
                torch.cuda.synchronize()
                first = time.time() - t0
                err = ((o.float() - ro).abs().max().item(), (q.grad.float() - rq.grad).abs().max().item())
                q.grad = k.grad = v.grad = None
                fwd, both = _timings(fn, (q, k, v, g, cap), a.iters)
                q.grad = k.grad = v.grad = None
                print(f"| {name} | {kname} | {fwd:.2f} | {both:.2f} | {flop / both / 1e9:.0f} | "
                      f"{err[0]:.1e}, {err[1]:.1e} | (first call {first:.1f} s)", flush=True)
            except Exception as e:  # noqa: BLE001 - a bench row that cannot run says why
                print(f"| {name} | {kname} | failed: {type(e).__name__}: {str(e)[:200]} |", flush=True)
                q.grad = k.grad = v.grad = None
        del q, k, v, g, ro, rq
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
