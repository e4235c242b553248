"""A tiny bf16 model, its two optimizer groups and a seeded backward: the optimizer tests' common bench."""
from __future__ import annotations

import torch


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 64)).bfloat16()


def param_groups(model):
    return [{"params": [p for p in model.parameters() if p.ndim == 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]


def backward(model, step):
    g = torch.Generator().manual_seed(step)
    model(torch.randn(8, 64, generator=g).bfloat16()).float().square().mean().backward()
