"""GPU host only (`pytest -m gpu`): the cross-entropy kernels as they run there (torch.compile'd on CUDA; Liger's
fused linear CE at tp=1) with a padded vocabulary: the padding columns never enter the softmax. fp32, against
F.cross_entropy over the real columns; the CPU suite checks the eager kernels (tests/distributed/test_model.py)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
REAL, PADDED, HIDDEN, TOKENS = 1000, 1024, 64, 300


def _case():
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda", generator=g)
    weight = torch.randn(PADDED, HIDDEN, device="cuda", generator=g) * 0.1
    weight[REAL:] = 0.0  # zero padding rows, as conversion writes them: logit 0 would enter an unmasked softmax
    target = torch.randint(0, REAL, (TOKENS,), device="cuda", generator=g)
    return hidden, weight, target


def test_vocab_parallel_ce_leaves_out_padding_on_cuda():
    import torch.nn.functional as F

    from adapter.kernels.fusions import vocab_parallel_cross_entropy

    hidden, weight, target = _case()
    logits = (hidden @ weight.t()).requires_grad_()
    ref_logits = logits.detach()[:, :REAL].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, target, reduction="none")
    ref.sum().backward()
    got = vocab_parallel_cross_entropy(logits, target, real=REAL)
    got.sum().backward()
    assert (got - ref).abs().max().item() <= 1e-4
    assert (logits.grad[:, :REAL] - ref_logits.grad).abs().max().item() <= 1e-5
    assert logits.grad[:, REAL:].abs().max().item() == 0.0


# None: Liger's kernel where installed; 128: ours, in chunks; 1,003 real rows: ours with the logits in rows padded
# to 128 columns (counts.LINEAR_CE_PAD_ROWS_ON_CUDA, an unaligned vocabulary's row stride)
@pytest.mark.parametrize("chunk, real", [(None, REAL), (128, REAL), (128, 1003)])
def test_linear_ce_leaves_out_padding_on_cuda(chunk, real, monkeypatch):
    import torch.nn.functional as F

    from adapter.kernels.fusions import linear_cross_entropy
    from adapter.models import counts

    monkeypatch.setattr(counts, "LINEAR_CE_PAD_ROWS_ON_CUDA", real % 8 != 0)
    hidden, weight, target = _case()
    weight[REAL:real] = torch.randn(real - REAL, HIDDEN, device="cuda") * 0.1
    mask = (torch.arange(TOKENS, device="cuda") % 3 != 0).float()
    h_ref, w_ref = hidden.clone().requires_grad_(), weight[:real].clone().requires_grad_()
    ref = (F.cross_entropy(h_ref @ w_ref.t(), target, reduction="none") * mask).sum()
    ref.backward()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    got = linear_cross_entropy(h, w, target, mask, chunk=chunk, real=real)
    got.backward()
    assert abs(got.item() - ref.item()) / ref.item() <= 1e-5
    assert (h.grad - h_ref.grad).abs().max().item() <= 1e-5 * h_ref.grad.abs().max().item() + 1e-7
    assert (w.grad[:real] - w_ref.grad).abs().max().item() <= 1e-5 * w_ref.grad.abs().max().item() + 1e-7
    assert w.grad[real:].abs().max().item() == 0.0


def test_linear_ce_backward_scales_its_gradients_in_place_on_cuda():
    """nd-adapter's chunked linear CE computes its gradients in the forward; backward scales them by the upstream
    scalar in place, so no second output-weight-sized buffer appears at the start of backward (the step's peak)."""
    from adapter.kernels.fusions import linear_cross_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    vocab, hidden_size, tokens = 32768, 1024, 2048
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=g).bfloat16().requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    loss = linear_cross_entropy(hidden, weight, target, torch.ones(tokens, device="cuda"), chunk=512).sum() / tokens
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - before
    assert grown < weight.numel() * weight.element_size() // 4, grown  # the copy was a whole weight-sized buffer
    ref_w = weight.detach().float().requires_grad_()
    ref = torch.nn.functional.cross_entropy(hidden.detach().float() @ ref_w.t(), target)
    ref.backward()
    assert (weight.grad.float() - ref_w.grad).abs().max().item() < 2e-2 * ref_w.grad.abs().max().item()
