"""adapter/kernels/fp8.py on CPU: the casts, and each of the three fp8 GEMMs against the same GEMM on the dequantized
operands (fp64), which it must equal up to accumulation rounding."""
from __future__ import annotations

import torch

from adapter.kernels.fp8 import E4M3_MAX, fp8_linear, quantize_rows, quantize_tensor


def _deq(t: torch.Tensor) -> torch.Tensor:
    q, s = quantize_rows(t)
    return q.double() * s.double()


def test_row_casts_use_power_of_two_scales_within_e4m3_range():
    for seed in range(8):
        torch.manual_seed(seed)
        x = torch.randn(8, 64) * torch.logspace(-3, 3, 8).unsqueeze(1)
        q, s = quantize_rows(x)
        assert q.dtype == torch.float8_e4m3fn and s.shape == (8, 1)
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)                  # powers of two
        # amax / scale lies in (224, 448]; e4m3 rounds values just above 224 down to 224 itself
        assert (q.float().abs().amax(1) <= E4M3_MAX).all() and (q.float().abs().amax(1) >= E4M3_MAX / 2).all()
        assert ((q.float() * s - x).abs() <= x.abs() * 2 ** -4 + s * 2 ** -9).all()  # e4m3: 3 mantissa bits


def test_fp8_linear_is_the_gemm_of_its_cast_operands():
    torch.manual_seed(0)
    x = torch.randn(32, 48, requires_grad=True)
    w = torch.randn(24, 48, requires_grad=True)
    g = torch.randn(32, 24)
    y = fp8_linear(x, w, "rowwise")
    y.backward(g)
    assert torch.allclose(y.double(), _deq(x.detach()) @ _deq(w.detach()).t(), rtol=1e-5, atol=1e-4)
    assert torch.allclose(x.grad.double(), _deq(g) @ _deq(w.detach().t()).t(), rtol=1e-5, atol=1e-4)
    assert torch.allclose(w.grad.double(), _deq(g.t()) @ _deq(x.detach().t()).t(), rtol=1e-5, atol=1e-4)
    exact = x.detach() @ w.detach().t()
    assert ((y - exact).norm() / exact.norm()) < 0.08                          # and close to the bf16/fp32 GEMM

    x.grad = w.grad = None
    fp8_linear(x, w, "rowwise_with_gw_hp").backward(g)                        # the weight gradient in full precision
    assert torch.allclose(w.grad, g.t() @ x.detach(), rtol=1e-5, atol=1e-4)


def test_tensor_casts_use_one_power_of_two_scale():
    torch.manual_seed(0)
    x = torch.randn(16, 32) * 1e-3
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q, s = quantize_tensor(x, dtype)
        top = torch.finfo(dtype).max
        assert q.dtype == dtype and s.dim() == 0 and torch.equal(torch.exp2(torch.log2(s).round()), s)
        assert top / 2 <= q.float().abs().max() <= top


def test_tensorwise_fp8_linear_is_the_gemm_of_its_cast_operands():
    """Input and weight in e4m3, the gradient in e5m2, each cast once (one scale each) and used by both its GEMMs."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, 48, requires_grad=True)                             # [..., k]: a leading batch dim
    w = torch.randn(32, 48, requires_grad=True)
    g = torch.randn(2, 16, 32)

    def deq(t, dtype=torch.float8_e4m3fn):
        q, s = quantize_tensor(t, dtype)
        return q.double() * s.double()

    y = fp8_linear(x, w)
    y.backward(g)
    x2, g2 = x.detach().reshape(-1, 48), g.reshape(-1, 32)
    assert torch.allclose(y.reshape(-1, 32).double(), deq(x2) @ deq(w.detach()).t(), rtol=1e-5, atol=1e-4)
    dg = deq(g2, torch.float8_e5m2)
    assert torch.allclose(x.grad.reshape(-1, 48).double(), dg @ deq(w.detach()), rtol=1e-5, atol=1e-4)
    assert torch.allclose(w.grad.double(), dg.t() @ deq(x2), rtol=1e-5, atol=1e-4)
    exact = x.detach() @ w.detach().t()
    assert ((y - exact).norm() / exact.norm()) < 0.08
    assert ((x.grad - g @ w.detach()).norm() / (g @ w.detach()).norm()) < 0.15   # e5m2: 2 mantissa bits


def test_fp8_refused_with_tensor_parallelism_in_one_line():
    from pathlib import Path

    import pytest

    from adapter import config
    from adapter.errors import UserError
    from adapter.models import checks
    from adapter.models.arch import load_arch

    model = Path(__file__).resolve().parents[2] / "configs/models/llama-3.2-1b"
    raw = {"model": {"path": str(model), "compile": True}, "parallelism": {"dp_shard_size": 1, "tp_size": 2},
           "precision": "fp8"}
    with pytest.raises(UserError, match=r"precision='fp8': fp8 matmuls are wired for tp_size = 1 only"):
        checks.check(config.build(raw, env={}, world_size=2), load_arch(model))
    raw["parallelism"]["tp_size"] = 1
    assert checks.check(config.build(raw, env={}, world_size=1), load_arch(model)) == []


def test_amax_by_rows_is_the_whole_tensor_amax():
    from adapter.kernels import fp8

    x = torch.randn(33, 70, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x[17, 5] = -40.0
    assert torch.equal(fp8.amax(x), x.abs().amax()) and fp8.amax(x).item() == 40.0
