"""Pre-quantised checkpoints (`quantization_config` in config.json), named in words by every command that reads the
model (adapter/models/arch.py calls `check_not_quantised` before either engine reads the config). bitsandbytes NF4
and int8 checkpoints hold exactly what `load_in_4bit` / `load_in_8bit` make of the 16-bit weights, and transformers
loads those codes itself: the transformers engine trains QLoRA adapters on them (the native engine's layers take
their own quantisation, so `model.engine: auto` moves such a checkpoint to transformers' model). Every other method
(GPTQ, AWQ, fp8, NVFP4, ...) is refused in one line."""
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


def loadable_codes(cfg: dict[str, Any]) -> str | None:
    """"nf4" / "int8" for a bitsandbytes checkpoint whose codes transformers loads as a QLoRA base; else None."""
    q = cfg.get("quantization_config")
    method = quant_method(q) if isinstance(q, dict) else ""
    return {"bitsandbytes nf4": "nf4", "bitsandbytes int8": "int8"}.get(method)


def check_not_quantised(cfg: dict[str, Any], source: str, native: Any = None) -> None:
    """A pre-quantised checkpoint (`quantization_config`: bitsandbytes, GPTQ, AWQ, fp8, NVFP4, ...) stores codes
    and scales where config.json's shapes say 16-bit weights, so converting it would fail tensor by tensor with a
    misleading shape error. Refused here, in one line naming the method, except bitsandbytes NF4 / int8 codes
    (`loadable_codes`): transformers' model loads them; `native` (arch.unbuilt, for the native engine's reading)
    turns those into the reason `model.engine: auto` takes the transformers engine."""
    q = cfg.get("quantization_config")
    if q is None:
        return
    if not isinstance(q, dict):
        raise bad("quantization_config", q, f"must be a mapping in {source}", "fix the model's config.json")
    method = quant_method(q)
    base = "point base_model (model.path) at the 16-bit checkpoint it was quantised from"
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


__all__ = ["quant_method", "loadable_codes", "check_not_quantised"]
