"""Tests by kind: `unit/` (one process), `distributed/` (several gloo processes on CPU), `gpu/` (the GPU host).

Everything under gpu/ is marked `gpu`; `gpu` tests run only where CUDA is and are skipped, not failed, elsewhere.
"""
from pathlib import Path

import pytest

from tests.helpers.why import WHY_KEY, say_at_the_end

GPU_DIR = Path(__file__).parent / "gpu"


def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:
        if GPU_DIR in Path(item.fspath).parents:
            item.add_marker(pytest.mark.gpu)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU host: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    for why in config.stash.get(WHY_KEY, []):
        terminalreporter.write_sep("=", "why a shared fixture failed")
        terminalreporter.write_line(why.rstrip())


def pytest_sessionfinish(session):
    """Under pytest-xdist each worker's reasons travel to the controller, which prints the run's last lines."""
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["why"] = session.config.stash.get(WHY_KEY, [])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    for why in getattr(node, "workeroutput", {}).get("why", []):
        say_at_the_end(node.config, why)
