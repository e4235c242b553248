"""The CPU shims still match the installed megatron-core: fail loudly after an upgrade instead of mis-running."""
from __future__ import annotations

import types

import torch

from adapter.patches import mcore


def test_megatron_version_is_one_the_shims_were_verified_on():
    assert mcore.megatron_version() in mcore.TESTED_MEGATRON_VERSIONS, (
        "megatron-core changed: re-verify adapter/patches/mcore.py against it, then add the version")


def test_patched_symbols_still_exist():
    assert mcore.check() == []


def test_cp_rotary_shim_selects_megatrons_chunks():
    from adapter.kernels.attention import split_for_cp

    pos = torch.arange(16.0)[:, None, None, None]  # [s, 1, 1, d] like RotaryEmbedding's table
    for r in range(4):
        group = types.SimpleNamespace(size=lambda: 4, rank=lambda r=r: r)
        assert torch.equal(mcore._pos_emb_on_this_cp_rank(pos, 0, group), split_for_cp(pos, 4, r, 0))


