"""One peer training process, run under torchrun. On 2 GPUs: the HF model trained by Accelerate's ND-parallel recipe
(FSDP2 or its TP plan) or by plain DeepSpeed ZeRO-3. On 1 GPU: plain transformers (bf16 parameters and AdamW states,
SDPA), the same with `torch.compile(model)`, and with Liger kernels (RoPE, RMSNorm, SwiGLU, fused linear
cross-entropy: what Axolotl's LigerPlugin switches on). Prints one `RESULT {json}` line on rank 0.

Same model shape (an HF config.json), tokens, optimizer (torch AdamW, fused on one GPU; clip 1.0) and MFU formula as
this project's runs. `model_state_bytes_per_param` lets compare.py report activation + logits memory (peak minus
weights, gradients and optimizer states), the one-GPU tables' memory measure (docs/BENCHMARKS.md, 2026-12-01).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["accelerate-fsdp2", "accelerate-tp", "deepspeed-hf", "hf", "hf-compile",
                                     "hf-liger"])
    ap.add_argument("--model-config", required=True, help="HF config.json of the shape to train")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    return ap.parse_args(argv)


def timed(step, warmup: int, steps: int):
    """(seconds per step, the last step's loss) after `warmup` untimed steps; the peak memory counts the timed ones.
    With ND_MEMORY_SNAPSHOT=path, one more step runs after them under the CUDA allocator's history, dumped there for
    bench/memory_peak.py (as nd-adapter's logging.profile_steps writes its own)."""
    import torch

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    took = (time.perf_counter() - t) / steps
    snapshot = os.environ.get("ND_MEMORY_SNAPSHOT")
    if snapshot:
        torch.cuda.memory._record_memory_history(max_entries=500_000)
        step()
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    return took, loss


def apply_liger(cfg) -> None:
    """Liger's kernels for the model's family, as Axolotl's liger_* keys apply them (before the model is built: it
    patches transformers' modules): RoPE, RMSNorm, the gated activation, the fused linear cross-entropy."""
    import liger_kernel.transformers as liger

    patch = {"llama": liger.apply_liger_kernel_to_llama, "phi3": liger.apply_liger_kernel_to_phi3,
             "gemma3_text": liger.apply_liger_kernel_to_gemma3_text,
             "qwen3_moe": getattr(liger, "apply_liger_kernel_to_qwen3_moe", None),
             "olmo3": getattr(liger, "apply_liger_kernel_to_olmo3", None)}[cfg.model_type]
    # Liger's RoPE rotates whole heads: a partial-rotary model (Phi-4-mini) keeps transformers' own
    # a mixture of experts keeps transformers' grouped_mm experts (Liger's swiglu swaps in its own expert module)
    moe = bool(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None))
    glu = {"geglu": True} if cfg.model_type.startswith("gemma") else {"swiglu": not moe}
    patch(rope=getattr(cfg, "partial_rotary_factor", 1.0) in (None, 1.0), rms_norm=True, cross_entropy=False,
          fused_linear_cross_entropy=True, **glu)


def main(argv=None) -> None:
    a = parse(argv)
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from adapter.models.arch import load_arch
    from adapter.models.counts import flops_per_token
    from adapter.train.metrics import mfu

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    cfg = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(a.model_config)))
    cfg.use_cache = False
    arch = load_arch(a.model_config)
    ckpt = f"/tmp/peer-{os.path.basename(os.path.dirname(os.path.abspath(a.model_config)))}"
    single = a.mode in ("hf", "hf-compile", "hf-liger")
    if a.mode == "hf-liger":  # before the model is built: it patches transformers' modules of the model's family
        apply_liger(cfg)
    if a.mode == "deepspeed-hf":
        import deepspeed

        deepspeed.init_distributed()
    elif single:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        from accelerate import Accelerator
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import FullyShardedDataParallelPlugin

        fsdp = a.mode == "accelerate-fsdp2"
        pc = ParallelismConfig(dp_shard_size=2) if fsdp else ParallelismConfig(tp_size=2)
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                                state_dict_type="SHARDED_STATE_DICT") if fsdp else None
        acc = Accelerator(mixed_precision="bf16", parallelism_config=pc, fsdp_plugin=plugin)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0 and not os.path.exists(f"{ckpt}/config.json"):  # TP plans load from a checkpoint
        torch.manual_seed(0)
        with torch.device("cuda"):
            AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16).save_pretrained(ckpt)
    dist.barrier()
    extra = {"tp_plan": "auto", "device_mesh": acc.torch_device_mesh} if a.mode == "accelerate-tp" else {}
    if getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None):
        extra["experts_implementation"] = "grouped_mm"  # transformers' fastest experts (NOTES.md: the MoE peer row)
    model = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.bfloat16, attn_implementation="sdpa",
                                                 use_cache=False, **extra)
    model.train()  # from_pretrained returns eval mode; Liger's fused linear cross-entropy runs only in training mode
    dp = 1 if a.mode == "accelerate-tp" else world
    if a.mode == "deepspeed-hf":
        conf = {"train_micro_batch_size_per_gpu": a.micro_batch, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
                "zero_optimization": {"stage": 3, "overlap_comm": True},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}}}
        model, opt, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)
    elif single:
        model = model.cuda()
        if a.mode == "hf-compile":
            model = torch.compile(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    else:
        if a.mode == "accelerate-tp":
            model = model.cuda()
        # foreach + DTensor TP crashes
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=a.mode != "accelerate-tp")
        model, opt = acc.prepare(model, opt)
    gen = torch.Generator(device="cuda").manual_seed(rank if dp > 1 else 0)
    ids = torch.randint(0, cfg.vocab_size, (a.micro_batch, a.seq), device="cuda", generator=gen)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        if a.mode == "deepspeed-hf":
            model.backward(loss)
            model.step()
        elif single:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            acc.backward(loss)
            if a.mode == "accelerate-fsdp2":
                acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        return loss

    dt, loss = timed(step, a.warmup, a.steps)
    tps = a.micro_batch * a.seq * dp / dt / world
    if rank == 0:
        print("RESULT " + json.dumps({
            "system": a.mode, "tokens_per_s_per_gpu": round(tps),
            "mfu": mfu(tps, flops_per_token(arch, a.seq), 989e12),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), "loss": round(float(loss), 4),
            # bf16 weights, bf16 gradients, bf16 AdamW moments (torch keeps them in the parameters' dtype)
            "num_params": sum(p.numel() for p in model.parameters()) * (world if a.mode == "accelerate-fsdp2" else 1),
            "model_state_bytes_per_param": 8}),
            flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
