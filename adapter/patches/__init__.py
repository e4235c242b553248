"""Everything that reaches into a third-party library's internals, in one place (Megatron-Core: `mcore.py`;
DeepSpeed ZeRO: `zero.py`, its checkpoint files: `zero_files.py`; torch.distributed.checkpoint: `dcp.py`;
transformers' mask builders: `hf_masks.py`; DeepSpeed's CPU communication set-up: `ds_comm.py`; bitsandbytes'
8-bit linear: `bnb_int8.py`; PEFT's LoRA over a parametrised weight: `peft_params.py`; a transformers class
bound to a subclass while a model is built: `hf_classes.py`).

Each patch names the versions it was checked against and refuses any other with one line before it changes
anything (`require`): an upgrade then fails loudly instead of mis-training. `ND_ADAPTER_ALLOW_UNTESTED=1` tries an
untested version anyway (say so when you report what happened).
"""
from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

from adapter.errors import UserError

ALLOW_UNTESTED = "ND_ADAPTER_ALLOW_UNTESTED"


def installed(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


def require(dist: str, tested: tuple[str, ...], what: str) -> None:
    """Refuse to apply `what` on a version of `dist` it was not checked against (one-line UserError)."""
    found = installed(dist)
    if found in tested or os.environ.get(ALLOW_UNTESTED) == "1":
        return
    raise UserError(f"{dist} {found}: nd-adapter's {what} reaches into its internals and was checked against "
                    f"{', '.join(tested)} only. Fix: pip install '{dist}=={tested[-1]}', or set "
                    f"{ALLOW_UNTESTED}=1 to try this version")


__all__ = ["ALLOW_UNTESTED", "installed", "require"]
