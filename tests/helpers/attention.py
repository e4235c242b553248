"""Attention inputs and references shared by the CPU (gloo) and GPU tests of context parallelism and packed
documents: q/k/v and an output gradient, full-sequence SDPA at cp = 1, one CP rank's error against it, and a packed
batch."""
from __future__ import annotations

import torch

S, B, NP, NG, D = 32, 2, 4, 2, 8  # GQA: 2 query heads per K/V head


def qkv_dout(s=S, b=B, np_=NP, ng=NG, d=D, seed=0):
    """q, k, v [s, b, heads, d] and an output gradient [b, np_, s, d], seeded."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, b, n, d, generator=g) for n in (np_, ng, ng))
    return q, k, v, torch.randn(b, np_, s, d, generator=g)


def sdpa_reference(q, k, v, dout):
    """Full-sequence causal attention (cp=1, SDPA with expanded K/V) and its input gradients."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    rep = q.size(2) // k.size(2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.repeat_interleave(rep, 2).permute(1, 2, 0, 3),
        v.repeat_interleave(rep, 2).permute(1, 2, 0, 3), is_causal=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def cp_diffs(rank, cp, comm, group, dtype=torch.float32, device="cpu", **shape):
    """Max |Δ| of this rank's output and q/k/v grads against the split cp=1 fp32 reference; plus a negative control."""
    from adapter.kernels.attention import context_parallel_attention, split_for_cp

    q, k, v, dout = (t.to(device) for t in qkv_dout(**shape))
    ref_out, *ref_grads = sdpa_reference(q, k, v, dout)
    local = [split_for_cp(t, cp, rank, 0).to(dtype).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, scale=q.size(-1) ** -0.5, group=group, comm=comm)
    out.backward(split_for_cp(dout, cp, rank, 2).to(dtype))
    diffs = [(out - split_for_cp(ref_out, cp, rank, 2)).abs().max().item()]
    diffs += [(t.grad - split_for_cp(g, cp, rank, 0)).abs().max().item() for t, g in zip(local, ref_grads)]
    wrong_order = (out - ref_out.chunk(2 * cp, 2)[rank].repeat(1, 1, 2, 1)).abs().max().item()
    return max(diffs), wrong_order


def packed_batch(docs, seed=0):
    """A [b, s] packed batch of documents of the lengths in `docs` (one list a row, each summing to s); token ids
    1.. number the flat positions (0 marks padding in a packed stream)."""
    b, s = len(docs), sum(docs[0])
    seg = torch.cat([torch.repeat_interleave(torch.arange(len(d)), torch.tensor(d)) for d in docs]).view(b, s)
    tokens = torch.arange(1, b * s + 1).view(b, s)
    mask = torch.rand(b, s, generator=torch.Generator().manual_seed(seed)) > 0.2
    return {"tokens": tokens, "labels": tokens.roll(-1), "loss_mask": mask.float(), "segment_ids": seg,
            "position_ids": torch.zeros(b, s, dtype=torch.long)}
