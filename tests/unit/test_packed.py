"""Packed documents on one process: the varlen path equals per-document SDPA and the dense document mask; the batch
transformation's per-document CP split (by hand and by invariants); the ring's block schedule covers causality."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adapter.kernels.thd import document_attention_mask, document_lengths, local_multiple, pack_batch
from adapter.kernels.varlen import block_bwd, ring_tasks, varlen, varlen_attention

TOL = 1e-5
HQ, HK, D = 4, 2, 8


def _batch(docs, seed=0):
    s = sum(docs[0])
    seg = torch.cat([torch.repeat_interleave(torch.arange(len(d)), torch.tensor(d)) for d in docs]).view(len(docs), s)
    tokens = torch.arange(1, seg.numel() + 1).view(seg.shape)
    mask = (torch.rand(seg.shape, generator=torch.Generator().manual_seed(seed)) > 0.3).float()
    return {"tokens": tokens, "labels": tokens + 1000, "loss_mask": mask, "segment_ids": seg}


def _qkv(b, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, D, generator=g) for h in (HQ, HK, HK, HQ)]


def _grads(fn, *xs):
    xs = [x.clone().requires_grad_() for x in xs[:3]] + [xs[3]]
    out = fn(*xs[:3])
    out.backward(xs[3])
    return [out.detach()] + [x.grad for x in xs[:3]]


def test_varlen_equals_per_document_sdpa_and_the_dense_document_mask():
    docs = ([1, 3, 17, 2, 9], [32])
    full = _batch(docs)
    b, s = full["tokens"].shape
    q, k, v, dout = _qkv(b, s)
    stream, params = pack_batch(full)
    assert torch.equal(stream["tokens"][0], full["tokens"].flatten())  # cp=1: the batch itself, flattened

    def thd(q, k, v):
        return varlen_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), params.cu_local, params.max_local,
                                D ** -0.5).view(b, s, HQ, D)

    def per_doc(q, k, v):
        rows = []
        for i, lens in enumerate(docs):
            a = 0
            for n in lens:
                x = [t[i, a:a + n].transpose(0, 1)[None] for t in (q, k, v)]
                rows.append(F.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
                a += n
        return torch.cat(rows).view(b, s, HQ, D)

    def dense(q, k, v):
        mask = ~document_attention_mask(full["segment_ids"])
        x = [t.transpose(1, 2) for t in (q, k, v)]
        return F.scaled_dot_product_attention(*x, attn_mask=mask, enable_gqa=True).transpose(1, 2)

    got = _grads(thd, q, k, v, dout)
    for ref_fn in (per_doc, dense):
        ref = _grads(ref_fn, q, k, v, dout)
        assert max((a - r).abs().max().item() for a, r in zip(got, ref)) <= TOL
    causal = _grads(lambda q, k, v: F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                                   is_causal=True, enable_gqa=True).transpose(1, 2),
                    q, k, v, dout)
    assert (got[0] - causal[0]).abs().max() > 0.1  # negative control: documents do change the result


def test_bottom_right_causal_and_explicit_backward():
    """A query sequence shorter than its keys sees them all but its own future (FlashAttention's alignment); the
    explicit backward given out/lse equals autograd of the reference forward."""
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator().manual_seed(3)
    q, dout = torch.randn(5, HQ, D, generator=g), torch.randn(5, HQ, D, generator=g)
    k, v = torch.randn(12, HK, D, generator=g), torch.randn(12, HK, D, generator=g)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 4, 12], dtype=torch.int32)
    out = varlen(q, k, v, cu_q, cu_k, (3, 8), True, 0.3)
    with pytest.raises(RuntimeError, match="longest query sequence 3 exceeds the max given"):
        varlen(q, k, v, cu_q, cu_k, (2, 8), True, 0.3)  # FlashAttention would silently drop rows
    for (a, b), (c, e) in zip(((0, 2), (2, 5)), ((0, 4), (4, 12))):
        x = [q[a:b].transpose(0, 1)[None], *(t[c:e].transpose(0, 1)[None] for t in (k, v))]
        ref = F.scaled_dot_product_attention(*x, attn_mask=causal_lower_right(b - a, e - c), scale=0.3,
                                             enable_gqa=True)[0].transpose(0, 1)
        assert (out[a:b] - ref).abs().max() <= TOL

    from adapter.kernels.varlen import _ref_fwd

    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = _ref_fwd(qs, ks, vs, cu_q, cu_k, True, 0.3)
    o.backward(dout)
    mine = block_bwd(dout, q, k, v, o.detach(), lse.detach(), cu_q, cu_k, 3, 8, True, 0.3)
    assert max((a - b.grad).abs().max().item() for a, b in zip(mine, (qs, ks, vs))) <= TOL


def test_cp_split_by_hand():
    """Documents 5, 2, 9 | 16 tokens at cp=2: padded to 8, 4, 12, 16; chunks of 2, 1, 3, 4; rank 0 keeps chunks 0
    and 3 of each, laid out [early chunks | late chunks]; padding has token 0 and loss_mask 0."""
    full = _batch(([5, 2, 9], [16]))
    full["loss_mask"] = torch.ones(2, 16)
    out, p = pack_batch(full, cp_size=2, cp_rank=0)
    assert out["tokens"][0].tolist() == [1, 2, 6, 8, 9, 10, 17, 18, 19, 20] + [0, 0, 0, 0, 0, 0, 29, 30, 31, 32]
    assert out["loss_mask"][0].tolist() == [1.0] * 10 + [0.0] * 6 + [1.0] * 4
    assert out["position_ids"][0].tolist() == [0, 1, 0, 0, 1, 2, 0, 1, 2, 3] + [6, 7, 3, 9, 10, 11, 12, 13, 14, 15]
    assert p.cu_local.tolist() == [0, 2, 3, 6, 10] and p.max_local == 4
    assert p.cu_seqlens_q.tolist() == [0, 5, 7, 16, 32] and p.cu_seqlens_q_padded.tolist() == [0, 8, 12, 24, 40]
    # all-gather: rank 0's early chunks attend chunk 0; its late chunks chunks 0..3 (ranks 0, 1, 1, 0)
    assert p.ag_cu_k.tolist() == [0, 2, 3, 6, 10, 18, 22, 34, 50]
    assert p.ag_index[10:18].tolist() == [0, 1, 20, 21, 30, 31, 10, 11]  # document 0: chunk 0, 1, 2, 3


@pytest.mark.parametrize("cp,multiple", [(2, 1), (2, 4), (4, 2), (4, 8), (1, 8)])
def test_cp_split_invariants(cp, multiple):
    docs = ([1, 3, 17, 2, 9], [32], [4, 28])
    full = _batch(docs)
    parts = [pack_batch(full, cp_size=cp, cp_rank=r, multiple=multiple) for r in range(cp)]
    lens = {len(o["tokens"][0]) for o, _ in parts}
    assert len(lens) == 1 and lens.pop() % multiple == 0  # every rank the same, SP-divisible length
    seen = torch.cat([o["tokens"][0] for o, _ in parts])
    real = seen[seen > 0]
    assert sorted(real.tolist()) == full["tokens"].flatten().tolist()  # every token exactly once over the group
    total = sum(o["loss_mask"].sum() for o, _ in parts)
    assert total == full["loss_mask"].sum()  # the trained-token count is the full batch's
    pos = torch.cat([torch.arange(n) for d in docs for n in d])  # in-document position of every flat token
    for o, p in parts:
        t = o["tokens"][0]
        keep = t > 0
        assert torch.equal(o["position_ids"][0][keep], pos[t[keep] - 1])  # RoPE follows the document
        assert torch.equal(o["labels"][0][keep], t[keep] + 1000)
        assert (o["loss_mask"][0][~keep] == 0).all()
        assert int(p.positions.max()) < p.rope_len


def test_document_lengths_restart_at_every_sample():
    seg = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 2]])  # sample 2's first segment id repeats sample 1's last
    assert document_lengths(seg).tolist() == [2, 3, 4, 1]


def test_local_multiple():
    assert local_multiple(4096, 1, 2) == 2 and local_multiple(64, 2, 1) == 2 and local_multiple(64, 2, 4) == 4
    assert local_multiple(16384, 2, 1) == 64 and local_multiple(16384, 2, 8) == 64 and local_multiple(8192, 4, 1) == 2


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_ring_schedule_covers_each_causal_chunk_pair_once(cp):
    """Over the ring's steps, rank r's two chunks (r, 2cp−1−r) meet every earlier chunk of the document fully and
    their own diagonal causally, exactly once, and never a later chunk."""
    for r in range(cp):
        own = (r, 2 * cp - 1 - r)
        met = []
        for step in range(cp):
            j = (r - step) % cp
            held = (j, 2 * cp - 1 - j)
            met += [(own[hq], held[hk], causal) for hq, hk, causal in ring_tasks(step, r, cp)]
        want = [(qc, kc, qc == kc) for qc in own for kc in range(2 * cp) if kc <= qc]
        assert sorted(met) == sorted(want), (cp, r)


def test_synthetic_documents():
    """data.synthetic_doc_len: documents of about N tokens with the packer's masking rules; unset, the old stream."""
    import numpy as np

    from adapter.data import SyntheticData

    one = SyntheticData(1000, 64, 0)[5]
    assert not one["segment_ids"].any() and one["loss_mask"].all()
    assert np.array_equal(one["tokens"], np.random.default_rng([0, 5]).integers(0, 1000, 65)[:-1])  # unchanged
    docs = SyntheticData(1000, 64, 0, doc_len=8)[5]
    assert np.array_equal(docs["tokens"], one["tokens"])
    lens = document_lengths(torch.from_numpy(docs["segment_ids"])[None])
    assert len(lens) >= 64 // 12 and (lens[:-1] >= 4).all() and (lens[:-1] <= 12).all()
    ends = np.cumsum(lens.numpy())[:-1] - 1
    assert (docs["loss_mask"][ends] == 0).all() and docs["loss_mask"].sum() == 64 - len(ends)
    assert (docs["position_ids"][ends + 1] == 0).all()
