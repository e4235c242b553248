"""The private names of torch.distributed.checkpoint that the streaming converter's writer and reader use.

DCP's public API has no way to write one item before the next is resolved, nor to read one chunk without loading
a whole state dict, so both use `filesystem._StorageInfo` (the per-item index entry in `.metadata`),
`utils._create_file_view` (a bounded view of one item's bytes) and `filesystem.DEFAULT_SUFFIX`. Checked against
torch 2.11 (the GPU host) and 2.13 (CI); another version must pass tests/unit/test_convert.py before it is listed.
"""
from __future__ import annotations

import os

import torch

from adapter.errors import UserError
from adapter.patches import ALLOW_UNTESTED

TESTED_TORCH = ("2.11", "2.13")  # major.minor: the private names below are the same in every patch release


def check_version() -> None:
    """Refuse (one line) a torch whose DCP internals the writer was not checked against."""
    minor = ".".join(torch.__version__.split(".")[:2])
    if minor not in TESTED_TORCH and os.environ.get(ALLOW_UNTESTED) != "1":
        raise UserError(f"torch {torch.__version__}: nd-adapter's checkpoint writer uses private names of "
                        f"torch.distributed.checkpoint checked on torch {', '.join(TESTED_TORCH)} only. Fix: install "
                        f"a tested torch, or set {ALLOW_UNTESTED}=1 to try this one")


try:
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
    from torch.distributed.checkpoint.utils import _create_file_view
except ImportError as e:  # pragma: no cover - only on an untested torch
    raise UserError(f"torch {torch.__version__}: torch.distributed.checkpoint lacks _StorageInfo / _create_file_view "
                    f"({e}), which nd-adapter's checkpoint writer was checked against on torch "
                    f"{', '.join(TESTED_TORCH)}. Fix: install a tested torch version") from None


def storage_info(relative_path: str, offset: int, length: int):
    """The `.metadata` entry saying where one item's bytes are (no transform extensions)."""
    return _StorageInfo(relative_path, offset, length)


def create_file_view(f, offset: int, length: int):
    return _create_file_view(f, offset, length)


__all__ = ["DEFAULT_SUFFIX", "TESTED_TORCH", "check_version", "storage_info", "create_file_view"]
