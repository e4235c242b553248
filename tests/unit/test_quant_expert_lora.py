"""LoRA on quantised expert weights (Axolotl's quantize_moe_experts with lora_target_parameters) against an
independent reference: plain PEFT on the same model whose expert weights hold bitsandbytes' NF4 round trip as
ordinary weights (tests/helpers/quant_expert_lora.py; the GPU host runs the same on CUDA). The engine's path
quantises after PEFT wrapped the weights and runs PEFT's delta over the dequantising parametrisation
(adapter/patches/peft_params.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("bitsandbytes")


def test_lora_on_nf4_experts_is_peft_over_the_dequantised_weights_and_saves_as_on_a_16_bit_base():
    from tests.helpers.quant_expert_lora import compare

    compare("cpu")
