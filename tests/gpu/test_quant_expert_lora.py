"""GPU host only (`pytest -m gpu`): LoRA on NF4 expert weights (quantize_moe_experts + lora_target_parameters) on
CUDA, where bitsandbytes quantises with its CUDA kernels: equal to plain PEFT over the NF4 round trip of the same
weights (tests/helpers/quant_expert_lora.py; fp32)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_lora_on_nf4_experts_is_peft_over_the_dequantised_weights_on_cuda():
    pytest.importorskip("bitsandbytes")
    from tests.helpers.quant_expert_lora import compare

    torch.backends.cuda.matmul.allow_tf32 = False
    compare("cuda")
