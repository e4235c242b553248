"""The optimizer step alone on one GPU: the flat AdamW's one-launch kernel against torch's fused AdamW, on a model
shape's parameter list (GPU host only).

    python bench/adamw_bench.py                 # Llama-3.2-1B shape
    python bench/adamw_bench.py --shape 3b
    python bench/adamw_bench.py --shape qwen3-moe-8l --launch 4096:8 8192:16   # bf16 states; other launch shapes

The MoE shape (Qwen3-30B-A3B cut to 8 layers, 5.6 B parameters, 2,100 tensors) runs `optimizer.state_dtype: bf16`
against torch's fused AdamW on bf16 parameters (14 bytes per parameter each: weight, gradient and moments read, all
but the gradient written), with each layer's expert gradients as rows of one tensor as the grouped experts leave
them; the step's gradient norm is timed on its own too. `--launch BLOCK:WARPS` times our kernel with other
elements-per-program and warps.

Both move the same 28 bytes per parameter (ours: fp32 master and moments read and written, bf16 gradient read,
bf16 weight written; torch fused on fp32 parameters and gradients: the same), so GB/s compares the kernels, and
torch's fused AdamW is the peer. Why it exists: in the profile of the 1B step the first kernel took 25.7 ms of a
~142 ms step for what should be ~8 ms of memory traffic (docs/BENCHMARKS.md, fifth session).
"""
from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHAPES = {"1b": "llama-3.2-1b", "3b": "llama-3.2-3b", "qwen3-moe-8l": "qwen3-30b-a3b-8l-shape"}
BYTES_PER_PARAM = 28


def param_shapes(cfg: dict) -> list[tuple[int, ...]]:
    """Megatron's parameter list for a Llama config: fused QKV, fused gate/up, two norms per layer, tied head."""
    h, ffn = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * hd
    layer = [(qkv, h), (h, cfg["num_attention_heads"] * hd), (2 * ffn, h), (h, ffn), (h,), (h,)]
    return [(cfg["vocab_size"], h), *layer * cfg["num_hidden_layers"], (h,)]


def moe_shapes(cfg: dict) -> tuple[list[tuple[int, ...]], list[int]]:
    """Megatron's parameter list for a Qwen3-MoE config (untied head) and, per layer, where its experts start."""
    h, hd, e, f = cfg["hidden_size"], cfg["head_dim"], cfg["num_experts"], cfg["moe_intermediate_size"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * hd
    shapes, starts = [(cfg["vocab_size"], h)], []
    for _ in range(cfg["num_hidden_layers"]):
        shapes += [(qkv, h), (h, cfg["num_attention_heads"] * hd), (hd,), (hd,), (h,), (h,), (e, h)]
        starts.append(len(shapes))
        shapes += [(2 * f, h), (h, f)] * e
    return shapes + [(h,), (cfg["vocab_size"], h)], starts


def moe_optimizer(cfg: dict, deposit: bool = True):
    """The MoE shape's bf16 parameters on the GPU with gradients, and the flat AdamW with bf16 states over them.
    `deposit`: each layer's expert gradients are rows of one tensor per linear, as the grouped experts leave them
    (adapter/modeling/moe.py); else every gradient is a tensor of its own."""
    import torch

    from adapter.train.optim import FlatAdamW

    shapes, starts = moe_shapes(cfg)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in shapes]
    experts = {i for s in starts for i in range(s, s + 2 * cfg["num_experts"])} if deposit else set()
    for p in (p for i, p in enumerate(params) if i not in experts):
        p.grad = torch.randn_like(p) * 1e-3
    for s in starts if deposit else ():
        for lin in (0, 1):
            ws = params[s + lin:s + 2 * cfg["num_experts"]:2]
            rows_of = torch.randn(len(ws), *ws[0].shape, device="cuda", dtype=torch.bfloat16) * 1e-3
            for w, g in zip(ws, rows_of.unbind(0)):
                w.grad = g
    opt = FlatAdamW([{"params": params, "weight_decay": 0.0}], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, clip_grad=1.0,
                    state_dtype="bf16")
    return params, opt


def moe_rows(cfg: dict, a) -> int:
    """bf16 states on the MoE shape: ours (one launch per launch shape, and the gradient norm alone) and torch's
    fused AdamW on bf16 parameters."""
    import torch
    from cuda_timing import ms_per_call

    from adapter.train import adamw_kernel
    from adapter.train.grads import whole

    params, opt = moe_optimizer(cfg)
    n = sum(p.numel() for p in params)
    prep = [adamw_kernel.prepare(f.table, f.params) for f in opt.flats]
    rows = {"ours, gradient norm alone (one launch)": ms_per_call(partial(opt.grad_norm, prep), a.iters),
            "one reduction per long gradient, norm alone": ms_per_call(opt.grad_norm, a.iters)}
    counted = whole([p.grad for p in params])
    rows["torch multi-tensor norm alone (the same tensors)"] = ms_per_call(
        lambda: torch.stack(torch._foreach_norm(counted, 2.0, dtype=torch.float32)).square().sum(), a.iters)
    for launch in a.launch:
        block, warps = (int(x) for x in launch.split(":"))
        for f in opt.flats:
            f.table = adamw_kernel.ChunkTable(f.params, f.offsets, f.device, block=block, num_warps=warps)
        rows[f"ours (norm + step), {block} per program, {warps} warps"] = ms_per_call(opt.step, a.iters)
    del opt
    torch.cuda.empty_cache()
    peer = torch.optim.AdamW([{"params": params, "weight_decay": 0.0}], lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                             fused=True)
    rows["torch AdamW fused (bf16), no norm"] = ms_per_call(peer.step, a.iters)
    print(f"{SHAPES[a.shape]}: {n / 1e9:.3f} B parameters in {len(params)} tensors, 14 bytes each (norm: 2),",
          torch.cuda.get_device_name())
    for name, ms in rows.items():
        moved = (2 if "alone" in name else 14) * n
        print(f"{name:50s} {ms:8.2f} ms  {moved / ms / 1e6:7.0f} GB/s")
    return 0


def vector_loads() -> str:
    """How many 16-byte vector loads the compiled kernels have (0: the scalar version)."""
    from adapter.train import adamw_kernel

    out = []
    for cache in getattr(adamw_kernel._adamw_chunks, "device_caches", {}).values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        for i, k in enumerate(kernels.values(), 1):  # in compilation order: aligned first (see main)
            ptx = getattr(k, "asm", {}).get("ptx", "")
            out.append(f"kernel {i}: {ptx.count('ld.global.v4') + ptx.count('ld.global.nc.v4')} v4 loads")
    return "; ".join(out) or "n/a"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--launch", nargs="*", default=["4096:8"], help="BLOCK:WARPS launch shapes (MoE shape)")
    a = ap.parse_args(argv)
    import torch
    from cuda_timing import ms_per_call  # bench/ is on the path when run as a script

    from adapter.train.optim import FlatAdamW

    cfg = json.loads((ROOT / f"configs/models/{SHAPES[a.shape]}/config.json").read_text())
    if "num_experts" in cfg:
        return moe_rows(cfg, a)
    shapes = param_shapes(cfg)
    n = sum(torch.Size(s).numel() for s in shapes)
    rows = {}

    def groups(params):
        return [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
                {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0}]

    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = FlatAdamW(groups(params), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, clip_grad=1.0)
    tables = [f.table for f in opt.flats]
    rows["ours, one launch"] = ms_per_call(opt.step, a.iters)
    for t in tables:
        t.sizes_aligned = False
    rows["ours, one launch, no alignment hints"] = ms_per_call(opt.step, a.iters)
    for f in opt.flats:
        f.table = None
    rows["ours, per-parameter calls"] = ms_per_call(opt.step, max(3, a.iters // 4))
    print("compiled:", vector_loads())
    del opt, params, tables
    torch.cuda.empty_cache()

    params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    peer = torch.optim.AdamW(groups(params), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    rows["torch AdamW fused (fp32)"] = ms_per_call(peer.step, a.iters)

    ref = rows["torch AdamW fused (fp32)"]
    print(f"{SHAPES[a.shape]}: {n / 1e9:.3f} B parameters, {BYTES_PER_PARAM} bytes each,",
          torch.cuda.get_device_name())
    for name, ms in rows.items():
        print(f"{name:40s} {ms:8.2f} ms  {BYTES_PER_PARAM * n / ms / 1e6:7.0f} GB/s  {ref / ms:5.2f}x torch fused")
    return 0


if __name__ == "__main__":
    sys.exit(main())
