"""The flat AdamW's step as one Triton launch per parameter group (CUDA, 16-bit weights with an fp32 master).

Why: the step was ~147 calls of a compiled per-parameter update (1B shape); each call's host overhead (guards,
wrapper, launch) made the step ~28 ms of CPU time for ~9 ms of GPU time, and the one-GPU runs are close to
host-bound, so the GPU idled (docs/BENCHMARKS.md, issue 16). One kernel walks a table of fixed-size chunks:
chunk -> (parameter, offset); the master weights and moments are the flat buffers, the gradients and the 16-bit
weights are reached through per-step pointer tables, so autograd's gradients stay where autograd put them.

Same arithmetic as `adapter.train.optim._adamw_update` (IEEE square root and division).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _adamw_chunks(master, exp_avg, exp_avg_sq, ptrs, chunk_param, chunk_start, offsets, numels, hyper, n_params,
                  LOW: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    p = tl.load(chunk_param + pid)
    start = tl.load(chunk_start + pid)
    n = tl.load(numels + p)
    base = tl.load(offsets + p)
    grad_ptr = tl.load(ptrs + p).to(tl.pointer_type(LOW))
    low_ptr = tl.load(ptrs + n_params + p).to(tl.pointer_type(LOW))
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
    w = tl.load(master + base + idx, mask=mask, other=0.0) * decay
    m = tl.load(exp_avg + base + idx, mask=mask, other=0.0)
    m = m + one_minus_b1 * (g - m)  # torch.lerp's formula for weights < 0.5
    v = tl.load(exp_avg_sq + base + idx, mask=mask, other=0.0) * b2 + g * g * one_minus_b2
    w = w - step_size * tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), sqrt_bc2) + eps)
    tl.store(master + base + idx, w, mask=mask)
    tl.store(exp_avg + base + idx, m, mask=mask)
    tl.store(exp_avg_sq + base + idx, v, mask=mask)
    tl.store(low_ptr + idx, w.to(LOW), mask=mask)


class ChunkTable:
    """Per parameter group, built once: each BLOCK-sized chunk's parameter and start, each parameter's offset and
    size in the flat buffers."""

    def __init__(self, params, offsets, device):
        numels = [p.numel() for p in params]
        counts = [-(-n // BLOCK) for n in numels]
        self.chunk_param = torch.repeat_interleave(torch.arange(len(params), dtype=torch.int32),
                                                   torch.tensor(counts)).to(device)
        self.chunk_start = torch.cat([torch.arange(c, dtype=torch.int64) * BLOCK for c in counts]).to(device)
        self.offsets = torch.tensor(offsets, dtype=torch.int64, device=device)
        self.numels = torch.tensor(numels, dtype=torch.int64, device=device)
        self.low = tl.bfloat16 if params[0].dtype == torch.bfloat16 else tl.float16


def supported(params) -> bool:
    """One 16-bit dtype for the whole group, contiguous, on CUDA (the kernel's 16-bit pointers have one type)."""
    dtypes = {p.dtype for p in params}
    return (params[0].is_cuda and len(dtypes) == 1 and dtypes <= {torch.bfloat16, torch.float16}
            and all(p.is_contiguous() for p in params))


def step(table: ChunkTable, params, master, exp_avg, exp_avg_sq, hyper) -> None:
    """One update of every parameter of the group; the gradients may be anywhere (None: zero)."""
    keep, grads = [], []
    for p in params:
        g = p.grad
        if g is None:
            g = torch.zeros_like(p)
        elif not g.is_contiguous() or g.dtype != p.dtype:
            g = g.to(p.dtype).contiguous()
        keep.append(g)  # alive until the launch is queued; stream order protects the memory after that
        grads.append(g.data_ptr())
    host = torch.tensor(grads + [p.data_ptr() for p in params], dtype=torch.int64).pin_memory()
    ptrs = host.to(master.device, non_blocking=True)
    grid = (table.chunk_param.numel(),)
    _adamw_chunks[grid](master, exp_avg, exp_avg_sq, ptrs, table.chunk_param, table.chunk_start, table.offsets,
                        table.numels, hyper, len(params), LOW=table.low, BLOCK=BLOCK)
    del keep
