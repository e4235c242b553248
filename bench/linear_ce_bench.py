"""Output layer + cross-entropy on one GPU at the Llama-3.2 vocabulary (128,256) and 8,192 tokens: the unfused path
(bf16 logits, adapter/kernels/fusions.py's cross-entropy), Liger's fused linear cross-entropy, and ours in token
chunks of several sizes; forward + backward time and the memory each holds above its inputs.

    python bench/linear_ce_bench.py [--tokens 8192] [--vocab 100278,100352 --hidden olmo3=4096]

`--vocab` takes several sizes: a vocabulary that is not a multiple of 8 (Olmo's 100,278) gives the logits a row
stride cuBLAS's aligned kernels cannot take; the transformers engine keeps the checkpoint's own vocabulary, the native
engine pads it (model.vocab_divisible_by), so the pair shows what that costs.
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_timing import ms_per_call  # noqa: E402 (bench/ is on the path)

from adapter.kernels.fusions import (  # noqa: E402
    _liger_linear_cross_entropy,
    linear_cross_entropy,
    vocab_parallel_cross_entropy,
)

VOCAB = 128256
HIDDEN = {"1b": 2048, "3b": 3072}


def unfused(h, w, y, mask):
    return (vocab_parallel_cross_entropy(h @ w.t(), y) * mask).sum()


def kinds():
    out = {"unfused (bf16 logits)": unfused}
    liger = _liger_linear_cross_entropy()
    if liger is not None:
        out["liger"] = lambda h, w, y, mask: liger(h, w, torch.where(mask > 0, y, -100), ignore_index=-100,
                                                   reduction="sum")
    for chunk in (256, 512, 1024, 2048, 4096):  # 256: Liger's own chunk at the 1B shape (counts.liger_linear_ce_chunk)
        out[f"ours, chunk {chunk}"] = lambda h, w, y, mask, c=chunk: linear_cross_entropy(h, w, y, mask, chunk=c)
    # an unaligned vocabulary's logits in the checkpoint's own row stride (the default pads them to 128 columns)
    out["ours, chunk 1024, unpadded rows"] = functools.partial(with_padding, False)
    return out


def with_padding(pad: bool, h, w, y, mask):
    """Ours at chunk 1024 with counts.LINEAR_CE_PAD_ROWS_ON_CUDA set to `pad` (the same as the default where the
    vocabulary is a multiple of 8)."""
    from adapter.models import counts

    before, counts.LINEAR_CE_PAD_ROWS_ON_CUDA = counts.LINEAR_CE_PAD_ROWS_ON_CUDA, pad
    try:
        return linear_cross_entropy(h, w, y, mask, chunk=1024)
    finally:
        counts.LINEAR_CE_PAD_ROWS_ON_CUDA = before


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", default=str(VOCAB), help="comma-separated vocabulary sizes")
    ap.add_argument("--hidden", nargs="*", help="NAME=SIZE hidden sizes (default: the 1B and 3B shapes)")
    a = ap.parse_args()
    hidden = dict(kv.split("=") for kv in a.hidden) if a.hidden else HIDDEN
    for (shape, hid), vocab in ((sh, int(v)) for sh in hidden.items() for v in a.vocab.split(",")):
        hid, shape = int(hid), f"{shape} V{vocab}"
        torch.manual_seed(0)
        h = torch.randn(a.tokens, hid, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(vocab, hid, device="cuda") / hid ** 0.5).to(torch.bfloat16).requires_grad_()
        y = torch.randint(0, vocab, (a.tokens,), device="cuda")
        mask = torch.ones(a.tokens, device="cuda")
        ref = None
        for name, fn in kinds().items():
            def step(fn=fn, h=h, w=w, y=y, mask=mask):
                h.grad = w.grad = None
                loss = fn(h, w, y, mask)
                loss.backward()
                return loss
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            h.grad = w.grad = None
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss = step()
            torch.cuda.synchronize()
            extra = (torch.cuda.max_memory_allocated() - base) / 2**30
            grads = (h.grad.float().clone(), w.grad.float().clone())
            ms = ms_per_call(step, iters=10, warmup=0)  # warmed up above
            if ref is None:
                ref = (loss.item(), *grads)
            err = max(((g - r).norm() / r.norm()).item() for g, r in zip(grads, ref[1:]))
            print(f"{shape} {name:24s} {ms:7.2f} ms  peak +{extra:5.2f} GiB  loss {loss.item():.4f} "
                  f"(ref {ref[0]:.4f})  grad rel err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
