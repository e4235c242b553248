"""Axolotl's linearized experts on the transformers engine (the layout: adapter/models/linearized.py).

`building(record)` is the `with` under which transformers' model is built and loaded: the class that constructs the
experts (Llama 4's `Llama4TextMoe`) is bound to a subclass that holds `LinearizedExperts` in their place
(adapter/patches/hf_classes.py), so `from_pretrained` reads the checkpoint's per-expert linears, bitsandbytes
quantises them as it quantises every linear (Axolotl's reason for the layout: a 4-bit base whose experts are 4-bit),
and PEFT can target them. transformers' `_init_weights` initialises them as linears (normal, the model's
initializer_range: the distribution of the fused weights' init).

`fused_state` turns a state dict back into transformers' layout for the export, `linearized_state` the other way (a
checkpoint of transformers' Llama 4 in Axolotl's layout, for tests and for users who have only the original)."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from adapter.models.linearized import Linearized, fused_name, sizes
from adapter.patches.hf_classes import swapped


class LinearizedExperts(torch.nn.Module):
    """Every expert's projections as `nn.Linear`s, computing what transformers' fused layer computes on the same
    input: rows grouped by expert ([experts · tokens, hidden], each token's copy pre-scaled by its router score, as
    Llama 4's MoE hands them over), each group through down(up(x) · act(gate(x))) (Axolotl's
    monkeypatch/models/llama4/modeling.py: the same order of operations)."""

    def __init__(self, config, record: Linearized):
        from transformers.activations import ACT2FN

        super().__init__()
        self.num_experts, linears = sizes(record, config)
        self.hidden_size = next(fan_in for lin, fan_in, _ in linears if lin.role == "gate")
        for lin, fan_in, fan_out in linears:
            setattr(self, lin.name, torch.nn.ModuleList(
                torch.nn.Linear(fan_in, fan_out, bias=False) for _ in range(self.num_experts)))
        self._roles = {lin.role: lin.name for lin in record.linears}
        self.act_fn = ACT2FN[getattr(config, record.act_key)]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, self._roles[r]) for r in ("gate", "up", "down"))
        x = hidden_states.view(self.num_experts, -1, self.hidden_size)
        out = [down[e](up[e](x[e]) * self.act_fn(gate[e](x[e]))) for e in range(self.num_experts)]
        return torch.stack(out).view(-1, self.hidden_size)


@contextmanager
def building(record: Linearized | None):
    """Inside: transformers builds the record's layers with linearized experts (nothing changes for None)."""
    if record is None:
        yield
        return

    def make(parent: type) -> type:
        def __init__(self, config, *args, **kwargs):
            parent.__init__(self, config, *args, **kwargs)
            setattr(self, record.attr, LinearizedExperts(config, record))

        return type(f"Linearized{parent.__name__}", (parent,), {"__init__": __init__})

    with swapped(record.hf_module, record.parent, make):
        yield


def fused_state(state: dict[str, torch.Tensor], record: Linearized) -> dict[str, torch.Tensor]:
    """A state dict with linearized experts -> transformers' fused layout (every other entry as it is): each
    `<prefix>.<fused>` stacked over the experts, each projection's weight transposed into its block of columns."""
    groups: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    parts: dict[str, int] = {}
    out = {}
    for key, value in state.items():
        hit = fused_name(record, key)
        if hit is None:
            out[key] = value
            continue
        fused, lin, expert = hit
        groups.setdefault(fused, {})[(expert, lin.part)] = value
        parts[fused] = lin.parts
    for fused, blocks in groups.items():
        experts = 1 + max(e for e, _ in blocks)
        out[fused] = torch.stack([torch.cat([blocks[(e, p)].t() for p in range(parts[fused])], dim=1)
                                  for e in range(experts)])
    return out


def linearized_state(state: dict[str, torch.Tensor], record: Linearized) -> dict[str, torch.Tensor]:
    """transformers' fused layout -> the linearized one (the inverse of `fused_state`)."""
    fused = {lin.fused: lin for lin in record.linears}
    out = {}
    for key, value in state.items():
        prefix, _, last = key.rpartition(".")
        if last not in fused or not prefix.endswith(record.attr) or value.dim() != 3:
            out[key] = value
            continue
        for lin in record.linears:
            if lin.fused != last:
                continue
            cols = value.shape[2] // lin.parts
            for e in range(value.shape[0]):
                out[f"{prefix}.{lin.name}.{e}.weight"] = value[e, :, lin.part * cols:(lin.part + 1) * cols].t() \
                    .contiguous()
    return out


__all__ = ["LinearizedExperts", "building", "fused_state", "linearized_state"]
