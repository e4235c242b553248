"""CPU shims so Megatron-Core's GPTModel and dist_checkpointing run without CUDA (tests, CI, laptops).

Megatron-Core assumes a GPU in a handful of places that are not about the maths: it asks for the current CUDA device,
forks the CUDA RNG around dropout, builds a default causal mask and the CP rotary index on "cuda", and synchronises
before checkpoint I/O. Each shim below replaces exactly one such symbol with its CPU meaning. They are applied only
when CUDA is unavailable, so GPU runs execute Megatron's own code untouched.

The shims name private Megatron symbols, so they are pinned: `install()` raises if a symbol is gone and warns when
megatron-core is not a version listed in TESTED_MEGATRON_VERSIONS (tests/test_cpu_shims.py fails there too).
"""
from __future__ import annotations

import contextlib
import importlib
import warnings

import torch

TESTED_MEGATRON_VERSIONS = ("0.16.1",)

_RANDOM = "megatron.core.tensor_parallel.random"
_ROPE = "megatron.core.models.common.embeddings.rotary_pos_embedding"
_YARN = "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding"
_SOFTMAX = "megatron.core.fusions.fused_softmax"

_installed = False


@contextlib.contextmanager
def _no_fork(self, name=None):
    # CPU has one RNG stream; Megatron's per-TP-rank CUDA streams do not exist there.
    yield


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    # Megatron's version builds the chunk index with pin_memory=True and .cuda(): same selection, on CPU.
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp, r = cp_group.size(), cp_group.rank()
    chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1:])
    chunks = chunks.index_select(seq_dim, torch.tensor([r, 2 * cp - r - 1], device=pos_emb.device))
    return chunks.view(*chunks.shape[:seq_dim], -1, *chunks.shape[seq_dim + 2:])


def _default_causal_mask(sq):
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


# (module, attribute, replacement). Everything Megatron reaches for "cuda" on the GPTModel / checkpoint paths.
_SHIMS = (
    ("torch.cuda", "current_device", lambda: "cpu"),
    ("torch.cuda", "synchronize", lambda device=None: None),
    (_RANDOM, "CudaRNGStatesTracker.fork", _no_fork),
    # Recompute (tensor_parallel.checkpoint) saves/restores the CUDA RNG; the CPU RNG is saved by it separately.
    (_RANDOM, "_get_cuda_rng_state", lambda *a, **k: torch.empty(0, dtype=torch.uint8)),
    (_RANDOM, "_set_cuda_rng_state", lambda *a, **k: None),
    (_ROPE, "get_pos_emb_on_this_cp_rank", _pos_emb_on_this_cp_rank),
    (_YARN, "get_pos_emb_on_this_cp_rank", _pos_emb_on_this_cp_rank),
    (_SOFTMAX, "get_default_causal_mask", _default_causal_mask),
)


def _owner(module: str, attr: str):
    """(object holding the last name, last name); raises AttributeError/ImportError when Megatron moved it."""
    obj = importlib.import_module(module)
    *path, name = attr.split(".")
    for p in path:
        obj = getattr(obj, p)
    getattr(obj, name)
    return obj, name


def megatron_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def check() -> list[str]:
    """Problems that would make the shims unsafe: symbols Megatron no longer has. Empty list when all is well."""
    problems = []
    for module, attr, _ in _SHIMS:
        try:
            _owner(module, attr)
        except (ImportError, AttributeError) as e:
            problems.append(f"{module}.{attr}: {e}")
    return problems


def install(force: bool = False) -> bool:
    """Apply the shims once; no-op with CUDA present (unless `force`, for tests). Returns whether they are active."""
    global _installed
    if _installed:
        return True
    if torch.cuda.is_available() and not force:
        return False
    version = megatron_version()
    if version not in TESTED_MEGATRON_VERSIONS:
        warnings.warn(f"nd-adapter CPU shims were verified on megatron-core {TESTED_MEGATRON_VERSIONS}, found {version}; "
                      "re-run tests/test_cpu_shims.py and update adapter/cpu_shims.py", RuntimeWarning, stacklevel=2)
    problems = check()
    if problems:
        raise RuntimeError(f"megatron-core {version} changed symbols nd-adapter's CPU shims patch: "
                           + "; ".join(problems) + ". Update adapter/cpu_shims.py.")
    for module, attr, replacement in _SHIMS:
        obj, name = _owner(module, attr)
        setattr(obj, name, replacement)
    _installed = True
    return True


__all__ = ["TESTED_MEGATRON_VERSIONS", "install", "check", "megatron_version"]
