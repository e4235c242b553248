"""DeepSpeed's communication set-up where it assumes one process per device: CPUs (the shared-memory op it compiles
at start) and the shared-GPU mode (every rank on cuda:0).

On its CPU accelerator DeepSpeed 0.19.8's TorchBackend builds `deepspeed_shm_comm` (a C++ extension, JIT-compiled
into ~/.cache/torch_extensions) in `init_distributed`, for one caller: `inference_all_reduce`, which only its
inference-time tensor-parallel layers (module_inject) use. Training never calls it, but the first CPU run on a
machine (every `nd-adapter rehearse` or CPU `train` on a fresh machine, every fresh CI machine) waits ~45 s for the
compile, its other ranks blocked on the build lock; without a compiler it fails. `skip_cpu_shm_op` makes the build
return None, DeepSpeed's own answer where the op is not compatible (inference_all_reduce then falls back to
torch.distributed.all_reduce)."""
from __future__ import annotations

from adapter.patches import require
from adapter.patches.zero import TESTED_DEEPSPEED_VERSIONS


def skip_cpu_shm_op() -> None:
    """Before deepspeed.init_distributed on a machine without CUDA."""
    import importlib

    # not `import deepspeed.comm.torch as ds_torch`: that binds deepspeed.comm's attribute `torch`, the torch package
    # itself (deepspeed/comm/__init__.py imports it), so the patch would land on torch and never be seen
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    require("deepspeed", TESTED_DEEPSPEED_VERSIONS, "CPU communication set-up (skipping its shared-memory op)")
    ds_torch.build_shm_op = lambda: None


def one_cuda_device(accelerator) -> None:
    """The shared-GPU mode (adapter/parallel/shared_gpu.py): DeepSpeed 0.19.8 takes the environment's LOCAL_RANK as
    the CUDA device index in a dozen places (the engine's `set_device(local_rank)`, ZeRO-3's `zero.Init` device,
    its contiguous-memory buffers...), and one GPU has no cuda:1, so rank 1 failed at `deepspeed.initialize`
    ("invalid device ordinal"; found on the GPU host). LOCAL_RANK itself stays the rank's (a node-local file
    leader reads it); this instance of DeepSpeed's CUDA accelerator maps every device index to 0."""
    require("deepspeed", TESTED_DEEPSPEED_VERSIONS, "the shared-GPU mode (every rank's device index taken as 0)")
    if getattr(accelerator, "_name", None) != "cuda":
        raise RuntimeError(f"the shared-GPU mode needs DeepSpeed's CUDA accelerator, not {accelerator!r}")
    import torch

    accelerator.device_name = lambda device_index=None: "cuda" if device_index is None else "cuda:0"
    accelerator.device = lambda device_index=None: torch.device("cuda", None if device_index is None else 0)
    accelerator.set_device = lambda device_index: torch.cuda.set_device(0)


__all__ = ["one_cuda_device", "skip_cpu_shm_op"]
