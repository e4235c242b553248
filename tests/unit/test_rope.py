"""The fused RoPE given cos/sin tables (`rope_tables`, what the model passes its layers) equals it given angles:
the same values and gradients, bit for bit (fp32 tables, one rounding to the input's dtype either way)."""
from __future__ import annotations

import torch

from adapter.kernels.fusions import fused_rope, rope_tables


def test_tables_equal_angles():
    g = torch.Generator().manual_seed(0)
    inv = 1.0 / (500000.0 ** (torch.arange(0, 12, 2).float() / 12))  # rot 12 of head_dim 16: a pass-through tail
    f = torch.outer(torch.arange(7).float(), inv)
    freqs = torch.cat([f, f], -1)[:, None, None, :]
    tables = rope_tables(freqs)
    assert tables.shape == (7, 2, 1, 12)
    outs = []
    for table in (freqs, tables):
        t = torch.randn(7, 3, 4, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).requires_grad_()
        out = fused_rope(t, table)
        (out.float() * torch.randn(out.shape, generator=g.manual_seed(2))).sum().backward()
        outs.append((out, t.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    x = t.detach()
    assert torch.equal(outs[1][0][0], x[0]) and torch.equal(outs[1][0][..., 12:], x[..., 12:])  # angle 0; the tail
    assert not torch.allclose(outs[1][0][1:, ..., :12].float(), x[1:, ..., :12].float())         # rotated
