"""Core-attention throughput: our SDPAttention vs Megatron-Core's local DotProductAttention (GPU host).

    python bench/attention_bench.py --seq 4096 --batch 2   # Llama-3.2-1B heads: 32 query, 8 KV, head_dim 64

Times forward+backward of the core attention alone (after QKV projection) in bf16, causal, GQA, and reports
ms/iter, TFLOP/s (4·b·s²·h·d / 2 for causal, ×3.5 for fwd+bwd) and peak memory, one row per module.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from adapter.kernels.attention import SDPAttention
    from adapter.modeling.gpt import transformer_config
    from adapter.models.arch import arch_from_hf_dict

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    ps.initialize_model_parallel()
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(0)  # the local module forks Megatron's CUDA RNG tracker
    arch = arch_from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": a.heads * a.head_dim,
                              "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads,
                              "head_dim": a.head_dim, "intermediate_size": 4 * a.heads * a.head_dim,
                              "num_hidden_layers": 1, "vocab_size": 1024})
    cfg = transformer_config(arch, params_dtype=torch.bfloat16, bf16=True)
    s, b, h, g, d = a.seq, a.batch, a.heads, a.kv_heads, a.head_dim
    flops = 3.5 * 4 * b * s * s * h * d / 2
    rows = []
    for name, cls in (("nd-adapter SDPAttention", SDPAttention),
                      ("megatron local DotProductAttention", DotProductAttention)):
        mod = cls(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self").cuda()
        q = torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(s, b, g, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(s, b, g, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for i in range(a.iters + 3):
            if i == 3:
                torch.cuda.synchronize()
                t = time.perf_counter()
            mod(q, k, v, None).sum().backward()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) / a.iters * 1e3
        rows.append({"module": name, "seq": s, "batch": b, "ms_fwd_bwd": round(ms, 3),
                     "tflops": round(flops / ms / 1e9, 1),
                     "peak_extra_gib": round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)})
        del mod, q, k, v
    rows.append({"speedup_sdpa_vs_local": round(rows[1]["ms_fwd_bwd"] / rows[0]["ms_fwd_bwd"], 2)})
    for r in rows:
        print("RESULT", json.dumps(r), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
