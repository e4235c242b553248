"""Fixtures the multi-process tests share."""
from __future__ import annotations

import pytest

from tests.helpers.train import converted_demo


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's tiny Llama, its data and its tp=2 conversion (tests/helpers/train.py), built once per module."""
    return converted_demo(tmp_path_factory.mktemp("demo"))
