"""LoRA on NF4 expert weights (quantize_moe_experts + lora_target_parameters) through the engine's path
(adapter/modeling/hf_build.add_peft) beside an independent reference: plain PEFT on the same model whose expert
weights hold bitsandbytes' NF4 round trip as ordinary weights. Shared by the CPU test and the GPU host's."""
from __future__ import annotations

import torch

TARGETS = ("experts.gate_up_proj", "experts.down_proj")


def tiny_moe(device: str):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=96, num_experts=4,
                         num_experts_per_tok=2, architectures=["Qwen3MoeForCausalLM"])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(device)


def nf4_round_trip_experts(model) -> None:
    """Every 3-D expert weight replaced by bitsandbytes' NF4 round trip (double quantisation, blocks of 64), held as
    ordinary weights: what a quantised expert weight computes, with nothing parametrised."""
    import bitsandbytes.functional as F

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 3 and "expert" in name.lower():
                p.copy_(F.dequantize_4bit(*F.quantize_4bit(p.data, compress_statistics=True, quant_type="nf4")))


def _train(model, device: str, steps: int = 3) -> list[float]:
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 96, (2, 12), generator=g).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def compare(device: str) -> None:
    """Three SGD steps each way: equal losses, only the dequantising parametrisation left after the forwards, and
    the saved adapter PEFT's own (its wrappers nested as on a 16-bit base)."""
    import peft

    from adapter.modeling.hf_build import add_peft
    from adapter.models.generic_run import PeftSpec

    spec = PeftSpec(r=4, alpha=8, dropout=0.0, rslora=False, target_modules=(), layers=None, modules_to_save=(),
                    init_from=None, added=0, trained=0, matched=(), quantize_base="nf4", target_parameters=TARGETS,
                    experts=(1,))
    ours = add_peft(tiny_moe(device), spec, seed=7)
    ref = tiny_moe(device)
    nf4_round_trip_experts(ref)
    torch.manual_seed(7)
    ref = peft.get_peft_model(ref, peft.LoraConfig(**spec.lora_config()))
    for m in (ours, ref):  # B starts at zero: give it values, so the deltas count from the first step
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.data.copy_(torch.linspace(-0.1, 0.1, p.numel()).reshape(p.shape))
    quantised = [m for m in ours.modules() if hasattr(m, "parametrizations")]
    assert quantised and all(p.original.dtype == torch.uint8 for m in quantised for p in m.parametrizations.values())
    got, want = _train(ours, device), _train(ref, device)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)
    # each forward's delta removed again: only the dequantising parametrisation stays
    assert all(len(m.parametrizations[k]) == 1 for m in quantised for k in m.parametrizations)
    saved, plain = (peft.get_peft_model_state_dict(m) for m in (ours, ref))
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in plain.items()}  # PEFT's nesting
    assert all(torch.allclose(saved[k], plain[k], atol=1e-5) for k in saved)
