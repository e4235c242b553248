"""FlatAdamW (adapter/train/optim.py) against torch.optim.AdamW + clip_grad_norm_ on the same gradients; its resume."""
from __future__ import annotations

import copy
import operator

import pytest
import torch

from adapter.errors import UserError
from adapter.train.optim import FlatAdamW


def _model(dtype):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4, bias=False))
    return m.to(dtype)


def _groups(model):
    decay = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _backward(model, step, micro=2):
    for k in range(micro):  # accumulation into the flat gradient views
        g = torch.Generator().manual_seed(100 * step + k)
        x = torch.randn(5, 8, generator=g).to(next(model.parameters()).dtype)
        (model(x).float().square().mean() * (30 if step == 1 else 1)).backward()  # step 1 is clipped


def _lambda(step):
    return min(1.0, (step + 1) / 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_adamw_matches_torch_adamw(dtype):
    ours = _model(dtype)
    ref = copy.deepcopy(ours).float()  # the reference keeps fp32 weights: our master weights
    opt = FlatAdamW(_groups(ours), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, clip_grad=0.5)
    torch_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lambda)
    torch_sched = torch.optim.lr_scheduler.LambdaLR(torch_opt, _lambda)
    for step in range(1, 6):
        _backward(ours, step)
        for p_ref, p in zip(ref.parameters(), ours.parameters()):
            p_ref.grad = p.grad.detach().float().clone()  # the same gradients (bf16: as backward rounded them)
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        torch_opt.step()
        sched.step()
        torch_sched.step()
        assert torch.allclose(opt._global_grad_norm, norm, rtol=1e-5), (step, opt._global_grad_norm, norm)
        for f, group in zip(opt.flats, torch_opt.param_groups):
            want = torch.cat([p.detach().reshape(-1) for p in group["params"]])
            master = torch.cat([opt._master(f, i) for i in range(len(f.params))])
            assert torch.allclose(master, want, rtol=1e-5, atol=1e-7), step
            weights = torch.cat([p.detach().reshape(-1) for p in f.params])
            assert torch.equal(weights, master.to(dtype))  # the 16-bit weights are the master's rounding
        opt.zero_grad()


def test_bf16_states_step_as_torch_fused_adamw_on_a_bf16_model():
    """optimizer.state_dtype: bf16 is torch's AdamW on bf16 weights (states in the weights' dtype; the fused kernel
    computes in fp32 and rounds once): the weights equal it, the moments to one bf16 rounding. The fp32-master mode
    trains differently on the same gradients (the control: small updates accumulate in the master only)."""
    ours, master_run = _model(torch.bfloat16), _model(torch.bfloat16)
    ref = copy.deepcopy(ours)
    kw = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, clip_grad=0.0)
    opt = FlatAdamW(_groups(ours), state_dtype="bf16", **kw)
    with_master = FlatAdamW(_groups(master_run), **kw)
    torch_opt = torch.optim.AdamW(_groups(ref), lr=3e-3, betas=(0.9, 0.99), eps=1e-8, fused=True)
    assert all(f.master is None and f.exp_avg.dtype == torch.bfloat16 for f in opt.flats)  # 4 bytes of state
    for step in range(1, 9):
        _backward(ours, step)
        for p_ref, p, p_m in zip(ref.parameters(), ours.parameters(), master_run.parameters()):
            p_ref.grad, p_m.grad = p.grad.clone(), p.grad.clone()
        for o in (opt, with_master, torch_opt):
            o.step()
            o.zero_grad()
        for p, p_ref in zip(ours.parameters(), ref.parameters()):
            assert torch.equal(p, p_ref), (step, (p.float() - p_ref.float()).abs().max())
        for f, group in zip(opt.flats, torch_opt.param_groups):
            for what in ("exp_avg", "exp_avg_sq"):
                want = torch.cat([torch_opt.state[p][what].reshape(-1) for p in group["params"]]).float()
                got = getattr(f, what).float()
                assert ((got - want).abs() <= want.abs() * 2 ** -8).all(), (step, what)
    assert any(not torch.equal(a, b) for a, b in zip(master_run.parameters(), ref.parameters()))


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_flat_adamw_resumes_exactly(tmp_path, state_dtype):
    models, opts = [], []
    for _ in range(2):
        models.append(_model(torch.bfloat16))
        opts.append(FlatAdamW(_groups(models[-1]), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, clip_grad=0.0,
                              state_dtype=state_dtype))
    model, opt = models[0], opts[0]
    for step in (2, 3):
        _backward(model, step)
        opt.step()
        opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())  # freed between steps
    torch.save({"opt": opt.state_dict(), "model": model.state_dict()}, tmp_path / "ck.pt")

    again, opt2 = models[1], opts[1]
    saved = torch.load(tmp_path / "ck.pt", weights_only=False)
    again.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    for m, o in zip(models, opts):
        _backward(m, 4)
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    for a, b in zip(opt.flats, opt2.flats):
        assert (a.master is None) == (state_dtype == "bf16")
        assert all(torch.equal(x, y) for x, y in ((a.master, b.master), (a.exp_avg, b.exp_avg)) if x is not None)

    with pytest.raises(UserError, match="optimizer.impl"):  # a ZeRO checkpoint's optimizer state
        opt2.load_state_dict(None)
    other = "fp32" if state_dtype == "bf16" else "bf16"
    elsewhere = FlatAdamW(_groups(_model(torch.bfloat16)), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, clip_grad=0.0,
                          state_dtype=other)
    with pytest.raises(UserError, match=f"optimizer.state_dtype='{other}'.*resume with optimizer.state_dtype: "
                       f"{state_dtype}"):
        elsewhere.load_state_dict(saved["opt"])


def test_nonfinite_gradient_norm_leaves_weights_finite():
    model = _model(torch.float32)
    opt = FlatAdamW([{"params": list(model.parameters()), "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.99),
                    eps=1e-8, clip_grad=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model, 2)
    next(model.parameters()).grad[0, 0] = float("nan")
    opt.step()
    assert not torch.isfinite(opt._global_grad_norm)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # clipped to zero gradients


def test_gradient_norm_reads_deposited_expert_rows_as_one_tensor():
    """Grouped experts leave their gradients as the rows of one tensor: the norm reads that tensor once (a complete,
    non-overlapping set of rows only) and equals the norm over every gradient on its own."""
    from adapter.train.grads import whole as _whole

    whole, part, alone = torch.randn(4, 3, 5), torch.randn(4, 3, 5), torch.randn(7)
    rows, some = list(whole.unbind(0)), list(part.unbind(0))[:3]
    got = _whole([*rows, *some, alone])
    assert got[0] is alone and len(got) == 5 and any(g is whole for g in got)  # the partial set stays row by row
    assert all(g is not whole for g in _whole(rows[:3] + rows[2:3]))  # a row twice, one missing: not the whole
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in (*rows, *some, alone)]
    for p, g in zip(params, (*rows, *some, alone)):
        p.grad = g
    opt = FlatAdamW([{"params": params, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, clip_grad=1.0)
    want = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in (*rows, *some, alone)]))
    assert torch.allclose(opt.grad_norm(), want, rtol=1e-6)


def test_gradient_norm_takes_long_tensors_one_reduction_each(monkeypatch):
    """Long gradients get a reduction of their own, the rest one multi-tensor norm: the same norm as the multi-tensor
    one over all of them."""
    from adapter.train import optim

    grads = [torch.randn(n) for n in (3, 40, 7, 64, 1)]
    launches = []
    monkeypatch.setattr(optim, "BIG", 32)
    real = torch.linalg.vector_norm
    monkeypatch.setattr(torch.linalg, "vector_norm", lambda g, *a, **k: launches.append(g.numel()) or real(g, *a, **k))
    got = optim._sum_of_squares(grads)
    assert sorted(launches) == [40, 64]
    want = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).square().sum()
    assert torch.allclose(got, want, rtol=1e-6)
    assert torch.allclose(optim._sum_of_squares(grads[:1]), grads[0].square().sum(), rtol=1e-6)  # short ones only
    assert torch.allclose(optim._sum_of_squares(grads[1:2]), grads[1].square().sum(), rtol=1e-6)  # long ones only


def test_step_pointer_table_is_every_gradient_then_every_weight():
    """The one-launch step's pointer table (made on the host, so checked here): autograd's gradients where they are;
    a missing one as zeros, one of another dtype or non-contiguous as a contiguous copy in the weight's dtype; the
    alignment flag false as soon as one address is not 16-byte aligned."""
    from adapter.train.grads import pointers

    params = [torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.bfloat16)) for _ in range(4)]
    base = torch.randn(2, 4, 8).to(torch.bfloat16)
    params[0].grad, params[1].grad = base[0], base[1]
    params[2].grad_dtype = None  # torch refuses another dtype's gradient unless told
    params[2].grad = torch.randn(8, 4).t()  # fp32 and non-contiguous
    table, aligned, keep = pointers(params)
    assert table.dtype == torch.int64 and table.numel() == 8
    assert table[:2].tolist() == [base[0].data_ptr(), base[1].data_ptr()]
    assert table[4:].tolist() == [p.data_ptr() for p in params]
    for i in (2, 3):
        copy = next(g for g in keep if g.data_ptr() == table[i])
        assert copy.dtype == torch.bfloat16 and copy.is_contiguous()
    assert torch.equal(keep[2], params[2].grad.to(torch.bfloat16)) and not keep[3].any()  # None: zeros
    params[2].grad = params[3].grad = base[0]
    assert all(map(operator.is_, pointers(params)[2], [p.grad for p in params]))  # the usual case: nothing copied
    assert not pointers([torch.nn.Parameter(torch.zeros(9, dtype=torch.bfloat16)[1:])])[1]  # 2-byte offset
