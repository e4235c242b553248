"""Bus bandwidth of the collectives our layouts issue, under whatever NCCL environment is set.

    torchrun --nproc-per-node=2 bench/nccl_bench.py                 # e.g. NCCL_PROTO=Simple TAG=Simple torchrun ...

Sizes are those of the 1B shape: ZeRO-2's 1 GB gradient bucket, tp=2's 32 MB activation all-reduce, and sequence
parallelism's 16 MB all-gather / 32 MB reduce-scatter. busbw follows nccl-tests' convention.
"""
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    tag = os.environ.get("TAG", "default")
    for op, mib in (("all_reduce", 1024), ("all_reduce", 32), ("all_gather", 16), ("reduce_scatter", 32)):
        numel = mib * 2**20 // 2
        x = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(numel * n if op == "all_gather" else numel // n, device="cuda", dtype=torch.bfloat16)

        def call(op=op, x=x, out=out):
            if op == "all_reduce":
                dist.all_reduce(x)
            elif op == "all_gather":
                dist.all_gather_into_tensor(out, x)
            else:
                dist.reduce_scatter_tensor(out, x)

        for _ in range(5):
            call()
        torch.cuda.synchronize()
        iters = 20 if mib > 100 else 100
        t = time.perf_counter()
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / iters
        size = numel * 2 * (n if op == "all_gather" else 1)
        busbw = size / dt * (2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n) / 1e9
        if rank == 0:
            print(f"{tag:10s} {op:15s} {mib:5d} MiB {dt * 1e3:8.3f} ms  busbw {busbw:6.1f} GB/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
