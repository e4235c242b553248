"""A transformers modelling class replaced by a subclass while a model is built and loaded.

transformers' modelling code constructs its sub-modules by the module-level name of their class (`self.feed_forward =
Llama4TextMoe(config)`), so binding that name to a subclass for the duration of `from_pretrained` / `_from_config`
builds every instance from the subclass, and transformers' loader then finds the subclass's parameters under the
names a checkpoint in that layout uses (adapter/modeling/hf_linearized.py: Axolotl's linearized Llama 4 experts,
which its own loader installs the same way). Outside the `with`, the module is as it was.

Checked against transformers 5.17 (the GPU host) and 5.25 (CI): `swapped` verifies, for any version, that the class
exists in that module and that the module's code constructs it by that name, and refuses in one line where not
(then the model would silently be built with transformers' own layer)."""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from contextlib import contextmanager

from adapter.errors import UserError


@contextmanager
def swapped(module_name: str, class_name: str, make) -> Iterator[type]:
    """Bind `module_name.class_name` to `make(original_class)` (a subclass) inside the `with`; yields it."""
    import transformers

    module = importlib.import_module(module_name)
    original = getattr(module, class_name, None)
    if not inspect.isclass(original) or f"{class_name}(" not in inspect.getsource(module).replace(
            f"class {class_name}(", ""):
        raise UserError(f"transformers {transformers.__version__}: {module_name} does not construct {class_name} by "
                        "name, which nd-adapter's linearized experts replace. Fix: use transformers 5.17-5.25, or "
                        "drop the linearized layout (a checkpoint in transformers' own layout)")
    sub = make(original)
    setattr(module, class_name, sub)
    try:
        yield sub
    finally:
        setattr(module, class_name, original)


__all__ = ["swapped"]
