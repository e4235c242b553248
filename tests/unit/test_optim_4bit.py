"""4-bit AdamW (torchao's AdamW4bit, adapter/train/optim_4bit.py) against torchao's own AdamW4bit stepping the same
tensors with the same gradients: ZeRO's client on a flat partition (its whole blocks and the rest as two tensors),
the flat AdamW on its fp32 masters; the flat AdamW's resume; plan's bytes per parameter.

The reference runs under torch.compiler's "force_eager" stance, as ours does on CPU (the module says why): the same
torchao step, so the parameters must be equal bit for bit."""
from __future__ import annotations

import copy

import pytest
import torch
from torchao.optim import AdamW4bit as Reference
from torchao.optim.subclass_4bit import OptimState4bit

from adapter.errors import UserError
from adapter.models import footprint
from adapter.train.optim import FlatAdamW, zero_client
from tests.helpers.optim import backward, param_groups, small_model


def _reference(params, wd: float, **kw) -> torch.optim.Optimizer:
    """torchao's AdamW4bit as transformers builds it for adamw_torch_4bit (block_size 256)."""
    return Reference([{"params": params, "weight_decay": wd}], block_size=256, bf16_stochastic_round=False, **kw)


def test_zero_client_steps_a_partition_as_torchao_steps_its_whole_blocks_and_the_rest():
    """A ZeRO partition of 256·20 + 77 elements and one of 100 (under 4096: fp32 states, torchao's rule), with a
    learning rate the schedule changes between steps: equal to torchao's AdamW4bit stepping [the 5120 whole-block
    elements, the 77 left, the 100] as three tensors."""
    torch.manual_seed(0)
    parts = [torch.nn.Parameter(torch.randn(256 * 20 + 77) * 0.1), torch.nn.Parameter(torch.randn(100) * 0.1)]
    pieces = [torch.nn.Parameter(t.detach().clone()) for t in (parts[0][:5120], parts[0][5120:], parts[1])]
    ours = zero_client("adamw_4bit", [{"params": parts, "weight_decay": 0.01}], lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    ref = _reference(pieces, 0.01, lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    for step in range(6):
        grads = [torch.randn_like(p) * 0.01 for p in parts]
        for p, g in zip(parts, grads):
            p.grad = g
        for p, g in zip(pieces, (grads[0][:5120], grads[0][5120:], grads[1])):
            p.grad = g.clone()
        lr = 1e-2 * (1 - step / 6)
        ours.param_groups[0]["lr"] = lr  # a float, as the schedule writes it
        ref.param_groups[0]["lr"].fill_(lr)
        ours.step()
        with torch.compiler.set_stance("force_eager"):
            ref.step()
        assert torch.equal(parts[0].detach(), torch.cat([pieces[0].detach(), pieces[1].detach()]))
        assert torch.equal(parts[1].detach(), pieces[2].detach())
    state = ours.state[parts[0]]
    assert isinstance(state["blocks"]["exp_avg"], OptimState4bit) and state["tail"]["exp_avg"].dtype == torch.float32
    assert set(ours.state[parts[1]]) == {"tail"}  # no whole block
    assert isinstance(ours.param_groups[0]["lr"], float)


def test_flat_4bit_takes_torchaos_steps_on_the_fp32_masters():
    """The flat AdamW's 4-bit mode (bf16 weights, fp32 masters, its own clipping) is torchao's AdamW4bit on fp32
    copies of the weights given the same clipped gradients."""
    ours = small_model()
    ref = copy.deepcopy(ours).float()
    flat = FlatAdamW(param_groups(ours), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, clip_grad=0.05, state_bits=4)
    groups = param_groups(ref)
    torchao = Reference(groups, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, block_size=256, bf16_stochastic_round=False)
    for step in range(4):
        backward(ours, step)
        for a, b in zip(ref.parameters(), ours.parameters()):
            a.grad = b.grad.float()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        flat.step()
        with torch.compiler.set_stance("force_eager"):
            torchao.step()
        flat.zero_grad()
        for f, group in zip(flat.flats, torchao.param_groups):
            master = torch.cat([m.detach().reshape(-1) for m in f.masters])
            assert torch.equal(master, torch.cat([p.detach().reshape(-1) for p in group["params"]]))
            assert torch.equal(torch.cat([p.detach().reshape(-1) for p in f.params]), master.bfloat16())
    assert isinstance(flat.inner.state[flat.flats[0].masters[0]]["all"]["exp_avg"], OptimState4bit)  # 64·128


def test_flat_4bit_resumes_exactly_and_refuses_another_state_width(tmp_path):
    models = [small_model(), small_model()]
    opts = [FlatAdamW(param_groups(m), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, clip_grad=1.0, state_bits=4)
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
    eight = FlatAdamW(param_groups(small_model()), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, clip_grad=1.0, state_bits=8)
    with pytest.raises(UserError, match="optimizer.name='adamw_8bit': the checkpoint's optimizer is adamw_4bit"):
        eight.load_state_dict(saved["opt"])


def test_plan_counts_the_4bit_states_as_torchao_holds_them():
    p = torch.nn.Parameter(torch.zeros(1 << 20))
    opt = zero_client("adamw_4bit", [p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    p.grad = torch.zeros_like(p)
    opt.step()
    moments = [opt.state[p]["blocks"][k] for k in ("exp_avg", "exp_avg_sq")]
    per_param = sum(m.codes.nbytes + m.scale.nbytes for m in moments)  # the 16-entry maps are per tensor
    assert per_param / p.numel() == footprint.STATE_BYTES["adamw_4bit"]
