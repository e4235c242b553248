"""AdamW with fp32 master weights in flat buffers, for layouts with nothing to shard (`optimizer.impl`: one GPU, or TP
without DP/CP).

Why: DeepSpeed's ZeRO-1 on one rank still pays its partition bookkeeping. On the Llama-3.2-1B shape its step took
29.7 ms of GPU time per step, of which the Adam kernel was 10 ms; the rest was copies of every gradient to fp32 and
back, a float64 norm and an unscale pass (docs/BENCHMARKS.md, 2026-12-01, third session). Here:

* the fp32 master weights and both moments are flat fp32 buffers (12 bytes/param, as in DeepSpeed's bf16 training;
  fp32 runs update the weights themselves, with no master copy);
* `optimizer.state_dtype: bf16` keeps no master: each bf16 weight is updated in place and the moments are flat bf16
  buffers (4 bytes/param), every update computed in fp32 and rounded once, as torch's fused AdamW does on a bf16
  model (tests/unit/test_flat_optim.py compares the two);
* one fused pass per parameter reads its 16-bit gradient, applies clipping and AdamW (torch.optim.AdamW's
  arithmetic) to the master and moments, and writes the 16-bit weight; on CUDA one Triton launch does it for a
  whole parameter group (adapter/train/adamw_kernel.py: per-parameter launches left the GPU waiting on the host);
* the gradient norm is one Triton launch per group over the step's own table on CUDA (elsewhere one reduction per
  long gradient and one multi-tensor kernel for the rest); clipping never leaves the device;
* gradients stay autograd's own tensors, freed after each step (`zero_grad` sets them to None), so they are not
  resident while the forward's activations peak.

Gradient clipping under TP follows Megatron: tensor-parallel parameters count on every TP rank, the rest (norms:
equal on every rank) once; the squares are summed over the TP group. A non-finite norm clips to zero gradients
(DeepSpeed clips with an infinite norm) and the loop stops on it.

`optimizer.name: adamw_8bit` (Axolotl's adamw_8bit, adamw_bnb_8bit, paged_adamw_8bit, adamw_torch_8bit) keeps the
moments in 8 bits: bitsandbytes' AdamW8bit (block-wise dynamic quantisation, 256 elements a block; tensors under 4096
elements keep fp32 moments), 2 bytes of state per parameter instead of 8. bitsandbytes because it is what Axolotl
runs for these names, its update is the reference the 8-bit names mean, it takes tensors of any size (DeepSpeed's
flat partitions are not whole blocks) and it runs on CPUs too (tests, rehearsals). Under DeepSpeed's ZeRO it is the
client optimizer stepping ZeRO's fp32 partitions (clipping stays ZeRO's); the flat AdamW runs it on its fp32
masters after its own clipping. `optimizer.name: adamw_4bit` (Axolotl's adamw_torch_4bit) runs torchao's AdamW4bit
the same two ways (adapter/train/optim_4bit.py: 4-bit moments, and how ZeRO's partitions are cut into whole blocks).
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from adapter.errors import bad
from adapter.train.grads import whole
from adapter.train.optim_4bit import AdamW4bit

try:  # Triton comes with torch's CUDA wheels, not its CPU ones; without it the per-parameter step runs
    from adapter.train import adamw_kernel
except ImportError:
    adamw_kernel = None


def _adamw_update(master, exp_avg, exp_avg_sq, grad, low, hyper):
    """hyper: [clip coef, 1 − lr·wd, 1 − β1, β2, 1 − β2, lr / bc1, √bc2, eps] (fp32, on the device)."""
    g = torch.where(hyper[0] > 0, grad.float() * hyper[0], 0.0)  # a non-finite norm: zeros, even for NaNs
    master.mul_(hyper[1])
    exp_avg.lerp_(g, hyper[2])
    exp_avg_sq.mul_(hyper[3]).add_(g * g * hyper[4])
    master.sub_(hyper[5] * (exp_avg / (exp_avg_sq.sqrt() / hyper[6] + hyper[7])))
    if low is not None:
        low.copy_(master)


def _adamw_update_16(weight, exp_avg, exp_avg_sq, grad, low, hyper):
    """`_adamw_update` on a 16-bit weight and 16-bit moments (no master): fp32 arithmetic, each result rounded once.
    `low` is unused (the weight is its own master)."""
    g = torch.where(hyper[0] > 0, grad.float() * hyper[0], 0.0)
    m = exp_avg.float().lerp_(g, hyper[2])
    v = exp_avg_sq.float().mul_(hyper[3]).add_(g * g * hyper[4])
    w = weight.float().mul_(hyper[1]).sub_(hyper[5] * (m / (v.sqrt() / hyper[6] + hyper[7])))
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    weight.copy_(w)


_compiled = {}


def _step_fn(device: torch.device, sixteen: bool = False):
    fn = _adamw_update_16 if sixteen else _adamw_update
    if device.type != "cuda":
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True)
    return _compiled[fn]


@dataclass
class _Flat:
    params: list                 # the group's parameters
    offsets: list                # where each starts in the flat buffers
    master: torch.Tensor | None  # fp32 copies of 16-bit weights, flat (None: the weights are their own master)
    exp_avg: torch.Tensor | None     # moments, flat: fp32, or the weights' dtype with 16-bit states (None: 8/4-bit)
    exp_avg_sq: torch.Tensor | None
    table: object = None         # adamw_kernel.ChunkTable where the one-launch step applies
    masters: list | None = None  # 8/4-bit: each parameter's fp32 master as a leaf tensor (a view of `master`)
    _counted: list | None = None
    _weights: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def counted(self, tp_rank: int) -> list:
        """The parameters whose gradients count in the norm on this TP rank (Megatron's rule: TP-parallel ones on
        every rank, the rest on rank 0), listed once."""
        if self._counted is None:
            self._counted = [p for p in self.params if getattr(p, "tensor_model_parallel", False)]
        return self.params if tp_rank == 0 else self._counted

    def norm_weights(self, tp_rank: int) -> torch.Tensor:
        """`counted` as a per-parameter 1/0 vector on the device, for the one-launch norm."""
        if self._weights is None:
            on = set(map(id, self.counted(tp_rank)))
            self._weights = torch.tensor([float(id(p) in on) for p in self.params], device=self.device)
        return self._weights

    @property
    def sixteen(self) -> bool:
        """16-bit weights that are their own master (optimizer.state_dtype: bf16)."""
        return self.master is None and self.exp_avg is not None and self.exp_avg.dtype != torch.float32


_GRAD = operator.attrgetter("grad")
BIG = 1 << 22  # elements: a tensor this long gets a reduction of its own in the gradient norm (`_sum_of_squares`)


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """The squared L2 norm of `grads`, fp32, on their device. Long tensors get a reduction each: torch's multi-tensor
    norm cuts every launch at ~21 M elements (320 blocks of 64 Ki), which read the MoE shape's 5.6 B gradient
    elements at 1.9 TB/s on one H200 (bench/adamw_bench.py); the rest share one multi-tensor launch."""
    long = [g for g in grads if g.numel() >= BIG]
    norms = [torch.linalg.vector_norm(g, 2.0, dtype=torch.float32) for g in long]
    if len(long) < len(grads):
        norms.extend(torch._foreach_norm([g for g in grads if g.numel() < BIG], 2.0, dtype=torch.float32))
    return torch.stack(norms).square().sum()


class FlatAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch's bias correction) with gradient clipping and fp32 master weights
    (`state_dtype="bf16"`: none, and moments in the weights' 16-bit dtype).

    DeepSpeed drives it as a plain client optimizer (`step()`, `zero_grad()`, `state_dict()`); it exposes the step's
    gradient norm as `_global_grad_norm` (a device tensor), which DeepSpeed's engine reports."""

    def __init__(self, param_groups, *, lr: float, betas: tuple[float, float], eps: float, clip_grad: float,
                 tp_group=None, state_bits: int = 32, state_dtype: str = "fp32"):
        super().__init__(param_groups, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=0.0))
        if state_dtype not in ("fp32", "bf16") or (state_dtype == "bf16" and state_bits != 32):
            raise ValueError(f"FlatAdamW: state_dtype {state_dtype!r} with {state_bits}-bit states")
        self.clip_grad, self.tp_group, self.state_bits = clip_grad, tp_group, state_bits
        self.state_dtype = state_dtype
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None and dist.is_initialized() else 0
        self.steps = 0
        self._global_grad_norm = None
        self.flats = [self._flatten(g["params"], state_bits, state_dtype == "bf16") for g in self.param_groups]
        self.inner = None  # 8/4-bit: bitsandbytes' AdamW8bit or torchao's AdamW4bit over the fp32 masters, one
        if state_bits in (8, 4):  # group per group here
            inner = [{"params": f.masters, "weight_decay": g["weight_decay"]}
                     for f, g in zip(self.flats, self.param_groups)]
            self.inner = (adamw_8bit(inner, lr=lr, betas=betas, eps=eps) if state_bits == 8 else
                          AdamW4bit(inner, lr=lr, betas=betas, eps=eps))

    @staticmethod
    def _flatten(params, state_bits: int = 32, sixteen: bool = False) -> _Flat:
        device = params[0].device
        if any(p.device != device for p in params):
            raise ValueError("FlatAdamW: a parameter group must be on one device")
        offsets, n = [], 0
        for p in params:
            offsets.append(n)
            n += p.numel()
        dtypes = {p.dtype for p in params}
        if sixteen and dtypes != {torch.float32}:  # the states follow the weights' dtype, as in torch's AdamW
            if len(dtypes) > 1:
                raise ValueError("FlatAdamW: 16-bit states need one weight dtype per parameter group")
            zeros = torch.zeros(n, dtype=params[0].dtype, device=device)
            table = None
            if device.type == "cuda" and adamw_kernel is not None and adamw_kernel.supported(params):
                table = adamw_kernel.ChunkTable(params, offsets, device, **adamw_kernel.SIXTEEN_LAUNCH)
            return _Flat(list(params), offsets, None, zeros, zeros.clone(), table)
        master = None
        if dtypes != {torch.float32}:
            master = torch.empty(n, dtype=torch.float32, device=device)
            for p, off in zip(params, offsets):
                master[off:off + p.numel()].copy_(p.data.reshape(-1))
        if state_bits in (8, 4):  # leaf tensors sharing the master's (or fp32 weights') storage, for the inner one
            masters = [torch.nn.Parameter(p.data if master is None else master[o:o + p.numel()].view(p.shape),
                                          requires_grad=False) for p, o in zip(params, offsets)]
            return _Flat(list(params), offsets, master, None, None, masters=masters)
        zeros = torch.zeros(n, dtype=torch.float32, device=device)
        table = None
        if master is not None and device.type == "cuda":
            if adamw_kernel is not None and adamw_kernel.supported(params):
                table = adamw_kernel.ChunkTable(params, offsets, device)
        return _Flat(list(params), offsets, master, zeros, zeros.clone(), table)

    def _master(self, f: _Flat, i: int) -> torch.Tensor:
        p, off = f.params[i], f.offsets[i]
        return p.data.view(-1) if f.master is None else f.master[off:off + p.numel()]

    def grad_norm(self, prepared: list | None = None) -> torch.Tensor:
        """Global L2 norm of the gradients (fp32, on the device), Megatron's TP rule. `prepared`: per group, the
        one-launch kernels' pointer table (adamw_kernel.prepare) or None."""
        prepared = prepared or [None] * len(self.flats)
        parts = [adamw_kernel.sum_of_squares(f.table, prep, f.norm_weights(self.tp_rank))
                 for f, prep in zip(self.flats, prepared) if prep is not None]
        rest = whole([g for f, prep in zip(self.flats, prepared) if prep is None
                      for g in map(_GRAD, f.counted(self.tp_rank)) if g is not None])
        if rest:
            parts.append(_sum_of_squares(rest))
        device = self.flats[0].device
        sq = torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float32, device=device)
        if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            dist.all_reduce(sq, group=self.tp_group)
        return sq.sqrt()

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("FlatAdamW.step takes no closure")
        prepared = [None if f.table is None else adamw_kernel.prepare(f.table, f.params) for f in self.flats]
        norm = self.grad_norm(prepared)
        self._global_grad_norm = norm
        if self.clip_grad > 0:
            coef = torch.clamp(self.clip_grad / (norm + 1e-6), max=1.0)
        else:
            coef = torch.ones_like(norm)
        coef = torch.where(torch.isfinite(norm), coef, torch.zeros_like(coef))
        self.steps += 1
        if self.inner is not None:
            self._step_low_bits(coef)
            return None
        for group, f, prep in zip(self.param_groups, self.flats, prepared):
            b1, b2 = group["betas"]
            lr, wd = float(group["lr"]), float(group["weight_decay"])
            bc1, bc2 = 1 - b1 ** self.steps, 1 - b2 ** self.steps
            host = torch.tensor([0.0, 1 - lr * wd, 1 - b1, b2, 1 - b2, lr / bc1, math.sqrt(bc2), group["eps"]],
                                dtype=torch.float32)
            device = f.device
            hyper = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
            hyper[0] = coef
            if prep is not None:
                adamw_kernel.step(f.table, prep, f.master, f.exp_avg, f.exp_avg_sq, hyper)
                continue
            fn = _step_fn(device, f.sixteen)
            for i, p in enumerate(f.params):
                off, n = f.offsets[i], p.numel()
                grad = p.grad.reshape(-1) if p.grad is not None else torch.zeros(n, dtype=p.dtype, device=device)
                fn(self._master(f, i), f.exp_avg[off:off + n], f.exp_avg_sq[off:off + n], grad,
                   None if f.master is None else p.data.view(-1), hyper)
        return None

    def _step_low_bits(self, coef: torch.Tensor) -> None:
        """The 8- or 4-bit AdamW on the fp32 masters, with the clipped gradients; then the 16-bit weights."""
        for group, inner, f in zip(self.param_groups, self.inner.param_groups, self.flats):
            inner["lr"], inner["betas"], inner["eps"] = group["lr"], group["betas"], group["eps"]
            for p, m in zip(f.params, f.masters):  # a non-finite norm clips to zeros, even NaNs (as the fp32 path)
                m.grad = (torch.zeros_like(m) if p.grad is None else
                          torch.where(coef > 0, p.grad.float() * coef, 0.0))
        self.inner.step()
        for f in self.flats:
            for p, m in zip(f.params, f.masters):
                m.grad = None
                if f.master is not None:
                    p.data.copy_(m)

    # -- checkpoints -------------------------------------------------------------------------------------------

    def state_dict(self):
        return {"format": FORMAT, "steps": self.steps, "state_bits": self.state_bits, "state_dtype": self.state_dtype,
                "inner": None if self.inner is None else self.inner.state_dict(),
                "groups": [{"numel": sum(p.numel() for p in f.params), "master": f.master, "exp_avg": f.exp_avg,
                            "exp_avg_sq": f.exp_avg_sq} for f in self.flats],
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}

    def load_state_dict(self, state):
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise bad("optimizer.impl", "flat", "the checkpoint's optimizer state was written by DeepSpeed's ZeRO "
                      "optimizer, not by the flat AdamW this run uses", "resume with optimizer.impl: deepspeed")
        groups = state["groups"]
        if [g["numel"] for g in groups] != [sum(p.numel() for p in f.params) for f in self.flats]:
            raise bad("optimizer.impl", "flat", "the checkpoint's optimizer state is for another model",
                      "resume with the model it was trained from")
        if state.get("state_bits", 32) != self.state_bits:
            raise bad("optimizer.name", _NAMES[self.state_bits], f"the checkpoint's optimizer is "
                      f"{_NAMES[state.get('state_bits', 32)]}", f"resume with optimizer.name: "
                      f"{_NAMES[state.get('state_bits', 32)]} (as it was saved)")
        saved = state.get("state_dtype", "fp32")
        if saved != self.state_dtype:
            raise bad("optimizer.state_dtype", self.state_dtype, f"the checkpoint's optimizer states are {saved}",
                      f"resume with optimizer.state_dtype: {saved} (as it was saved)")
        if self.inner is not None:
            self.inner.load_state_dict(state["inner"])
        for f, g in zip(self.flats, groups):
            if self.inner is None:
                f.exp_avg.copy_(g["exp_avg"])
                f.exp_avg_sq.copy_(g["exp_avg_sq"])
            if f.master is not None:  # the master is the truth; the 16-bit weights are its rounding
                f.master.copy_(g["master"])
                for i, p in enumerate(f.params):
                    p.data.view(-1).copy_(self._master(f, i))
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update(saved)
        self.steps = int(state["steps"])

    def set_state(self, param, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """One parameter's fp32 master weight and moments, from a checkpoint of another layout
        (adapter/train/reshard.py); its 16-bit weight is the master's rounding, as after a step. With 16-bit states
        the values come from 16-bit ones (reshard refuses a checkpoint whose states were kept otherwise)."""
        if self.inner is not None:
            raise ValueError("FlatAdamW.set_state: 8/4-bit moments cannot be set from fp32 ones exactly")
        for f in self.flats:
            for i, p in enumerate(f.params):
                if p is param:
                    off, n = f.offsets[i], p.numel()
                    self._master(f, i).copy_(master.reshape(-1))
                    f.exp_avg[off:off + n].copy_(exp_avg.reshape(-1))
                    f.exp_avg_sq[off:off + n].copy_(exp_avg_sq.reshape(-1))
                    if f.master is not None:
                        p.data.view(-1).copy_(self._master(f, i))
                    return
        raise KeyError("FlatAdamW.set_state: the parameter is not one this optimizer steps")


def state_dtype_of(opt) -> str:
    """`optimizer.state_dtype` an engine's optimizer keeps: the flat AdamW's own, or DeepSpeed's ZeRO optimizer with
    bf16 master partitions and moments (bf16_optimizer_states: adapter/parallel/deepspeed_config.py)."""
    if isinstance(opt, FlatAdamW):
        return opt.state_dtype
    return "bf16" if getattr(opt, "bf16_optimizer_states", False) else "fp32"


def check_state_dtype(saved: str, opt, key: str, value: str) -> None:
    """A checkpoint resumes only with the state dtype that wrote it, at its layout or another (fp32 states placed
    into bf16 ones would be rounded; bf16 ones into fp32 would not continue the run that was saved)."""
    here = state_dtype_of(opt)
    if saved != here:
        raise bad(key, value, f"its optimizer states are {saved}, this run keeps {here} ones",
                  f"resume with optimizer.state_dtype: {saved} (as it was saved)")


def adamw_8bit(param_groups, *, lr: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    """bitsandbytes' AdamW8bit (the module docstring says why), imported here: only runs that ask for it pay for the
    import, and its note about an optional CPU kernel package is kept out of the run's log."""
    level = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        import bitsandbytes as bnb
    finally:
        logging.disable(level)
    return bnb.optim.AdamW8bit(param_groups, lr=lr, betas=tuple(betas), eps=eps)


def zero_client(name: str, param_groups, *, lr: float, betas: tuple[float, float], eps: float):
    """The client optimizer DeepSpeed's ZeRO steps on its fp32 partitions for `optimizer.name` (8- or 4-bit), or
    None (DeepSpeed's own AdamW)."""
    if name == "adamw_8bit":
        return adamw_8bit(param_groups, lr=lr, betas=betas, eps=eps)
    if name == "adamw_4bit":
        return AdamW4bit(param_groups, lr=lr, betas=betas, eps=eps, partitions=True)
    return None


def quantized(opt) -> bool:
    """Whether an engine's optimizer keeps 8- or 4-bit moments, quantised in blocks of its own tensors."""
    if isinstance(opt, FlatAdamW):
        return opt.state_bits < 32
    inner = getattr(opt, "optimizer", opt)
    return isinstance(inner, AdamW4bit) or type(inner).__module__.startswith("bitsandbytes")


def name_of(opt) -> str:
    """`optimizer.name` of an engine's optimizer: the flat AdamW, or what ZeRO steps (its `optimizer`)."""
    if isinstance(opt, FlatAdamW):
        return _NAMES[opt.state_bits]
    inner = getattr(opt, "optimizer", opt)
    return ("adamw_4bit" if isinstance(inner, AdamW4bit) else
            "adamw_8bit" if type(inner).__module__.startswith("bitsandbytes") else "adamw")


FORMAT = "nd-adapter.FlatAdamW/1"
_NAMES = {32: "adamw", 8: "adamw_8bit", 4: "adamw_4bit"}
STATE_BITS = {name: bits for bits, name in _NAMES.items()}  # optimizer.name -> FlatAdamW's state_bits

__all__ = ["FlatAdamW", "STATE_BITS", "adamw_8bit", "check_state_dtype", "name_of", "quantized", "state_dtype_of",
           "zero_client"]
