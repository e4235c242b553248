"""Axolotl's `quantize_moe_experts` (`lora.quantize_experts`): a mixture's fused 3-D expert weights, which
transformers keeps as parameters of their own and bitsandbytes' 4/8-bit loading leaves 16-bit, quantised too, in the
base's format (NF4 or int8), through a parametrisation as Axolotl's loader does at 067b021 (monkeypatch/moe_quant.py):
each use dequantises the whole weight (a layer's experts at once). The transformers engine only (a native family's
run moves there: lora.check_native); torch-free facts here, the quantising in adapter/modeling/hf_quant_experts.py.
"""
from __future__ import annotations

from adapter.errors import bad


def is_expert_weight(name: str, dims: int) -> bool:
    """Axolotl's rule for what quantize_moe_experts quantises (its monkeypatch/moe_quant.py at 067b021): a parameter
    of three or more dimensions whose full name mentions an expert (a mixture's fused expert weights, which
    transformers keeps as 3-D parameters and bitsandbytes' loading leaves 16-bit)."""
    return dims >= 3 and "expert" in name.lower()


def check(cfg) -> None:
    """What `lora.quantize_experts` needs, each in one line as Axolotl's schema refuses it (a 4/8-bit base; not with
    lora_target_linear) or where it is not built here (experts split over ep ranks). LoRA on the quantised experts
    themselves (lora_target_parameters) is PEFT's delta over the dequantised weight, as Axolotl's patched PEFT
    computes it (adapter/modeling/hf_build.add_peft). Under ZeRO-3 the codes are partitioned like any frozen
    parameter: reading the weight calls its parametrisation module, whose hooks gather them
    (generic_run.quantized_base_zero3)."""
    from adapter.config import spell

    c, key = cfg.lora, spell(cfg, "lora.quantize_experts")
    problem = (("it quantises the experts as the base is quantised, and the base is 16-bit",
                "set load_in_4bit: true (adapter: qlora), or remove it") if not c.quantize_base else
               ("Axolotl refuses lora_target_linear beside it", "list lora_target_modules instead")
               if c.target_linear else
               ("experts split over expert-parallel ranks are not built 4-bit",
                "use expert_parallel_size: 1") if cfg.parallelism.ep_size > 1 else None)
    if problem is not None:
        raise bad(key, True, *problem)
