"""Core attention for Megatron-Core's layer spec: torch SDPA, with context parallelism, without TransformerEngine.

Megatron's local `DotProductAttention` materialises the S×S scores (≈3× slower and ≈4× the memory of SDPA on H200,
docs/internals.md) and refuses CP; TransformerEngine is not installed on our hosts. `SDPAttention` keeps the
DotProductAttention constructor/forward contract so a ModuleSpec can swap it in, and is the default for every run.

Context parallelism follows Megatron's load-balanced layout: the sequence is cut into 2·cp chunks and CP rank r holds
chunks r and 2·cp−1−r (`split_for_cp`), so every rank does the same causal work. Two schemes (`cp_comm_type`):
  * "all_gather": K|V are all-gathered once (reduce-scattered in backward, Megatron's autograd op); each local query
    chunk attends its causal prefix with torch SDPA and a lower-right causal mask. Simple; K/V of the whole sequence
    live on every rank for the layer's duration.
  * "p2p": K|V blocks travel around the ring, overlapped with compute, merged with log-sum-exp; backward sends the
    K/V gradients around the ring with them (as in ring-flash-attention). Memory per rank stays O(S/cp).
    CPU only for now (see _block_fwd); refused on GPUs at model construction.

Packed documents (`packed_seq_params`, built by adapter/kernels/thd.py) take their own path: varlen attention
within each document, both CP schemes included (adapter/kernels/varlen.py).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch.nn.attention.bias import causal_lower_right

from adapter.errors import bad
from adapter.kernels import ring
from adapter.kernels.thd import PackedDocs
from adapter.kernels.varlen import math_attention, packed_attention, varlen, varlen_attention, window_mask

CP_COMM_TYPES = ("all_gather", "p2p")
# Accelerate/torch names (`cp_comm_strategy`, torch's set_rotate_method). torch's "alltoall" rotates whole K/V
# shards to the next rank, i.e. a ring: same semantics as Megatron's "p2p". Megatron's "a2a" (Ulysses) is not here.
_ALIASES = {"allgather": "all_gather", "alltoall": "p2p"}
_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def normalize_cp_comm_type(name: str | None) -> str:
    """Megatron name for a CP communication scheme; None means "all_gather"."""
    name = _ALIASES.get(name, name) if name is not None else "all_gather"
    if name not in CP_COMM_TYPES:
        raise bad("cp_comm_type", name, "unsupported context-parallel communication scheme",
                  "use 'all_gather' (Accelerate 'allgather') or 'p2p' (Accelerate 'alltoall', a KV ring)")
    return name


def split_for_cp(tensor: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """This CP rank's part of a full-sequence tensor: chunks r and 2·cp−1−r of 2·cp.

    Same split as Megatron's get_batch_on_this_cp_rank; apply it to input_ids, labels and loss_mask."""
    if cp_size == 1:
        return tensor
    s = tensor.shape[seq_dim]
    if s % (2 * cp_size):
        raise bad("seq_length", s, f"not divisible by 2 × context_parallel_size = {2 * cp_size}",
                  f"pad sequences to a multiple of {2 * cp_size} (and of tp when sequence_parallel is on)")
    chunks = tensor.view(*tensor.shape[:seq_dim], 2 * cp_size, s // (2 * cp_size), *tensor.shape[seq_dim + 1:])
    idx = torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank], device=tensor.device)
    chunks = chunks.index_select(seq_dim, idx)
    return chunks.reshape(*tensor.shape[:seq_dim], -1, *tensor.shape[seq_dim + 1:])


class _WholeFromCP(torch.autograd.Function):
    """[b, s/cp] slices (split_for_cp's) of every CP rank -> [b, s] in sequence order. Backward: this rank's own
    chunks of the incoming gradient, no communication: what follows runs the same on every CP rank (a pair's
    log-probability, its loss), so each rank's gradient is already the whole one and its slice is its share."""

    @staticmethod
    def forward(ctx, local, group, cp_size, cp_rank):
        ctx.cp = (cp_size, cp_rank)
        parts = [torch.empty_like(local) for _ in range(cp_size)]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        half = local.shape[1] // 2
        chunks = [None] * (2 * cp_size)
        for r, part in enumerate(parts):
            chunks[r], chunks[2 * cp_size - 1 - r] = part[:, :half], part[:, half:]
        return torch.cat(chunks, 1)

    @staticmethod
    def backward(ctx, grad):
        cp_size, cp_rank = ctx.cp
        return split_for_cp(grad, cp_size, cp_rank), None, None, None


def whole_from_cp(local: torch.Tensor, group, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The inverse of split_for_cp over the CP group, with the gradient of a computation every CP rank repeats
    (preference objectives' per-sequence sums: adapter/train/dpo.py)."""
    return _WholeFromCP.apply(local, group, cp_size, cp_rank)


def sum_over_cp(partial: torch.Tensor, group) -> torch.Tensor:
    """Σ over the CP group of tensors each rank filled at its own tokens (0 elsewhere), with the gradient of a
    computation every CP rank repeats on the sum: each rank's own entries get the sum's gradient as it is (no
    reduction: every rank computed the same one)."""
    return _SumOverCP.apply(partial, group)


class _SumOverCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, group):
        out = partial.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _sdpa(q, k, v, **kw):
    """SDPA with GQA: torch's native K/V head broadcast where available, else expanded K/V."""
    if q.size(1) == k.size(1):
        return F.scaled_dot_product_attention(q, k, v, **kw)
    if _HAS_GQA:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    rep = q.size(1) // k.size(1)
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), **kw)


def local_attention(q, k, v, *, scale, window=None, softcap=None, dropout_p=0.0, mask=None, causal=True):
    """One rank's whole sequences (cp = 1, no packing): [b, h, s, d] q and [b, hk, s, d] k/v -> [b, h, s, d], as
    both engines run them. Plain causal attention is SDPA's (flash); a sliding `window` shorter than the sequence
    runs FlashAttention's windowed kernel on a GPU (each sample one sequence of a varlen call), where SDPA would
    take a materialised mask and leave flash (transformers' own sdpa path does that); soft-capped scores are
    materialised (math_attention). `mask`: True = attend, beside or instead of `causal`."""
    window = window if window is not None and window < k.size(2) else None
    if window is None and softcap is None:
        return _sdpa(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, dropout_p=dropout_p)
    if not causal and mask is None:
        raise bad("attention_mask", "none (not causal)", "sliding windows are causal here", "use causal masks")
    allowed = window_mask(q.size(2), k.size(2), window, q.device) if causal else mask
    if causal and mask is not None:
        allowed = allowed & mask
    if softcap is not None:
        return math_attention(q, k, v, scale, allowed, softcap, dropout_p)
    if q.is_cuda and mask is None and not dropout_p and q.dtype in (torch.bfloat16, torch.float16):
        b, s = q.size(0), q.size(2)
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)
        flat = [t.transpose(1, 2).reshape(b * s, t.size(1), t.size(3)) for t in (q, k, v)]
        out = varlen(*flat, cu, cu, (s, s), True, scale, window)
        return out.view(b, s, *out.shape[1:]).transpose(1, 2)
    return _sdpa(q, k, v, attn_mask=allowed, scale=scale, dropout_p=dropout_p)


def _all_gather_attention(q, k, v, scale, group, dropout_p, window=None):
    """q/k/v: [s_local, b, heads, d] (Megatron layout). Returns [b, heads, s_local, d]."""
    cp, r = group.size(), group.rank()
    c, d = q.size(0) // 2, k.size(-1)
    kv = gather_from_sequence_parallel_region(torch.cat([k, v], -1), True, group=group)  # rank order
    kv = kv.view(cp, 2, c, *kv.shape[1:])
    kv = torch.cat([kv[:, 0].flatten(0, 1), kv[:, 1].flip(0).flatten(0, 1)])  # chunk order 0 .. 2cp-1
    k_all, v_all = kv.permute(1, 2, 0, 3).split(d, dim=-1)
    q = q.permute(1, 2, 0, 3)
    outs = []
    for i, chunk in enumerate((r, 2 * cp - 1 - r)):
        n = (chunk + 1) * c  # causal prefix of this query chunk
        first = 0 if window is None else max(0, chunk * c - window + 1)  # keys before it are outside every window
        mask = causal_lower_right(c, n - first) if window is None else window_mask(c, n - first, window, q.device)
        outs.append(_sdpa(q[:, :, i * c:(i + 1) * c], k_all[:, :, first:n], v_all[:, :, first:n],
                          attn_mask=mask, scale=scale, dropout_p=dropout_p))
    return torch.cat(outs, dim=2)


# ---- ring (p2p): block kernels that also return the log-sum-exp, and their exact backward given the global out/lse.
# CUDA: torch's FlashAttention-2 ops (native GQA, so K/V travel with their own head count; bf16/fp16 only). Their
# backward takes "undefined" cum_seq/rng tensors for dense batches, which Python passes as None. (The efficient-
# attention ops were tried first and hit an illegal memory access in backward from 8k local tokens on H200.)
# CPU: torch's flash-for-CPU ops, which want equal head counts.
def _block_fwd(q, k, v, causal, scale):
    """[b, h, s, d] blocks -> (out [b, h, sq, d], lse [b, h, sq] fp32)."""
    if q.is_cuda:
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, q.size(2), k.size(2), 0.0, causal,
            False, scale=scale)
        return out.transpose(1, 2), lse
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _block_bwd(dout, q, k, v, out, lse, causal, scale):
    """dq, dk, dv of one block, given the merged (global) out and lse of its query rows."""
    if q.is_cuda:
        t = [x.transpose(1, 2) for x in (dout, q, k, v, out)]
        grads = torch.ops.aten._flash_attention_backward(*t, lse, None, None, q.size(2), k.size(2), 0.0, causal,
                                                         None, None, scale=scale)
        return [g.transpose(1, 2) for g in grads]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _ring_step(step, r, cp, c):
    """Which rows/keys a ring step touches: (query rows, key slice, causal). Load-balanced chunk layout."""
    j = (r - step) % cp  # owner of the K/V block held at this step
    if step == 0:
        return slice(None), slice(None), True  # own chunks: plain causal over the local 2c tokens
    if j < r:
        return slice(None), slice(0, c), False  # block's early chunk precedes both local chunks; its late one neither
    return slice(c, None), slice(None), False  # only the local late chunk sees the block, and all of it


class _RingAttention(torch.autograd.Function):
    """q/k/v: [b, heads, 2c, d] with equal head counts. Output [b, heads, 2c, d]."""

    @staticmethod
    def forward(ctx, q, k, v, scale, group):
        cp, r, c = group.size(), group.rank(), q.size(2) // 2
        acc = {}  # "out", "lse": fp32, merged block by block

        def visit(step, kv):
            rows, keys, causal = _ring_step(step, r, cp, c)
            kb, vb = kv[:, :, keys].split(k.size(-1), -1)
            o, lse_b = _block_fwd(q[:, :, rows].contiguous(), kb.contiguous(), vb.contiguous(), causal, scale)
            o, lse_b = o.float(), lse_b.float()
            if not acc:  # step 0 covers every row
                acc["out"], acc["lse"] = o, lse_b
                return
            out, lse = acc["out"], acc["lse"]  # stable merge (ring-flash-attention #34):
            lse_r = lse[:, :, rows]            # out -= σ(l − lse)(out − o); lse −= logσ(lse − l)
            out[:, :, rows] -= torch.sigmoid(lse_b - lse_r).unsqueeze(-1) * (out[:, :, rows] - o)
            lse[:, :, rows] = lse_r - F.logsigmoid(lse_r - lse_b)

        ring.forward(torch.cat([k, v], -1).contiguous(), group, visit)
        out, lse = acc["out"].to(q.dtype), acc["lse"]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.group = scale, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, r, c, d = group.size(), group.rank(), q.size(2) // 2, k.size(-1)
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)

        def block_grads(step, kv):
            rows, keys, causal = _ring_step(step, r, cp, c)
            kb, vb = kv[:, :, keys].split(d, -1)
            g = _block_bwd(*(t.contiguous() for t in (dout[:, :, rows], q[:, :, rows], kb, vb, out[:, :, rows],
                                                      lse[:, :, rows])), causal, scale)
            dq[:, :, rows] += g[0].float()
            return [((slice(None), slice(None), keys), torch.cat([g[1], g[2]], -1))]

        dk, dv = ring.backward(torch.cat([k, v], -1).contiguous(), group, block_grads).split(d, -1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _p2p_dtype_error(dtype):
    return bad("precision", str(dtype).removeprefix("torch."),
               "the GPU ring (cp_comm_type='p2p') runs FlashAttention kernels, which take bf16/fp16 only",
               "train in bf16, or use cp_comm_type='all_gather'")


def _p2p_attention(q, k, v, scale, group):
    """q/k/v: [s_local, b, heads, d]. Returns [b, heads, s_local, d]."""
    if q.is_cuda and q.dtype not in (torch.bfloat16, torch.float16):
        raise _p2p_dtype_error(q.dtype)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    if not q.is_cuda and k.size(1) != q.size(1):  # the CPU block kernels want equal head counts
        rep = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), scale, group)


def context_parallel_attention(q, k, v, *, scale, group, comm="all_gather", dropout_p=0.0, window=None):
    """Causal attention over a CP-split sequence: q [s_local, b, np, d], k/v [s_local, b, ng, d]
    -> [b, np, s_local, d]. A sliding `window` runs with "all_gather" only (SDPAttention refuses the ring)."""
    if comm == "all_gather":
        return _all_gather_attention(q, k, v, scale, group, dropout_p, window)
    if dropout_p:
        raise bad("attention_dropout", dropout_p, "not supported with cp_comm_type='p2p'",
                  "set attention_dropout to 0 or use cp_comm_type='all_gather'")
    return _p2p_attention(q, k, v, scale, group)


class SDPAttention(MegatronModule):
    """Drop-in for Megatron's DotProductAttention (same constructor and forward signature)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, window=None, softcap=None):
        """`window`: this layer's sliding window (a query sees itself and window − 1 keys before it), None: all;
        `softcap`: scores soft-capped to c·tanh(s/c) (Gemma 2). Both come from the layer spec
        (adapter/modeling/gpt.py layer_spec), per layer."""
        super().__init__(config=config)
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise NotImplementedError("SDPAttention supports vanilla softmax; windows come from its layer spec")
        self.window, self.softcap = window, softcap
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group = getattr(pg_collection, "cp", None)
        self.cp_size = self.cp_group.size() if self.cp_group is not None else 1
        self.cp_comm_type = normalize_cp_comm_type(cp_comm_type)
        if (self.cp_size > 1 and self.cp_comm_type == "p2p" and torch.cuda.is_available()
                and config.params_dtype not in (torch.bfloat16, torch.float16)):
            raise _p2p_dtype_error(config.params_dtype)  # fail at build time, not at the first step
        if self.cp_size > 1 and (softcap is not None or (window is not None and self.cp_comm_type == "p2p")):
            what = "attention soft-capping" if softcap is not None else "a sliding window with cp_comm_type p2p"
            raise bad("context_parallel_size", self.cp_size, f"{what} under context parallelism is not built",
                      "use context_parallel_size: 1" if softcap is not None else "use cp_comm_type: all_gather")
        self.attn_mask_type = attn_mask_type
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """[sq, b, np, hn] q and [sk, b, ng, hn] k/v -> [sq, b, np·hn]. `attention_mask`: True = masked (Megatron)."""
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by SDPAttention")
        if value.requires_grad and not value.is_contiguous():
            # Megatron splits V out of the fused QKV projection's output as a view; saved for the attention's
            # backward, that view would keep the whole [s, b, (q + k + v) width] buffer alive in every layer (q and k
            # are new tensors after RoPE or their norms). Its own copy frees the rest: on the 1B shape, seq 4096 x 2,
            # 40 MiB a layer, 0.63 GiB of the step's peak (one H100, docs/BENCHMARKS.md), for an 8 MiB copy.
            value = value.contiguous()
        p = self.dropout_p if self.training else 0.0
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if p and not self.config.sequence_parallel \
            else contextlib.nullcontext()
        with rng:
            if packed_seq_params is not None:
                out = self._packed(query, key, value, packed_seq_params, p)
                return out.reshape(*out.shape[:-2], -1)
            if self.cp_size > 1:
                if attention_mask is not None:
                    raise bad("attention_mask", "given", "explicit masks are not supported with context parallelism",
                              "drop the mask (causal is implied) or run with context_parallel_size=1")
                out = context_parallel_attention(query, key, value, scale=self.scale, group=self.cp_group,
                                                 comm=self.cp_comm_type, dropout_p=p, window=self.window)
            else:
                q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
                mask_type = attn_mask_type or self.attn_mask_type
                causal = attention_mask is None and mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
                mask = None if attention_mask is None else ~attention_mask
                out = local_attention(q, k, v, scale=self.scale, window=self.window, softcap=self.softcap,
                                      dropout_p=p, mask=mask, causal=causal)
        return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)

    def _packed(self, q, k, v, params, p):
        """Packed documents (adapter/kernels/varlen.py): our PackedDocs ([t, 1, heads, d], any cp) or Megatron's own
        THD PackedSeqParams ([t, heads, d], cp = 1). Returns q's shape."""
        if p:
            raise bad("attention_dropout", p, "not supported with packed documents", "set attention_dropout to 0")
        if isinstance(params, PackedDocs):
            out = packed_attention(q.squeeze(1), k.squeeze(1), v.squeeze(1), params, scale=self.scale,
                                   group=self.cp_group if self.cp_size > 1 else None, comm=self.cp_comm_type,
                                   window=self.window, softcap=self.softcap)
            return out.unsqueeze(1)
        if self.window is not None or self.softcap is not None:
            raise bad("packed sequences", "Megatron THD format", "sliding windows and soft-capping run on "
                      "nd-adapter's packed batches", "pack with adapter.kernels.thd.pack_batch (data.document_mask)")
        if self.cp_size > 1:
            raise bad("packed sequences", "Megatron THD format", "not split for context parallelism here",
                      "pack batches with adapter.kernels.thd.pack_batch (data.document_mask: true)")
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        max_len = params.max_seqlen_q or int((cu[1:] - cu[:-1]).max())
        return varlen_attention(q, k, v, cu.to(torch.int32), max_len, self.scale)


__all__ = ["SDPAttention", "local_attention", "split_for_cp", "whole_from_cp", "sum_over_cp",
           "context_parallel_attention", "normalize_cp_comm_type", "CP_COMM_TYPES"]
