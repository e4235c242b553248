"""Every rank of a layout on ONE GPU, through gloo: a correctness mode for the multi-rank CUDA paths, not a speed mode.

Why: a layout with more than one rank otherwise runs its CUDA kernels (FlashAttention's varlen under cp, the MoE
dispatch at ep > 1, bitsandbytes on tp shards, the flat AdamW over tp-sharded weights, compiled layers at tp > 1)
for the first time on the user's 8-GPU job. NCCL refuses two ranks on one device, but gloo takes CUDA tensors for
all_reduce, broadcast, all_gather(_into_tensor), reduce_scatter_tensor, all_to_all_single and barrier (measured on
the 1×H200 host with torch 2.11: the project's shared notes); it cannot send or receive them point to point, so the
context-parallel ring (adapter/kernels/ring.py, the one point-to-point user) stages its blocks through host memory
in this mode only. Two other switches, in this mode only: DeepSpeed's device index is always 0
(patches/ds_comm.one_cuda_device), and Megatron's uneven gathers and reduce-scatters (the alltoall MoE dispatcher at
tp > 1), which gloo lacks, become exact all_reduces (patches/mcore.uneven_gloo_collectives).

On with `ND_ADAPTER_SHARED_GPU=1` in the ranks' environment (`nd-adapter rehearse --gpu` sets it; so can a user in
front of `nd-adapter train` or a launch script): every rank then selects cuda:0 and the process group is gloo's
(adapter/train/engine.init_distributed), and the run's first lines say so. Never the default. What it cannot check:
speed, NCCL itself, point-to-point transfers under NCCL, memory per GPU (all ranks share one).
"""
from __future__ import annotations

import os

ENV = "ND_ADAPTER_SHARED_GPU"


def on() -> bool:
    return os.environ.get(ENV) == "1"


def note(world: int) -> str:
    return (f"shared GPU ({ENV}=1): all {world} ranks on cuda:0 through gloo -- a correctness mode for the layout's "
            "CUDA paths, not a speed mode (it checks no speed, no NCCL, no per-GPU memory)")


__all__ = ["ENV", "on", "note"]
