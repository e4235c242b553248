"""A config resolved against a given architecture, as the plan's models take it (adapter/models/resolved.py)."""
from __future__ import annotations

from adapter.models.resolved import ResolvedRun, resolve_run
from adapter.models.source import WeightsSource

NO_WEIGHTS = WeightsSource("random", "", reason="a test's architecture")


def planned(cfg, arch, layout=None) -> ResolvedRun:
    """`cfg` on `arch` (no model directory is looked at), on `layout` when given (placed on nodes)."""
    return resolve_run(cfg, arch=arch, weights=NO_WEIGHTS, layout=layout)


def vocab_of(cfg) -> int:
    """The embedding rows of `cfg`'s model (grown by data.tokens), as SFT data preparation checks token ids against
    them."""
    from adapter.models import source

    return source.vocab_rows(cfg)


def train(cfg, *, arch=None, **kw):
    """`adapter.train.trainer.run` on `cfg` resolved once (against `arch` when given), as a training process
    resolves its config before it trains."""
    from adapter.train.trainer import run

    return run(resolve_run(cfg, arch=arch), **kw)


def cuda_train(rank, world, raw: dict, fields: tuple[str, ...]):
    """A GPU test's rank (run_workers' function): `raw` trained on cuda:rank in fp32 with TF32 off (the reference
    runs so too), the named fields of its result."""
    import torch

    from adapter import config
    from adapter.train.engine import init_distributed

    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    init_distributed()
    res = train(config.build(raw, env={}, world_size=world), log=lambda s: None)
    return tuple(getattr(res, f) for f in fields)
