"""Probe (GPU host): where the MoE shape's step could still lose GPU time.

    python bench/moe_kernels_probe.py

1. The experts' grouped GEMMs (forward, input gradient, weight gradient) of one layer at seq 4096, top-8 of 128,
   with each operand layout `torch._grouped_mm` takes (a contiguous transpose's cost included).
2. AdamW with bf16 states on 5.6 B parameters: the flat AdamW's table-driven kernel against the same arithmetic on
   four flat buffers (the upper bound for 14 bytes per parameter), and a plain copy's bandwidth.
"""
# ruff: noqa: B023 (each lambda is timed in the iteration that makes it)
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def grouped_rows(ms_per_call) -> dict:
    import torch

    dev, bf = "cuda", torch.bfloat16
    s, h, e, f, k = 4096, 2048, 128, 768, 8
    torch.manual_seed(0)
    top = torch.randn(s, e, device=dev).topk(k, dim=-1).indices
    counts = torch.bincount(top.view(-1), minlength=e) // 8 * 8  # K-major operands need groups of 8 rows (16 B)
    counts[-1] += s * k - counts.sum()
    offs = counts.cumsum(0).to(torch.int32)
    rows = {}
    for name, out_f, in_f in (("fc1", 2 * f, h), ("fc2", h, f)):
        x = torch.randn(s * k, in_f, device=dev, dtype=bf)
        dy = torch.randn(s * k, out_f, device=dev, dtype=bf)
        w = torch.randn(e, out_f, in_f, device=dev, dtype=bf) * 0.02
        flop = 2 * s * k * out_f * in_f
        cases = {
            "fwd x . w^T (current)": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs),
            "dgrad dy . w (current)": lambda: torch._grouped_mm(dy, w, offs=offs),
            "wgrad dy^T . x (current)": lambda: torch._grouped_mm(dy.t(), x, offs=offs),
            "wgrad, dy^T contiguous": lambda: torch._grouped_mm(dy.t().contiguous(), x, offs=offs),
            "wgrad, both K-major": lambda: torch._grouped_mm(dy.t().contiguous(), x.t().contiguous().t(), offs=offs),
            "wgrad, x K-major": lambda: torch._grouped_mm(dy.t(), x.t().contiguous().t(), offs=offs),
            "wgrad as x^T . dy ([e, in, out])": lambda: torch._grouped_mm(x.t(), dy, offs=offs),
        }
        ref = cases["wgrad dy^T . x (current)"]()
        for case, fn in cases.items():
            if case.startswith("wgrad") and "[e, in" not in case:
                assert torch.equal(fn(), ref), case
            ms = ms_per_call(fn, 20)
            rows[f"{name} {case}"] = (ms, flop / ms / 1e9)
    return rows



def adamw_rows(ms_per_call) -> dict:
    import json

    import torch
    import triton
    import triton.language as tl
    from adamw_bench import moe_optimizer

    from adapter.train import adamw_kernel

    @triton.jit
    def flat_adamw(w_ptr, g_ptr, m_ptr, v_ptr, n, coef, decay, one_minus_b1, b2, one_minus_b2, step_size, sqrt_bc2,
                   eps, BLOCK: tl.constexpr, EVICT: tl.constexpr):
        """The flat AdamW's arithmetic (adapter/train/adamw_kernel.py) on flat buffers, the hyperparameters as
        arguments: the bound for 14 bytes a parameter without tables."""
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        if EVICT:
            g = tl.load(g_ptr + idx, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            w = tl.load(w_ptr + idx, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            m = tl.load(m_ptr + idx, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            v = tl.load(v_ptr + idx, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        else:
            g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            m = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        g = tl.where(coef > 0, g * coef, 0.0)
        w = w * decay
        m = m + one_minus_b1 * (g - m)
        v = v * b2 + g * g * one_minus_b2
        w = w - step_size * tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), sqrt_bc2) + eps)
        if EVICT:
            tl.store(m_ptr + idx, m.to(tl.bfloat16), mask=mask, cache_modifier=".cs")
            tl.store(v_ptr + idx, v.to(tl.bfloat16), mask=mask, cache_modifier=".cs")
            tl.store(w_ptr + idx, w.to(tl.bfloat16), mask=mask, cache_modifier=".cs")
        else:
            tl.store(m_ptr + idx, m.to(tl.bfloat16), mask=mask)
            tl.store(v_ptr + idx, v.to(tl.bfloat16), mask=mask)
            tl.store(w_ptr + idx, w.to(tl.bfloat16), mask=mask)

    cfg = json.loads((ROOT / "configs/models/qwen3-30b-a3b-8l-shape/config.json").read_text())
    params, opt = moe_optimizer(cfg, deposit=False)
    n = sum(p.numel() for p in params)
    fl = opt.flats[0]
    prep = adamw_kernel.prepare(fl.table, fl.params)
    hyper = torch.tensor([1.0, 1.0, 0.1, 0.95, 0.05, 1e-4, 1.0, 1e-8], device="cuda")
    rows = {}
    for block, warps in ((4096, 8), (2048, 4), (4096, 4), (1024, 4), (2048, 8)):
        fl.table = adamw_kernel.ChunkTable(fl.params, fl.offsets, fl.device, block=block, num_warps=warps)
        rows[f"table kernel (ours), {block}/{warps} warps"] = ms_per_call(
            lambda: adamw_kernel.step(fl.table, prep, None, fl.exp_avg, fl.exp_avg_sq, hyper), 10)
    w, g, m, v = (torch.zeros(n, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    g.normal_(0, 1e-3)
    hp = hyper.tolist()  # once: a read per call would sync the host with the GPU inside the timing
    for block, warps, evict in ((4096, 8, False), (4096, 8, True), (2048, 4, False), (8192, 8, False),
                                (1024, 4, False), (2048, 4, True)):
        grid = (triton.cdiv(n, block),)
        rows[f"flat buffers, {block}/{warps} warps{', evict-first' if evict else ''}"] = ms_per_call(
            lambda: flat_adamw[grid](w, g, m, v, n, *hp, BLOCK=block, EVICT=evict, num_warps=warps), 10)
    rows["copy 2 x n bf16 (read 2 B, write 2 B, x 3.5 for 14 B)"] = 3.5 * ms_per_call(lambda: w.copy_(g), 10)
    return {name: (ms, 14 * n / ms / 1e6) for name, ms in rows.items()}


def main() -> int:
    import torch
    from cuda_timing import ms_per_call

    print(torch.cuda.get_device_name(), torch.__version__)
    for name, (ms, tf) in grouped_rows(ms_per_call).items():
        print(f"{name:45s} {ms:7.3f} ms {tf:6.0f} TFLOP/s")
    for name, (ms, gbs) in adamw_rows(ms_per_call).items():
        print(f"{name:55s} {ms:7.2f} ms {gbs:6.0f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
