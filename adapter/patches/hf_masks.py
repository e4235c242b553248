"""Packed documents for every transformers model: attention confined to each document, whatever the model's code
passes to transformers' mask builders.

transformers' mask builders (`create_causal_mask`, `create_sliding_window_causal_mask`, `create_chunked_causal_mask`)
confine attention to packed documents when the model hands them `position_ids` that restart at each document start
(`find_packed_sequence_indices`; windows and chunks then count positions inside each document), but not every model
does: gpt-oss, for one, builds its masks without them, so its packed documents would attend to each other.
`prepare(model)` wraps the builders where the model's modules imported them, and inside `documents(position_ids)`
the wrappers pass this forward's positions when the model's call left them out. Outside `documents`, and for a call
that passes positions, a padding mask or a cache, nothing changes.

SDPA's mask builder evaluates a model's own mask functions by broadcasting, where the first mask of the same
structure was equal to transformers' vmapped one (`_sdpa`). The sliding-window builder's wrapper hands a window at
least as long as the sequence (no cache) to `create_causal_mask`: every causal pair is inside such a window, so the
masks are equal, and the causal one lets SDPA run is_causal on its flash kernels, where transformers materialises
the window's mask from kv_length >= window.

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


def _arg(args, kwargs, i: int, *names: str):
    for name in names:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return args[i] if len(args) > i else None


def _wrap(builder):
    sliding = builder.__name__ == "create_sliding_window_causal_mask"

    def build(*args, **kwargs):
        pos = _POSITIONS.get()
        embeds = _arg(args, kwargs, 1, "inputs_embeds")
        no_cache = _arg(args, kwargs, 3, "cache", "past_key_values") is None
        if (pos is not None and len(args) <= _POSITION_ARG and kwargs.get("position_ids") is None
                and _arg(args, kwargs, 2, "attention_mask") is None and no_cache):
            if embeds is not None and embeds.shape[1] == pos.shape[1]:  # this forward's sequence, not another tower's
                kwargs["position_ids"] = pos.to(embeds.device)
        window = getattr(_arg(args, kwargs, 0, "config"), "sliding_window", None) if sliding else None
        if no_cache and embeds is not None and isinstance(window, int) and embeds.shape[1] <= window:
            # a window as long as the sequence keeps every causal pair (q - kv < window): the causal mask itself,
            # which SDPA runs as is_causal on its flash kernels. transformers materialises this one from
            # kv_length >= window (masking_utils._ignore_causal_mask_sdpa), so Olmo-3's sliding layers at
            # seq = window = 4,096 ran without flash attention for us and for transformers alike
            return _causal(builder)(*args, **kwargs)
        return builder(*args, **kwargs)

    build.__wrapped__ = builder
    build.nd_adapter_documents = True
    return build


def _causal(builder):
    """transformers' create_causal_mask beside `builder` (its own module's, for the same signature)."""
    return sys.modules[builder.__module__].create_causal_mask


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

    sdpa = mu.AttentionMaskInterface._global_mapping.get("sdpa")
    if sdpa is not None and not getattr(sdpa, "nd_adapter_broadcast", False):
        mu.AttentionMaskInterface.register("sdpa", _sdpa(sdpa))
    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        for builder in BUILDERS:
            found = getattr(module, builder, None)
            if found is not None and found is getattr(mu, builder) and not getattr(found, "nd_adapter_documents",
                                                                                    False):
                setattr(module, builder, _wrap(found))


# A mask function's structure -> whether transformers' broadcast evaluation of it equalled the vmapped one
_BROADCAST: dict[tuple, bool] = {}


def _structure(fn, depth: int = 0) -> tuple:
    """The code object of a mask function and those of every function its closure holds (or_masks / and_masks keep
    theirs in a tuple): two masks of one structure run the same code, over other tensors."""
    code = getattr(fn, "__code__", None)
    if code is None or depth > 8:
        return (type(fn).__qualname__,)
    inner = []
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        inner += [_structure(g, depth + 1) for g in (value if isinstance(value, (tuple, list)) else (value,))
                  if callable(g) and hasattr(g, "__code__")]
    return (code, *inner)


def _sdpa(sdpa_mask):
    """transformers' SDPA mask builder, evaluating custom mask functions by broadcasting where that was checked.

    transformers vmaps a mask function over batch, head, query and key (four nested vmaps) whenever the model adds
    its own (`or_mask_function` / `and_mask_function`: Gemma 3's image tokens seen both ways), since it cannot
    know the function is index-based; one H100 on transformers 5.17 took 14.7 ms a call there, two calls a
    micro-batch with the GPU idle (docs/BENCHMARKS.md, 2026-12-07). Its broadcast path gives the same mask for an
    index-based function in a fraction of that (Gemma 3's two masks on CPU: 3.3 against 6.8 ms). The first mask
    of each structure is built both ways and compared: equal, that structure takes the broadcast path from then
    on; different or failing (a function indexing one axis at a time), it keeps the vmap, as transformers does."""
    def build(*args, **kwargs):
        if not kwargs.get("use_vmap"):
            return sdpa_mask(*args, **kwargs)
        key = _structure(kwargs.get("mask_function"))
        checked = _BROADCAST.get(key)
        if checked is False:
            return sdpa_mask(*args, **kwargs)
        try:
            fast = sdpa_mask(*args, **{**kwargs, "use_vmap": False})
        except Exception:  # noqa: BLE001 -- not index-based under broadcasting: transformers' own way
            _BROADCAST[key] = False
            return sdpa_mask(*args, **kwargs)
        if checked is None:
            import torch

            slow = sdpa_mask(*args, **kwargs)
            _BROADCAST[key] = same = (fast is None and slow is None) or (
                fast is not None and slow is not None and fast.shape == slow.shape and bool(torch.equal(fast, slow)))
            if not same:
                return slow
        return fast

    build.nd_adapter_broadcast = True
    return build


@contextmanager
def documents(position_ids) -> Iterator[None]:
    """Within: masks built without positions get `position_ids` (restarting at 0 at each packed document)."""
    token = _POSITIONS.set(position_ids)
    try:
        yield
    finally:
        _POSITIONS.reset(token)


__all__ = ["TESTED", "BUILDERS", "prepare", "documents"]
