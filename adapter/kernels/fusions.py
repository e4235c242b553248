"""TE-free fused kernels for the memory-bound hot spots the H200 profiles showed (docs/BENCHMARKS.md):

* RoPE: Megatron's unfused rotary embedding costs ~10 elementwise kernels per q/k per layer (mul, cat, neg, add,
  cos, sin, casts) — about 7% of a Llama-3.2-1B step. Megatron only fuses it through TransformerEngine; we install
  one torch.compile'd function into its extension point (`rope_utils.fused_apply_rotary_pos_emb`, None without TE).
* Vocab-parallel cross-entropy: Megatron's versions (plain and "native fused") materialise the logits in fp32 and
  save exp(logits) in fp32 for backward: ~12 passes over a [tokens × vocab/tp] fp32 array per step. Ours reads the
  bf16 logits twice forward and once backward, saves only the logits and the per-token log-sum-exp, and writes the
  gradient in the logits' dtype.

* Linear + cross-entropy (`linear_cross_entropy`): the output layer's matmul and the loss in token chunks, the
  gradients computed in the forward, so the [tokens × vocab/tp] logits and their gradient never exist whole (2 × 2 GB
  per micro-batch on the 1B shape at seq 4096 × 2). Ours, vocab-parallel, is the default (`model.fused_linear_ce:
  auto`: faster than Liger's small chunks); `true` without a chunk takes Liger's kernel at tp = 1 on GPUs.

The math runs eagerly on CPU (what CI checks against Megatron's references) and is compiled on CUDA.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from adapter.models.counts import linear_ce_chunk, linear_ce_row_stride
from adapter.patches import mcore


def _compiled_on_cuda(fn):
    """`fn` compiled for each shape it meets on CUDA, eager elsewhere. `.any_length` is the same compiled once with
    a symbolic first dimension: for a shape that changes every call (the fused linear CE's last, shorter chunk of
    an unpacked micro-batch), where a graph per shape would pass Dynamo's recompile limit and fall back to eager
    kernels with their fp32 temporaries."""
    compiled = torch.compile(fn, dynamic=False)
    dynamic = torch.compile(fn, dynamic=True)

    def call(*args):
        return (compiled if args[0].is_cuda else fn)(*args)

    def any_length(*args):
        return (dynamic if args[0].is_cuda else fn)(*args)

    call.__doc__, call.__name__ = fn.__doc__, fn.__name__
    call.any_length = any_length  # type: ignore[attr-defined]
    return call


# ---- RoPE --------------------------------------------------------------------------------------------------------

@_compiled_on_cuda
def _rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """t [s, b, h, d], freqs [s, 1, 1, rot] (fp32 angles) or `rope_tables` [s, 2, 1, rot]: rotate-half RoPE in fp32,
    one rounding to t's dtype."""
    rot = freqs.shape[-1]
    cos, sin = (freqs[:, :1], freqs[:, 1:]) if freqs.size(1) == 2 else (freqs.cos(), freqs.sin())
    x, rest = t[..., :rot].float(), t[..., rot:]
    x1, x2 = x.chunk(2, dim=-1)
    out = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out.to(t.dtype), rest), dim=-1)


def rope_tables(freqs: torch.Tensor) -> torch.Tensor:
    """Angles [s, 1, 1, rot] -> [s, 2, 1, rot] fp32, cos at [:, 0] and sin at [:, 1], for `fused_rope`.

    Why: given angles, each RoPE kernel (q and k, forward and backward, every layer) evaluates cos and sin for every
    element of every head; computed once per forward, the kernels only read them (1B shape: ~20% less RoPE time,
    bench/rope_bench.py). Megatron's angle tensors are [s, 1, 1, rot] (mRoPE's per-sample angles never reach the
    fused RoPE), so dim 1 of size 2 tells the two apart. The model makes them (`PackedGPTModel`) only where ours is
    the fused RoPE Megatron calls."""
    return torch.cat((freqs.cos(), freqs.sin()), dim=1)


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    if interleaved:
        raise NotImplementedError("nd-adapter's fused RoPE is rotate-half only (HF Llama/Qwen/Mistral layout)")
    return _rope(t, freqs)


def install_rope_fusion() -> bool:
    """Our fused RoPE where TransformerEngine's would go; True if a fused RoPE (ours or TE's) is in place."""
    return mcore.install_rope_fusion(fused_rope)


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


def _softmax_minus_target(x, target, lse, grad_loss, vocab_start):
    """(softmax − one_hot(target)) · dloss in fp32: the cross-entropy's gradient with respect to fp32 logits `x`."""
    local = target - vocab_start
    cols = torch.arange(x.size(-1), device=x.device)
    one_hot = (cols == local.unsqueeze(-1)).float()
    return (torch.exp(x - lse.unsqueeze(-1)) - one_hot) * grad_loss.unsqueeze(-1)


@_compiled_on_cuda
def _ce_grad(logits, target, lse, grad_loss, vocab_start):
    """(softmax − one_hot(target)) · dloss, in the logits' dtype."""
    return _softmax_minus_target(logits.float(), target, lse, grad_loss, vocab_start).to(logits.dtype)


@_compiled_on_cuda
def _softcap(logits, cap):
    """Gemma 2's final soft-capping, cap · tanh(logits / cap), as its model computes it (in the logits' dtype)."""
    return torch.tanh(logits / cap) * cap


@_compiled_on_cuda
def _ce_grad_into(logits, target, lse, grad_loss, vocab_start, cap):
    """`_ce_grad` written over the logits themselves (one chunk's buffer, not two), carried through Gemma 2's
    soft-capping where `cap` is given: d/dz [c · tanh(z / c)] = 1 − (capped / c)²."""
    x = logits.float()
    grad = _softmax_minus_target(x, target, lse, grad_loss, vocab_start)
    if cap is not None:
        grad = grad * (1 - (x / cap) ** 2)
    return logits.copy_(grad)


def _row_max(logits: torch.Tensor) -> torch.Tensor:
    """fp32 max over this rank's real columns; −inf where it holds none (only padding), so the TP max ignores it."""
    if logits.size(-1) == 0:
        return torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
    return logits.amax(-1).float()


def _partials(logits, target, row_max, start, any_length=False):
    if logits.size(-1) == 0:
        return torch.zeros(2, logits.size(0), device=logits.device)
    return (_ce_partials.any_length if any_length else _ce_partials)(logits, target, row_max, start)


class _VocabParallelCE(torch.autograd.Function):
    """Only this rank's first `real` columns take part (the rest is vocabulary padding: never in the softmax, zero
    gradient), so the loss is the HF model's whatever the padding."""

    @staticmethod
    def forward(ctx, logits, target, group, real):
        shape = target.shape
        logits2, target1 = logits.reshape(-1, logits.size(-1)), target.reshape(-1)
        rank = dist.get_rank(group) if group is not None and dist.is_initialized() else 0
        start = rank * logits2.size(-1)
        x = logits2[:, :real]
        row_max = _row_max(x)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        partials = _partials(x, target1, row_max, start)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(partials, group=group)
        lse = row_max + partials[0].log()
        ctx.save_for_backward(logits2, target1, lse)
        ctx.start, ctx.shape, ctx.real = start, logits.shape, real
        return (lse - partials[1]).view(shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits2, target1, lse = ctx.saved_tensors
        real = ctx.real
        if real == logits2.size(-1):
            grad = _ce_grad(logits2, target1, lse, grad_loss.reshape(-1).float(), ctx.start)
        else:
            grad = torch.zeros_like(logits2)
            if real:
                grad[:, :real] = _ce_grad(logits2[:, :real], target1, lse, grad_loss.reshape(-1).float(), ctx.start)
        return grad.view(ctx.shape), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 real: int | None = None) -> torch.Tensor:
    """Per-token loss for logits split over `group` along the vocabulary (rank r holds slice r); fp32 result.
    `real`: how many of this rank's columns are real vocabulary (default all)."""
    return _VocabParallelCE.apply(logits, target, group, logits.size(-1) if real is None else real)


# ---- linear + cross-entropy ---------------------------------------------------------------------------------------

class _LinearCrossEntropy(torch.autograd.Function):
    """Σ_t w_t · CE(h_t · Wᵀ, y_t) with W's rows (the vocabulary) split over `group`, token chunk by token chunk.

    The loss is a weighted sum, so the gradients can be computed in the forward; the backward only scales them by the
    upstream scalar. Only the gradients autograd can ask for are computed: none under no_grad (evaluation), and no
    output-weight gradient where that weight is frozen (adapters), which saves one [tokens × vocab × hidden] GEMM and
    a weight-sized buffer. `hidden` must already be the TP-replicated input (Megatron's copy/gather op in front
    reduces its gradient over TP, as for the output layer's own input). `softcap`: Gemma 2's final
    cap · tanh(logits / cap), applied to each chunk's logits as the model applies it to all of them."""

    @staticmethod
    def forward(ctx, hidden, weight, target, weights, group, chunk, real, softcap, grads):
        tp = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        start = (dist.get_rank(group) if tp > 1 else 0) * weight.size(0)
        need_h, need_w = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        grad_h = (torch.zeros_like(hidden) if real == 0 else torch.empty_like(hidden)) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        w_real = weight[:real]  # the padding rows: no logits, no gradient
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # an unaligned vocabulary slice's logits go into rows padded to 128 columns, of which only the first `real`
        # are used (counts.linear_ce_row_stride: cuBLAS's aligned kernels)
        stride = linear_ce_row_stride(real, hidden.is_cuda)
        buf = torch.empty(min(chunk, hidden.size(0)), stride, dtype=hidden.dtype, device=hidden.device) \
            if stride != real else None
        # there, the GEMMs whose contiguous dimension is the vocabulary (the logits' columns, grad_h's contraction)
        # run over its first multiple of 8 rows, and the rest (< 8 rows) apart: an unaligned extent there also keeps
        # cuBLAS off its aligned kernels (padded rows alone: 73.6 ms against 33.6 aligned, one H100)
        k8 = real - real % 8 if buf is not None else real
        for lo in range(0, hidden.size(0), chunk):
            h, y, w = hidden[lo:lo + chunk], target[lo:lo + chunk], weights[lo:lo + chunk].float()
            short = h.size(0) < chunk  # the last chunk: its length changes with the micro-batch's (unpacked SFT)
            if buf is None:
                logits = h @ w_real.t()
            else:
                torch.mm(h, w_real[:k8].t(), out=buf[:h.size(0), :k8])
                if k8 < real:
                    torch.mm(h, w_real[k8:].t(), out=buf[:h.size(0), k8:real])
                logits = buf[:h.size(0), :real]
            if softcap is not None:
                capped = (_softcap.any_length if short else _softcap)(logits, softcap)
                logits = capped if buf is None else logits.copy_(capped)
            row_max = _row_max(logits)
            if tp > 1:
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            partials = _partials(logits, y, row_max, start, short)  # Σ exp(x − max), the target's logit where held
            if tp > 1:
                dist.all_reduce(partials, group=group)
            lse = row_max + partials[0].log()
            total += ((lse - partials[1]) * w).sum()
            if real and (need_h or need_w):  # (softmax − one_hot) · w, over the logits
                d = (_ce_grad_into.any_length if short else _ce_grad_into)(logits, y, lse, w, start, softcap)
                if need_h:  # into grad_h's rows (no temporary), the unaligned rows' < 8 apart
                    torch.mm(d[:, :k8], w_real[:k8], out=grad_h[lo:lo + chunk])
                    if k8 < real:
                        grad_h[lo:lo + chunk].addmm_(d[:, k8:], w_real[k8:])
                if need_w:
                    grad_w[:real].addmm_(d.t(), h)
                del d
            del logits  # before the next chunk's: one chunk's logits exist at a time (or the padded buffer)
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        """The forward's gradients scaled in place by the upstream scalar: a copy of the output weight's gradient
        (the 1B's tied embedding: 0.49 GiB) would land at the start of backward, when every activation is still
        alive, i.e. at the step's peak. Liger's kernel scales its own in place too. The buffers are this Function's
        alone; a second backward through the same graph (retain_graph) is not supported."""
        grad_h, grad_w = ctx.saved_tensors
        return (None if grad_h is None else grad_h.mul_(grad_total.to(grad_h.dtype)),
                None if grad_w is None else grad_w.mul_(grad_total.to(grad_w.dtype)),
                None, None, None, None, None, None, None)


def _liger_linear_cross_entropy():
    """Liger's fused linear cross-entropy, where it runs (CUDA and the package installed), else None."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy  # optional package
    except ImportError:  # not installed, or no triton (CPU builds)
        return None
    return liger_fused_linear_cross_entropy


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, loss_mask: torch.Tensor,
                         group=None, chunk: int | None = None, real: int | None = None,
                         softcap: float | None = None) -> torch.Tensor:
    """Σ over tokens of loss_mask · CE(hidden · weightᵀ, target), fp32 scalar; hidden [t, h], weight [v/tp, h] (this
    rank's vocabulary slice), target and loss_mask [t]. loss_mask is 0/1 (untrained tokens), as the loop's data is.
    `real`: how many of the slice's rows are real vocabulary (the rest is padding, left out; default all).
    `chunk`: tokens per chunk of ours; None: Liger's kernel where it runs (tp = 1, CUDA, installed, no soft-capping),
    else ours at adapter.models.counts.linear_ce_chunk tokens. `softcap`: the final logits' soft-capping (Gemma 2)."""
    tp = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    real = weight.size(0) if real is None else real
    if tp == 1 and hidden.is_cuda and chunk is None and softcap is None:
        liger = _liger_linear_cross_entropy()
        if liger is not None:
            masked = torch.where(loss_mask > 0, target, torch.full_like(target, -100))
            return liger(hidden, weight[:real], masked, ignore_index=-100, reduction="sum").float()
    chunk = chunk or linear_ce_chunk(weight.size(0))
    # grad mode as the caller has it (forward itself always runs without it): none computed for evaluation
    return _LinearCrossEntropy.apply(hidden, weight, target, loss_mask, group, chunk, real, softcap,
                                     torch.is_grad_enabled())


__all__ = ["fused_rope", "install_rope_fusion", "rope_tables", "vocab_parallel_cross_entropy", "linear_cross_entropy"]
