"""The flat AdamW's step as one Triton launch per parameter group (CUDA, 16-bit weights with an fp32 master, or
16-bit weights that are their own master with 16-bit moments: `optimizer.state_dtype: bf16`).

Why: the step was ~147 calls of a compiled per-parameter update (1B shape); each call's host overhead (guards,
wrapper, launch) made the step ~28 ms of CPU time for ~9 ms of GPU time, and the one-GPU runs are close to
host-bound, so the GPU idled (docs/BENCHMARKS.md, 2026-12-01, fourth session, "A one-launch AdamW step"). One
kernel walks a table of fixed-size chunks:
chunk -> (parameter, offset); the master weights and moments are the flat buffers, the gradients and the 16-bit
weights are reached through per-step pointer tables, so autograd's gradients stay where autograd put them.

Same arithmetic as `adapter.train.optim._adamw_update` (IEEE square root and division). The gradient norm before it
walks the same table (`sum_of_squares`): one launch per group through the same pointers.

Alignment: Triton vectorises a load (16 bytes per thread) only when it can prove the address is aligned, and an
address read from a table proves nothing, so the first version issued scalar loads and ran at ~1.35 TB/s: 25.7 ms
per 1B step, 18% of the GPU time (docs/BENCHMARKS.md, fifth session). When every size is a multiple of 16 elements
and every pointer is 16-byte aligned (the usual case: autograd's gradients come from the caching allocator), ALIGN
tells the compiler so; otherwise the same kernel runs without the hints.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from adapter.train.grads import pointers

BLOCK = 4096
# 16-bit states (14 bytes a parameter): 2,048 elements and 4 warps a program took the MoE shape's norm + step in
# 21.9 ms against 22.2 at 4,096 / 8 (bench/adamw_bench.py --launch, docs/BENCHMARKS.md); fp32 masters keep BLOCK / 8
SIXTEEN_LAUNCH = {"block": 2048, "num_warps": 4}
ALIGN = 16  # elements: sizes and offsets divisible by this, and 16-byte aligned pointers, get the vectorised kernel


@triton.jit
def _adamw_chunks(master, exp_avg, exp_avg_sq, ptrs, chunk_param, chunk_start, offsets, numels, hyper, n_params,
                  LOW: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr, MASTER: tl.constexpr):
    pid = tl.program_id(0)
    p = tl.load(chunk_param + pid)
    start = tl.multiple_of(tl.load(chunk_start + pid), BLOCK)
    n = tl.load(numels + p)
    base = tl.load(offsets + p)
    grad_ptr = tl.load(ptrs + p).to(tl.pointer_type(LOW))
    low_ptr = tl.load(ptrs + n_params + p).to(tl.pointer_type(LOW))
    if ALIGN > 1:  # what the host checked (`step`): lets every load and store below be a 16-byte vector
        n = tl.multiple_of(n, ALIGN)
        base = tl.multiple_of(base, ALIGN)
        grad_ptr = tl.multiple_of(grad_ptr, 16)
        low_ptr = tl.multiple_of(low_ptr, 16)
    idx = start + tl.arange(0, BLOCK).to(tl.int64)
    mask = idx < n
    coef = tl.load(hyper)
    decay = tl.load(hyper + 1)
    one_minus_b1 = tl.load(hyper + 2)
    b2 = tl.load(hyper + 3)
    one_minus_b2 = tl.load(hyper + 4)
    step_size = tl.load(hyper + 5)
    sqrt_bc2 = tl.load(hyper + 6)
    eps = tl.load(hyper + 7)

    g = tl.load(grad_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    g = tl.where(coef > 0, g * coef, 0.0)  # a non-finite norm: zeros, even for NaN gradients
    if MASTER:
        w = tl.load(master + base + idx, mask=mask, other=0.0)
    else:  # the 16-bit weight is its own master
        w = tl.load(low_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    w = w * decay
    m = tl.load(exp_avg + base + idx, mask=mask, other=0.0).to(tl.float32)
    m = m + one_minus_b1 * (g - m)  # torch.lerp's formula for weights < 0.5
    v = tl.load(exp_avg_sq + base + idx, mask=mask, other=0.0).to(tl.float32) * b2 + g * g * one_minus_b2
    w = w - step_size * tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), sqrt_bc2) + eps)
    if MASTER:
        tl.store(master + base + idx, w, mask=mask)
    tl.store(exp_avg + base + idx, m.to(exp_avg.dtype.element_ty), mask=mask)  # rounded once where 16-bit
    tl.store(exp_avg_sq + base + idx, v.to(exp_avg_sq.dtype.element_ty), mask=mask)
    tl.store(low_ptr + idx, w.to(LOW), mask=mask)


class ChunkTable:
    """Per parameter group, built once: each BLOCK-sized chunk's parameter and start, each parameter's offset and
    size in the flat buffers."""

    def __init__(self, params, offsets, device, block: int = BLOCK, num_warps: int = 8):
        numels = [p.numel() for p in params]
        counts = [-(-n // block) for n in numels]
        self.block, self.num_warps = block, num_warps  # the launch's shape (bench/adamw_bench.py tries others)
        self.chunk_param = torch.repeat_interleave(torch.arange(len(params), dtype=torch.int32),
                                                   torch.tensor(counts)).to(device)
        self.chunk_start = torch.cat([torch.arange(c, dtype=torch.int64) * block for c in counts]).to(device)
        self.offsets = torch.tensor(offsets, dtype=torch.int64, device=device)
        self.numels = torch.tensor(numels, dtype=torch.int64, device=device)
        self.low = tl.bfloat16 if params[0].dtype == torch.bfloat16 else tl.float16
        self.sizes_aligned = all(n % ALIGN == 0 for n in numels)  # then every offset is too
        self.n_params = len(params)
        self.partial = None  # the norm's per-chunk sums, allocated on first use


def supported(params) -> bool:
    """One 16-bit dtype for the whole group, contiguous, on CUDA (the kernel's 16-bit pointers have one type)."""
    dtypes = {p.dtype for p in params}
    return (params[0].is_cuda and len(dtypes) == 1 and dtypes <= {torch.bfloat16, torch.float16}
            and all(p.is_contiguous() for p in params))


@triton.jit
def _sum_sq_chunks(ptrs, chunk_param, chunk_start, numels, weight, partial, LOW: tl.constexpr, BLOCK: tl.constexpr,
                   ALIGN: tl.constexpr):
    """Each chunk's Σ g² (fp32) times its parameter's weight in the norm (1, or 0 where it does not count)."""
    pid = tl.program_id(0)
    p = tl.load(chunk_param + pid)
    start = tl.multiple_of(tl.load(chunk_start + pid), BLOCK)
    n = tl.load(numels + p)
    grad_ptr = tl.load(ptrs + p).to(tl.pointer_type(LOW))
    if ALIGN > 1:
        n = tl.multiple_of(n, ALIGN)
        grad_ptr = tl.multiple_of(grad_ptr, 16)
    idx = start + tl.arange(0, BLOCK).to(tl.int64)
    g = tl.load(grad_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
    tl.store(partial + pid, tl.where(tl.load(weight + p) != 0, tl.sum(g * g), 0.0))  # not counted: 0, even NaN


class Prepared(NamedTuple):
    """One step's pointer table on the device, the alignment the kernels may assume, the tensors it points into
    that nothing else keeps alive (zeros for missing gradients, converted copies)."""
    ptrs: torch.Tensor
    align: int
    keep: list


def prepare(table: ChunkTable, params) -> Prepared:
    """Where this step's gradients and weights are, once for the norm and the update."""
    host, aligned, keep = pointers(params)
    align = ALIGN if table.sizes_aligned and aligned else 1
    return Prepared(host.pin_memory().to(table.numels.device, non_blocking=True), align, keep)


def sum_of_squares(table: ChunkTable, prep: Prepared, weight: torch.Tensor) -> torch.Tensor:
    """Σ g² over the group's gradients, fp32, in one launch: one partial sum per chunk, then their sum (the same
    order every step: deterministic, unlike atomics). `weight`: per parameter, 0 where it does not count (TP ranks
    other than 0 skip the replicated ones). Why: one reduction per long gradient read the MoE shape's 11 GB at
    2.8 TB/s, torch's multi-tensor norm at 1.9 (bench/adamw_bench.py)."""
    if table.partial is None:
        table.partial = torch.empty(table.chunk_param.numel(), dtype=torch.float32, device=table.numels.device)
    _sum_sq_chunks[(table.chunk_param.numel(),)](prep.ptrs, table.chunk_param, table.chunk_start, table.numels, weight,
                                                 table.partial, LOW=table.low, BLOCK=table.block, ALIGN=prep.align,
                                                 num_warps=table.num_warps)
    return table.partial.sum()


def step(table: ChunkTable, prep: Prepared, master, exp_avg, exp_avg_sq, hyper) -> int:
    """One update of every parameter of the group; the gradients may be anywhere (None: zero); `master` None: the
    16-bit weights are their own master (the moments are 16-bit too). Returns the alignment the kernel was told
    (ALIGN or 1). `prep` (from `prepare`) must outlive the launch's queueing; stream order does the rest."""
    grid = (table.chunk_param.numel(),)
    _adamw_chunks[grid](exp_avg if master is None else master, exp_avg, exp_avg_sq, prep.ptrs, table.chunk_param,
                        table.chunk_start, table.offsets, table.numels, hyper, table.n_params, LOW=table.low,
                        BLOCK=table.block, ALIGN=prep.align, MASTER=master is not None, num_warps=table.num_warps)
    return prep.align
