"""Axolotl's linearized experts (`llama4_linearized_experts`; `model.linearized_experts`): a mixture whose experts
transformers keeps as 3-D weights, held instead as one `nn.Linear` per expert and projection. Axolotl publishes Llama 4
checkpoints in that layout (`axolotl-quants/Llama-4-*-Linearized-bnb-nf4-bf16`): bitsandbytes quantises linears, not
3-D parameters, so only this layout gives a 4-bit base whose experts are 4-bit too, and PEFT can target single
experts' projections (`experts.gate_projs.3`).

The record below is the one description every consumer reads: plan's meta-device model (`meta_layout`, so parameter
counts, the linears a 4-bit base quantises and PEFT's targets are the linearized model's), the builder
(adapter/modeling/hf_linearized.py: the layer that computes, swapped into transformers' module while the model is
built and loaded) and the export, which writes the experts back in transformers' fused layout so that the result
loads in transformers (what Axolotl's `delinearize-llama4` command does as a separate step).

Each expert computes down(up(x) · act(gate(x))) on the rows routed to it, exactly the fused layer's arithmetic: the
fused `gate_up_proj` [experts, hidden, 2 · ffn] holds gate's weight transposed in its first ffn columns and up's in
the rest, `down_proj` [experts, ffn, hidden] down's transposed (Axolotl's cli/delinearize_llama4.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapter.errors import bad


@dataclass(frozen=True)
class ExpertLinear:
    """One projection of every expert: `name` is the ModuleList of per-expert linears, `fused` the 3-D parameter of
    transformers' layer that holds them all ([experts, in, out]: x @ w), `part` which of its `parts` equal column
    blocks is this projection's; `in_key` / `out_key` the text config's sizes of one linear."""
    role: str  # gate / up / down
    name: str
    fused: str
    part: int
    parts: int
    in_key: str
    out_key: str


@dataclass(frozen=True)
class Linearized:
    model_types: tuple[str, ...]   # config.json's model_type (the image-text checkpoint's and its text model's)
    module: str                    # transformers' class whose instances hold the fused experts
    hf_module: str                 # the transformers module that defines it and `parent`
    parent: str                    # the class that constructs it (as `attr`), by its module-level name
    attr: str
    experts_key: str               # the text config's expert count
    act_key: str                   # the text config's activation (transformers' ACT2FN name)
    linears: tuple[ExpertLinear, ...]
    axolotl_key: str


LLAMA4 = Linearized(
    model_types=("llama4", "llama4_text"), module="Llama4TextExperts",
    hf_module="transformers.models.llama4.modeling_llama4", parent="Llama4TextMoe", attr="experts",
    experts_key="num_local_experts",
    act_key="hidden_act", axolotl_key="llama4_linearized_experts",
    linears=(ExpertLinear("gate", "gate_projs", "gate_up_proj", 0, 2, "hidden_size", "intermediate_size"),
             ExpertLinear("up", "up_projs", "gate_up_proj", 1, 2, "hidden_size", "intermediate_size"),
             ExpertLinear("down", "down_projs", "down_proj", 0, 1, "intermediate_size", "hidden_size")))
LAYOUTS = (LLAMA4,)


def for_model_type(model_type: str) -> Linearized | None:
    return next((r for r in LAYOUTS if model_type in r.model_types), None)


def check(cfg, arch) -> Linearized | None:
    """The run's linearized layout (None when it asks for none); one line where the model has none, or where a
    layout would split the per-expert linears in ways nd-adapter does not build (tensor parallelism: transformers'
    plan names the fused weights)."""
    from adapter.config import spell

    if not cfg.model.linearized_experts:
        return None
    key = spell(cfg, "model.linearized_experts")
    record = for_model_type(arch.hf_model_type)
    if record is None:
        known = ", ".join(t for r in LAYOUTS for t in r.model_types[:1])
        raise bad(key, True, f"{arch.architecture} has no linearized expert layout (built for: {known})",
                  "remove it: the checkpoint is in transformers' own layout")
    if cfg.parallelism.tp_size > 1:
        raise bad(key, True, "tensor parallelism over linearized experts is not built (transformers' plan splits "
                  "the fused expert weights)", "use tensor_parallel_size: 1 and shard with dp_shard_size (ZeRO-3)")
    return record


def sizes(record: Linearized, text: Any) -> tuple[int, list[tuple[ExpertLinear, int, int]]]:
    """(experts, [(projection, in_features, out_features)]) from the text config."""
    return (int(getattr(text, record.experts_key)),
            [(lin, int(getattr(text, lin.in_key)), int(getattr(text, lin.out_key))) for lin in record.linears])


def meta_layout(model: Any, record: Linearized) -> int:
    """Replace, on a meta-device model (plan's facts, PEFT's counts), every instance of the record's fused module by
    the linearized one's parameters: per-expert `nn.Linear`s under the names the checkpoint and PEFT use. Returns
    how many were replaced. (The layer that computes is adapter/modeling/hf_linearized.py's.)"""
    import torch

    text = getattr(model.config, "get_text_config", lambda: model.config)()
    experts, linears = sizes(record, text)
    swapped = 0
    for name, mod in list(model.named_modules()):
        if type(mod).__name__ != record.module:
            continue
        new = torch.nn.Module()
        for lin, fan_in, fan_out in linears:
            setattr(new, lin.name, torch.nn.ModuleList(
                torch.nn.Linear(fan_in, fan_out, bias=False, device="meta") for _ in range(experts)))
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
        swapped += 1
    return swapped


def fused_name(record: Linearized, key: str) -> tuple[str, ExpertLinear, int] | None:
    """For a linearized state-dict key (`...experts.gate_projs.3.weight`): (the fused key, its projection, the
    expert); None for any other key."""
    parts = key.split(".")
    for lin in record.linears:
        if len(parts) >= 3 and parts[-1] == "weight" and parts[-3] == lin.name and parts[-2].isdigit():
            return ".".join([*parts[:-3], lin.fused]), lin, int(parts[-2])
    return None


__all__ = ["ExpertLinear", "Linearized", "LLAMA4", "LAYOUTS", "for_model_type", "check", "sizes", "meta_layout",
           "fused_name"]
