"""Triton kernels for the memory-bound steps around the experts' grouped GEMMs (CUDA; adapter/modeling/moe.py keeps
the same arithmetic in torch for CPUs, and uses these where Triton runs).

Why: on the Qwen3-30B-A3B shape (one H200, seq 4096, top-8 of 128 experts) the GEMMs and the optimizer were at
their bounds and these small steps were what was left to take (docs/BENCHMARKS.md, 2026-12-03 21:40, "the MoE
layer's small kernels"):

* `gather_sum`, each token's k expert rows summed (the combine's forward, the permutation's backward): torch
  gathers the [tokens·k, hidden] rows into a new tensor and then reduces it, writing and reading 134 MB more than
  the sum needs. One kernel reads each row once and writes the sums; fp32 accumulation in row order, one rounding,
  as torch's bf16 sum.
* `weighted_swiglu` and its backward, Megatron's `weighted_bias_swiglu_impl` (silu(a)·b·p per routed row, p its
  routing weight): compiled by Megatron, the backward ran as two kernels, the input gradient at ~2.2 TB/s and the
  routing weights' gradient reading the input again. Here one pass per row computes both, in fp32 with one
  rounding per stored value and Megatron's order of operations.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_sum_kernel(y, inv, out, width, K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(inv + t * K + j).to(tl.int64)
        acc += tl.load(y + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + t * width + cols, acc.to(out.dtype.element_ty), mask=mask)


def gather_sum(y: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """out[t] = Σ_j y[inv[t, j]] for y [rows, width] and inv [tokens, k] (int64)."""
    tokens, k = inv.shape
    y, inv = y.contiguous(), inv.contiguous()
    width = y.size(1)
    out = torch.empty(tokens, width, dtype=y.dtype, device=y.device)
    if not tokens * width:
        return out
    block = min(triton.next_power_of_2(width), 2048)
    _gather_sum_kernel[(tokens, triton.cdiv(width, block))](y, inv, out, width, K=k, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _swiglu_forward_kernel(y, p, out, width, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    a = tl.load(y + r * 2 * width + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(y + r * 2 * width + width + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(p + r).to(tl.float32)
    tl.store(out + r * width + cols, (a * tl.sigmoid(a) * b * w).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(g, y, p, dy, dp, width, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    a = tl.load(y + r * 2 * width + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(y + r * 2 * width + width + cols, mask=mask, other=0.0).to(tl.float32)
    go = tl.load(g + r * width + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(p + r).to(tl.float32)
    s = tl.sigmoid(a)
    silu = a * s
    gw = go * w
    da = gw * s * (1 + a * (1 - s)) * b  # Megatron's swiglu_back, on g · p
    db = gw * silu
    tl.store(dy + r * 2 * width + cols, da.to(dy.dtype.element_ty), mask=mask)
    tl.store(dy + r * 2 * width + width + cols, db.to(dy.dtype.element_ty), mask=mask)
    tl.store(dp + r, tl.sum(silu * b * go, axis=0).to(dp.dtype.element_ty))  # masked columns add 0


def _block(width: int) -> int:
    return triton.next_power_of_2(width)


class WeightedSwiGLU(torch.autograd.Function):
    """silu(y[:, :F]) · y[:, F:] · p for y [rows, 2F] and p [rows, 1] (the routed rows' weights): the output in y's
    dtype, p's gradient in p's dtype (Megatron's WeightedSwiGLUFunction, the same arithmetic)."""

    @staticmethod
    def forward(ctx, y, p):
        y, p = y.contiguous(), p.contiguous()
        rows, width = y.size(0), y.size(1) // 2
        out = torch.empty(rows, width, dtype=y.dtype, device=y.device)
        if rows:
            _swiglu_forward_kernel[(rows,)](y, p, out, width, BLOCK=_block(width), num_warps=4)
        ctx.save_for_backward(y, p)
        return out

    @staticmethod
    def backward(ctx, g):
        y, p = ctx.saved_tensors
        g = g.contiguous()
        rows, width = y.size(0), y.size(1) // 2
        dy, dp = torch.empty_like(y), torch.empty_like(p)
        if rows:
            _swiglu_backward_kernel[(rows,)](g, y, p, dy, dp, width, BLOCK=_block(width), num_warps=4)
        return dy, dp


def weighted_swiglu(y: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return WeightedSwiGLU.apply(y, p)


__all__ = ["gather_sum", "weighted_swiglu", "WeightedSwiGLU"]
