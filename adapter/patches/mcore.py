"""Megatron-Core internals nd-adapter changes, checked against TESTED_MEGATRON_VERSIONS and refused on others:

* CPU shims (`install_cpu_shims`), so GPTModel and dist_checkpointing run without CUDA (tests, CI, laptops);
* RowParallelLinear's group lookup without its per-forward warning (`quiet_row_parallel_group`, for torch.compile);
* our fused RoPE plugged into the extension point TransformerEngine would fill (`install_rope_fusion`);
* GPTModel's preprocessing result with per-token RoPE angles for packed documents (`with_rotary`);
* a linear layer's matmul implementation (`set_linear_impl`: plain `F.linear` at tp = 1 under torch.compile, fp8);
* uneven gathers and reduce-scatters over gloo (`uneven_gloo_collectives`, the shared-GPU mode).

CPU shims.

Megatron-Core assumes a GPU in a handful of places that are not about the maths: it asks for the current CUDA device,
forks the CUDA RNG around dropout, builds a default causal mask and the CP rotary index on "cuda", and synchronises
before checkpoint I/O. Each shim below replaces exactly one such symbol with its CPU meaning. They are applied only
when CUDA is unavailable, so GPU runs execute Megatron's own code untouched.

The shims name private Megatron symbols, so they are pinned: installing refuses (one line) a megatron-core version
not listed in TESTED_MEGATRON_VERSIONS and raises if a symbol is gone (tests/unit/test_cpu_shims.py fails there too).
"""
from __future__ import annotations

import contextlib
import importlib

import torch
from megatron.core import package_info, parallel_state
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.tensor_parallel import layers
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from adapter.patches import require

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


def install_cpu_shims(force: bool = False) -> bool:
    """Apply the shims once; no-op with CUDA present (unless `force`, for tests). Returns whether they are active."""
    global _installed
    if _installed:
        return True
    if torch.cuda.is_available() and not force:
        return False
    require("megatron-core", TESTED_MEGATRON_VERSIONS, "CPU shims (adapter/patches/mcore.py)")
    problems = check()
    if problems:
        raise RuntimeError(f"megatron-core {megatron_version()} changed symbols nd-adapter's CPU shims patch: "
                           + "; ".join(problems) + ". Update adapter/patches/mcore.py.")
    for module, attr, replacement in _SHIMS:
        obj, name = _owner(module, attr)
        setattr(obj, name, replacement)
    _installed = True
    return True


def quiet_row_parallel_group() -> None:
    """Megatron 0.16's RowParallelLinear passes tp_group=None on every forward; the lookup then warns (on rank 0),
    and `warnings.warn` is a graph break under torch.compile. Resolve None to the TP group without the warning: same
    group, same math (adapter/modeling/compile.py)."""
    original = layers.get_tensor_model_parallel_group_if_none
    if getattr(original, "_nd_quiet", False):
        return
    require("megatron-core", TESTED_MEGATRON_VERSIONS, "compiled-layer group lookup (adapter/patches/mcore.py)")

    def group_if_none(tp_group, is_expert=False, check_initialized=True):
        if tp_group is None and not is_expert and parallel_state.is_initialized():
            return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)
        return original(tp_group, is_expert=is_expert, check_initialized=check_initialized)

    group_if_none._nd_quiet = True
    layers.get_tensor_model_parallel_group_if_none = group_if_none


def install_rope_fusion(fused_rope) -> bool:
    """Plug `fused_rope` into Megatron where TransformerEngine's would go (`rope_utils.fused_apply_rotary_pos_emb`,
    None without TE); True if ours (or TE's) is in place."""
    if rope_utils.fused_apply_rotary_pos_emb is None:
        require("megatron-core", TESTED_MEGATRON_VERSIONS, "fused-RoPE hook (adapter/patches/mcore.py)")
        rope_utils.fused_apply_rotary_pos_emb = fused_rope
    return rope_utils.fused_apply_rotary_pos_emb is not None


def fused_rope_is(fused_rope) -> bool:
    """Whether `fused_rope` is the fused RoPE Megatron calls (not TE's)."""
    return rope_utils.fused_apply_rotary_pos_emb is fused_rope


def set_linear_impl(linear, matmul) -> None:
    """Run a Column/RowParallelLinear's matmul as `matmul(input, weight)` (e.g. `F.linear`, fp8) instead of its
    `_forward_impl`, Megatron's autograd Function with its TP communication and gradient-accumulation fusion: only
    where there is neither (tp = 1), which each call checks."""
    if not isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
        raise TypeError(f"not a Megatron parallel linear: {type(linear).__name__}")
    require("megatron-core", TESTED_MEGATRON_VERSIONS, "linear matmul implementation (adapter/patches/mcore.py)")

    def impl(input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
             sequence_parallel=False, grad_output_buffer=None, **_):
        if gradient_accumulation_fusion or allreduce_dgrad or sequence_parallel or grad_output_buffer:
            raise NotImplementedError(f"{getattr(matmul, '__name__', matmul)} in a Megatron linear is for tp = 1 "
                                      "without gradient-accumulation fusion")
        out = matmul(input, weight)
        return out if bias is None else out + bias

    linear._forward_impl = impl


_MAPPINGS = "megatron.core.tensor_parallel.mappings"


def uneven_gloo_collectives() -> None:
    """The shared-GPU mode (adapter/parallel/shared_gpu.py): gloo has no uneven all_gather or reduce_scatter, and
    Megatron's alltoall MoE dispatcher (the CUDA one) uses both at tp > 1, gathering each expert's tokens over the
    tp ranks with per-rank counts (`output_split_sizes`) and scattering the results back (`input_split_sizes`): ep=2 ×
    tp=2 failed at its first step ("ProcessGroupGloo::allgather: invalid tensor size"; found on the GPU host). Over
    a gloo group those two calls become one all_reduce each, exact: a gather is a sum of zero-filled slots each rank
    fills its own of, a reduce-scatter the rank's slice of the summed input. Other groups and even splits run
    Megatron's own code."""
    require("megatron-core", TESTED_MEGATRON_VERSIONS, "uneven collectives over gloo (the shared-GPU mode)")
    mappings = importlib.import_module(_MAPPINGS)
    if getattr(mappings._gather_along_first_dim, "_nd_uneven", False):
        return
    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def on_gloo(group, sizes) -> bool:
        return sizes is not None and group is not None and group.size() > 1 \
            and torch.distributed.get_backend(group) == "gloo"

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if not on_gloo(group, output_split_sizes):
            return gather(input_, group, output_split_sizes, use_global_buffer)
        start = sum(output_split_sizes[:group.rank()])
        out = input_.new_zeros((sum(output_split_sizes), *input_.shape[1:]))
        out[start:start + input_.shape[0]] = input_
        torch.distributed.all_reduce(out, group=group)
        return out

    def scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if not on_gloo(group, input_split_sizes):
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(input_split_sizes[:group.rank()])
        return total[start:start + input_split_sizes[group.rank()]].clone()

    gather_uneven._nd_uneven = scatter_uneven._nd_uneven = True  # type: ignore[attr-defined]
    mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim = gather_uneven, scatter_uneven


def check_preprocess() -> None:
    """`with_rotary` knows GPTModel._preprocess's result layout of the tested versions only."""
    require("megatron-core", TESTED_MEGATRON_VERSIONS, "per-token RoPE for packed documents (adapter/patches/mcore.py)")


def with_rotary(preprocessed: tuple, rotary_pos_emb: torch.Tensor) -> tuple:
    """GPTModel._preprocess's result (0.16.1: decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
    sequence_len_offset, padding_mask[, rotary_pos_cos_sin]) with its rotary embedding replaced."""
    return (preprocessed[0], rotary_pos_emb, *preprocessed[2:])


def with_decoder_input(preprocessed: tuple, decoder_input: torch.Tensor) -> tuple:
    """GPTModel._preprocess's result with its decoder input (the embeddings) replaced (Gemma scales them)."""
    return (decoder_input, *preprocessed[1:])


__all__ = ["with_decoder_input", "TESTED_MEGATRON_VERSIONS", "install_cpu_shims",
           "check", "megatron_version", "quiet_row_parallel_group", "uneven_gloo_collectives",
           "install_rope_fusion", "fused_rope_is", "check_preprocess", "with_rotary", "set_linear_impl"]
