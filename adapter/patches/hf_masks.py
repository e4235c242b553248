"""Packed documents for every transformers model: attention confined to each document, whatever the model's code
passes to transformers' mask builders.

transformers' mask builders (`create_causal_mask`, `create_sliding_window_causal_mask`, `create_chunked_causal_mask`)
confine attention to packed documents when the model hands them `position_ids` that restart at each document start
(`find_packed_sequence_indices`; windows and chunks then count positions inside each document), but not every model
does: gpt-oss, for one, builds its masks without them, so its packed documents would attend to each other.
`prepare(model)` wraps the builders where the model's modules imported them, and inside `documents(position_ids)`
the wrappers pass this forward's positions when the model's call left them out. Outside `documents`, and for a call
that passes positions, a padding mask or a cache, nothing changes.

Checked against transformers 5.25 (CI): the builders' names and their `position_ids` parameter (fifth, or by name);
another version is used when its builders have that signature (checked at `prepare`), else refused in one line.
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from adapter.patches import installed, require

TESTED = ("5.25.0",)
BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask")
_POSITIONS: ContextVar = ContextVar("nd_adapter_positions", default=None)
_POSITION_ARG = 4  # config, inputs_embeds, attention_mask, cache, position_ids


def _wrap(builder):
    def build(*args, **kwargs):
        pos = _POSITIONS.get()
        if (pos is not None and len(args) <= _POSITION_ARG and kwargs.get("position_ids") is None
                and kwargs.get("attention_mask", args[2] if len(args) > 2 else None) is None
                and kwargs.get("cache", args[3] if len(args) > 3 else None) is None):
            embeds = kwargs.get("inputs_embeds", args[1] if len(args) > 1 else None)
            if embeds is not None and embeds.shape[1] == pos.shape[1]:  # this forward's sequence, not another tower's
                kwargs["position_ids"] = pos.to(embeds.device)
        return builder(*args, **kwargs)

    build.__wrapped__ = builder
    build.nd_adapter_documents = True
    return build


def _takes_positions(builder) -> bool:
    """The builder exists and takes `position_ids` fifth (what the wrapper relies on; any version that keeps it)."""
    import inspect

    if builder is None:
        return False
    params = list(inspect.signature(builder).parameters)
    return len(params) > _POSITION_ARG and params[_POSITION_ARG] == "position_ids"


def prepare(model) -> None:
    """Wrap the mask builders in every module that defines one of `model`'s submodules (refused, in one line, on a
    transformers these names were not checked on)."""
    from transformers import masking_utils as mu

    if installed("transformers") not in TESTED and not all(_takes_positions(getattr(mu, b, None)) for b in BUILDERS):
        require("transformers", TESTED, "packed-document masks for the transformers engine")  # one line

    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        for builder in BUILDERS:
            found = getattr(module, builder, None)
            if found is not None and found is getattr(mu, builder) and not getattr(found, "nd_adapter_documents",
                                                                                    False):
                setattr(module, builder, _wrap(found))


@contextmanager
def documents(position_ids) -> Iterator[None]:
    """Within: masks built without positions get `position_ids` (restarting at 0 at each packed document)."""
    token = _POSITIONS.set(position_ids)
    try:
        yield
    finally:
        _POSITIONS.reset(token)


__all__ = ["TESTED", "BUILDERS", "prepare", "documents"]
