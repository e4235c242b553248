"""The facts of a transformers model's tensor-parallel plan that `plan` and the engine share (torch-free: they read
module objects built elsewhere): the plan as transformers resolves it, which modules it names, which styles the
transformers engine builds (adapter/modeling/hf_tp.py says how each runs), and how many parameters a rank holds."""
from __future__ import annotations

import re
from typing import Any

COLWISE = {"colwise": False, "colwise_gather_output": True, "colwise_rep": True}  # style -> output gathered
ROWWISE = {"rowwise": False, "rowwise_split_input": True, "rowwise_rep": True}  # style -> input split here
OTHER = ("embedding_rowwise", "replicated_with_grad_allreduce", "mla_kv_a_proj", "packed_colwise")
BUILT = (*COLWISE, *ROWWISE, *OTHER)
VOCAB = "embedding_rowwise"


def model_plan(model: Any) -> dict[str, str]:
    """The model's resolved plan (full module paths, `*` for a layer index), as transformers resolves it."""
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {}
    return {k: v for k, v in dict(plan).items() if isinstance(v, str)}


def plan_matches(model: Any, plan: dict[str, str]) -> list[tuple[str, str, Any]]:
    """(module path, style, module) for every module a plan entry names; entries that name nothing (a plan key
    for a layout the model does not use) are left out, as transformers does."""
    pats = [(re.compile(re.escape(k).replace(r"\*", r"\d+") + "$"), v) for k, v in plan.items()]
    out = []
    for name, mod in model.named_modules():
        for pat, style in pats:
            if pat.match(name):
                out.append((name, style, mod))
                break
    for name, _ in model.named_parameters():  # an entry for a bare parameter (fused experts, sinks): module None
        for pat, style in pats:
            if pat.match(name):
                out.append((name, style, None))
                break
    return out


def is_vocab(name: str, style: str) -> bool:
    """The input embedding or the output layer: left replicated where tp does not divide the vocabulary."""
    return style == VOCAB or (style == "colwise_gather_output" and name.endswith("lm_head"))


def split_numel(model: Any, tp: int) -> tuple[int, list[str]]:
    """(parameters the plan splits at this tp, what keeps this tp from running: a style the engine does not build,
    a width tp does not divide) of a model built on the meta device: `plan` counts a rank's share from it and
    refuses the rest (adapter/models/generic_run.check_run)."""
    numel, problems, seen = 0, [], set()
    for name, style, mod in plan_matches(model, model_plan(model)):
        if style not in BUILT or mod is None:
            problems.append(f"its plan splits {name} as {style}, a tensor-parallel style nd-adapter does not build")
            continue
        if style in ("replicated_with_grad_allreduce", "mla_kv_a_proj"):
            continue
        w = getattr(mod, "base_layer", mod).weight
        dim = 1 if style in ROWWISE else 0
        parts = 2 if style == "packed_colwise" else 1
        if id(w) in seen or (is_vocab(name, style) and w.shape[0] % tp):
            continue
        if w.shape[dim] % (tp * parts):
            problems.append(f"tp {tp} does not divide {name}'s {w.shape[dim]} {'inputs' if dim else 'outputs'}")
            continue
        seen.add(id(w))
        bias = getattr(mod, "bias", None)
        numel += w.numel() + (bias.numel() if style not in ROWWISE and bias is not None else 0)
    return numel, problems


__all__ = ["BUILT", "COLWISE", "ROWWISE", "VOCAB", "is_vocab", "model_plan", "plan_matches", "split_numel"]
