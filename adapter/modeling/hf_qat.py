"""`qat:` on transformers' model: torchao's fake-quantised linears as Axolotl 067b021 prepares them
(utils/quantization.py), so the run trains the weights a quantised model will have.

`prepare` swaps every `nn.Linear` of the model (the LM head included: Axolotl's `quantize_(model, config)` filters
nothing) for torchao's fake-quantised one, with the fake-quantise configs Axolotl's `_make_qat_config` builds for the
(weight, activation) pair (adapter/config/schema_qat.FAKE_QUANT), and with `quantize_embedding` the embeddings
too (weights only). The forward rounds each weight (and input) through the format and back, the backward passes the
gradient straight through, and the parameters stay the model's own (their names and shapes unchanged: checkpoints,
ZeRO's partitions and the export are those of the model without QAT). `at_step` is Axolotl's QATCallback:
with `fake_quant_after_n_steps` the fake quantisation is off for the steps before it, on from then; like that
callback it switches torchao's integer and float8 quantisers, not MXFP4's, which stay on. The export writes the
plain weights, as Axolotl's `convert_qat_model` leaves them (quantising them is a separate step, `axolotl quantize`).
"""
from __future__ import annotations

import torch


def _configs(q, *, embedding: bool = False):
    """(weight, activation) fake-quantise configs for `q` (a QATSection), Axolotl's `_make_qat_config`."""
    from torchao.quantization.qat.fake_quantize_config import (
        Float8FakeQuantizeConfig,
        Int4WeightFakeQuantizeConfig,
        IntxFakeQuantizeConfig,
    )

    w, a = q.weight_dtype, None if embedding else q.activation_dtype
    if w == "mxfp4":
        from torchao.prototype.qat import MXFakeQuantizeConfig

        mx = MXFakeQuantizeConfig(dtype=torch.float4_e2m1fn_x2, block_size=32)
        return mx, mx
    if w == "int4":
        kw = {"group_size": q.group_size or 128}  # (Axolotl: the base config's own, 128, where none is given)
        if a == "int8":
            kw["activation_dtype"] = torch.bfloat16
        elif a == "float8_e4m3fn":
            kw["activation_dtype"] = torch.float8_e4m3fn
        weight = Int4WeightFakeQuantizeConfig(**kw)
    else:
        weight = Float8FakeQuantizeConfig(dtype=torch.float8_e4m3fn)
    act = (IntxFakeQuantizeConfig(dtype=torch.int8, granularity="per_token", is_symmetric=False) if a == "int8" else
           Float8FakeQuantizeConfig(dtype=torch.float8_e4m3fn) if a == "float8_e4m3fn" else None)
    return weight, act


def prepare(model, q) -> None:
    """Fake-quantise `model`'s linears (and embeddings) in place, before anything wraps or shards them."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    weight, act = _configs(q)
    quantize_(model, QATConfig(weight_config=weight, activation_config=act))
    if q.quantize_embedding:
        weight, _ = _configs(q, embedding=True)
        quantize_(model, QATConfig(weight_config=weight), filter_fn=lambda m, _: isinstance(m, torch.nn.Embedding))


def at_step(model, q, step: int) -> None:
    """Before optimizer step `step` (1-based): fake quantisation on from step `fake_quant_after_n_steps` + 1, as
    Axolotl's QATCallback switches it when `global_step` (the steps done) reaches that number."""
    if q is None or q.fake_quant_after_n_steps is None:
        return
    from torchao.quantization.qat.embedding import FakeQuantizedEmbedding
    from torchao.quantization.qat.linear import FakeQuantizedLinear

    on = step - 1 >= q.fake_quant_after_n_steps
    for m in model.modules():
        if isinstance(m, (FakeQuantizedLinear, FakeQuantizedEmbedding)):
            quantisers = [m.weight_fake_quantizer, getattr(m, "activation_fake_quantizer", None)]
            for fq in quantisers:
                if fq is not None and hasattr(fq, "enabled"):
                    fq.enabled = on


__all__ = ["prepare", "at_step"]
