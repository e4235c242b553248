"""Causal attention over packed documents (THD / varlen), with and without context parallelism; no s×s mask on GPUs.

Block kernels share one contract: q [tq, hq, d], k/v [tk, hk, d], int32 cumulative sequence lengths cu_q / cu_k
(query sequence i attends key sequence i only) -> out [tq, hq, d] and the fp32 log-sum-exp [hq, tq]; the backward
takes the final (merged) out and lse of its query rows, which is what makes ring attention's partial blocks exact.
Causal masks are aligned bottom-right when a query sequence is shorter than its keys (FlashAttention's rule).
  * CUDA: torch's FlashAttention-2 varlen ops (`_flash_attention_forward/_backward`), GQA without repeating K/V,
    bf16/fp16 only.
  * CPU (tests, CI): the same maths in fp32 with a block-diagonal mask built from cu_seqlens; fine for small shapes.

Schemes, on the stream adapter/kernels/thd.py lays out (chunk lengths c_i; early half E = chunk r of every
document, late half L = chunk 2·cp−1−r):
  * cp = 1: one causal call over the document boundaries.
  * "all_gather": K|V all-gathered once (reduce-scattered in backward); each query chunk's causal key prefix is
    gathered into one stream (`ag_index`) and a single bottom-right causal call covers every chunk of every
    document.
  * "p2p": K|V blocks travel the ring; at each step the (E or L) × (E or L) pairs that are causally visible are
    separate varlen calls over the c_i, merged with their log-sum-exp; backward sends K/V gradients with them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from adapter.kernels import ring

HALF = (torch.bfloat16, torch.float16)


# ---- reference kernels (CPU) -----------------------------------------------------------------------------------
def _allowed(cu_q, cu_k, tq, tk, causal, window=-1):
    """[tq, tk] bool: same sequence and, if causal, key position ≤ query position + (len_k − len_q); with a
    window (≥ 0: FlashAttention's window_size_left), also key position ≥ that − window."""
    iq, ik = torch.arange(tq, device=cu_q.device), torch.arange(tk, device=cu_k.device)
    cu_q, cu_k = cu_q.long(), cu_k.long()
    sq = torch.searchsorted(cu_q[1:], iq, right=True)
    sk = torch.searchsorted(cu_k[1:], ik, right=True)
    ok = sq[:, None] == sk[None, :]
    if causal:
        shift = (cu_k[sq + 1] - cu_k[sq]) - (cu_q[sq + 1] - cu_q[sq])
        ok &= (ik - cu_k[sk])[None, :] <= (iq - cu_q[sq] + shift)[:, None]
        if window >= 0:
            ok &= (ik - cu_k[sk])[None, :] >= (iq - cu_q[sq] + shift - window)[:, None]
    return ok


def _check_max(cu, max_len, what):
    """FlashAttention sizes its grid by the longest sequence given: a stale or short one drops rows silently on a GPU,
    so the CPU kernel (where cu_seqlens are host values) refuses it."""
    longest = int((cu[1:] - cu[:-1]).max()) if len(cu) > 1 else 0
    if longest > max_len:
        raise RuntimeError(f"varlen attention: longest {what} sequence {longest} exceeds the max given ({max_len})")


def _ref_probs(q, k, cu_q, cu_k, causal, scale, lse=None, window=-1):
    rep = q.size(1) // k.size(1)
    kr = k.float().repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kr) * scale
    s = s.masked_fill(~_allowed(cu_q, cu_k, q.size(0), k.size(0), causal, window), float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, -1)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    return torch.exp(s - safe[..., None]), lse, kr, rep


def _ref_fwd(q, k, v, cu_q, cu_k, causal, scale, window=-1):
    p, lse, _, rep = _ref_probs(q, k, cu_q, cu_k, causal, scale, window=window)
    out = torch.einsum("hqk,khd->qhd", p, v.float().repeat_interleave(rep, 1))
    return out.to(q.dtype).contiguous(), lse.contiguous()


def _ref_bwd(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, window=-1):
    p, _, kr, rep = _ref_probs(q, k, cu_q, cu_k, causal, scale, lse, window)
    do, hk = dout.float(), k.size(1)
    dv = torch.einsum("hqk,qhd->khd", p, do)
    dp = torch.einsum("qhd,khd->hqk", do, v.float().repeat_interleave(rep, 1))
    ds = p * (dp - (do * out.float()).sum(-1).t()[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, kr) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, q.float()) * scale
    fold = lambda t: t.view(t.size(0), hk, rep, -1).sum(2)  # noqa: E731 - GQA: sum the query heads of a group
    return tuple(t.to(x.dtype).contiguous() for t, x in ((dq, q), (fold(dk), k), (fold(dv), v)))


def window_mask(sq: int, sk: int, window: int | None, device=None) -> torch.Tensor:
    """[sq, sk] bool, True = attend: causal with the query rows aligned bottom-right (query i sits at key position
    i + sk − sq), and with a window, only the window − 1 keys before each query and itself (HF's sliding mask)."""
    qpos = torch.arange(sq, device=device)[:, None] + (sk - sq)
    kpos = torch.arange(sk, device=device)[None, :]
    ok = kpos <= qpos
    return ok & (kpos > qpos - window) if window is not None else ok


def math_attention(q, k, v, scale, allowed, softcap=None, dropout_p=0.0):
    """Attention with the scores materialised, as transformers' eager path computes them: q [b, hq, sq, d], k/v
    [b, hk, sk, d], `allowed` a bool mask broadcastable to [b, hq, sq, sk]. For what no fused kernel here runs:
    Gemma 2's soft-capped scores (c·tanh(s/c), before the mask). Autograd does the backward."""
    rep = q.size(1) // k.size(1)
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout_p:
        p = F.dropout(p, dropout_p)
    return torch.matmul(p, v)


# ---- dispatch -----------------------------------------------------------------------------------------------------
def block_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=-1):
    """(out [tq, hq, d] in q's dtype, lse [hq, tq] fp32), both contiguous. `window` ≥ 0: each query also sees only
    that many keys before it (FlashAttention's window_size_left; −1: no window)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if not q.is_cuda or q.dtype not in HALF:  # FlashAttention is bf16/fp16 only: fp32 on a GPU runs the reference
        _check_max(cu_q, max_q, "query")      # (exact; its scores materialised, so slower and larger)
        _check_max(cu_k, max_k, "key")
        return _ref_fwd(q, k, v, cu_q, cu_k, causal, scale, window)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                           scale=scale, **_window_kw(window, causal))
    if lse.shape != (q.size(1), q.size(0)):  # the merges index it [heads, tokens] (torch 2.11-2.13 varlen layout)
        raise RuntimeError(f"unexpected varlen log-sum-exp shape {tuple(lse.shape)} for q {tuple(q.shape)}")
    return out, lse


def _window_kw(window: int, causal: bool) -> dict:
    return {} if window < 0 else {"window_size_left": window, "window_size_right": 0 if causal else -1}


def block_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window=-1):
    """(dq, dk, dv) of one block given the final out/lse of its query rows; contiguous."""
    dout, q, k, v, out = (t.contiguous() for t in (dout, q, k, v, out))
    if not q.is_cuda or q.dtype not in HALF:
        _check_max(cu_q, max_q, "query")
        _check_max(cu_k, max_k, "key")
        return _ref_bwd(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, window)
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # never read at dropout 0 (as torch's varlen_attn)
    unused = torch.empty(0, device=q.device)
    return torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal,
                                                    rng, unused, scale=scale, **_window_kw(window, causal))


# A custom op, so torch.compile keeps it as one graph node (no graph break inside Megatron's attention). The longest
# sequence lengths travel as a CPU tensor: as Python ints they would be guarded and recompile at every new value.
@torch.library.custom_op("nd_adapter::varlen_fwd", mutates_args=())
def _varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                max_qk: torch.Tensor, causal: bool, scale: float, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    max_q, max_k = max_qk.tolist()
    return block_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window)


@_varlen_fwd.register_fake
def _(q, k, v, cu_q, cu_k, max_qk, causal, scale, window):
    return q.new_empty(q.shape), q.new_empty((q.size(1), q.size(0)), dtype=torch.float32)


@torch.library.custom_op("nd_adapter::varlen_bwd", mutates_args=())
def _varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_qk: torch.Tensor, causal: bool,
                scale: float, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    max_q, max_k = max_qk.tolist()
    return tuple(block_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window))


@_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_q, cu_k, max_qk, causal, scale, window):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_qk, causal, scale, window = inputs
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k, max_qk)  # saved, not an attribute: a compiled backward
    ctx.causal, ctx.scale, ctx.window = causal, scale, window      # must see each batch's lengths, not the first's


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k, max_qk = ctx.saved_tensors
    dq, dk, dv = _varlen_bwd(dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_qk, ctx.causal, ctx.scale,
                             ctx.window)
    return dq, dk, dv, None, None, None, None, None, None


_varlen_fwd.register_autograd(_backward, setup_context=_setup)


def varlen(q, k, v, cu_q, cu_k, max_qk, causal, scale, window=None):
    """One varlen call with autograd: q [tq, hq, d], k/v [tk, hk, d] -> [tq, hq, d]. `max_qk`: the longest query
    and key sequence, as (int, int) or a CPU int64 tensor [2]. `window`: a query sees itself and window − 1 keys
    before it (HF's sliding window); None: all."""
    if not isinstance(max_qk, torch.Tensor):
        max_qk = torch.tensor(max_qk, dtype=torch.int64)
    return _varlen_fwd(q, k, v, cu_q, cu_k, max_qk, causal, scale, -1 if window is None else window - 1)[0]


def varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale, window=None):
    """Causal attention within each sequence of cu_seqlens (cp = 1)."""
    if not isinstance(max_seqlen, torch.Tensor):
        max_seqlen = (max_seqlen, max_seqlen)
    return varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, True, scale, window)


def softcapped_packed(q, k, v, cu, scale, softcap, window=None):
    """Causal attention within each document with soft-capped scores (Gemma 2), the scores materialised per
    document (no fused kernel here caps them); cp = 1. q [t, hq, d], k/v [t, hk, d] -> [t, hq, d]."""
    outs, bounds = [], cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            qd, kd, vd = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            outs.append(math_attention(qd, kd, vd, scale, window_mask(b - a, b - a, window, q.device),
                                       softcap)[0].transpose(0, 1))
    if bounds[-1] < q.size(0):  # rows past the last document: padding, no keys to see
        outs.append(torch.zeros_like(q[bounds[-1]:]))
    return torch.cat(outs)


# ---- context parallelism ------------------------------------------------------------------------------------------
def _all_gather(q, k, v, params, scale, group, window=None):
    kv = gather_from_sequence_parallel_region(torch.cat([k, v], -1), True, group=group)  # [cp·t, hk, 2d]
    ks, vs = kv.index_select(0, params.ag_index).split(k.size(-1), -1)
    return varlen(q, ks.contiguous(), vs.contiguous(), params.ag_cu_q, params.ag_cu_k, params.max_host, True, scale,
                  window)


E, L = 0, 1


def ring_tasks(step: int, r: int, cp: int) -> tuple[tuple[int, int, bool], ...]:
    """(query half, key half of the held block, causal) pairs that are visible at a ring step, for every document at
    once. The block held is rank j = r − step's: its early chunk j and late chunk 2·cp−1−j."""
    j = (r - step) % cp
    if step == 0:
        return (E, E, True), (L, E, False), (L, L, True)
    if j < r:  # chunk j precedes both local chunks; chunk 2cp−1−j follows both
        return (E, E, False), (L, E, False)
    return (L, E, False), (L, L, False)  # both of the block's chunks lie between the local ones


class _Ring(torch.autograd.Function):
    """q [2t, hq, d], k/v [2t, hk, d] in the [E | L] layout -> [2t, hq, d]."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_c, scale, group):
        cp, r, t, d = group.size(), group.rank(), q.size(0) // 2, k.size(-1)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.size(1), q.size(0), dtype=torch.float32, device=q.device)
        seen = [False, False]

        def visit(step, kv):
            for hq, hk, causal in ring_tasks(step, r, cp):
                rows = slice(hq * t, (hq + 1) * t)
                kb, vb = kv[hk * t:(hk + 1) * t].split(d, -1)
                o, l_b = block_fwd(q[rows], kb.contiguous(), vb.contiguous(), cu, cu, max_c, max_c, causal, scale)
                if not seen[hq]:
                    out[rows], lse[:, rows], seen[hq] = o.float(), l_b, True
                else:  # stable merge: out −= σ(l − lse)(out − o); lse −= logσ(lse − l)
                    l_r = lse[:, rows]
                    out[rows] -= torch.sigmoid(l_b - l_r).t().unsqueeze(-1) * (out[rows] - o.float())
                    lse[:, rows] = l_r - F.logsigmoid(l_r - l_b)

        ring.forward(torch.cat([k, v], -1).contiguous(), group, visit)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, cu)
        ctx.max_c, ctx.scale, ctx.group = max_c, scale, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu = ctx.saved_tensors
        group, scale, max_c = ctx.group, ctx.scale, ctx.max_c
        cp, r, t, d = group.size(), group.rank(), q.size(0) // 2, k.size(-1)
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)

        def block_grads(step, kv):
            grads = []
            for hq, hk, causal in ring_tasks(step, r, cp):
                rows, keys = slice(hq * t, (hq + 1) * t), slice(hk * t, (hk + 1) * t)
                kb, vb = kv[keys].split(d, -1)
                g = block_bwd(dout[rows], q[rows], kb.contiguous(), vb.contiguous(), out[rows],
                              lse[:, rows].contiguous(), cu, cu, max_c, max_c, causal, scale)
                dq[rows] += g[0].float()
                grads.append((keys, torch.cat([g[1], g[2]], -1)))
            return grads

        dk, dv = ring.backward(torch.cat([k, v], -1).contiguous(), group, block_grads).split(d, -1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def packed_attention(q, k, v, params, *, scale, group=None, comm="all_gather", window=None, softcap=None):
    """This rank's packed stream: q [t, hq, d], k/v [t, hk, d] -> [t, hq, d], causal within each document.

    `params`: adapter.kernels.thd.PackedDocs for this rank (its cp_size must match `group`). `window`: a sliding
    window (every scheme but the ring); `softcap`: soft-capped scores (cp = 1; SDPAttention refuses the rest)."""
    if softcap is not None and params.kv_index is None:
        if params.cp_size > 1:
            raise ValueError("soft-capped packed attention runs at cp = 1 only")
        return softcapped_packed(q, k, v, params.cu_local, scale, softcap, window)
    if params.kv_index is not None:  # shared prompts (thd.pairs_to_shared_stream): each query sequence's keys
        if softcap is not None or params.cp_size > 1:  # gathered, aligned bottom-right
            raise ValueError("packed pairs with a shared prompt run at cp = 1 without soft-capping")
        ks, vs = (t.index_select(0, params.kv_index) for t in (k, v))
        return varlen(q, ks, vs, params.cu_local, params.kv_cu, params.max_host, True, scale, window)
    if params.cp_size == 1:
        return varlen_attention(q, k, v, params.cu_local, params.max_host, scale, window)
    return _cp_attention(q, k, v, params, scale, group, comm, window)


@torch.compiler.disable  # collectives and ring sends: a graph break (torch.compile stays correct, fuses less)
def _cp_attention(q, k, v, params, scale, group, comm, window=None):
    if group is None or group.size() != params.cp_size:
        raise ValueError(f"packed batch split for cp={params.cp_size} but the attention's CP group has "
                         f"{group.size() if group is not None else 1} ranks")
    if comm == "all_gather":
        return _all_gather(q, k, v, params, scale, group, window)
    if window is not None:
        raise ValueError("a sliding window on the packed ring (cp_comm_type p2p) is not built")
    return _Ring.apply(q, k, v, params.cu_local, params.max_local, scale, group)


__all__ = ["window_mask", "math_attention", "softcapped_packed", "packed_attention", "varlen_attention", "varlen",
           "block_fwd", "block_bwd", "ring_tasks"]
