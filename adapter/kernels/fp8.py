"""`precision: fp8`: a layer's matmuls in fp8, without TransformerEngine (by default the MLP's: `model.fp8_linears`).

Why the MLP by default: on one H200 at the Llama-3.2-1B/3B layer shapes (`bench/fp8_bench.py`: norm + linear,
forward and both gradients, compiled), the FFN's linears gained (tensorwise: up-projection 1.21× / 1.37× bf16,
down-projection 1.12× / 1.24×), the attention's QKV and output projections did not (0.66-1.04× in every recipe):
at their sizes the casts cost what the fp8 GEMMs save (docs/BENCHMARKS.md).

Why not torchao: its float8 training swaps `nn.Linear` modules, and Megatron's Column/RowParallelLinear are not
`nn.Linear`. So the three GEMMs of a linear layer (output, input gradient, weight gradient) call torch's scaled
matmul here directly, in one of torchao's recipes (`model.fp8_recipe`), every scale a power of two so that scaling
itself is exact:

* "tensorwise" (default): one scale per operand; input and weight e4m3, the gradient e5m2. Each operand is cast once
  and serves both of its GEMMs (the second layout is a transpose of fp8 bytes), and the input is saved in fp8.
* "rowwise": one scale per row of each GEMM's contraction, all e4m3; each operand is cast again along the other
  axis in backward (the input is saved in bf16). "rowwise_with_gw_hp": the weight gradient in bf16.

What is kept in high precision: the output layer and the embedding, the norms, attention and the loss. Master
weights and optimizer states are fp32 as in bf16 training. Inside a compiled layer (`model.compile`) Inductor fuses
each cast with its amax and with the op before it; eager it is correct but slow.
"""
from __future__ import annotations

import functools

import torch

from adapter.errors import bad
from adapter.patches.mcore import set_linear_impl

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
E5M2 = torch.float8_e5m2


def _cast(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (fp8 x, fp32 scale) with x ≈ q · scale; the scale is the power of two that maps amax into range."""
    top = torch.finfo(dtype).max
    scale = torch.exp2(torch.ceil(torch.log2(amax.float().clamp(min=1e-12) / top)))
    return (x.float() / scale).clamp(-top, top).to(dtype), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [r, c] -> (e4m3 [r, c] row-major, fp32 scale [r, 1]); one scale per row."""
    q, scale = _cast(x, x.abs().amax(dim=-1, keepdim=True), E4M3)
    return q.contiguous(), scale


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the whole tensor, as the maximum of row maxima (the same value: a maximum rounds nothing).

    Why two stages: a row reduction iterates like the kernel that produces x, so Inductor can compute it inside that
    kernel, where a whole-tensor reduction is a separate split reduction that reads x again (the 1B MLP's input
    gradient: ~200 µs per layer, docs/BENCHMARKS.md). `bench/fp8_mlp_bench.py` times both."""
    return x.abs().amax(dim=-1).amax() if x.dim() > 1 else x.abs().amax()


def quantize_tensor(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (fp8 x, fp32 0-dim scale); one scale for the whole tensor."""
    return _cast(x, amax(x), dtype)


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, fast: bool) -> torch.Tensor:
    """a [m, k] @ b[n, k]ᵀ with both cast row-wise along k: the layout torch._scaled_mm wants (a row-major, the
    second operand column-major, scales [m, 1] and [1, n])."""
    qa, sa = quantize_rows(a)
    qb, sb = quantize_rows(b)
    return torch._scaled_mm(qa, qb.t(), sa, sb.t(), out_dtype=out_dtype, use_fast_accum=fast)


def _col_major(q: torch.Tensor) -> torch.Tensor:
    """The same [r, c] matrix stored column-major (torch._scaled_mm's second operand): an fp8 transpose copy."""
    return q.t().contiguous().t()


class _Fp8LinearRowwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, wgrad_fp8: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.wgrad_fp8 = wgrad_fp8
        x2 = x.reshape(-1, x.size(-1))
        return _mm(x2, weight, x.dtype, True).view(*x.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.size(-1))                      # [m, n]
        x2 = x.reshape(-1, x.size(-1))                           # [m, k]
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:                              # g @ W: contraction over n
            grad_x = _mm(g, weight.t(), grad.dtype, False).view_as(x)
        if ctx.needs_input_grad[1]:                              # gᵀ @ x: contraction over the tokens
            grad_w = _mm(g.t(), x2.t(), weight.dtype, False) if ctx.wgrad_fp8 else (g.t() @ x2).to(weight.dtype)
        return grad_x, grad_w, None


class _Fp8LinearTensorwise(torch.autograd.Function):
    """One scale per tensor (torchao's "tensorwise" recipe: e4m3 input and weight, e5m2 gradient): each operand is
    cast once and serves both of its GEMMs (a transpose copy of fp8 bytes instead of a second amax-and-cast of bf16),
    cuBLAS's fp8 GEMM instead of the row-scaled one, and the input is saved for backward in fp8 (half the bytes)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.size(-1))
        qx, sx = quantize_tensor(x2)
        qw, sw = quantize_tensor(weight)
        ctx.save_for_backward(qx, sx, weight)
        ctx.x_shape = x.shape
        out = torch._scaled_mm(qx, qw.t(), sx, sw, out_dtype=x.dtype, use_fast_accum=True)
        return out.view(*x.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        qx, sx, weight = ctx.saved_tensors
        qg, sg = quantize_tensor(grad.reshape(-1, grad.size(-1)), E5M2)         # [m, n]
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:                                            # g [m, n] @ W [n, k]
            qw, sw = quantize_tensor(weight)
            grad_x = torch._scaled_mm(qg, _col_major(qw), sg, sw, out_dtype=grad.dtype).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:                                            # gᵀ [n, m] @ x [m, k]
            grad_w = torch._scaled_mm(qg.t().contiguous(), _col_major(qx), sg, sx, out_dtype=weight.dtype)
        return grad_x, grad_w


RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: str = "tensorwise") -> torch.Tensor:
    """x [..., k] @ weight[n, k]ᵀ with its three GEMMs (output, input gradient, weight gradient) in fp8; out in x's
    dtype. Recipes (torchao's names): "tensorwise" (one scale per operand), "rowwise" (one scale per row of each
    GEMM's contraction), "rowwise_with_gw_hp" (rowwise, the weight gradient in bf16)."""
    if recipe == "tensorwise":
        return _Fp8LinearTensorwise.apply(x, weight)
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r}: one of {RECIPES}")
    return _Fp8LinearRowwise.apply(x, weight, recipe == "rowwise")


def install_fp8(model, recipe: str = "tensorwise", linears=("fc1", "fc2")) -> int:
    """Every decoder layer's named linears (qkv, proj: attention; fc1, fc2: MLP) on fp8 matmuls; returns how many.
    Refuses GPUs without fp8."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        name = torch.cuda.get_device_name()
        raise bad("precision", "fp8", f"{name} has no fp8 matmuls (compute capability 8.9+: H100, H200, L40S, B200)",
                  "use precision: bf16")
    matmul = functools.partial(fp8_linear, recipe=recipe)
    matmul.__name__ = f"fp8 ({recipe})"
    n = 0
    for layer in model.decoder.layers:
        modules = {"qkv": layer.self_attention.linear_qkv, "proj": layer.self_attention.linear_proj,
                   "fc1": layer.mlp.linear_fc1, "fc2": layer.mlp.linear_fc2}
        for name in linears:
            set_linear_impl(modules[name], matmul)
            n += 1
    return n


__all__ = ["fp8_linear", "install_fp8", "quantize_rows", "quantize_tensor", "RECIPES"]
