"""`precision: fp8`: the MLP's matmuls in fp8, without TransformerEngine.

Why only the MLP: on one H200 at the Llama-3.2-1B/3B layer shapes (`bench/fp8_bench.py`: norm + linear, forward and
both gradients, compiled), fp8 ran the FFN's up-projection at 1.19× / 1.34× bf16 and the down-projection at
1.01× / 1.10×, but the attention's QKV and output projections at 0.59-0.93×: below K·N ≈ 3072², the casts (an amax
pass and a transposed copy per operand per GEMM) cost what the fp8 GEMMs save (docs/BENCHMARKS.md). End to end the
MLP in fp8 gave 1.08× tokens/s on the 1B shape.

Why not torchao: its float8 training swaps `nn.Linear` modules, and Megatron's Column/RowParallelLinear are not
`nn.Linear`. So the three GEMMs of a linear layer (output, input gradient, weight gradient) call torch's scaled
matmul here directly, each operand cast to e4m3 with one scale per row of the contraction (torchao's "rowwise"
recipe: scales along the axis each GEMM sums over, rounded up to powers of two so scaling itself is exact).

What is kept in high precision: the saved activations and weights (bf16; re-cast along the other axis in backward),
the output layer and the embedding, the norms, attention and the loss. Master weights and optimizer states are
fp32 as in bf16 training. Inside a compiled layer (`model.compile`) Inductor fuses each cast with its amax and with
the op before it; eager it is correct but slow.
"""
from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [r, c] -> (e4m3 [r, c] row-major, fp32 scale [r, 1]) with x ≈ q · scale; one power-of-two scale per row."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.contiguous(), scale


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, fast: bool) -> torch.Tensor:
    """a [m, k] @ b[n, k]ᵀ with both cast row-wise along k: the layout torch._scaled_mm wants (a row-major, the
    second operand column-major, scales [m, 1] and [1, n])."""
    qa, sa = quantize_rows(a)
    qb, sb = quantize_rows(b)
    return torch._scaled_mm(qa, qb.t(), sa, sb.t(), out_dtype=out_dtype, use_fast_accum=fast)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, wgrad_fp8: bool = True) -> torch.Tensor:
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


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, wgrad_fp8: bool = True) -> torch.Tensor:
    """x [..., k] @ weight[n, k]ᵀ in fp8 (forward and input gradient; the weight gradient too unless
    `wgrad_fp8=False`, torchao's "rowwise_with_gw_hp"); out in x's dtype."""
    return _Fp8Linear.apply(x, weight, wgrad_fp8)


def install_fp8_mlp(model) -> int:
    """Every decoder layer's MLP linears (fc1, fc2) on fp8 matmuls; returns how many. Refuses GPUs without fp8."""
    from adapter.errors import bad
    from adapter.patches.mcore import set_linear_impl

    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        name = torch.cuda.get_device_name()
        raise bad("precision", "fp8", f"{name} has no fp8 matmuls (compute capability 8.9+: H100, H200, L40S, B200)",
                  "use precision: bf16")
    n = 0
    for layer in model.decoder.layers:
        for linear in (layer.mlp.linear_fc1, layer.mlp.linear_fc2):
            set_linear_impl(linear, fp8_linear)
            n += 1
    return n


__all__ = ["fp8_linear", "install_fp8_mlp", "quantize_rows"]
