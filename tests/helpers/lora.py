"""LoRA runs against transformers + PEFT (+ bitsandbytes), shared by the LoRA, QLoRA and MoE fine-tuning tests: the
native config of a small LoRA run, PEFT's reference training of the same adapter on the same samples, and the model
with bitsandbytes' dequantised weights that a PEFT QLoRA / 8-bit run computes with."""
from __future__ import annotations

from pathlib import Path

from adapter import config
from tests.helpers.sft import packed_examples

SEQ, LR, STEPS = 128, 2e-3, 4
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_section(peft_kw: dict, init_from: str | None) -> dict:
    """The native `lora:` section of PEFT's LoraConfig keywords `peft_kw`, started from the adapter `init_from`."""
    out = {"r": peft_kw["r"], "alpha": peft_kw["lora_alpha"], "target_modules": peft_kw["target_modules"],
           "rslora": peft_kw.get("use_rslora", False), "modules_to_save": peft_kw.get("modules_to_save", [])}
    return out | ({"init_from": init_from} if init_from else {})


def lora_cfg(model_dir, root, shape, micro, lora: dict, world=2, steps=STEPS, **over):
    """A LoRA run of `model_dir` on the demo's chat set (packed, fp32, constant lr) at (dp_shard, cp, tp) = `shape`;
    `over`: dotted keys set on top."""
    from adapter.demo.build import ASSETS

    s, c, t = shape
    raw = {"model": {"path": str(model_dir), "cache_dir": f"{root}/cache"},
           "parallelism": {"dp_shard_size": s, "cp_size": c, "tp_size": t},
           "batch": {"micro_batch_size": micro, "gradient_accumulation_steps": 1}, "seq_len": SEQ,
           "precision": "fp32", "lora": lora,
           "optimizer": {"lr": LR, "schedule": "constant", "warmup_steps": 0, "max_steps": steps, "clip_grad": 1e12},
           "data": {"datasets": [{"path": str(ASSETS / "chat_genesis.jsonl"), "type": "chat_template"}],
                    "chat_template": "chatml", "sample_packing": True, "prepared_path": f"{root}/prep"}}
    for k, v in over.items():
        config.set_dotted(raw, k, v)
    return config.build(raw, env={}, world_size=world)


PROBE = [[5, 17, 300, 42, 7, 99, 512, 3, 8, 260, 61, 400, 2, 77, 31, 19]]  # token ids for the logit comparisons


def peft_reference(model_dir: str, adapter_dir: str, data, cfg, global_batch: int = 2, plus: float | None = None,
                   **load):
    """transformers + PEFT from the adapter, on the samples nd-adapter reads, each packed example on its own; `load`:
    from_pretrained's keywords for the base (default fp32 on the CPU); `plus`: LoRA+'s ratio, the optimizer PEFT's
    create_loraplus_optimizer as Axolotl calls it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from adapter.data import DPSampler

    order = iter(DPSampler(len(data.train), dp_rank=0, dp_size=1, micro_batch=global_batch, seed=cfg.data.seed))
    base = AutoModelForCausalLM.from_pretrained(model_dir, **(load or {"dtype": torch.float32}))
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    dev = base.device
    with torch.no_grad():
        before = model(input_ids=torch.tensor(PROBE, device=dev)).logits.float()
    trained = [p for p in model.parameters() if p.requires_grad]
    if plus is None:
        opt = torch.optim.AdamW(trained, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    else:
        from peft.optimizers import create_loraplus_optimizer

        opt = create_loraplus_optimizer(model, torch.optim.AdamW, lr=LR, loraplus_lr_ratio=plus, betas=(0.9, 0.95),
                                        eps=1e-8)
    losses = []
    for _ in range(STEPS):
        total, count = 0.0, 0.0
        for i in next(order):
            for loss_sum, n, _ in packed_examples(model, data.train, i, device=dev):
                total, count = total + loss_sum, count + n
        loss = total / count
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "before": before, "trained": {n for n, p in model.named_parameters()
                                                              if p.requires_grad}}


def bnb_reference(model_dir: str, fmt: str, out: Path) -> tuple[Path, dict]:
    """The model with every decoder linear replaced by bitsandbytes' dequantisation of its quantisation (what a PEFT
    QLoRA / 8-bit run computes with), and bitsandbytes' per-element codes and scales of each HF tensor."""
    import bitsandbytes.functional as bnbf
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    codes = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("proj.weight"):
                continue
            if fmt == "nf4":
                q, state = bnbf.quantize_4bit(p.data, blocksize=64, compress_statistics=True, quant_type="nf4")
                deq = bnbf.dequantize_4bit(q, state)
                scale = (bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset).float()
                packed = q.reshape(-1)
                per = torch.stack([packed >> 4, packed & 15], 1).reshape(p.shape)
                codes[name] = (per.numpy(), scale.view(p.shape[0], -1).numpy())
            else:
                cb, scb, _ = bnbf.int8_vectorwise_quant(p.data.half())  # as Int8Params quantises
                deq = bnbf.int8_vectorwise_dequant(cb, scb)
                codes[name] = (cb.numpy(), scb.numpy())
            assert not torch.equal(deq, p.data)  # quantisation changed the weights: the comparison can fail
            p.copy_(deq)
    model.save_pretrained(out)
    return out, codes
