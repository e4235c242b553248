"""Packed documents -> this rank's THD stream and the attention parameters for it (a pure, host-side function).

Why one stream: a `[b, s]` micro-batch is flattened into one token stream with boundaries over every document of
every sample (`cu_seqlens`), so attention runs per document through varlen kernels (adapter/kernels/varlen.py),
whatever the batch size, and no s×s mask exists anywhere.

Context parallelism splits each document, not the sequence: document i is padded to a multiple of 2·cp and cut
into 2·cp chunks of c_i tokens, and CP rank r keeps chunks r and 2·cp−1−r of every document (Megatron's load
balance, per document). The rank's stream is laid out as [chunk r of every document | chunk 2·cp−1−r of every
document], so each block the all-gather and ring schemes need is one contiguous varlen call over the c_i.
The padding (each document's tail, plus one all-padding document that rounds the local length to `multiple`) has
loss_mask 0 and comes after its document's real tokens, so causal attention never lets a real token see it; the
loop's trained-token count stays that of the full batch. RoPE angles follow each token's position inside its
document (`positions`), so the chunks a rank holds rotate as they would in the whole document.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from megatron.core.packed_seq_params import PackedSeqParams

# per-token keys carried into the stream when the batch has them (position_ids are recomputed); the stream's own
# padding is 0 in each, so attention_mask (SFT's real tokens) marks it as padding too
KEYS = ("tokens", "labels", "loss_mask", "attention_mask")


@dataclass
class PackedDocs(PackedSeqParams):
    """Megatron's PackedSeqParams (its fields keep their meaning: global cu_seqlens of the real and the padded
    documents, max padded length) plus what this rank's attention and RoPE need. Tensors are [1, T]-stream
    tensors; `qkv_format="sbhd"` because q/k/v reach the core attention as [T, 1, heads, d]."""

    positions: torch.Tensor = None   # [T] int64: each local token's position inside its padded document
    rope_len: int = None             # RoPE table rows (> every position; one value per run, so it caches)
    longest: int = None              # the longest real document: max(position) + 1 (LongRoPE's switch)
    cu_local: torch.Tensor = None    # int32: cp=1 document boundaries of the stream; cp>1 cumulative c_i
    max_local: int = None            # longest sequence in cu_local
    cp_size: int = 1
    cp_rank: int = 0
    ag_index: torch.Tensor = None    # all-gather scheme: rows of the gathered K|V forming each query's key prefix
    ag_cu_q: torch.Tensor = None     # int32 [2n+1]: the stream as 2n query sequences (early chunks, late chunks)
    ag_cu_k: torch.Tensor = None     # int32 [2n+1]: their key prefixes in the ag_index stream
    ag_max_k: int = None
    kv_index: torch.Tensor = None    # cp=1, shared prompts (pairs_to_shared_stream): rows of K|V forming each query
    kv_cu: torch.Tensor = None       # sequence's keys, and int32 boundaries of those key sequences
    max_host: torch.Tensor = None    # CPU int64 [2]: longest query and key sequence of the attention call (stays on
                                     # the host: the kernels take ints, and torch.compile guards no tensor values)

    def __post_init__(self):
        if self.max_host is None and self.max_local is not None:
            self.max_host = torch.tensor([self.max_local, self.ag_max_k or self.max_local])

    def to(self, device, non_blocking: bool = True) -> PackedDocs:
        """On `device`; the cu_seqlens are marked dynamic, so a compiled graph serves every document count."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, v in moved.items():
            if isinstance(v, torch.Tensor) and k != "max_host":
                moved[k] = v.to(device, non_blocking=non_blocking)
                if v.dtype == torch.int32:
                    torch._dynamo.maybe_mark_dynamic(moved[k], 0)
        return PackedDocs(**moved)


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """cat(arange(s, s + n) for s, n in zip(starts, lengths)), vectorised."""
    before = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - before, lengths) + torch.arange(int(lengths.sum()))


def _cu(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)


def local_multiple(seq_len: int, cp: int, sp_tp: int = 1) -> int:
    """What the local stream length is rounded up to: divisible by tp under sequence parallelism, even under CP (for
    the split of the padding document), and, for long sequences under CP, by 64 so per-document padding gives only
    a few distinct lengths (the fused RoPE and compiled layers see static shapes, recompiling once per length)."""
    if cp == 1:
        return sp_tp
    return math.lcm(2, sp_tp, 64 if seq_len // cp >= 4096 else 1)


def document_lengths(segment_ids: torch.Tensor) -> torch.Tensor:
    """Lengths of the documents of the flattened [b, s] batch: a new one at every segment change and sample start."""
    b, s = segment_ids.shape
    new = torch.ones(b, s, dtype=torch.bool)
    new[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    starts = new.flatten().nonzero().flatten()
    return torch.diff(torch.cat([starts, starts.new_tensor([b * s])]))


def cu_seqlens(segment_ids: torch.Tensor) -> torch.Tensor:
    """int32 cumulative document lengths over the flattened [b·s] batch (the THD / varlen-attention format)."""
    return _cu(document_lengths(segment_ids))


def document_attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool, True = masked (Megatron's convention): causal and within one document. The dense reference
    for what the varlen kernels compute (tests, benches); training never builds it."""
    s = segment_ids.shape[-1]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=segment_ids.device), 1)
    return (causal | (segment_ids[:, :, None] != segment_ids[:, None, :]))[:, None]


def pack_batch(batch: dict[str, torch.Tensor], *, cp_size: int = 1, cp_rank: int = 0,
               multiple: int = 1, carry: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], PackedDocs]:
    """The FULL micro-batch ([b, s] tensors on the host: tokens, labels, loss_mask, segment_ids) -> this CP rank's
    [1, T] tokens / labels / loss_mask / position_ids and its PackedDocs. Same result on every rank of a CP group
    but for its own chunks; the trained tokens over the group are exactly the batch's. `carry`: more per-token keys
    laid out alike (0 on the stream's padding)."""
    seg = batch["segment_ids"].cpu()
    b, s = seg.shape
    flat = {k: batch[k].cpu().reshape(-1) for k in (*KEYS, *carry) if k in batch}
    lens = document_lengths(seg)
    starts = torch.cumsum(lens, 0) - lens
    g = 2 * cp_size if cp_size > 1 else 1
    padded = (lens + g - 1) // g * g
    m = math.lcm(multiple, 2) if cp_size > 1 else multiple
    extra = -int(padded.sum()) // cp_size % m  # local tokens short of a multiple of m: one padding document
    if extra:
        lens, starts = torch.cat([lens, lens.new_zeros(1)]), torch.cat([starts, starts.new_zeros(1)])
        padded = torch.cat([padded, padded.new_tensor([extra * cp_size])])
    n = len(lens)
    docs = torch.arange(n)
    if cp_size == 1:
        owner = torch.repeat_interleave(docs, padded)
        pos = _ranges(torch.zeros_like(padded), padded)
        cu_local, max_local = _cu(padded), int(padded.max())
    else:
        c = padded // g
        owner = torch.cat([torch.repeat_interleave(docs, c)] * 2)
        chunk = torch.cat([torch.full((int(c.sum()),), cp_rank), torch.full((int(c.sum()),), g - 1 - cp_rank)])
        pos = chunk * c[owner] + torch.cat([_ranges(torch.zeros_like(c), c)] * 2)
        cu_local, max_local = _cu(c), int(c.max())
    real = pos < lens[owner]
    src = torch.where(real, starts[owner] + pos, 0)
    out = {k: torch.where(real, v[src], torch.zeros((), dtype=v.dtype))[None] for k, v in flat.items()}
    out["position_ids"] = pos[None]
    rope_len = max(-(-s // g) * g, int(padded.max()))
    params = PackedDocs(qkv_format="sbhd", cu_seqlens_q=_cu(lens), cu_seqlens_kv=_cu(lens),
                        cu_seqlens_q_padded=_cu(padded), cu_seqlens_kv_padded=_cu(padded),
                        max_seqlen_q=int(padded.max()), max_seqlen_kv=int(padded.max()), positions=pos,
                        rope_len=rope_len, longest=int(lens.max()),
                        cu_local=cu_local, max_local=max_local, cp_size=cp_size, cp_rank=cp_rank)
    if cp_size > 1:
        _all_gather_plan(params, c, cp_size, cp_rank)
        params.max_host = torch.tensor([max_local, params.ag_max_k])
    return out, params


def rows_to_stream(rows: dict[str, torch.Tensor], lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """Right-padded [r, s] rows (tokens, labels, loss_mask) -> one [1, T] stream of each row's first `lengths`
    tokens, T = Σ lengths, no padding (TRL's padding_free): positions restarting at each row, `segment_ids`
    numbering the rows, `row_index` each token's place in the flattened [r·s] rows (where per-token results go
    back) and `real` 1 (0 wherever pack_batch pads the stream)."""
    r, s = rows["tokens"].shape
    index = (torch.arange(s)[None, :] < lengths[:, None]).flatten().nonzero().flatten()
    out = {k: rows[k].reshape(-1)[index][None] for k in ("tokens", "labels", "loss_mask")}
    out["position_ids"] = (index % s)[None]
    out["segment_ids"] = (index // s)[None]
    out["row_index"], out["real"] = index[None], torch.ones(1, len(index), dtype=torch.int64)
    return out


def pairs_to_shared_stream(rows: dict[str, torch.Tensor], lengths: torch.Tensor, shared: torch.Tensor,
                           multiple: int = 1) -> tuple[dict[str, torch.Tensor], PackedDocs]:
    """[2m, s] pair rows (m chosen rows, then their m rejected ones) -> one [1, T] stream in which each pair's first
    `shared[i]` tokens (its prompt: identical in both rows and trained in neither, preference.shared_prefix) run
    once, for the model and the reference alike.

    Pair i is two query sequences: [prefix | chosen's rest] (causal over itself, exactly its padded row's attention)
    and [rejected's rest], whose keys are the prefix's and its own (`kv_index` gathers them, `kv_cu` bounds them;
    the varlen kernels align a query sequence shorter than its keys bottom-right, so each rejected token sees the
    prefix and its own predecessors, as in its row). Positions are the rows' columns, so RoPE is the rows'; `labels`
    and `loss_mask` are the rows' at each token's column, so the prefix's last token predicts the chosen answer and
    the rejected part starts at the same column again (that token runs twice: once per answer it predicts).
    `row_index` says where each token's loss goes back (the prefix: to the chosen row, the only one that reads a
    prompt token's loss: ORPO's NLL); `real` is 0 on the padding that rounds T to `multiple` (one sequence of its
    own). The attention of the whole stream costs what two rows of their real tokens cost, less the prompt once."""
    r, s = rows["tokens"].shape
    m = r // 2
    pair = torch.arange(m)
    rest = lengths[m:] - shared
    q_lens = torch.stack([lengths[:m], rest], 1).flatten()                 # [2m]: chosen, rejected of each pair
    q_starts = torch.stack([pair * s, (m + pair) * s + shared], 1).flatten()  # their first tokens in the rows
    index = _ranges(q_starts, q_lens)
    n = int(q_lens.sum())
    extra = -n % multiple
    out = {k: rows[k].reshape(-1)[index] for k in ("tokens", "labels", "loss_mask")}
    out["position_ids"], out["row_index"] = index % s, index
    out["real"] = torch.ones(n, dtype=torch.int64)
    offset = torch.cumsum(q_lens, 0) - q_lens                              # each query sequence in the stream
    kv_starts = torch.stack([offset[0::2], offset[0::2], offset[1::2]], 1).flatten()
    kv_lens = torch.stack([lengths[:m], shared, rest], 1).flatten()        # chosen: itself; rejected: prefix, itself
    seq_k = torch.stack([lengths[:m], shared + rest], 1).flatten()
    if extra:  # the padding: one more sequence, its keys itself
        out = {k: torch.cat([v, v.new_zeros(extra)]) for k, v in out.items()}
        out["position_ids"][n:] = torch.arange(extra)
        q_lens, seq_k, kv_lens = (torch.cat([t, t.new_tensor([extra])]) for t in (q_lens, seq_k, kv_lens))
        kv_starts = torch.cat([kv_starts, kv_starts.new_tensor([n])])
    pos = out["position_ids"]
    cu_q, cu_k = _cu(q_lens), _cu(seq_k)
    max_q, max_k = int(q_lens.max()), int(seq_k.max())
    params = PackedDocs(qkv_format="sbhd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, cu_seqlens_q_padded=cu_q,
                        cu_seqlens_kv_padded=cu_k, max_seqlen_q=max_q, max_seqlen_kv=max_k, positions=pos,
                        rope_len=max(s, extra), longest=int(lengths.max()), cu_local=cu_q, max_local=max_q,
                        kv_index=_ranges(kv_starts, kv_lens), kv_cu=cu_k,
                        max_host=torch.tensor([max_q, max_k]))
    return {k: v[None] for k, v in out.items()}, params


def _all_gather_plan(params: PackedDocs, c: torch.Tensor, cp: int, r: int) -> None:
    """Where each local query chunk's causal key prefix lies in the all-gathered K|V ([cp ranks × local stream]):
    chunk j of document i is held by rank j (early part) or 2·cp−1−j (late part), at the document's chunk offset."""
    n, t_half = len(c), int(c.sum())
    off = torch.cumsum(c, 0) - c
    doc_e, m_e = torch.repeat_interleave(torch.arange(n), r + 1), torch.arange(r + 1).repeat(n)
    doc_l, m_l = torch.repeat_interleave(torch.arange(n), 2 * cp - r), torch.arange(2 * cp - r).repeat(n)
    doc, m = torch.cat([doc_e, doc_l]), torch.cat([m_e, m_l])
    rank = torch.where(m < cp, m, 2 * cp - 1 - m)
    base = rank * 2 * t_half + torch.where(m < cp, 0, t_half) + off[doc]
    params.ag_index = _ranges(base, c[doc])
    k_lens = torch.cat([(r + 1) * c, (2 * cp - r) * c])
    params.ag_cu_q, params.ag_cu_k = _cu(torch.cat([c, c])), _cu(k_lens)
    params.ag_max_k = int(k_lens.max())


__all__ = ["PackedDocs", "pack_batch", "rows_to_stream", "pairs_to_shared_stream", "document_lengths",
           "local_multiple", "cu_seqlens", "document_attention_mask"]
