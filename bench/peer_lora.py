"""The LoRA peer on one GPU, as an Axolotl user runs it: transformers + PEFT (r, alpha 2r, dropout 0, the seven Llama
linears), Liger's kernels (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy), SDPA, fused torch AdamW on the
adapters, clip 1.0; `--qlora`: the base loaded 4-bit by bitsandbytes (NF4, double quantisation, bf16 compute) and
prepared by PEFT's `prepare_model_for_kbit_training`, as Axolotl loads `adapter: qlora`; `--gc`: gradient
checkpointing (non-reentrant) with input gradients, as Axolotl's `gradient_checkpointing: true`. Random bf16 weights
of the shape given (saved once, then loaded). Prints one `RESULT {json}` line. Run by bench/lora_bench.py."""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-config", required=True)
    ap.add_argument("--qlora", action="store_true")
    ap.add_argument("--gc", action="store_true")
    ap.add_argument("--no-liger", action="store_true")
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args(argv)
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    from adapter.models import lora
    from adapter.models.arch import load_arch
    from adapter.train.metrics import mfu
    from bench.peers import apply_liger, timed

    src = os.path.dirname(os.path.abspath(a.model_config))
    cfg = AutoConfig.from_pretrained(src)
    arch = load_arch(a.model_config)
    if not a.no_liger:  # before the model is built: it patches transformers' modules of the model's family
        apply_liger(cfg)
    ckpt = f"/tmp/peer-lora-{os.path.basename(src)}"
    if not os.path.exists(f"{ckpt}/config.json"):
        torch.manual_seed(0)
        with torch.device("cuda"):
            AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(ckpt)
        torch.cuda.empty_cache()
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16) if a.qlora else None
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                 device_map={"": 0}, quantization_config=quant, use_cache=False)
    if a.qlora:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=a.gc)
    if a.gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=a.r, lora_alpha=2 * a.r, lora_dropout=0.0, task_type="CAUSAL_LM",
                                             target_modules=targets))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (a.micro_batch, a.seq), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(0))

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    dt, loss = timed(step, a.warmup, a.steps)
    tps = a.micro_batch * a.seq / dt
    spec = lora.resolve(arch, r=a.r, alpha=2 * a.r, target_linear=True)
    print("RESULT " + json.dumps({
        "system": "transformers + PEFT" + (" + bitsandbytes NF4" if a.qlora else "") + ("" if a.no_liger else
                                                                                         " + Liger")
                  + (" + grad checkpointing" if a.gc else ""),
        "tokens_per_s_per_gpu": round(tps), "mfu": mfu(tps, lora.flops_per_token(spec, arch, a.seq), 989e12),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), "loss": round(float(loss), 4)}), flush=True)


if __name__ == "__main__":
    main()
