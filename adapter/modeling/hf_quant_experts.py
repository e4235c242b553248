"""Axolotl's `quantize_moe_experts` on transformers' loaded model (adapter/models/quant_experts.py: which weights,
and what is refused): each 3-D expert weight replaced by its codes through a parametrisation that dequantises the
whole weight at each use, as Axolotl's loader does at 067b021 (monkeypatch/moe_quant.py). NF4 (a 4-bit base):
bitsandbytes' own `replace_parameter_4bit` (double quantisation, blocks of 64). int8 (an 8-bit base): Axolotl's
own parametrisation, rebuilt here: bitsandbytes' row-wise absmax over the weight seen as rows of its last dimension
(`int8_vectorwise_quant` of the fp16 weight; on a GPU bitsandbytes flattens the leading dimensions itself, its CPU
op needs them flattened first), dequantised in fp32 and used in the run's dtype (Axolotl's bf16 runs compute it
under autocast, which casts it so). The model is built on the CPU here: the same codes bitsandbytes makes on a GPU.
"""
from __future__ import annotations

import torch
import torch.nn.utils.parametrize as P


class Int8Experts(torch.nn.Module):
    """Axolotl's Bnb8bitParametrization: the int8 codes (the parameter's data) times their row's absmax / 127."""

    def __init__(self, row_stats: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("row_stats", row_stats)
        self.dtype = dtype

    @torch.no_grad()
    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        from bitsandbytes.functional import int8_vectorwise_dequant

        w = int8_vectorwise_dequant(codes.reshape(-1, codes.shape[-1]), self.row_stats)
        return w.reshape(codes.shape).to(self.dtype)


def _cache_on(module, inputs) -> None:
    P._cache_enabled += 1  # one dequantisation per forward of the module, however often it reads the weight


def _cache_off(module, inputs, output) -> None:
    P._cache_enabled = max(0, P._cache_enabled - 1)  # (always_call: an aborted recompute must not leave it on)
    if not P._cache_enabled:
        P._cache = {}


def _int8(module: torch.nn.Module, name: str) -> None:
    from bitsandbytes.functional import int8_vectorwise_quant

    w = getattr(module, name).data
    codes, row_stats, _ = int8_vectorwise_quant(w.reshape(-1, w.shape[-1]).to(torch.float16))
    setattr(module, name, torch.nn.Parameter(codes.reshape(w.shape), requires_grad=False))
    P.register_parametrization(module, name, Int8Experts(row_stats, w.dtype), unsafe=True)
    if not getattr(module, "_nd_int8_cache_hooks", False):
        module.register_forward_pre_hook(_cache_on)
        module.register_forward_hook(_cache_off, always_call=True)
        module._nd_int8_cache_hooks = True


def quantize_expert_weights(model, fmt: str) -> int:
    """Every 3-D expert weight of `model` in `fmt` ("nf4" / "int8"); returns how many."""
    from bitsandbytes.nn.parametrize import replace_parameter_4bit

    from adapter.models.quant_experts import is_expert_weight

    todo = [(name.rpartition(".")[0], name.rpartition(".")[2]) for name, p in model.named_parameters()
            if is_expert_weight(name, p.dim())]
    for mod, pname in todo:
        if fmt == "nf4":
            replace_parameter_4bit(model.get_submodule(mod), pname, compress_statistics=True, quant_type="nf4")
        else:
            _int8(model.get_submodule(mod), pname)
    return len(todo)


def move_expert_states(model, device) -> None:
    """bitsandbytes' NF4 parametrisation keeps a weight's statistics (QuantState) outside the module's tensors, so
    `model.to(device)` moves the codes but not them: moved here after it (the int8 row statistics are a buffer)."""
    from bitsandbytes.nn.parametrize import Bnb4bitParametrization

    for m in model.modules():
        if isinstance(m, Bnb4bitParametrization):
            m.quant_state.to(device)
