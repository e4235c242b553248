"""`qat:` (Axolotl's key of that name): quantisation-aware training with torchao's fake-quantised linears, as Axolotl
067b021 prepares it (utils/quantization.py: `prepare_model_for_qat`, its QATCallback, `convert_qat_model` before the
save). The combinations built are the ones Axolotl's `_make_qat_config` turns into explicit fake-quantise configs
(FAKE_QUANT below); the rest is refused in one line. What the engine does: adapter/modeling/hf_qat.py.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from adapter.config.values import Strict as _Strict
from adapter.errors import bad

DTYPES = ("int4", "int8", "float8_e4m3fn", "mxfp4", "nvfp4")
ALIASES = {"fp8": "float8_e4m3fn", "float8": "float8_e4m3fn"}  # Axolotl's validate_ao_dtype
# (weight, activation) -> (weight's fake quantiser, activation's), Axolotl's _make_qat_config: int4 weights in groups
# (their emulated activation dtype: bf16 beside int8 activations, fp8 beside fp8 ones, torchao's default fp8 alone),
# int8 activations per token and asymmetric, fp8 as torchao's Float8FakeQuantizeConfig, MXFP4 on both in blocks of 32
FAKE_QUANT = {("int4", None): ("int4 groups (fp8 activation emulation)", None),
              ("int4", "int8"): ("int4 groups (bf16 activation emulation)", "int8 per token, asymmetric"),
              ("int4", "float8_e4m3fn"): ("int4 groups (fp8 activation emulation)", "float8_e4m3fn"),
              ("float8_e4m3fn", None): ("float8_e4m3fn", None),
              ("float8_e4m3fn", "int8"): ("float8_e4m3fn", "int8 per token, asymmetric"),
              ("float8_e4m3fn", "float8_e4m3fn"): ("float8_e4m3fn", "float8_e4m3fn"),
              ("mxfp4", "mxfp4"): ("mxfp4 blocks of 32", "mxfp4 blocks of 32")}


class QATSection(_Strict):
    weight_dtype: Literal["int4", "int8", "float8_e4m3fn", "mxfp4", "nvfp4"] = Field(
        "int8", description="the weights' fake quantisation (Axolotl's default int8, which torchao's QAT refuses)")
    activation_dtype: Literal["int4", "int8", "float8_e4m3fn", "mxfp4", "nvfp4"] | None = Field(
        None, description="the linears' inputs' fake quantisation; unset: none")
    group_size: int | None = Field(32, gt=0, description="elements per group of the int4 weights' scales (Axolotl's "
                                                         "default 32; MXFP4's block: 32)")
    quantize_embedding: bool = Field(False, description="fake-quantise the embedding's weights too")
    fake_quant_after_n_steps: int | None = Field(None, ge=0, description="the fake quantisation is off for the first "
                                                 "n steps, on from then (Axolotl's QATCallback)")

    @field_validator("weight_dtype", "activation_dtype", mode="before")
    @classmethod
    def _alias(cls, v: object) -> object:
        return ALIASES.get(v, v) if isinstance(v, str) else v


class QATFields(_Strict):
    """`qat:` on the run, mixed into schema.py's `RunConfig`; what is not built refused in one line each."""
    qat: QATSection | None = Field(None, description="quantisation-aware training (Axolotl's qat:); unset: none")

    @model_validator(mode="after")
    def _qat_scope(self) -> QATFields:
        q = self.qat
        if q is None:
            return self
        ax = self.source == "axolotl"  # type: ignore[attr-defined]
        key = (lambda k: f"qat.{k}")  # noqa: E731 - Axolotl's and the native key alike
        pair = (q.weight_dtype, q.activation_dtype)
        if q.weight_dtype == "nvfp4" or q.activation_dtype == "nvfp4":
            raise bad(key("weight_dtype"), q.weight_dtype, "NVFP4 QAT is not built: Axolotl hands torchao its "
                      "NVFP4WeightOnlyConfig, from which torchao 0.18 derives no fake quantiser", "use int4 weights "
                      "(activation_dtype int8) or mxfp4, or run this config with Axolotl")
        if pair not in FAKE_QUANT:
            built = ", ".join(f"{w}/{a}" for w, a in FAKE_QUANT)
            raise bad(key("weight_dtype"), q.weight_dtype, f"with activation_dtype {q.activation_dtype}: not a "
                      f"combination torchao's QAT builds as Axolotl asks it (built: weight/activation {built})",
                      "pick one of those")
        if q.weight_dtype == "mxfp4" and q.quantize_embedding:
            raise bad(key("quantize_embedding"), True, "Axolotl's MXFP4 config fake-quantises activations too, "
                      "which torchao refuses on an embedding (Axolotl's run fails there)", "remove it")
        if q.weight_dtype == "mxfp4" and q.group_size not in (None, 32):
            raise bad(key("group_size"), q.group_size, "MXFP4 scales blocks of 32 (Axolotl refuses another size)",
                      "set it to 32")
        if self.lora is not None:  # type: ignore[attr-defined]
            raise bad("adapter" if ax else "lora", "lora", "QAT beside LoRA is not built (Axolotl's examples train "
                      "every weight with it)", "remove the adapter, or remove qat")
        p = self.parallelism  # type: ignore[attr-defined]
        for name, size in (("tp_size", p.tp_size), ("cp_size", p.cp_size), ("ep_size", p.ep_size)):
            if size > 1:
                raise bad(f"parallelism.{name}", size, "QAT's fake-quantised linears are built beside data "
                          "parallelism and ZeRO only", "set it to 1 (dp_shard_size shards a QAT run)")
        if self.model.compile is True:  # type: ignore[attr-defined]
            raise bad("torch_compile" if ax else "model.compile", True, "compiled layers beside QAT's fake "
                      "quantisation are not checked", "remove it")
        return self


__all__ = ["DTYPES", "FAKE_QUANT", "QATSection", "QATFields"]
