"""Pre-quantised checkpoints (`quantization_config` in config.json), named in words by every command that reads the
model (adapter/models/arch.py calls `check_not_quantised` before either engine reads the config). bitsandbytes NF4
and int8 checkpoints hold exactly what `load_in_4bit` / `load_in_8bit` make of the 16-bit weights, and transformers
loads those codes itself: the transformers engine trains QLoRA adapters on them (the native engine's layers take
their own quantisation, so `model.engine: auto` moves such a checkpoint to transformers' model). MXFP4 (gpt-oss as
OpenAI ships it) and fine-grained FP8 (DeepSeek-V3, MiniMax-M2) checkpoints train where the config asks for them
dequantized (`model.dequantize`, Axolotl's `model_quantization_config: Mxfp4Config` with `dequantize: true`):
transformers' own loader turns their codes into 16-bit weights on the transformers engine, as Axolotl loads them.
Every other method (GPTQ, AWQ, NVFP4, ...) is refused in one line."""
from __future__ import annotations

from typing import Any

from adapter.errors import bad


def quant_method(q: dict[str, Any]) -> str:
    """A `quantization_config`'s method in words: transformers' quant_method with the format it names (bitsandbytes'
    NF4 / FP4 / int8, ModelOpt's quant_algo, compressed-tensors' format); checkpoints written before transformers
    stored quant_method are bitsandbytes' (load_in_4bit / load_in_8bit)."""
    method = q.get("quant_method") or ("bitsandbytes" if q.get("load_in_4bit") or q.get("load_in_8bit") else None)
    if method == "bitsandbytes":
        return f"bitsandbytes {'int8' if q.get('load_in_8bit') else str(q.get('bnb_4bit_quant_type') or 'fp4')}"
    detail = q.get("quant_algo") or q.get("format")
    return f"{method} {detail}" if isinstance(detail, str) else str(method or "unnamed")


# quant_method -> the transformers class whose `dequantize=True` loads such a checkpoint as 16-bit weights
DEQUANTIZABLE = {"mxfp4": "Mxfp4Config", "fp8": "FineGrainedFP8Config"}


def dequantizable(cfg: dict[str, Any]) -> str | None:
    """The transformers quantization class that dequantizes this checkpoint's codes as it loads, or None."""
    q = cfg.get("quantization_config")
    return DEQUANTIZABLE.get(str(q.get("quant_method"))) if isinstance(q, dict) else None


def loadable_codes(cfg: dict[str, Any]) -> str | None:
    """"nf4" / "int8" for a bitsandbytes checkpoint whose codes transformers loads as a QLoRA base; else None."""
    q = cfg.get("quantization_config")
    method = quant_method(q) if isinstance(q, dict) else ""
    return {"bitsandbytes nf4": "nf4", "bitsandbytes int8": "int8"}.get(method)


def check_not_quantised(cfg: dict[str, Any], source: str, native: Any = None, dequantize: str | None = None) -> None:
    """A pre-quantised checkpoint (`quantization_config`: bitsandbytes, GPTQ, AWQ, fp8, NVFP4, ...) stores codes
    and scales where config.json's shapes say 16-bit weights, so converting it would fail tensor by tensor with a
    misleading shape error. Refused here, in one line naming the method, except bitsandbytes NF4 / int8 codes
    (`loadable_codes`): transformers' model loads them; `native` (arch.unbuilt, for the native engine's reading)
    turns those into the reason `model.engine: auto` takes the transformers engine. `dequantize`: the key that asks
    for an MXFP4 or FP8 checkpoint as 16-bit weights, as the config spells it (model.dequantize; Axolotl's
    model_quantization_config), where it is on: transformers' loader dequantizes (`dequantizable`), on its engine."""
    q = cfg.get("quantization_config")
    if q is not None and not isinstance(q, dict):
        raise bad("quantization_config", q, f"must be a mapping in {source}", "fix the model's config.json")
    base = "point base_model (model.path) at the 16-bit checkpoint it was quantised from"
    if q is None:
        if dequantize:
            raise bad(dequantize, True, f"{source} is not a pre-quantised checkpoint (no quantization_config)",
                      "remove it")
        return
    method = quant_method(q) if isinstance(q, dict) else ""
    cls = dequantizable(cfg)
    if cls and (dequantize or native is not None):  # never the native layers': the config decides the rest
        if native is None:
            return
        raise native("quantization_config", method, "a pre-quantised checkpoint: transformers' loader dequantizes "
                     "its codes into its own model, not into the native layers", "model.engine: auto or transformers")
    if dequantize:
        raise bad(dequantize, True, f"{source} is a {method} checkpoint, which transformers does not "
                  "dequantize as it loads (MXFP4 and FP8 only)", "point base_model at its 16-bit checkpoint")
    if cls:
        raise bad("quantization_config", method, f"{source} is a pre-quantised checkpoint ({method} codes, not "
                  "16-bit weights), which trains dequantized", "set model.dequantize: true (Axolotl: "
                  f"model_quantization_config: {cls} with model_quantization_config_kwargs: {{dequantize: true}}), or "
                  "point base_model at its 16-bit checkpoint")
    if loadable_codes(cfg):
        if native is None:
            return
        raise native("quantization_config", method, "a pre-quantised checkpoint: its stored codes load into "
                     "transformers' own model, not the native layers", "model.engine: auto or transformers")
    if method.startswith("bitsandbytes"):
        bits = "load_in_8bit" if method.endswith("int8") else "load_in_4bit"
        raise bad("quantization_config", method, f"{source} is a pre-quantised checkpoint ({method} "
                  "codes, not 16-bit weights): loading its stored codes as the frozen base is not built",
                  f"{base} and keep adapter: qlora with {bits}: true, which quantises it as it loads (what "
                  "Axolotl's QLoRA does)")
    raise bad("quantization_config", method, f"{source} is a pre-quantised checkpoint ({method}): "
              "nd-adapter loads and trains 16/32-bit weights only", f"{base}; for a 4-bit frozen base add adapter: "
              "qlora with load_in_4bit: true")


__all__ = ["DEQUANTIZABLE", "quant_method", "dequantizable", "loadable_codes", "check_not_quantised"]
