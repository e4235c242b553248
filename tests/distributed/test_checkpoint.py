"""Checkpoint bookkeeping: exact resume under ZeRO-3 (1 and 2 gloo ranks), SIGKILL during save, pruning."""
from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest

from adapter.train import checkpoint as ckpt
from tests.helpers.dist import _child, free_port, run_workers

# --- directory rules, no DeepSpeed ------------------------------------------------------------------------------

def _fake(root: Path, *steps: int, latest: int | None = None) -> None:
    for s in steps:
        (root / f"global_step{s}").mkdir(parents=True)
        (root / f"global_step{s}" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_text("x")
    if latest is not None:
        (root / "latest").write_text(f"global_step{latest}")


def test_clean_removes_temps_and_orphans_newer_than_latest(tmp_path):
    _fake(tmp_path, 1, 2, 3, latest=2)
    (tmp_path / "tmp-global_step3").mkdir()
    (tmp_path / "tmp-latest.123").write_text("global_step3")
    ckpt._clean(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step1", "global_step2", "latest"]


def test_prune_keeps_newest_up_to_latest(tmp_path):
    _fake(tmp_path, 1, 2, 10, 11, latest=11)
    ckpt._prune(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step10", "global_step11", "latest"]
    ckpt._prune(tmp_path, 0)  # 0 keeps all
    assert ckpt.latest_tag(tmp_path) == "global_step11"


def test_latest_tag_missing_dir(tmp_path):
    assert ckpt.latest_tag(tmp_path / "nope") is None


# --- DeepSpeed ZeRO-3 on CPU ------------------------------------------------------------------------------------

def _engine(hidden: int = 16, seed: int = 0):
    import deepspeed
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Dropout(0.3), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 1))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "zero_optimization": {"stage": 3}, "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


class _Trainer:
    """Loss depends on the sampler (which rows), torch RNG (input noise, dropout) and the engine state."""

    def __init__(self, engine, rank: int, world: int):
        import torch

        from adapter.data import DPSampler

        g = torch.Generator().manual_seed(123)
        self.x, self.y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
        self.engine = engine
        self.sampler = DPSampler(64, dp_rank=rank, dp_size=world, micro_batch=4, seed=7)
        self.it = iter(self.sampler)

    def step(self) -> float:
        import torch

        idx = next(self.it)
        x = self.x[idx] + 0.1 * torch.randn(len(idx), 8)
        loss = (self.engine(x) - self.y[idx]).pow(2).mean()
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def restart(self):
        self.it = iter(self.sampler)


def _resume_worker(rank: int, world: int, root: str) -> dict:
    import deepspeed
    import torch

    from adapter.errors import UserError

    deepspeed.init_distributed(dist_backend="gloo")
    root = Path(root)
    torch.manual_seed(1000 + rank)  # ranks draw different noise and dropout: per-rank RNG must round-trip
    t = _Trainer(_engine(), rank, world)
    losses = []
    for s in range(1, 7):
        losses.append(t.step())
        if s <= 3:
            ckpt.save(t.engine, root, s, {"sampler": t.sampler.state_dict()}, keep_last=2)
    dirs = sorted(p.name for p in root.iterdir() if p.is_dir())

    torch.manual_seed(5)  # scramble, then resume into a differently initialised engine
    t2 = _Trainer(_engine(seed=99), rank, world)
    step, client = ckpt.load(t2.engine, root)
    t2.sampler.load_state_dict(client["sampler"])
    t2.restart()
    resumed = [t2.step() for _ in range(3)]

    try:
        ckpt.load(_engine(hidden=32), root)
        mismatch = None
    except UserError as e:
        mismatch = str(e)

    only0 = root.parent / f"{root.name}-rank0"
    ckpt.save(t2.engine, only0, 7, save_ranks=lambda r: r == 0)
    written = sorted(p.name for p in (only0 / "global_step7").iterdir())
    return {"losses": losses, "resumed": resumed, "step": step, "dirs": dirs, "mismatch": mismatch,
            "written": written, "none": ckpt.load(t2.engine, root / "empty") is None}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_resume_matches_uninterrupted_run(tmp_path, world):
    results = run_workers(_resume_worker, world, str(tmp_path / "ckpt"))
    for rank, r in enumerate(results):
        assert r["step"] == 3 and r["none"]
        assert r["resumed"] == r["losses"][3:], (rank, r["losses"], r["resumed"])
        assert r["dirs"] == ["global_step2", "global_step3"]
        assert r["mismatch"].startswith("load_dir=") and "does not match this model" in r["mismatch"]
        assert "there" in r["mismatch"] and "Fix:" in r["mismatch"]
        assert r["written"] == [f"zero_pp_rank_0_mp_rank_00_{kind}_states.pt" for kind in ("model", "optim")]
    if world == 2:
        assert results[0]["losses"] != results[1]["losses"]  # the ranks really saw different data
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step3"


def _crashing_worker(rank: int, world: int, root: str, flag: str) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    t = _Trainer(_engine(), rank, world)
    t.step()
    ckpt.save(t.engine, root, 1)
    t.step()
    real = t.engine.checkpoint_engine.save

    def slow_save(*args, **kwargs):
        real(*args, **kwargs)
        Path(flag).write_text("written")
        time.sleep(600)  # the test SIGKILLs us here, mid-checkpoint

    t.engine.checkpoint_engine.save = slow_save
    ckpt.save(t.engine, root, 2)


def _recover_worker(rank: int, world: int, root: str) -> dict:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    t = _Trainer(_engine(), rank, world)
    step, _ = ckpt.load(t.engine, root)
    t.step()
    ckpt.save(t.engine, root, step + 1)
    return {"step": step, "entries": sorted(p.name for p in Path(root).iterdir())}


@pytest.mark.slow
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    root, flag = tmp_path / "ckpt", tmp_path / "flag"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()  # keep a reference: the child unpickles it after start() returns
    p = ctx.Process(target=_child, args=(_crashing_worker, 0, 1, free_port(), (str(root), str(flag)), q))
    p.start()
    deadline = time.time() + 400  # generous: a loaded 2-core CI machine once needed more than 120 s
    while not flag.exists() and p.is_alive() and time.time() < deadline:
        time.sleep(0.1)
    assert flag.exists(), f"the worker never reached the second save (alive={p.is_alive()}, exit={p.exitcode})"
    p.kill()
    p.join()
    assert (root / "latest").read_text() == "global_step1"
    assert (root / "tmp-global_step2").is_dir() and not (root / "global_step2").exists()

    [r] = run_workers(_recover_worker, 1, str(root))
    assert r["step"] == 1
    assert "tmp-global_step2" not in r["entries"] and {"global_step1", "global_step2"} <= set(r["entries"])
    assert (root / "latest").read_text() == "global_step2"
