"""GPU host only: an image-text run (`processor_type`, Axolotl's multimodal path) on one GPU through nd-adapter's
CUDA path (the transformers engine's Gemma3ForConditionalGeneration fed by the processor's tensors) against
transformers' own model on the same GPU and micro-batches, fp32 with TF32 off on both sides: the same losses over 3
steps and the same held-out loss. The exact semantics on CPU (ZeRO-3/2, freeze_mm_modules, LoRA):
tests/distributed/test_image_text.py."""
from __future__ import annotations

import pytest

from tests.helpers.dist import run_workers
from tests.helpers.runs import cuda_train

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
MB, GA, STEPS, LR, N, VAL = 2, 2, 3, 2e-3, 14, 2


@pytest.mark.parametrize("compiled", [False, True])
def test_image_text_run_on_cuda_follows_transformers(tmp_path, compiled):
    """`compiled`: torch_compile: true, the vision tower's layers compiled with the language model's."""
    import torch

    from adapter import config
    from adapter.data.sampler import DPSampler
    from adapter.data.sft.multimodal import load
    from tests.helpers.image_text import gemma3_vlm, reference, rows
    from tests.helpers.sft_data import write_jsonl

    assert torch.cuda.is_available()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = gemma3_vlm(tmp_path)
    data = write_jsonl(tmp_path / "mm.jsonl", rows(tmp_path, N))
    raw = {"base_model": str(model), "processor_type": "AutoProcessor", "skip_prepare_dataset": True,
           "sample_packing": False, "chat_template": "gemma3",
           "datasets": [{"path": str(data), "type": "chat_template"}],
           "sequence_len": 256, "dataset_prepared_path": str(tmp_path / "prep"), "output_dir": str(tmp_path / "out"),
           "val_set_size": VAL, "micro_batch_size": MB, "gradient_accumulation_steps": GA, "max_steps": STEPS,
           "learning_rate": LR, "lr_scheduler": "constant", "warmup_steps": 0, "weight_decay": 0.0,
           "max_grad_norm": 1e12, "optimizer": "adamw_torch_fused", "torch_compile": compiled}
    losses, evals = run_workers(cuda_train, 1, raw, ("losses", "eval_losses"), timeout=600)[0]
    cfg = config.build(raw, env={}, world_size=1)
    train_set, held_set, _ = load(cfg, model, model, 10 ** 6)
    it = iter(DPSampler(len(train_set), dp_rank=0, dp_size=1, micro_batch=MB, seed=cfg.data.seed))
    order = [[[train_set.rows[int(i)] for i in next(it)] for _ in range(GA)] for _ in range(STEPS)]
    want, want_eval, _ = reference(model, order, [held_set.rows[i] for i in range(len(held_set))], lr=LR,
                                   device="cuda")
    tol = 1e-3 if compiled else 1e-4  # inductor's own reduction orders (fp32)
    assert len(losses) == STEPS and all(abs(a - b) <= tol * abs(b) for a, b in zip(losses, want)), (losses, want)
    assert evals and abs(evals[-1][1] - want_eval) <= tol * abs(want_eval), (evals, want_eval)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "pixtral"])
def test_more_families_on_cuda_follow_transformers(tmp_path, family):
    """Qwen2.5-VL (M-RoPE, a windowed vision tower) and Pixtral (LLaVA over a Pixtral tower, [INST] turns) through
    the checkpoint's real processor (AutoProcessor: they need torchvision, which the GPU host has and CPU CI lacks),
    one row in two with an image (no system turns: Pixtral's template folds them in): the same losses over 3 steps
    and the held-out loss as transformers' own model on the same GPU and micro-batches."""
    import torch

    from adapter import config
    from adapter.data.sampler import DPSampler
    from adapter.data.sft.multimodal import load
    from tests.helpers.image_text import pixtral_vlm, qwen2_5_vlm, reference, rows, save_qwen_processor
    from tests.helpers.sft_data import write_jsonl

    assert torch.cuda.is_available()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if family == "qwen2_5_vl":
        model = qwen2_5_vlm(tmp_path)
        save_qwen_processor(model)
    else:
        model = pixtral_vlm(tmp_path)
    data_rows = [{**r, "messages": [m for m in r["messages"] if m["role"] != "system"]}
                 for r in rows(tmp_path, N, images_every=2)]
    data = write_jsonl(tmp_path / "mm.jsonl", data_rows)
    raw = {"base_model": str(model), "processor_type": "AutoProcessor", "skip_prepare_dataset": True,
           "sample_packing": False, "chat_template": {"qwen2_5_vl": "qwen2_vl"}.get(family, family),
           "datasets": [{"path": str(data), "type": "chat_template"}],
           "sequence_len": 256, "dataset_prepared_path": str(tmp_path / "prep"), "output_dir": str(tmp_path / "out"),
           "val_set_size": VAL, "micro_batch_size": MB, "gradient_accumulation_steps": GA, "max_steps": STEPS,
           "learning_rate": LR, "lr_scheduler": "constant", "warmup_steps": 0, "weight_decay": 0.0,
           "max_grad_norm": 1e12, "optimizer": "adamw_torch_fused"}
    losses, evals = run_workers(cuda_train, 1, raw, ("losses", "eval_losses"), timeout=600)[0]
    cfg = config.build(raw, env={}, world_size=1)
    train_set, held_set, _ = load(cfg, model, model, 10 ** 6)
    assert type(train_set.processor).__name__ == {"qwen2_5_vl": "Qwen2_5_VLProcessor"}.get(family, "PixtralProcessor")
    it = iter(DPSampler(len(train_set), dp_rank=0, dp_size=1, micro_batch=MB, seed=cfg.data.seed))
    order = [[[train_set.rows[int(i)] for i in next(it)] for _ in range(GA)] for _ in range(STEPS)]
    want, want_eval, _ = reference(model, order, [held_set.rows[i] for i in range(len(held_set))], lr=LR,
                                   device="cuda", family=family)
    assert len(losses) == STEPS and all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses, want)), (losses, want)
    assert evals and abs(evals[-1][1] - want_eval) <= 1e-4 * abs(want_eval), (evals, want_eval)
