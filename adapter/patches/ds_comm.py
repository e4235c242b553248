"""DeepSpeed's communication backend on CPUs, without the shared-memory op it compiles at start.

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


__all__ = ["skip_cpu_shm_op"]
