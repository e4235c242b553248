"""GPU host only: Axolotl's linearized Llama 4 experts (`model.linearized_experts`) through nd-adapter's CUDA path
give the losses of the same model in transformers' layout (fp32, TF32 off), and a QLoRA run on them quantises every
expert linear with bitsandbytes' CUDA kernels and trains adapters on single experts. The exact semantics against
transformers (CPU): tests/unit/test_linearized.py, tests/distributed/test_transformers_engine.py."""
from __future__ import annotations

import math

import pytest

from tests.helpers.dist import run_workers
from tests.helpers.runs import cuda_train

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _raw(model, root, name: str, linearized: bool, **over) -> dict:
    from adapter.demo.build import ASSETS

    return {"model": {"path": str(model), "engine": "transformers", "linearized_experts": linearized,
                      "cache_dir": f"{root}/cache"},
            "seq_len": 128, "precision": "fp32", "batch": {"micro_batch_size": 1},
            "optimizer": {"lr": 2e-3, "schedule": "constant", "warmup_steps": 0, "max_steps": 4, "clip_grad": 1e12},
            "data": {"datasets": [{"path": str(ASSETS / "chat_genesis.jsonl"), "type": "chat_template"}],
                     "chat_template": "chatml", "sample_packing": True, "prepared_path": f"{root}/prep-{name}"},
            **over}


def test_linearized_experts_on_cuda_follow_the_fused_layout(tmp_path):
    import torch

    from tests.helpers.archs import linearized, make_arch
    from tests.helpers.sft_data import tiny_model

    assert torch.cuda.is_available()
    fused = make_arch("llama4_text", tmp_path / "fused", tiny_model(tmp_path / "tok"))
    lin = linearized(fused, tmp_path / "linearized")
    want = run_workers(cuda_train, 1, _raw(fused, tmp_path, "fused", False), ("losses",), timeout=600)[0][0]
    got = run_workers(cuda_train, 1, _raw(lin, tmp_path, "lin", True), ("losses",), timeout=600)[0][0]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) < 1e-5, (got, want)
    qlora = {"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "gate_projs.0", "down_projs.1"],
                      "quantize_base": "nf4"}, "precision": "bf16"}
    losses = run_workers(cuda_train, 1, _raw(lin, tmp_path, "qlora", True, **qlora), ("losses",), timeout=600)[0][0]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses
