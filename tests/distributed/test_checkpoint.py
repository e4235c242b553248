"""Checkpoint bookkeeping: exact resume under ZeRO-3 (1 and 2 gloo ranks), SIGKILL during save, pruning."""
from __future__ import annotations

import multiprocessing as mp
import shutil
import time
from pathlib import Path

import pytest

from adapter.train import checkpoint as ckpt
from tests.helpers.dist import _child, _context, free_port, run_workers

# --- directory rules, no DeepSpeed ------------------------------------------------------------------------------

def _fake(root: Path, *steps: int, latest: int | None = None, lineage: str | None = "ours") -> None:
    """Checkpoints as a save leaves them: one file and the record listing it (`lineage` None: a record-less one)."""
    from adapter.train import ckpt_info

    for s in steps:
        d = root / f"global_step{s}"
        d.mkdir(parents=True)
        (d / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_text("x")
        if lineage is not None:
            files = {"zero_pp_rank_0_mp_rank_00_model_states.pt": {"bytes": 1, "crc32": ckpt_info.crc32(
                d / "zero_pp_rank_0_mp_rank_00_model_states.pt")}}
            (d / "nd_adapter.json").write_text(ckpt_info.record_text({"step": s, "lineage": lineage, "files": files}))
    if latest is not None:
        (root / "latest").write_text(f"global_step{latest}")


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_clean_removes_temps_and_this_lineages_orphans_newer_than_latest(tmp_path):
    _fake(tmp_path, 1, 2, 3, latest=2)
    _fake(tmp_path, 4, lineage="another run")
    (tmp_path / "tmp-global_step3").mkdir()
    (tmp_path / "tmp-latest.123").write_text("global_step3")
    ckpt._clean(tmp_path, "ours")
    assert _names(tmp_path) == ["global_step1", "global_step2", "global_step4", "latest"]


def test_prune_keeps_newest_up_to_latest_and_never_another_lineages(tmp_path):
    _fake(tmp_path, 1, 2, 10, 11, latest=11)
    _fake(tmp_path, 3, lineage="another run")
    _fake(tmp_path, 4, lineage=None)  # saved before records (or lineages) existed: not provably this run's
    ckpt._prune(tmp_path, 2, lineage="ours")
    assert _names(tmp_path) == ["global_step10", "global_step11", "global_step3", "global_step4", "latest"]
    ckpt._prune(tmp_path, 0, lineage="ours")  # 0 keeps all
    ckpt._prune(tmp_path, 1, lineage=None)  # a run without a lineage deletes nothing
    assert _names(tmp_path) == ["global_step10", "global_step11", "global_step3", "global_step4", "latest"]


def test_without_latest_a_resume_takes_the_newest_complete_checkpoint(tmp_path):
    """`latest` lost or emptied: the newest checkpoint whose record is intact and whose files are all there at their
    written size; none complete is one line; an empty directory has none."""
    from adapter.errors import UserError

    assert ckpt.latest_tag(tmp_path) is None
    _fake(tmp_path, 2, 4, 6)
    (tmp_path / "latest").write_text("")
    (tmp_path / "global_step6" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_text("")  # torn
    (tmp_path / "tmp-global_step8").mkdir()  # a save that never finished
    assert ckpt.latest_tag(tmp_path) == "global_step4"
    (tmp_path / "global_step4" / "nd_adapter.json").write_text("{")
    assert ckpt.latest_tag(tmp_path) == "global_step2"
    (tmp_path / "global_step2" / "nd_adapter.json").unlink()
    with pytest.raises(UserError, match=r"`latest` is missing and no checkpoint here is complete \(the newest: "
                       r"checkpoint file global_step6/zero_pp_rank_0_mp_rank_00_model_states.pt is empty"):
        ckpt.latest_tag(tmp_path)


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
        assert r["written"] == ["nd_adapter.json"] + [f"zero_pp_rank_0_mp_rank_00_{kind}_states.pt"
                                                     for kind in ("model", "optim")]
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


# --- integrity: every file checked at load, `latest` lost, rotation within the lineage --------------------------

def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _damages(d: Path) -> dict:
    """One damage per kind of file a save writes, each a function of the checkpoint directory `d`."""
    model, optim = d / "zero_pp_rank_1_mp_rank_00_model_states.pt", d / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    return {
        "model states": (lambda: _flip(model, model.stat().st_size // 2), model.name),
        "optimizer states": (lambda: _flip(optim, optim.stat().st_size // 2), optim.name),
        # the client state (the sampler's position, our step and RNG record) is pickled in the model-states file
        "sampler state": (lambda: _flip(model, model.read_bytes().index(b"sampler") + 12), model.name),
        # a flipped digit of the step that leaves valid JSON
        "record": (lambda: _flip(d / "nd_adapter.json", (d / "nd_adapter.json").read_bytes().index(b'"step": ') + 8),
                   "nd_adapter.json"),
        "truncated shard": (lambda: optim.write_bytes(optim.read_bytes()[:1000]), optim.name),
        "empty shard": (lambda: model.write_bytes(b""), model.name),
        "missing shard": (lambda: optim.unlink(), optim.name),
        "a shard the save did not write": (lambda: shutil.copy(optim, d / "zero_pp_rank_2_mp_rank_00_optim_states.pt"),
                                           "zero_pp_rank_2_mp_rank_00_optim_states.pt"),
    }


def _integrity_worker(rank: int, world: int, root: str) -> dict:
    import deepspeed
    import torch.distributed as dist

    from adapter.errors import UserError
    from adapter.train import ckpt_info

    deepspeed.init_distributed(dist_backend="gloo")
    root = Path(root)
    t = _Trainer(_engine(), rank, world)
    losses = []
    for s in range(1, 5):
        losses.append(t.step())
        if s <= 2:
            ckpt.save(t.engine, root, s, {"sampler": t.sampler.state_dict()}, keep_last=2)
    before = {p.name: p.read_bytes() for p in (root / "global_step1").iterdir()}

    def refused(d: Path, damage, **kw) -> str | None:
        if rank == 0:
            shutil.copytree(d, root / "pristine")
            damage()
        dist.barrier()
        try:
            ckpt.load(_engine(seed=99), root, **kw)
            said = None
        except UserError as e:
            said = str(e)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(d)
            (root / "pristine").rename(d)
        dist.barrier()
        return said

    said = {kind: (refused(root / "global_step2", damage), name)
            for kind, (damage, name) in _damages(root / "global_step2").items()}
    best, name = _damages(root / "global_step1")["optimizer states"]  # load_best's reload of an earlier step
    said["an earlier step, by tag"] = (refused(root / "global_step1", best, tag="global_step1"), name)
    intact = {p.name: p.read_bytes() for p in (root / "global_step1").iterdir()} == before
    ckpt_info.check_files(root / "global_step1", ckpt_info.read_record(root / "global_step1"),
                          sums=list(ckpt_info.read_record(root / "global_step1")["files"]))

    fresh = _engine(seed=5)  # another run (no lineage of its own yet) saving over this one's step 2: refused
    try:
        ckpt.save(fresh, root, 2)
        replaced = None
    except UserError as e:
        replaced = str(e)

    if rank == 0:  # `latest` lost, and a checkpoint of another run beside this one's
        (root / "latest").unlink()
        shutil.copytree(root / "global_step1", root / "global_step0")
        record = ckpt_info.read_record(root / "global_step0")
        (root / "global_step0" / "nd_adapter.json").write_text(ckpt_info.record_text({**record, "lineage": "other"}))
    dist.barrier()
    t2 = _Trainer(_engine(seed=99), rank, world)
    step, client = ckpt.load(t2.engine, root)
    t2.sampler.load_state_dict(client["sampler"])
    t2.restart()
    resumed = []
    for s in (3, 4):
        resumed.append(t2.step())
        ckpt.save(t2.engine, root, s, {"sampler": t2.sampler.state_dict()}, keep_last=2)
    return {"losses": losses, "resumed": resumed, "step": step, "said": said, "intact": intact,
            "replaced": replaced, "kept": sorted(p.name for p in root.iterdir() if p.is_dir())}


@pytest.mark.slow
def test_damaged_checkpoints_are_refused_naming_the_file_and_a_lost_latest_resumes(tmp_path):
    """ZeRO-3 on 2 ranks. A flipped byte in each kind of file a save writes, a truncated, empty, missing or foreign
    shard: every rank refuses the load in the same one line naming the file, and the step before stays intact.
    `latest` removed: the resume finds the newest complete checkpoint and continues with the uninterrupted run's
    losses; rotation then deletes this run's older checkpoints and never another run's; another run saving over
    this one's step is refused."""
    root = tmp_path / "ckpt"
    results = run_workers(_integrity_worker, 2, str(root), timeout=400)
    r = results[0]
    for kind, (line, name) in r["said"].items():
        assert line is not None, f"{kind}: loaded"
        assert all(other["said"][kind][0] == line for other in results), kind  # every rank, the same line
        assert line.startswith("load_dir=" if "by tag" not in kind else "tag=") and "\n" not in line, line
        assert f"/{name} " in line and "Fix:" in line, (kind, line)
    assert "is damaged (CRC-32 " in r["said"]["optimizer states"][0]
    assert "no longer matches its own CRC-32" in r["said"]["record"][0]
    assert "is truncated (1,000 bytes;" in r["said"]["truncated shard"][0]
    assert "is empty (0 bytes;" in r["said"]["empty shard"][0] and "is missing" in r["said"]["missing shard"][0]
    assert "global_step1/" in r["said"]["an earlier step, by tag"][0]
    assert r["intact"]
    assert r["replaced"] is not None and "holds global_step2 of another run" in r["replaced"], r["replaced"]
    assert r["step"] == 2 and r["resumed"] == r["losses"][2:], (r["losses"], r["resumed"])
    assert r["kept"] == ["global_step0", "global_step3", "global_step4"], r["kept"]  # global_step0: another run's
    assert (root / "latest").read_text() == "global_step4"


def _peer_dies_worker(rank: int, world: int, root: str) -> str:
    import os

    import deepspeed

    from adapter.errors import UserError

    deepspeed.init_distributed(dist_backend="gloo")
    t = _Trainer(_engine(), rank, world)
    t.step()
    ckpt.save(t.engine, root, 1)
    t.step()
    if rank == 1:  # killed (the out-of-memory killer, a node lost) while writing its part of the next checkpoint
        t.engine.checkpoint_engine.save = lambda *args, **kwargs: os._exit(9)
    try:
        ckpt.save(t.engine, root, 2)
    except UserError as e:
        return str(e)
    return "saved"


@pytest.mark.slow
def test_a_rank_killed_during_a_save_is_not_blamed_on_the_disk(tmp_path):
    root = tmp_path / "ckpt"
    ctx = _context()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(_peer_dies_worker, r, 2, port, (str(root),), q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, ok, said = q.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    assert (rank, ok) == (0, True), said
    assert said.startswith("checkpoint.dir=") and "\n" not in said, said
    assert "the checkpoint of step 2 was not finished: another rank stopped during the save" in said, said
    assert "global_step1 is the last complete checkpoint" in said and "free space" not in said, said
    assert procs[1].exitcode == 9 and (root / "latest").read_text() == "global_step1"
    assert not (root / "tmp-global_step2").exists()
