"""nd-adapter's fused linear cross-entropy on its own (one process; the vocab-parallel and model-level checks are in
tests/distributed/test_model.py): only the gradients autograd can ask for are computed, Gemma 2's soft-capping is
carried through, and the chunk the `auto` default picks is GEMM-friendly."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adapter.kernels.fusions import linear_cross_entropy
from adapter.models.counts import linear_ce_chunk


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    y = torch.randint(0, 45, (37,), generator=g)
    mask = (torch.rand(37, generator=g) > 0.3).float()
    return h, w, y, mask


@pytest.mark.parametrize("cap", [None, 3.0])
def test_loss_and_gradients_equal_the_unfused_ones(cap):
    """45 real rows of 50 (the rest vocabulary padding; 45 is not a multiple of 8, so the logits sit in a buffer
    with padded rows), 8-token chunks that do not divide 37 tokens."""
    h, w, y, mask = _case()
    z = h @ w[:45].t()
    z = z if cap is None else torch.tanh(z / cap) * cap
    ref = (F.cross_entropy(z, y, reduction="none") * mask).sum()
    gh, gw = torch.autograd.grad(ref, (h, w))
    got = linear_cross_entropy(h, w, y, mask, chunk=8, real=45, softcap=cap)
    ah, aw = torch.autograd.grad(got * 1.5, (h, w))  # the upstream scale reaches both
    assert abs(got.item() - ref.item()) <= 1e-5 * ref.item()
    assert (ah - 1.5 * gh).abs().max().item() <= 1e-5 and (aw - 1.5 * gw).abs().max().item() <= 1e-5
    assert aw[45:].abs().max().item() == 0.0


def test_a_frozen_output_weight_gets_no_gradient_and_evaluation_none():
    h, w, y, mask = _case(1)
    frozen = w.detach()
    got = linear_cross_entropy(h, frozen, y, mask, chunk=8)
    got.backward()
    ref = (F.cross_entropy(h.detach().requires_grad_() @ frozen.t(), y, reduction="none") * mask).sum()
    assert h.grad is not None and frozen.grad is None and abs(got.item() - ref.item()) <= 1e-5 * ref.item()
    with torch.no_grad():
        evaluated = linear_cross_entropy(h, w, y, mask, chunk=8)
    assert not evaluated.requires_grad and abs(evaluated.item() - got.item()) <= 1e-6 * got.item()


def test_the_default_chunk_is_a_multiple_of_128_tokens():
    assert linear_ce_chunk(128256) == 1024              # Llama 3's vocabulary at tp = 1
    assert linear_ce_chunk(262272) == 512               # Gemma 3's, padded
    assert linear_ce_chunk(200064) == 640               # Phi-4's
    assert linear_ce_chunk(10**7) == 256                # never under 256 tokens
    assert linear_ce_chunk(512) == 262144
