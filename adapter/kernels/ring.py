"""K/V blocks passed around a context-parallel ring, each step's transfer overlapped with the step's compute.

Both ring attentions use it: the dense one (adapter/kernels/attention.py, cp_comm_type "p2p") and the one over
packed documents (adapter/kernels/varlen.py). At step s a CP rank r holds the K|V block of rank (r − s) mod cp; the
next block is already on its way while the current one is used. In backward the gradient of a block travels one
rank ahead of the block itself and collects each holder's contribution, so after cp hops every rank has the whole
gradient of its own K|V (as in ring-flash-attention).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

Index = tuple | slice  # where a gradient lands in the block (any tensor index)


def staged(tensor: torch.Tensor, group) -> bool:
    """Whether the ring stages its blocks through host memory: CUDA tensors over gloo (the shared-GPU mode,
    adapter/parallel/shared_gpu.py), which sends and receives only host tensors."""
    return tensor.is_cuda and dist.get_backend(group) == "gloo"


class _Staged:
    """A receive through host memory: its requests, then the host buffer copied into the device one."""

    def __init__(self, reqs: list, host: torch.Tensor, out: torch.Tensor):
        self.reqs, self.host, self.out = reqs, host, out

    def wait(self) -> None:
        for req in self.reqs:
            req.wait()
        self.out.copy_(self.host)


def shift(tensor: torch.Tensor, group, stage: bool | None = None) -> tuple[torch.Tensor, list]:
    """Start sending `tensor` to the next rank of the ring and receiving the previous rank's; (recv buffer,
    requests). The send buffer must not change until the requests are waited for (NCCL may still read it).
    `stage` (default: `staged`): through host copies, the receive landing in the buffer when waited for."""
    r, n = group.rank(), group.size()
    recv = torch.empty_like(tensor)
    to, frm = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
    if stage if stage is not None else staged(tensor, group):
        host = tensor.detach().cpu()
        back = torch.empty_like(host)
        ops = [dist.P2POp(dist.isend, host, to, group), dist.P2POp(dist.irecv, back, frm, group)]
        return recv, [_Staged(dist.batch_isend_irecv(ops), back, recv)]
    ops = [dist.P2POp(dist.isend, tensor, to, group), dist.P2POp(dist.irecv, recv, frm, group)]
    return recv, dist.batch_isend_irecv(ops)


def wait(reqs: list) -> None:
    for req in reqs:
        req.wait()


def forward(kv: torch.Tensor, group, visit: Callable[[int, torch.Tensor], None]) -> None:
    """`visit(step, block)` for step 0 .. cp−1, `block` being rank (r − step)'s K|V (step 0: this rank's own)."""
    cp = group.size()
    for step in range(cp):
        if step + 1 < cp:
            nxt, reqs = shift(kv, group)
        visit(step, kv)
        if step + 1 < cp:
            wait(reqs)
            kv = nxt


def backward(kv: torch.Tensor, group,
             block_grads: Callable[[int, torch.Tensor], list[tuple[Index, torch.Tensor]]]) -> torch.Tensor:
    """The fp32 gradient of this rank's own K|V block. `block_grads(step, block)` returns (index, gradient) pairs
    for the block held at `step`; they are added into the block's travelling gradient buffer at `index`."""
    cp = group.size()
    dkv = dkv_next = dkv_reqs = None
    for step in range(cp):
        if step + 1 < cp:
            kv_next, kv_reqs = shift(kv, group)
        grads = block_grads(step, kv)  # computed while the previous hop of the gradient buffer is in flight
        if dkv_reqs is None:
            dkv = torch.zeros_like(kv, dtype=torch.float32)
        else:  # rebound only after its send completed
            wait(dkv_reqs)
            dkv = dkv_next
        for index, g in grads:
            dkv[index] += g.float()
        dkv_next, dkv_reqs = shift(dkv, group)
        if step + 1 < cp:
            wait(kv_reqs)
            kv = kv_next
    wait(dkv_reqs)
    return dkv_next


__all__ = ["shift", "wait", "forward", "backward"]
