"""Context parallelism on the transformers engine: transformers' own modules compute q, k, v and RoPE on this rank's
load-balanced part of the sequence (its global positions, or each packed document's own), and one attention
function, registered in transformers' attention interface, does the attention across the CP group with the native
engine's kernels (adapter/kernels/attention.py for one causal stream per sample, adapter/kernels/varlen.py for
packed documents): all-gathered K|V or the ring, sliding windows included (all-gather only). At cp = 1 the same
function runs preference pairs whose prompt is shared (adapter/kernels/thd.pairs_to_shared_stream: the rejected
answer's keys gathered as [prompt | itself]), which transformers' position-built masks cannot describe, and every
model whose attention those kernels compute (checks.own_attention): packed documents by their boundaries, and
whole sequences through adapter/kernels/attention.local_attention (flash attention with a sliding window, where
transformers' sdpa path would take a materialised mask).

Why through the attention interface and not a split of the model: it is transformers' public seam for attention
kernels (`AttentionInterface.register`; models declare `_supports_attention_backend`), so everything before and after
attention -- projections, norms, RoPE variants, MLA's latent K/V, routers -- stays the model's own code, per token,
and only the one place that mixes positions changes. `AttentionMaskInterface` gets the same name with a builder
that returns no mask: transformers would otherwise build an S×S mask for the local queries that cannot describe the
other ranks' keys (documents and windows are the kernels' business here).

What reaches the function is checked, not trusted: a mask the model built itself, scores it wants soft-capped,
attention sinks (`s_aux`), attention dropout, a non-causal call, or a forward in which the function never ran,
raise at once. The same features are refused at plan time from the meta-device model
(adapter/models/generic.attention_features, adapter/models/generic_run.check_run), so these raises are the net for
a model that hides one.

Checked against transformers 5.25 (CI): the attention function's keywords (`scaling`, `dropout`, `sliding_window`,
`softcap`, `s_aux`, `is_causal`), `set_attn_implementation` and `config._attn_implementation`, all as transformers'
attention-interface documentation describes them for custom functions.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from adapter.kernels.attention import (
    _p2p_dtype_error,
    context_parallel_attention,
    local_attention,
    normalize_cp_comm_type,
)
from adapter.kernels.varlen import HALF, packed_attention
from adapter.patches.mcore import install_cpu_shims

NAME = "nd_adapter_cp"  # the name in transformers' AttentionInterface and AttentionMaskInterface


@dataclass
class _Forward:
    """One forward's CP state: the group, the scheme, this rank's packed documents (None: one causal stream per
    sample, split by adapter.kernels.attention.split_for_cp) and how many attention calls ran."""
    group: Any
    comm: str
    packed: Any = None
    calls: int = 0


_STATE: ContextVar[_Forward | None] = ContextVar("nd_adapter_cp", default=None)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
              **kwargs):
    """transformers' attention-function contract: query [b, hq, s, d], key/value [b, hk, s, d/dv] (this rank's
    tokens) -> ([b, s, hq, dv], None). A sliding window counts as transformers' masks count it (a query sees itself
    and window − 1 keys before it), which is the kernels' `window`."""
    state = _STATE.get()
    if state is None:
        raise RuntimeError("nd-adapter's context-parallel attention ran outside CausalLMLosses' forward")
    unknown = [k for k in ("s_aux", "position_bias") if kwargs.get(k) is not None]
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if attention_mask is not None or softcap is not None or unknown or not causal or dropout:
        what = ("a mask the model built itself" if attention_mask is not None else
                "soft-capped scores" if softcap is not None else unknown[0] if unknown else
                "attention dropout" if dropout else "non-causal attention")
        raise RuntimeError(f"{type(module).__name__} asks context-parallel attention for {what}, which its kernels "
                           "do not compute (adapter/models/generic.attention_features should have refused it)")
    state.calls += 1
    scale = scaling if scaling is not None else query.size(-1) ** -0.5
    dv, d = value.size(-1), max(value.size(-1), query.size(-1))
    # unequal head dims (MLA: values narrower than queries): zero columns give the kernels equal ones and change
    # neither the scores (the scale is fixed above) nor the output's first dv columns
    query, key, value = (F.pad(t, (0, d - t.size(-1))) if t.size(-1) < d else t for t in (query, key, value))
    if state.packed is None and state.group.size() == 1:  # cp = 1, whole sequences (checks.own_attention)
        out = local_attention(query, key, value, scale=scale, window=sliding_window)
        return out.transpose(1, 2)[..., :dv].contiguous(), None
    span = (max(state.packed.max_seqlen_q, state.packed.max_seqlen_kv or 0) if state.packed is not None else
            query.size(2) * state.group.size())  # (a shared prompt's rejected queries: keys longer than queries)
    if sliding_window is not None and sliding_window >= span:  # no query has a key outside it (the longest
        sliding_window = None                                   # padded document, or the whole sample)
    if state.packed is not None:  # [1, h, T, d] -> [T, h, d]: the rank's stream of document chunks
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        out = packed_attention(q, k, v, state.packed, scale=scale, group=state.group, comm=state.comm,
                               window=sliding_window).unsqueeze(0)
    else:  # [b, h, s, d] -> Megatron's [s, b, h, d]; back as [b, h, s, d]
        q, k, v = (t.permute(2, 0, 1, 3) for t in (query, key, value))
        if sliding_window is not None and state.comm != "all_gather":  # (packed_attention raises the same)
            raise RuntimeError("a sliding window on the ring (cp_comm_type p2p) is not built (check_run refuses it)")
        out = context_parallel_attention(q, k, v, scale=scale, group=state.group, comm=state.comm,
                                         window=sliding_window).transpose(1, 2)
    return out[..., :dv].contiguous(), None


def no_mask(*args, **kwargs):
    """AttentionMaskInterface entry: no mask (documents and windows are the attention function's)."""
    return None


def install(model, *, dtype: torch.dtype, gpu: bool, comm: str) -> None:
    """Register the function under NAME and switch `model` (and its sub-models) to it. On a GPU (`gpu`) the ring
    (cp_comm_type p2p) runs FlashAttention's kernels, bf16/fp16 only: fp32 there is refused before the first step,
    as the native engine refuses it; all_gather's varlen runs fp32 through the exact reference kernels
    (adapter/kernels/varlen.block_fwd), on either engine."""
    from transformers import AttentionInterface, AttentionMaskInterface

    if gpu and dtype not in HALF and normalize_cp_comm_type(comm) == "p2p":
        raise _p2p_dtype_error(dtype)
    install_cpu_shims()  # Megatron's gathers allocate on "the current CUDA device"; CPU runs need the shim
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, no_mask)
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:  # transformers declined (a warning only): attention would be local
        raise RuntimeError(f"{type(model).__name__} did not take the attention implementation {NAME!r} "
                           "(generic.attention_features should have refused it)")


@contextmanager
def forward(group, comm: str, packed=None) -> Iterator[_Forward]:
    """Within: the model's attention calls run over `group`; afterwards, a forward that never called the function
    (a model whose attention bypasses the interface) raises instead of training on local attention."""
    state = _Forward(group, normalize_cp_comm_type(comm), packed)
    token = _STATE.set(state)
    try:
        yield state
    finally:
        _STATE.reset(token)
    if state.calls == 0:
        raise RuntimeError("the model's forward never called nd-adapter's context-parallel attention: its attention "
                           "does not run through transformers' attention interface")


def recompute_context():
    """torch.utils.checkpoint's `context_fn` for transformers' gradient checkpointing: called as a layer's forward
    runs, it returns (nothing for the forward, the forward's state for the recomputation), since backward runs the
    layer again after `forward`'s context has ended (and on autograd's thread, which a ContextVar does not reach)."""
    state = _STATE.get()
    return nullcontext(), (nullcontext() if state is None else _restored(state))


@contextmanager
def _restored(state: _Forward) -> Iterator[None]:
    token = _STATE.set(state)
    try:
        yield
    finally:
        _STATE.reset(token)


__all__ = ["NAME", "attention", "no_mask", "install", "forward", "recompute_context"]
