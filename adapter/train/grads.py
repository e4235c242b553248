"""The host's reads of a step's gradients, for the flat AdamW (adapter/train/optim.py) and its one-launch step
(adapter/train/adamw_kernel.py): which tensors make the norm (`whole`), where every gradient is (`pointers`).

Why a module: on the MoE shape (2,107 parameters, grouped experts depositing their gradients as rows of one tensor)
these per-parameter reads ran as Python loops each step, host time the GPU waited for (docs/BENCHMARKS.md). They
are C-level maps here, and torch-only (the kernel module needs Triton; these run and are tested on CPUs too).
"""
from __future__ import annotations

import operator
from array import array
from itertools import repeat

import torch

_BASE, _GRAD, _DTYPE = operator.attrgetter("_base"), operator.attrgetter("grad"), operator.attrgetter("dtype")


def whole(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """`grads` with every complete set of equal rows of one tensor replaced by that tensor (grouped experts deposit
    their gradients so: adapter/modeling/moe.py): the same norm, from a few long tensors instead of thousands."""
    bases = list(map(_BASE, grads))
    if not any(map(operator.is_not, bases, repeat(None))):
        return grads
    out, shared = [], {}
    for g, base in zip(grads, bases):
        if base is not None and base.dtype == g.dtype:
            shared.setdefault(id(base), (base, []))[1].append(g)
        else:
            out.append(g)
    for base, rows in shared.values():
        n, size = rows[0].numel(), base.element_size()
        if n * len(rows) == base.numel() and base.is_contiguous() and all(map(torch.Tensor.is_contiguous, rows)) \
                and all(map(n.__eq__, map(torch.Tensor.numel, rows))) and \
                sorted(map(base.data_ptr().__rsub__, map(torch.Tensor.data_ptr, rows))) == \
                list(range(0, base.numel() * size, n * size)):
            out.append(base)
        else:
            out.extend(rows)
    return out


def pointers(params) -> tuple[torch.Tensor, bool, list]:
    """The step's pointer table on the host: each parameter's gradient address (None: zeros; another dtype or a
    non-contiguous gradient: a contiguous copy in the weight's dtype), then each weight's; whether all are 16-byte
    aligned; the tensors to keep alive until the launch is queued. The table is an array's buffer: `torch.tensor` of
    the MoE shape's 4,214 addresses took ~0.5 ms of host time."""
    grads = list(map(_GRAD, params))
    dtype = params[0].dtype
    if any(map(operator.is_, grads, repeat(None))) or not all(map(torch.Tensor.is_contiguous, grads)) or \
            not all(map(operator.is_, map(_DTYPE, grads), repeat(dtype))):
        grads = [torch.zeros_like(p) if g is None else
                 g if g.is_contiguous() and g.dtype is p.dtype else g.to(p.dtype).contiguous()
                 for p, g in zip(params, grads)]
    addresses = array("q", map(torch.Tensor.data_ptr, grads))
    addresses.extend(map(torch.Tensor.data_ptr, params))
    table = torch.frombuffer(addresses, dtype=torch.int64)  # it keeps `addresses` alive
    return table, not bool(table.bitwise_and(16 - 1).any()), grads
