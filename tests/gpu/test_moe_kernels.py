"""GPU host only (`pytest -m gpu`): the MoE layer's Triton kernels (adapter/kernels/moe_triton.py) against the torch
arithmetic they replace there: the gather-sum against index_select + sum, the weighted SwiGLU (output, input and
routing-weight gradients) against Megatron's weighted_bias_swiglu_impl."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("width,dtype", [(2048, torch.bfloat16), (200, torch.bfloat16), (96, torch.float32)])
def test_gather_sum_equals_torch(width, dtype):
    from adapter.kernels.moe_triton import gather_sum

    torch.manual_seed(0)
    tokens, k = 1000, 8
    y = torch.randn(tokens * k, width, device="cuda", dtype=dtype)
    inv = torch.randperm(tokens * k, device="cuda").view(tokens, k)
    ref = y.index_select(0, inv.reshape(-1)).view(tokens, k, -1).sum(1)
    out = gather_sum(y, inv)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref)
    if dtype == torch.bfloat16:  # fp32 sums, one rounding: equal but where the two summation orders round apart
        assert (out == ref).float().mean().item() > 0.99


@pytest.mark.parametrize("prob_dtype", [torch.float32, torch.bfloat16])
def test_weighted_swiglu_equals_megatron(prob_dtype):
    from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

    from adapter.kernels.moe_triton import weighted_swiglu

    torch.manual_seed(0)
    rows, f = 3000, 768
    y = torch.randn(rows, 2 * f, device="cuda", dtype=torch.bfloat16)
    p = torch.rand(rows, 1, device="cuda", dtype=prob_dtype)
    g = torch.randn(rows, f, device="cuda", dtype=torch.bfloat16)
    results = []
    for fn in (weighted_swiglu, lambda a, b: weighted_bias_swiglu_impl(a, None, b)):
        a, b = y.clone().requires_grad_(), p.clone().requires_grad_()
        out = fn(a, b)
        out.backward(g)
        results.append((out, a.grad, b.grad))
    (out, dy, dp), (ref_out, ref_dy, ref_dp) = results
    assert out.dtype == ref_out.dtype and dy.dtype == ref_dy.dtype and dp.dtype == ref_dp.dtype == prob_dtype
    assert dp.shape == ref_dp.shape == (rows, 1)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(dy, ref_dy)
    tol = dict(rtol=1e-4, atol=1e-4) if prob_dtype == torch.float32 else {}
    torch.testing.assert_close(dp, ref_dp, **tol)
    for mine, ref in ((out, ref_out), (dy, ref_dy)):
        assert (mine == ref).float().mean().item() > 0.9  # fp32 arithmetic in Megatron's order, one rounding
