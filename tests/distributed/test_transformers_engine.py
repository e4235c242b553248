"""The transformers engine against plain transformers: tiny random models of architectures no native family covers
(tests/helpers/archs.py: Phi-2, GPT-NeoX, StarCoder2, gpt-oss, DeepSeek-V3, GLM-4.5, Llama 4, Qwen3-Next, Granite
4, OLMo 3, Mistral 3's image-text checkpoint), each trained by nd-adapter for 4 steps at dp_shard=2 under ZeRO-3 on
packed chat data (unpacked for the hybrids, whose recurrent layers cannot take packed documents), against
transformers trained on the same prepared samples (each packed example on its own), the same masks and the same
normalisation (Σ loss / Σ trained tokens of the step), torch AdamW, fp32 on CPU. A native family forced onto the
transformers engine gives the native engine's losses, so the two engines check each other."""
from __future__ import annotations

from pathlib import Path

import pytest

from adapter import config
from tests.helpers.archs import ARCHS, HYBRID, VISION, make_arch, reference_model
from tests.helpers.dist import run_workers
from tests.helpers.runs import vocab_of
from tests.helpers.sft import batch_of, hf_loss, make_model, packed_examples, rel

pytestmark = pytest.mark.slow
SEQ, LR, STEPS = 128, 2e-3, 4
MODELS = (*ARCHS, *VISION)


def _cfg(model_dir: str, root: str, pack: bool, engine: str = "auto", **parallelism):
    from adapter.demo.build import ASSETS

    raw = {"model": {"path": model_dir, "cache_dir": f"{root}/cache", "engine": engine},
           "parallelism": {"dp_shard_size": 2, **parallelism},
           "batch": {"micro_batch_size": 1, "gradient_accumulation_steps": 1}, "seq_len": SEQ, "precision": "fp32",
           "optimizer": {"lr": LR, "schedule": "constant", "warmup_steps": 0, "max_steps": STEPS, "clip_grad": 1e12},
           "data": {"datasets": [{"path": str(ASSETS / "chat_genesis.jsonl"), "type": "chat_template"}],
                    "chat_template": "chatml", "sample_packing": pack, "prepared_path": f"{root}/prep-{pack}"}}
    return config.build(raw, env={}, world_size=2)


def _worker(rank, world, models, root):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    init_distributed()
    out = {}
    for name, path in models.items():
        pack = name not in HYBRID
        lines: list[str] = []
        res = train(_cfg(path, f"{root}/{name}", pack), log=lines.append)
        out[name] = (res.losses, [ln for ln in lines if ln.startswith("engine:")])
    llama = models["llama"]
    out["llama forced"] = (train(_cfg(llama, f"{root}/forced", True, engine="transformers"),
                                 log=lambda s: None).losses, [])
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.helpers.sft_data import tiny_model

    root = tmp_path_factory.mktemp("hf-engine")
    tok = tiny_model(root / "tok")
    made = {name: str(make_arch(name, root / name, tok)) for name in MODELS}
    return {**made, "llama": str(make_model(root / "llama", tok))}


def _reference(model_dir: str, cfg) -> list[float]:
    """transformers trained on the run's own prepared samples, in the order the two ranks' samplers deal them."""
    import torch

    from adapter.data import DPSampler
    from adapter.data.sft import prepare

    data = prepare(cfg, model_dir, vocab_of(cfg), builder=True, barrier=None, progress=False).train
    model = reference_model(Path(model_dir))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=cfg.optimizer.betas, eps=cfg.optimizer.eps,
                            weight_decay=0.0)
    its = [iter(DPSampler(len(data), dp_rank=r, dp_size=2, micro_batch=1, seed=cfg.data.seed)) for r in range(2)]
    losses = []
    for _ in range(STEPS):
        idx = [next(it)[0] for it in its]
        if cfg.data.sample_packing:
            parts = [(s, n) for i in idx for s, n, _ in packed_examples(model, data, i)]
            loss = sum(s for s, _ in parts) / max(sum(n for _, n in parts), 1.0)
        else:  # one example per row, padded after it: the whole row is causal and its tail untrained
            batch = batch_of(data, idx)
            loss = hf_loss(model, {**batch, "position_ids": torch.arange(SEQ).expand(2, -1)})
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_architectures_no_native_family_covers_match_transformers_at_dp_shard2_zero3(models, tmp_path):
    got = run_workers(_worker, 2, models, str(tmp_path), timeout=1200)[0]
    for name in MODELS:
        losses, said = got[name]
        assert len(said) == 1 and "engine: transformers' own" in said[0] and "no native family" in said[0], said
        if name in VISION:
            assert "its language model trains on text, the other towers frozen" in said[0]
        want = _reference(models[name], _cfg(models[name], f"{tmp_path}/{name}", name not in HYBRID))
        assert max(rel(a, b) for a, b in zip(losses, want)) < 1e-4, (name, losses, want)
    native = _reference(models["llama"], _cfg(models["llama"], f"{tmp_path}/forced", True))
    assert max(rel(a, b) for a, b in zip(got["llama forced"][0], native)) < 1e-4
