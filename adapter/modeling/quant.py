"""The frozen base of a LoRA run in 4 or 8 bits (adapter/models/lora.py's `BASE_FORMATS`), quantised per TP shard
so that every weight equals, element for element, what bitsandbytes makes of the whole HF tensor when Axolotl loads
the model with `load_in_4bit` (QLoRA: NF4, blocks of 64, double quantisation) or `load_in_8bit` (row-wise absmax).

bitsandbytes because it is the format Axolotl's and PEFT's users train and ship (torchao's NF4 tensor is the other
well-kept implementation; it differs in the second-level scales); its own ops do the quantising and dequantising.
Why the result does not depend on the layout:
- NF4's first level quantises blocks of 64 consecutive elements of the row-major HF tensor. Every block lies inside
  one row when the linear's (per-rank) input width is a multiple of 64, so a block's codes and absmax are the same
  whether TP splits rows (column-parallel) or columns (row-parallel), and in Megatron's fused row order.
- The second level (double quantisation) quantises the HF tensor's vector of block absmaxes, minus its mean, in
  blocks of 256 of the HF order: those vectors are gathered over TP into HF order, quantised there by bitsandbytes
  and the dequantised (effective) fp32 scales kept for this rank's blocks. The scales are stored in fp32 (4 bytes a
  block, where bitsandbytes keeps 1 byte plus a 256th): 0.5625 bytes per weight instead of 0.516.
  A packed HF tensor (Phi-3's qkv_proj = [q; k; v], gate_up_proj = [gate; up]) is one vector of absmaxes for
  bitsandbytes: its rows are gathered into Megatron's whole order, put in the HF tensor's order by the family's
  own conversion rule, quantised there, and brought back.
- int8: one absmax per HF row (a max over TP for row-parallel linears), then bitsandbytes' rounding; rows are
  independent, so packing changes nothing.
A quantised linear keeps only its codes for backward: its weight is dequantised again there (as bitsandbytes'
MatMul4Bit does), so no bf16 copy of the base outlives one GEMM, compiled or not (`quant_linear`). The codes are
buffers, not parameters: DeepSpeed neither shards nor checkpoints them (a resume quantises the base again from the
converted checkpoint).
int8 computes in the compute dtype after dequantisation: the weights are bitsandbytes', without LLM.int8's
quantisation of the activations (so a little closer to the 16-bit model than Axolotl's 8-bit run).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from adapter.modeling.lora import gather, gather_list
from adapter.models.arch import ModelArch
from adapter.models.counts import Linear
from adapter.models.lora import NF4_BLOCK, nn_linears, packed_of, placement
from adapter.models.mapping import Ctx, cut_blocks, merge_blocks

# Megatron's column-parallel linears of a dense layer (its GPT layer spec); this module reads each linear's own
# tp_axis from the family's table (counts.linears), tests name these
COLUMN = ("linear_qkv", "linear_fc1")


def _bnb():
    """bitsandbytes' functional API, imported here: only quantised runs pay for it (and its CPU-kernel note stays
    out of every other run's log)."""
    import logging

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    import bitsandbytes.functional as bnbf

    return bnbf


def hf_row_sets(arch: ModelArch, fused: str, tp: int, rows: int) -> list[torch.Tensor]:
    """This rank's rows of each HF tensor fused into a column-parallel linear, in HF order (q, k, v; gate, up)."""
    place = placement(arch, fused, tp)
    base = torch.arange(place.groups).unsqueeze(1) * place.width
    sets = [(base + torch.arange(start, start + size)).reshape(-1) for _, start, size in place.pieces]
    assert sum(len(s) for s in sets) == rows, (fused, rows)
    return sets


def nf4_quantize(w: torch.Tensor, arch: ModelArch | None, fused: str, tp: int, tp_rank: int,
                 tp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed NF4 codes, effective fp32 block scales) of this rank's shard `w` [out, in] of a Megatron linear.
    `arch` None: `w` is one whole HF matrix of no family (its second level runs over all of it)."""
    column = arch is not None and _tp_axis(arch, fused) == 0
    bnbf = _bnb()
    out_rows, cols = w.shape
    codes, absmax = torch.ops.bitsandbytes.quantize_4bit(w.contiguous(), NF4_BLOCK, "nf4", torch.uint8)
    absmax = absmax.view(out_rows, cols // NF4_BLOCK)
    scales = torch.empty_like(absmax)

    def second_level(hf: torch.Tensor) -> torch.Tensor:  # what bitsandbytes' quantize_4bit does to its absmaxes
        flat = hf.reshape(-1)
        offset = flat.mean()
        q, state = bnbf.quantize_blockwise(flat - offset, blocksize=256)
        return (bnbf.dequantize_blockwise(q, state) + offset).float().view_as(hf)

    packed = packed_of(arch, fused)
    if packed is not None:  # one HF tensor: one second level over all of it, in its own row order
        whole = merge_blocks(gather_list(absmax, tp_group), 0, packed.parts) if tp > 1 else absmax
        hf = second_level(packed.to_hf(whole, Ctx(arch, 0))[0])
        scales.copy_(cut_blocks(packed.to_megatron([hf], Ctx(arch, 0)), 0, packed.parts, tp, tp_rank))
    elif column:
        for rows in hf_row_sets(arch, fused, tp, out_rows):
            whole = second_level(gather(absmax[rows], 0, tp_group) if tp > 1 else absmax[rows])
            scales[rows] = whole.view(tp, len(rows), -1)[tp_rank] if tp > 1 else whole
    else:
        whole = second_level(gather(absmax, 1, tp_group) if tp > 1 else absmax)
        scales.copy_(whole.view(out_rows, tp, -1)[:, tp_rank] if tp > 1 else whole)
    return codes.reshape(-1), scales.reshape(-1)


def int8_quantize(w: torch.Tensor, column: bool, tp: int, tp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weights, fp32 row absmax) as bitsandbytes' `Int8Params` makes them from the whole HF rows: the weight
    in fp16 (its CUDA kernel takes nothing else), then `int8_vectorwise_quant`'s rounding. `column`: the linear is
    column-parallel (each rank holds whole rows)."""
    _bnb()  # its ops
    w = w.to(torch.float16)
    stats = w.abs().amax(dim=1).float()
    if not column and tp > 1:  # a row-parallel rank holds a slice of each row
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=tp_group)
    return torch.round(w * (127.0 / stats.unsqueeze(-1))).to(torch.int8), stats


def dequantize(codes: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int], fmt: str,
               dtype: torch.dtype) -> torch.Tensor:
    """The weight in `dtype`, by bitsandbytes' own dequantisation ops."""
    if fmt == "nf4":
        return torch.ops.bitsandbytes.dequantize_4bit(codes, scales, NF4_BLOCK, "nf4", list(shape), dtype)
    return torch.ops.bitsandbytes.int8_vectorwise_dequant(codes, scales).to(dtype)


@torch.library.custom_op("nd_adapter::quant_linear", mutates_args=())
def quant_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, rows: int, cols: int,
                 fmt: str) -> torch.Tensor:
    """x Wᵀ for a frozen quantised W [rows, cols]. An op of its own (not a Python function) so that torch.compile's
    partitioner cannot choose to keep the dequantised weight for backward: what backward keeps is the codes (the
    module's own buffers, no copy), and it dequantises again, as bitsandbytes' MatMul4Bit does (measured on one
    H200: compiled layers kept every layer's bf16 weight otherwise, 14 GiB more for the 8B shape)."""
    return F.linear(x, dequantize(codes, scales, (rows, cols), fmt, x.dtype))


@quant_linear.register_fake
def _(x, codes, scales, rows, cols, fmt):
    return x.new_empty((*x.shape[:-1], rows))


@torch.library.custom_op("nd_adapter::quant_linear_dgrad", mutates_args=())
def quant_linear_dgrad(grad: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, rows: int, cols: int,
                       fmt: str) -> torch.Tensor:
    """The input gradient of `quant_linear`: grad W, the weight dequantised again."""
    return grad @ dequantize(codes, scales, (rows, cols), fmt, grad.dtype)


@quant_linear_dgrad.register_fake
def _(grad, codes, scales, rows, cols, fmt):
    return grad.new_empty((*grad.shape[:-1], cols))


def _setup_context(ctx, inputs, output):
    _, codes, scales, rows, cols, fmt = inputs
    ctx.save_for_backward(codes, scales)
    ctx.meta = (rows, cols, fmt)


def _backward(ctx, grad):
    codes, scales = ctx.saved_tensors
    return quant_linear_dgrad(grad, codes, scales, *ctx.meta), None, None, None, None, None


quant_linear.register_autograd(_backward, setup_context=_setup_context)


class _Quantized:
    """Mixed into a Megatron linear's class: its weight held quantised (`self.qformat`), its forward Megatron's with
    the same TP communication (column-parallel: copy / sequence-parallel gather of the input; row-parallel: reduce
    / reduce-scatter of the output)."""

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.qcodes, self.qscales, self.qshape, self.qformat, dtype)

    def forward(self, input_, *args, **kwargs):
        sp, group, tp = self.sequence_parallel, self.tp_group, self.tp_size
        if self.qcolumn:
            x = input_
            if tp > 1:
                x = (gather_from_sequence_parallel_region(x, True, group=group) if sp
                     else copy_to_tensor_model_parallel_region(x, group=group))
            out = quant_linear(x, self.qcodes, self.qscales, *self.qshape, self.qformat)
        else:
            out = quant_linear(input_, self.qcodes, self.qscales, *self.qshape, self.qformat)
            if tp > 1:
                out = (reduce_scatter_to_sequence_parallel_region(out, group=group) if sp
                       else reduce_from_tensor_model_parallel_region(out, group=group))
        if self.bias is not None and not self.skip_bias_add:
            return out + self.bias, None
        return out, self.bias


_CLASSES: dict[type, type] = {}


def _quantized_linears(arch: ModelArch) -> list[Linear]:
    """One HF linear of each Megatron linear a layer quantises (`models.lora.nn_linears`), in forward order."""
    first: dict[str, Linear] = {}
    for lin in nn_linears(arch):
        first.setdefault(lin.module, lin)
    return list(first.values())


def _tp_axis(arch: ModelArch, fused: str) -> int | None:
    return next(lin.tp_axis for lin in nn_linears(arch) if lin.fused == fused)


def _quantized(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Quantized{cls.__name__}", (_Quantized, cls), {})
    return _CLASSES[cls]


@torch.no_grad()
def quantize_base(model, arch: ModelArch, fmt: str, *, tp_rank: int, tp_group, device) -> None:
    """Replace every decoder linear's weight of the built, loaded GPTModel by `fmt` codes on `device` (the
    embedding, norms and LM head stay in the model's dtype, as bitsandbytes leaves them; so do a mixture of
    experts' router and experts: `models.lora.nn_linears`). Collective over TP."""
    tp = model.config.tensor_model_parallel_size
    for layer in model.decoder.layers:
        for lin in _quantized_linears(arch):
            linear = layer.get_submodule(lin.module)
            w = linear.weight.detach().to(device)
            if fmt == "nf4":
                codes, scales = nf4_quantize(w, arch, lin.fused, tp, tp_rank, tp_group)
            else:
                codes, scales = int8_quantize(w, lin.tp_axis == 0, tp, tp_group)
            del linear._parameters["weight"]
            linear.register_buffer("qcodes", codes, persistent=False)
            linear.register_buffer("qscales", scales, persistent=False)
            linear.qshape, linear.qformat, linear.qcolumn = tuple(w.shape), fmt, lin.tp_axis == 0
            linear.tp_size = tp
            linear.__class__ = _quantized(type(linear))
            del w


def quantized_weights(model) -> dict[tuple[int, str], tuple[str, torch.Tensor, torch.Tensor, tuple[int, int]]]:
    """(layer, Megatron linear) -> (format, codes, scales, local shape): what a test compares with bitsandbytes."""
    out = {}
    for i, layer in enumerate(model.decoder.layers):
        for name, m in layer.named_modules():
            if isinstance(m, _Quantized):
                out[(i, name.rpartition(".")[2])] = (m.qformat, m.qcodes, m.qscales, m.qshape)
    return out


__all__ = ["packed_of", "quantize_base", "quantized_weights", "nf4_quantize", "int8_quantize", "dequantize",
           "hf_row_sets", "COLUMN"]
