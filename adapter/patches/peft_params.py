"""PEFT's LoRA on a parameter that keeps a parametrisation of its own: Axolotl's `quantize_moe_experts` with
`lora_target_parameters` (a mixture's 3-D expert weights stored as NF4 / int8 codes, dequantised by a
parametrisation at each use, and adapted by PEFT's ParamWrapper).

PEFT's ParamWrapper adds its delta for one forward by registering a proxy parametrisation on top of the weight's
(`ParamWrapper._activate_lora`) and removes it afterwards (`_remove_parametrizations`). Over a weight that already
has a parametrisation, PEFT 0.21.2 gets two things wrong (both seen on CPU, 2026-12-06):
- Removal. One adapter on stacked experts uses `_LoraFactorsProxy` (W + s·B·A folded into one baddbmm), but where
  the weight keeps another parametrisation the removal looks for `_LoraParameterProxy` only: it warns and leaves
  the proxy in place, so each forward stacks one more delta, and the second forward fails (the stacked proxy's
  output requires a gradient the integer codes cannot have).
- A stale cached weight. With two adapted weights in one module (gate_up_proj and down_proj), the wrappers nest:
  the outer one registers its proxy and opens parametrize's cache, then the inner one reads its weight
  (`get_param`) before registering its own proxy. That read is cached without the delta, and the module's forward
  then uses it: the inner weight's adapter is left out of the forward (and never trains).
`stacked_parametrisations()` makes the removal take the last proxy of either class (the one this forward
registered) and drops the cache entry of the weight right after its proxy is registered, so the forward computes
dequantise → + delta. The result equals plain PEFT over the dequantised weights (tests/unit/test_quant_expert_lora).

Checked against peft 0.21.2 (CI); another version is refused in one line (`require`): it may have fixed either
or work otherwise.
"""
from __future__ import annotations

from contextlib import contextmanager

from adapter.patches import require

TESTED = ("0.21.2",)


def stacked_parametrisations() -> None:
    """Idempotent: ParamWrapper's delta over a weight's own parametrisation, applied and removed correctly."""
    import torch.nn.utils.parametrize as P
    from peft.tuners.lora import layer

    wrapper = layer.ParamWrapper
    if getattr(wrapper, "_nd_stacked", False):
        return
    require("peft", TESTED, "LoRA on quantised expert weights (PEFT's ParamWrapper over another parametrisation)")
    proxies = tuple(c for c in (getattr(layer, "_LoraParameterProxy", None), getattr(layer, "_LoraFactorsProxy", None))
                    if c is not None)
    remove_original, activate_original = wrapper._remove_parametrizations, wrapper._activate_lora

    def remove(self) -> None:
        lists = getattr(self.get_base_layer(), "parametrizations", None)
        if lists is None or self.parameter_name not in lists or len(lists[self.parameter_name]) == 1:
            return remove_original(self)
        stack = lists[self.parameter_name]
        for i in reversed(range(len(stack))):
            if isinstance(stack[i], proxies):
                del stack[i]
                return None
        return remove_original(self)  # no proxy of ours: PEFT's own warning

    @contextmanager
    def activate(self, active_adapters):
        with activate_original(self, active_adapters):
            P._cache.pop((id(self.get_base_layer()), self.parameter_name), None)  # read before the proxy existed
            yield

    wrapper._remove_parametrizations = remove
    wrapper._activate_lora = activate
    wrapper._nd_stacked = True


__all__ = ["TESTED", "stacked_parametrisations"]
