"""Entropy-Aware Focal Training (Axolotl's use_eaft; adapter/kernels/eaft.py): the keys as Axolotl reads them, the
weights as its loss computes them (padding columns of the vocabulary left out, k capped at the vocabulary), and
what it cannot run beside, one line each. Training against transformers with Axolotl's loss on every layout:
tests/distributed/test_sft_train.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from adapter import config
from adapter.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "configs/models/llama-3.2-1b")


def _axolotl(**keys):
    raw = {"base_model": MODEL, "sequence_len": 64, "micro_batch_size": 1, "max_steps": 1, "learning_rate": 1e-5,
           "datasets": [{"path": "x.jsonl", "type": "alpaca"}], **keys}
    return config.build(raw, env={}, world_size=1)


def test_axolotl_keys_map_with_its_defaults():
    cfg = _axolotl(use_eaft=True, eaft_alpha=0.5, eaft_k=7)
    assert (cfg.eaft.alpha, cfg.eaft.k) == (0.5, 7)
    cfg = _axolotl(use_eaft=True, eaft_alpha=None)
    assert (cfg.eaft.alpha, cfg.eaft.k) == (1.0, 20) and any("use_eaft: true -> eaft" in n for n in cfg.notes)
    cfg = _axolotl(eaft_alpha=2.0)  # Axolotl reads it beside use_eaft only
    assert cfg.eaft is None and any("eaft_alpha: read beside use_eaft: true only" in n for n in cfg.notes)
    with pytest.raises(UserError, match=r"^eaft_k=0: "):
        _axolotl(use_eaft=True, eaft_k=0)


def test_weights_are_axolotls_without_the_padding_columns(monkeypatch):
    import torch
    import torch.nn.functional as F

    from adapter.kernels import eaft
    from adapter.kernels.eaft import entropy_weights

    torch.manual_seed(0)
    logits = torch.randn(3, 5, 40) * 3
    padded = torch.cat([logits, torch.full((3, 5, 24), 50.0)], dim=-1)  # padding columns larger than any logit
    for k, alpha in ((4, 1.0), (20, 0.3), (100, 2.0)):
        p = F.softmax(logits.topk(min(k, 40), dim=-1).values, dim=-1)
        want = (-(p * torch.log(p + 1e-10)).sum(-1)) ** alpha
        got = entropy_weights(padded, k, alpha, real=40, vocab=40)
        assert torch.allclose(got, want, atol=1e-6), (k, alpha)
        # the vocabulary split over two TP ranks: each rank's top-k (padded where its slice is narrower), gathered,
        # hold the whole row's top-k (the all-gather stands in for the group's)
        tops = [F.pad(x.topk(min(k, 40, 20), dim=-1).values, (0, max(0, min(k, 40) - 20)), value=float("-inf"))
                for x in logits.split(20, dim=-1)]
        monkeypatch.setattr(eaft.dist, "get_world_size", lambda group: 2)
        monkeypatch.setattr(eaft.dist, "all_gather",
                            lambda parts, t, group, tops=tops: [p.copy_(x) for p, x in zip(parts, tops)])
        got = entropy_weights(logits[..., :20], k, alpha, group="tp", vocab=40)
        assert torch.allclose(got, want, atol=1e-6), (k, alpha)
        monkeypatch.undo()
    assert not entropy_weights(logits.requires_grad_(), 4, 1.0).requires_grad


@pytest.mark.parametrize("keys, said", [
    ({"rl": "dpo", "datasets": [{"path": "x.jsonl", "type": "chat_template.default"}]},
     r"^use_eaft=True: EAFT weighs the next-token loss of supervised fine-tuning; dpo has a loss of its own"),
])
def test_it_is_refused_beside_another_objective(keys, said, tmp_path):
    from adapter.models.resolved import resolve_run

    with pytest.raises(UserError, match=said):
        resolve_run(_axolotl(use_eaft=True, **keys), gpu=False)


def test_the_fused_linear_ce_goes_off_for_it_and_is_refused_when_asked():
    from adapter.models.resolved import resolve_run

    run = resolve_run(_axolotl(use_eaft=True), gpu=False)
    assert not run.cfg.model.fused_linear_ce
    assert any("model.fused_linear_ce: auto: off: EAFT weighs each token by its logits' top-k entropy" in n
               for n in run.cfg.notes), run.cfg.notes
    cfg = _axolotl(use_eaft=True)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"fused_linear_ce": True})})
    with pytest.raises(UserError, match=r"^model.fused_linear_ce=True: EAFT weighs each token"):
        resolve_run(cfg, gpu=False)
    cfg = _axolotl(use_eaft=True, liger_fused_linear_cross_entropy=True)
    with pytest.raises(UserError, match=r"^use_eaft=True: Liger's fused_linear_cross_entropy computes the loss"):
        resolve_run(cfg, gpu=False)


def test_a_native_config_says_it_in_the_first_lines():
    from adapter.models import announce
    from adapter.models.resolved import resolve_run

    raw = {"model": {"path": MODEL}, "seq_len": 64, "eaft": {"k": 7}}
    lines = announce.announce(resolve_run(config.build(raw, env={}, world_size=1), gpu=False), gpu=False)
    assert any(ln.startswith("loss: EAFT: each token's cross-entropy × (entropy of the softmax over its 7 largest "
                             "logits)^1, without gradient") for ln in lines), lines
