"""GPU host only (`pytest -m gpu`): the flat AdamW's one-launch Triton step (adapter/train/adamw_kernel.py) against
its per-parameter update (the arithmetic the CPU suite checks against torch.optim.AdamW), on bf16 weights whose
sizes are not multiples of the kernel's chunk, with clipping, weight decay, a parameter without a gradient and a
non-finite step."""
from __future__ import annotations

import copy

import pytest
import torch

from adapter.train.optim import FlatAdamW

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


UNALIGNED = [(1000, 77), (4096,), (3, 5), (8192, 9)]  # sizes not multiples of 16: the kernel without hints
ALIGNED = [(1024, 48), (4096,), (16,), (8192, 16)]   # the vectorised kernel (every size a multiple of 16)


def _params(shapes):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, device="cuda").to(torch.bfloat16)) for s in shapes]


def _run(params, kernel: bool, steps: int = 6, align: int = 1, state_dtype: str = "fp32"):
    opt = FlatAdamW([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}],
                    lr=1e-2, betas=(0.9, 0.95), eps=1e-8, clip_grad=1.0, state_dtype=state_dtype)
    assert all(f.table is not None for f in opt.flats)
    if not kernel:
        for f in opt.flats:
            f.table = None
    else:
        assert all(f.table.sizes_aligned == (align > 1) for f in opt.flats)
    for step in range(steps):
        g = torch.Generator(device="cuda").manual_seed(step)
        for i, p in enumerate(params):
            p.grad = None if i == 2 and step % 2 else (torch.randn(p.shape, device="cuda", generator=g) * 3).to(p.dtype)
        if step == 4:
            params[0].grad[0, 0] = float("nan")  # this step's norm is NaN: no update of the gradients
        opt.step()
    return opt


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shapes,align", [(UNALIGNED, 1), (ALIGNED, 16)], ids=["unaligned", "aligned"])
def test_one_launch_step_equals_the_per_parameter_step(shapes, align, state_dtype, monkeypatch):
    """fp32: master and moments FMA-level; bf16 states (no master): weights and moments to one bf16 rounding. Both
    runs clip with one norm (float64, rounded to fp32): the one-launch norm sums in another order than the
    per-tensor one, and a last-bit change of the clip factor moves bf16 roundings over six steps; the norm has its
    own test below."""
    from adapter.train import adamw_kernel

    told, plain = [], adamw_kernel.step
    monkeypatch.setattr(adamw_kernel, "step", lambda *a: told.append(plain(*a)))
    monkeypatch.setattr(FlatAdamW, "grad_norm", lambda self, prepared=None: torch.stack(
        [p.grad.double().square().sum() for f in self.flats for p in f.params if p.grad is not None]
    ).sum().sqrt().float())
    base = _params(shapes)
    ref_params, got_params = copy.deepcopy(base), copy.deepcopy(base)
    ref = _run(ref_params, kernel=False, state_dtype=state_dtype)
    got = _run(got_params, kernel=True, align=align, state_dtype=state_dtype)
    assert told and set(told) == {align}
    for fr, fg in zip(ref.flats, got.flats):
        assert (fg.master is None) == (state_dtype == "bf16")
        for a, b in ((fr.master, fg.master), (fr.exp_avg, fg.exp_avg), (fr.exp_avg_sq, fg.exp_avg_sq)):
            if a is None:
                continue
            assert torch.isfinite(b).all() and b.dtype == (torch.float32 if state_dtype == "fp32" else torch.bfloat16)
            a, b = a.float(), b.float()
            if state_dtype == "fp32":
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()  # FMA-level
            else:
                assert ((a - b).abs() <= a.abs() * 2 ** -7 + 1e-30).all(), (a - b).abs().max()  # one rounding
    for start, a, b in zip(base, ref_params, got_params):
        assert (a.float() - b.float()).abs().max() <= a.float().abs().max() * 2 ** -7  # at most a bf16 rounding
        assert not torch.equal(b, start)                                               # it did update


@pytest.mark.parametrize("shapes", [UNALIGNED, ALIGNED], ids=["unaligned", "aligned"])
def test_one_launch_norm_follows_megatrons_tp_rule(shapes):
    """The Triton norm over the step's table: Σ g² in float64 within fp32 accumulation, a missing gradient counted as
    zero; on a TP rank other than 0 the replicated parameters do not count, not even a NaN in them."""
    from adapter.train import adamw_kernel

    params = _params(shapes)
    params[0].tensor_model_parallel = params[3].tensor_model_parallel = True
    for i, p in enumerate(params):
        p.grad = None if i == 2 else torch.randn(p.shape, device="cuda").to(p.dtype)
    for rank in (0, 1):
        opt = FlatAdamW([{"params": params, "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, clip_grad=1.0,
                        state_dtype="bf16")
        opt.tp_rank = rank
        prep = [adamw_kernel.prepare(f.table, f.params) for f in opt.flats]
        counted = [p for p in params if rank == 0 or getattr(p, "tensor_model_parallel", False)]
        want = sum(p.grad.double().square().sum() for p in counted if p.grad is not None).sqrt()
        got = opt.grad_norm(prep)
        assert got.dtype == torch.float32 and torch.allclose(got.double(), want, rtol=1e-6), (got, want)
        assert torch.allclose(got, opt.grad_norm(), rtol=1e-6)  # the per-tensor path agrees
    params[1].grad[0] = float("nan")  # replicated: counted on rank 0 only
    assert torch.isfinite(opt.grad_norm([adamw_kernel.prepare(f.table, f.params) for f in opt.flats]))


def test_flat_8bit_on_cuda_takes_bitsandbytes_cuda_steps():
    """optimizer.name: adamw_8bit on one GPU: the flat AdamW's 8-bit mode (bf16 weights, fp32 master views, its own
    norm) steps bitsandbytes' CUDA AdamW8bit exactly as that optimizer steps fp32 copies of the weights. Clipping is
    off: a last-bit difference in a clipped gradient can move a moment to the next 8-bit code (CPU tests clipping)."""
    from adapter.train.optim import adamw_8bit

    base = _params(ALIGNED)
    ours = copy.deepcopy(base)
    ref = [torch.nn.Parameter(p.detach().float()) for p in base]
    groups = lambda ps: [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]  # noqa: E731
    flat = FlatAdamW(groups(ours), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, clip_grad=0.0, state_bits=8)
    bnb = adamw_8bit(groups(ref), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for step in range(5):
        g = torch.Generator(device="cuda").manual_seed(step)
        for a, b in zip(ours, ref):
            a.grad = (torch.randn(a.shape, device="cuda", generator=g) * 3).to(a.dtype)
            b.grad = a.grad.float()
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ref]))
        flat.step()
        bnb.step()
        assert torch.allclose(flat._global_grad_norm, norm, rtol=1e-4)
    state = flat.inner.state[flat.flats[0].masters[0]]
    assert state["state1"].dtype == torch.uint8 and state["state1"].is_cuda
    for f, group in zip(flat.flats, bnb.param_groups):
        for m, p, w in zip(f.masters, group["params"], f.params):
            assert torch.equal(m, p), (m - p).abs().max()
            assert torch.equal(w, m.to(w.dtype))
