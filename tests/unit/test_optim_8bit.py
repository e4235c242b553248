"""8-bit AdamW (bitsandbytes' AdamW8bit, adapter/train/optim.py) against fp32 AdamW within bitsandbytes' own test
band; the flat AdamW's 8-bit mode taking bitsandbytes' steps on its fp32 masters; its resume; plan's bytes per
parameter."""
from __future__ import annotations

import copy

import pytest
import torch

from adapter.errors import UserError
from adapter.models import footprint
from adapter.train.optim import FlatAdamW, adamw_8bit
from tests.helpers.optim import backward, param_groups, small_model

BNB_BLOCK = 256


def _dequantized(state: dict, name: str) -> torch.Tensor:
    import bitsandbytes.functional as F

    i = name[-1]
    return F.dequantize_blockwise(A=state[name], code=state[f"qmap{i}"], absmax=state[f"absmax{i}"],
                                  blocksize=BNB_BLOCK).reshape(-1)


@pytest.mark.parametrize("shape", [(1024, 64), (1000, 67)])  # whole 256-element blocks; a part block
def test_8bit_adamw_tracks_fp32_adamw_within_bitsandbytes_band(shape):
    """bitsandbytes' own test_optimizer8bit, fp32: p = randn·0.1, grads randn·0.01, 50 steps against torch's fp32
    AdamW; after each step the reference takes the 8-bit run's weights and (dequantised) moments, so each step's
    error is measured alone: mean |Δp| < 6e-5, mean relative |Δp| < 6e-4, fewer than 20 moments off."""
    torch.manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(shape) * 0.1)
    ours = torch.nn.Parameter(ref.detach().clone())
    torch_opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01, foreach=False)
    opt = adamw_8bit([{"params": [ours], "weight_decay": 0.01}], lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    for _ in range(50):
        g = torch.randn(shape) * 0.01
        ref.grad, ours.grad = g.clone(), g.clone()
        torch_opt.step()
        opt.step()
        err = (ref - ours).abs()
        assert err.mean() < 6e-5 and (err / (ref.abs() + 1e-9)).mean() < 6e-4
        state, want = opt.state[ours], torch_opt.state[ref]
        for name, ref_name in (("state1", "exp_avg"), ("state2", "exp_avg_sq")):
            got = _dequantized(state, name)
            assert (~torch.isclose(want[ref_name].reshape(-1), got, atol=3e-3, rtol=1e-3)).sum() < 20
            want[ref_name].copy_(got.view(shape))
        with torch.no_grad():
            ref.copy_(ours)
    assert state["state1"].dtype == torch.uint8  # the moments are 8-bit


def test_flat_8bit_takes_bitsandbytes_steps_on_the_fp32_masters():
    """The flat AdamW's 8-bit mode (bf16 weights, fp32 masters, its own clipping) is bitsandbytes' AdamW8bit on fp32
    copies of the weights given the same clipped gradients."""
    ours = small_model()
    ref = copy.deepcopy(ours).float()
    flat = FlatAdamW(param_groups(ours), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, clip_grad=0.05, state_bits=8)
    bnb_opt = adamw_8bit(param_groups(ref), lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    for step in range(4):
        backward(ours, step)
        for a, b in zip(ref.parameters(), ours.parameters()):
            a.grad = b.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        flat.step()
        bnb_opt.step()
        flat.zero_grad()
        assert torch.allclose(flat._global_grad_norm, norm, rtol=1e-5)
        for f, group in zip(flat.flats, bnb_opt.param_groups):
            master = torch.cat([m.detach().reshape(-1) for m in f.masters])
            assert torch.allclose(master, torch.cat([p.detach().reshape(-1) for p in group["params"]]),
                                  rtol=1e-6, atol=1e-8)
            assert torch.equal(torch.cat([p.detach().reshape(-1) for p in f.params]), master.bfloat16())
    assert flat.inner.state[flat.flats[0].masters[0]]["state1"].dtype == torch.uint8  # 64·128 elements: 8-bit


def test_flat_8bit_resumes_exactly_and_refuses_another_state_width(tmp_path):
    models = [small_model(), small_model()]
    opts = [FlatAdamW(param_groups(m), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, clip_grad=1.0, state_bits=8)
            for m in models]
    for step in (1, 2):
        backward(models[0], step)
        opts[0].step()
        opts[0].zero_grad()
    torch.save({"opt": opts[0].state_dict(), "model": models[0].state_dict()}, tmp_path / "ck.pt")
    saved = torch.load(tmp_path / "ck.pt", weights_only=False)
    models[1].load_state_dict(saved["model"])
    opts[1].load_state_dict(saved["opt"])
    for m, o in zip(models, opts):
        backward(m, 3)
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    fp32 = FlatAdamW(param_groups(small_model()), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, clip_grad=1.0)
    with pytest.raises(UserError, match="optimizer.name"):
        fp32.load_state_dict(saved["opt"])


def test_plan_counts_the_8bit_states_as_bitsandbytes_holds_them():
    p = torch.nn.Parameter(torch.zeros(1 << 20))
    opt = adamw_8bit([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    p.grad = torch.zeros_like(p)
    opt.step()
    per_param = [v.nbytes for k, v in opt.state[p].items() if k.startswith(("state", "absmax"))]
    assert sum(per_param) / p.numel() == footprint.STATE_BYTES["adamw_8bit"]  # the 256-entry maps are shared
