"""Axolotl's `unfrozen_parameters` on the transformers engine: regexes over transformers' own parameter names, and
over the checkpoint's names where transformers renames or fuses them on load.

Why the checkpoint's names too: transformers 5 loads many checkpoints through a conversion mapping (Mixtral's
`block_sparse_moe.experts.{e}.w1/w3` become one 3-D `mlp.experts.gate_up_proj`, `block_sparse_moe.gate` becomes
`mlp.gate`). YAMLs written before that, Axolotl's own Mixtral 8x22B examples among them, name the checkpoint's
tensors; matched against transformers' names only (as Axolotl does today) they find nothing and the run silently
trains less than it says. Here a transformers tensor is trained when a pattern matches its own name, or when the
patterns match every checkpoint tensor it is built from (`checkpoint_names`: transformers' own reverse
conversion, the one `save_pretrained` writes back with, run on the meta-device model). A pattern that matches some
of one fused tensor's checkpoint tensors but not all would split it: one line, as on the native engine
(adapter/models/freeze.py). Torch-free to import, like generic_run.
"""
from __future__ import annotations

import functools
import json
from typing import Any

from adapter.errors import bad
from adapter.models.generic import meta_model


def checkpoint_names(model, name: str, param) -> tuple[str, ...]:
    """The checkpoint's names of `model`'s parameter `name` (sorted): what `save_pretrained` would write it as,
    from transformers' `core_model_loading.revert_weight_conversion` on this one meta tensor (checked against
    transformers 5.25). (name,) where transformers keeps the checkpoint's name, or where another version lacks the
    function or cannot reverse one tensor alone: patterns in the checkpoint's names then match nothing and are
    refused in one line, as before this lookup existed. A reader, not a patch: it changes nothing in transformers."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return (name,)
    try:
        saved = revert_weight_conversion(model, {name: param})
    except Exception:  # noqa: BLE001 - a conversion this version cannot reverse on one meta tensor: its own name
        return (name,)
    return tuple(sorted(saved)) or (name,)


def _shown(names: list[str]) -> str:
    return ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")


@functools.lru_cache(maxsize=8)
def parameters(config_text: str, trust_remote_code: bool, model_dir: str | None, linearized: bool = False):
    """(class name, ((name, numel, rows, checkpoint names), ...)) of the meta-device model; the checkpoint names are
    () where the checkpoint spells the parameter as transformers does. Cached: `plan --search` resolves one run per
    candidate layout."""
    model, cls = meta_model(json.loads(config_text), trust_remote_code=trust_remote_code, model_dir=model_dir,
                            linearized=linearized)
    out = []
    for name, p in model.named_parameters():
        saved = checkpoint_names(model, name, p)
        out.append((name, p.numel(), p.shape[0] if p.dim() else 1, () if saved == (name,) else saved))
    return cls, tuple(out)


def resolve_unfrozen(cfg, config_json: dict[str, Any], *, trust_remote_code: bool, model_dir: str | None):
    """(one freeze.Tensor per parameter of the meta-device model, the first line's note or None). Axolotl's rules
    (its utils/freeze.py): `re.match`, a dot is a dot, a trailing [start:end] trains only those rows of the first
    dimension. A pattern matching nothing, a split fused tensor, or nothing left to train: one line."""
    from adapter.config import spell
    from adapter.models import freeze

    key = spell(cfg, "model.unfrozen_parameters")
    parsed = freeze.parse(cfg.model.unfrozen_parameters, key)
    cls, params = parameters(json.dumps(config_json, sort_keys=True), trust_remote_code, model_dir,
                             cfg.model.linearized_experts)
    used, out, renamed = [False] * len(parsed), [], []
    for name, numel, first, saved in params:
        hits = [j for j, pat in enumerate(parsed) if pat.regex.match(name)]
        by_saved = [[j for j, pat in enumerate(parsed) if pat.regex.match(s)] for s in saved]
        if not hits and any(by_saved):
            on = [s for s, h in zip(saved, by_saved) if h]
            if len(on) < len(saved):
                pattern = parsed[next(j for h in by_saved for j in h)].text
                off = [s for s, h in zip(saved, by_saved) if not h]
                raise bad(key, pattern, f"trains the checkpoint's {_shown(on)} but not {_shown(off)}, which {cls} "
                          f"holds in one tensor ({name})", "unfreeze all of them or none")
            hits = sorted({j for h in by_saved for j in h})
            if any(parsed[j].rows for j in hits):
                raise bad(key, next(parsed[j].text for j in hits if parsed[j].rows), f"a row range on the "
                          f"checkpoint's name of {name}, which transformers loads converted", f"give the rows on "
                          f"transformers' name ({name}[start:end])")
            renamed.append((saved[0], name))
        for j in hits:
            used[j] = True
        ranges = {parsed[j].rows for j in hits}
        rows = None
        if hits and None not in ranges:  # every matching pattern names rows: those (one range) are trained
            if len(ranges) > 1:
                raise bad(key, [parsed[j].text for j in hits], f"gives {name} more than one row range",
                          "give its rows in one pattern")
            start, end = next(iter(ranges))  # type: ignore[misc]
            end = first if end is None else min(end, first)
            if start >= end:
                raise bad(key, parsed[hits[0]].text, "an empty row range", f"give rows within 0..{first}")
            rows = (start, end)
        out.append(freeze.Tensor(name, (name,), numel, None, bool(hits), rows))
    trained = {t.name: t.trained for t in out} | {s: t.trained for t, p in zip(out, params) for s in p[3]}
    freeze.refuse_unmatched(parsed, used, trained, key, cls)
    if not any(t.trained for t in out):
        raise bad(key, cfg.model.unfrozen_parameters, "leaves nothing to train", "unfreeze at least one parameter")
    note = None if not renamed else (
        f"{key}: {len(renamed)} of {cls}'s tensors matched by the checkpoint's names, which transformers converts on "
        f"load (e.g. {renamed[0][0]} -> {renamed[0][1]}): each trained whole, every checkpoint tensor it holds "
        "matched (Axolotl matches transformers' names only, where these patterns find nothing)")
    return out, note


__all__ = ["checkpoint_names", "parameters", "resolve_unfrozen"]
