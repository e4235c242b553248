"""The shared-GPU mode (adapter/parallel/shared_gpu.py) where there is no GPU: refused in one line, before any
process group or rank starts (its runs on the GPU host: tests/gpu/test_shared_gpu.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from adapter.errors import UserError
from adapter.parallel import shared_gpu
from tests.helpers.cli import run_cli

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo-llama-tiny.yaml"


def test_rehearse_gpu_without_a_gpu_is_one_line():
    code, _, err = run_cli("rehearse", "--config", str(DEMO), "--gpu", "--steps", "2")
    assert code == 2 and err.count("\n") == 1 and "--gpu=True: this machine shows no GPU device" in err, err


def test_the_mode_without_cuda_is_refused_before_the_process_group(monkeypatch):
    import torch.distributed as dist

    from adapter.train.engine import init_distributed

    monkeypatch.setenv(shared_gpu.ENV, "1")
    with pytest.raises(UserError, match=f"^{shared_gpu.ENV}='1': the shared-GPU mode puts every rank on cuda:0"):
        init_distributed()
    assert not dist.is_initialized()
    assert "a correctness mode for the layout's CUDA paths, not a speed mode" in shared_gpu.note(4)
