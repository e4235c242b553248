"""TE-free fused kernels for the two memory-bound hot spots the H200 profile showed (docs/BENCHMARKS.md):

* RoPE: Megatron's unfused rotary embedding costs ~10 elementwise kernels per q/k per layer (mul, cat, neg, add,
  cos, sin, casts) — about 7% of a Llama-3.2-1B step. Megatron only fuses it through TransformerEngine; we install
  one torch.compile'd function into its extension point (`rope_utils.fused_apply_rotary_pos_emb`, None without TE).
* Vocab-parallel cross-entropy: Megatron's versions (plain and "native fused") materialise the logits in fp32 and
  save exp(logits) in fp32 for backward: ~12 passes over a [tokens × vocab/tp] fp32 array per step. Ours reads the
  bf16 logits twice forward and once backward, saves only the logits and the per-token log-sum-exp, and writes the
  gradient in the logits' dtype.

The math runs eagerly on CPU (what CI checks against Megatron's references) and is compiled on CUDA.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _compiled_on_cuda(fn):
    compiled = torch.compile(fn, dynamic=False)

    def call(*args):
        return (compiled if args[0].is_cuda else fn)(*args)

    call.__doc__, call.__name__ = fn.__doc__, fn.__name__
    return call


# ---- RoPE --------------------------------------------------------------------------------------------------------

@_compiled_on_cuda
def _rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """t [s, b, h, d], freqs [s, 1, 1, rot] (fp32 angles): rotate-half RoPE in fp32, one rounding to t's dtype."""
    rot = freqs.shape[-1]
    x, rest = t[..., :rot].float(), t[..., rot:]
    x1, x2 = x.chunk(2, dim=-1)
    out = x * freqs.cos() + torch.cat((-x2, x1), dim=-1) * freqs.sin()
    return torch.cat((out.to(t.dtype), rest), dim=-1)


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    if interleaved:
        raise NotImplementedError("nd-adapter's fused RoPE is rotate-half only (HF Llama/Qwen/Mistral layout)")
    return _rope(t, freqs)


def install_rope_fusion() -> bool:
    """Our fused RoPE where TransformerEngine's would go; True if a fused RoPE (ours or TE's) is in place."""
    from adapter.patches.mcore import install_rope_fusion as hook

    return hook(fused_rope)


# ---- vocab-parallel cross-entropy ---------------------------------------------------------------------------------

@_compiled_on_cuda
def _ce_partials(logits, target, row_max, vocab_start):
    """Per token: Σ exp(logit − max) over this rank's vocab slice, and the target's logit if this rank holds it."""
    x = logits.float()
    sum_exp = torch.exp(x - row_max.unsqueeze(-1)).sum(-1)
    local = target - vocab_start
    held = (local >= 0) & (local < x.size(-1))
    picked = torch.gather(x, -1, local.clamp(0, x.size(-1) - 1).unsqueeze(-1)).squeeze(-1)
    return torch.stack((sum_exp, torch.where(held, picked, torch.zeros_like(picked))))


@_compiled_on_cuda
def _ce_grad(logits, target, lse, grad_loss, vocab_start):
    """(softmax − one_hot(target)) · dloss, in the logits' dtype."""
    x = logits.float()
    local = target - vocab_start
    cols = torch.arange(x.size(-1), device=x.device)
    one_hot = (cols == local.unsqueeze(-1)).float()
    return ((torch.exp(x - lse.unsqueeze(-1)) - one_hot) * grad_loss.unsqueeze(-1)).to(logits.dtype)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        shape = target.shape
        logits2, target1 = logits.reshape(-1, logits.size(-1)), target.reshape(-1)
        rank = dist.get_rank(group) if group is not None and dist.is_initialized() else 0
        start = rank * logits2.size(-1)
        row_max = logits2.amax(-1).float()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        partials = _ce_partials(logits2, target1, row_max, start)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(partials, group=group)
        lse = row_max + partials[0].log()
        ctx.save_for_backward(logits2, target1, lse)
        ctx.start, ctx.shape = start, logits.shape
        return (lse - partials[1]).view(shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits2, target1, lse = ctx.saved_tensors
        grad = _ce_grad(logits2, target1, lse, grad_loss.reshape(-1).float(), ctx.start)
        return grad.view(ctx.shape), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None) -> torch.Tensor:
    """Per-token loss for logits split over `group` along the vocabulary (rank r holds slice r); fp32 result."""
    return _VocabParallelCE.apply(logits, target, group)


__all__ = ["fused_rope", "install_rope_fusion", "vocab_parallel_cross_entropy"]
