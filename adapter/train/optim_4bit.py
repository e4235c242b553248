"""`optimizer.name: adamw_4bit` (Axolotl's adamw_torch_4bit): torchao's AdamW4bit, built as transformers' Trainer
builds it for that name (transformers/trainer_optimizer.py, `_get_torchao_optimizer`): block_size 256 (optim_args'
default there, not torchao's own 128), no bf16 stochastic rounding, the run's lr, betas, eps and weight decay. Its
moments are 4-bit codes, two a byte, with one fp32 scale per block of 256 (exp_avg on a signed dynamic map,
exp_avg_sq on a linear unsigned one): 2 × (0.5 + 4/256) bytes per parameter (adapter/models/footprint.py counts
them). torchao because it is what Axolotl runs for the name; it runs on CPUs too (tests, rehearsals).

torchao quantises the states of a tensor of at least 4096 elements that is whole blocks; any other tensor keeps
fp32 states. The flat AdamW (adapter/train/optim.py) steps it on its fp32 masters, shaped as the parameters, so that
rule applies as it does in transformers. Under DeepSpeed's ZeRO it is the client optimizer stepping ZeRO's flat 1-D
fp32 partitions, whose lengths are sums of parameter slices padded to the data-parallel size: almost never whole
blocks, so torchao would keep every partition's states in fp32, 8 bytes a parameter instead of 1.03. Here
(`partitions=True`) each partition is stepped as two views, its whole blocks and the rest (under 256 elements:
fp32, torchao's rule for small tensors), each with torchao's own state and step: exactly torchao's AdamW4bit
stepping the two views as parameters (tests/unit/test_optim_4bit.py). The partition's state holds the two under
"blocks" and "tail": nested, because ZeRO-1/2 links each parameter's fragment to every state tensor shaped as the
partition by slicing it, and a 4-bit state cannot be sliced off its block boundaries.

On CPU the step runs eagerly: torchao compiles its per-tensor step for each shape (torch.compile, dynamic=False),
and inductor's C++ build of one took 20-60 s on a 2-core test machine; eagerly the same torchao function runs
unfused (within 1 ulp of the compiled step after 20 steps of 8192 elements). On one H200 the compiled step of a
partition equalled torchao's own on its two views bit for bit, at 4.7 ms per 2^28 elements (torch's fused fp32
AdamW: 2.2 ms). The learning rate stays a float in param_groups (the schedule, DeepSpeed and the log write and read
floats); torchao takes a tensor, made at each step.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

BLOCK = 256  # transformers' block_size for adamw_torch_4bit


def _torchao():
    """torchao.optim, imported here: only runs that ask for it pay for the import (its import-time log lines are
    silenced in adapter/__init__.py)."""
    import torchao.optim as ao

    warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching")  # compiled steps, per state type
    return ao


class AdamW4bit(torch.optim.Optimizer):
    """torchao's AdamW4bit (the module docstring says how), as a plain torch optimizer: DeepSpeed's ZeRO sets its
    param_groups' params to its own partitions and saves and loads `state_dict()` as it does any optimizer's."""

    def __init__(self, param_groups, *, lr: float, betas: tuple[float, float], eps: float, partitions: bool = False):
        super().__init__(param_groups, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=0.0))
        self.partitions = partitions
        probe = torch.zeros(1)  # torchao's optimizer does the steps; the params it is given each step are ours
        self.inner = _torchao().AdamW4bit([probe], lr=lr, betas=tuple(betas), eps=eps, block_size=BLOCK,
                                          bf16_stochastic_round=False)

    def _pieces(self, p: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """(state key, tensor torchao steps, its gradient) for `p`: `p` itself, or a partition's whole blocks and
        the rest as views of it."""
        if not self.partitions:
            return [("all", p, p.grad)]
        flat, grad = p.detach().view(-1), p.grad.view(-1)
        cut = flat.numel() - flat.numel() % BLOCK
        return [(key, flat[a:b], grad[a:b]) for key, a, b in (("blocks", 0, cut), ("tail", cut, flat.numel()))
                if b > a]

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("AdamW4bit.step takes no closure")
        inner = self.inner
        inner.param_groups, inner.state = [], {}
        eager, viewed = False, []
        for group in self.param_groups:
            params = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                eager = eager or p.device.type == "cpu"
                for key, t, g in self._pieces(p):
                    if t is not p:
                        t.grad = g
                        viewed.append(t)
                    params.append(t)
                    inner.state[t] = self.state[p].setdefault(key, {})  # torchao fills it on the first step
            inner.param_groups.append({"params": params, "lr": torch.tensor(float(group["lr"]), dtype=torch.float32),
                                       "betas": group["betas"], "eps": group["eps"],
                                       "weight_decay": group["weight_decay"], "amsgrad": False})
        try:
            with torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext():
                inner.step()
        finally:
            for t in viewed:
                t.grad = None
            inner.param_groups, inner.state = [], {}
        return None


__all__ = ["AdamW4bit", "BLOCK"]
