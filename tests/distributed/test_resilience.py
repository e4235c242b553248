"""Runs that survive a cluster, as a user runs them: `nd-adapter train`, 4 CPU processes (tp=2 ×
dp_shard=2, fp32), against the same run nobody disturbed. Each run is a session of its own, whose processes the
tests signal together (as SLURM, systemd and container runtimes do) and count afterwards.
- SIGTERM sent to every process of the job mid-run: every rank finishes its step, the checkpoint is complete, the
  status is 75 (requeue), one line says so, and `--resume` continues with the undisturbed run's losses.
- SIGTERM to every process before step 1: the job ends at once, 75, one line, nothing left running.
- The launcher killed (SIGKILL): its ranks end by themselves within seconds.
- A disk that refuses the writes of a save (the files' size limit, RLIMIT_FSIZE: EFBIG where ENOSPC would come):
  one line, exit 2, the partial checkpoint removed, `latest` still naming the last complete one, which resumes.
- A rank killed from outside: the run ends at once with one line naming it, no traceback (these on 2 processes).
- Retention that cannot fit the disk: refused in one line before step 1, with the numbers.
- A damaged checkpoint (a shard cut short: before any process starts; a flipped byte: by the ranks, as they
  verify what they load at another layout), a fresh start over a run's checkpoints, a checkpoint.dir that is a
  file: one line each, nothing changed."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.cli import said
from tests.helpers.sft import make_model, rel

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
STEPS = 16
STEP = re.compile(r"^step (\d+)/\d+ \| loss ([\d.]+)")


SLOW_START = """
import time
import adapter.train.preempt as preempt
_stop_later = preempt.stop_later
def _late():
    time.sleep(60)
    _stop_later()
preempt.stop_later = _late
"""


def _losses(text: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in map(STEP.match, text.splitlines()) if m}


def _train(cfg: Path, *extra: str, pythonpath: Path | None = None) -> subprocess.Popen:
    """`nd-adapter train` in a session of its own: os.killpg(p.pid, ...) signals the whole job, `_job(p.pid)`
    lists what is left of it. `pythonpath` goes first on the job's path (a sitecustomize module there runs in every
    process of it)."""
    path = f"{pythonpath}:{ROOT}" if pythonpath else str(ROOT)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "adapter", "train", "--config", str(cfg), *extra], cwd=cfg.parent,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _job(session: int) -> list:
    """The processes of the job started as session `session` still running (zombies are over)."""
    import psutil

    left = []
    for q in psutil.process_iter():
        try:
            if os.getsid(q.pid) == session and q.status() != psutil.STATUS_ZOMBIE:
                left.append(q)
        except (OSError, psutil.Error):  # it ended meanwhile
            pass
    return left


def _ends(session: int, within: float) -> list:
    """What of the job is still running `within` seconds from now, or as soon as nothing is."""
    deadline = time.monotonic() + within
    while _job(session) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [(q.pid, q.name()) for q in _job(session)]


def _cfg(path: Path, raw: dict, ckpt: Path, **checkpoint) -> Path:
    path.write_text(yaml.safe_dump({**raw, "checkpoint": {"dir": str(ckpt), **checkpoint}}))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The tiny model, the run's settings, and the undisturbed run's losses (its converted weights then cached)."""
    from tests.helpers.sft_data import tiny_model

    root = tmp_path_factory.mktemp("resilience")
    model = make_model(root / "model", tiny_model(root / "tok"))
    raw = {"model": {"path": str(model), "cache_dir": str(root / "cache")},
           "parallelism": {"dp_shard_size": 2, "tp_size": 2}, "batch": {"micro_batch_size": 2}, "seq_len": 64,
           "precision": "fp32", "data": {"synthetic": True},
           "optimizer": {"lr": 1e-3, "schedule": "constant", "warmup_steps": 0, "max_steps": STEPS},
           "hardware": {"gpus_per_node": 4}}
    out, err = _train(_cfg(root / "whole.yaml", raw, root / "ck-whole")).communicate(timeout=600)
    reference = _losses(out)
    assert len(reference) == STEPS, err[-2000:]
    return root, raw, reference


def test_sigterm_to_the_job_saves_exits_75_and_resumes_exactly(base):
    """Every process of the job gets SIGTERM (SLURM, systemd, Kubernetes): the launcher, multiprocessing's fork
    server and each rank. The fork server used to die of it, and the job with it (status 1, no checkpoint)."""
    root, raw, reference = base
    tmp_path = root
    cut = _cfg(root / "cut.yaml", raw, root / "ck-cut")
    p = _train(cut)
    seen = []
    for line in p.stdout:  # the run is training: stop it as a cluster would
        seen.append(line)
        if line.startswith("signals: SIGTERM, SIGUSR1 finish the current step"):
            signals_line = line
        if line.startswith("step 3/"):
            time.sleep(0.3)
            os.killpg(p.pid, signal.SIGTERM)
            break
    rest, err = p.communicate(timeout=600)
    out = "".join(seen) + rest
    assert p.returncode == 75, (out[-2000:], err[-2000:])
    assert "status 75 (requeue" in signals_line
    m = re.search(r"nd-adapter: stopped by SIGTERM after step (\d+): checkpoint (\S+) saved; continue with --resume",
                  err)
    assert m, err[-2000:]
    stopped = int(m.group(1))
    assert 3 <= stopped < STEPS and max(_losses(out)) == stopped, out[-2000:]
    assert len([ln for ln in said(err) if ln.startswith("nd-adapter:")]) == 1, err[-2000:]
    assert (tmp_path / "ck-cut/latest").read_text().strip() == f"global_step{stopped}"
    assert not list((tmp_path / "ck-cut").glob("tmp-*"))  # complete, published
    assert all(_losses(out)[k] == reference[k] for k in range(1, stopped + 1))

    out, err = _train(cut, "--resume").communicate(timeout=600)
    resumed = _losses(out)
    assert sorted(resumed) == list(range(stopped + 1, STEPS + 1)), (out[-2000:], err[-2000:])
    assert all(rel(resumed[k], reference[k]) <= 1e-5 for k in resumed), (resumed, reference)
    _says_what_it_holds(root, cut)


def _cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "adapter", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def _says_what_it_holds(root: Path, cfg: Path) -> None:
    """`checkpoint info`, plan's word on resuming it (here and at another layout), and a resume that cannot move
    (8-bit moments) refused before any process."""
    p = _cli("checkpoint", "info", str(root / "ck-cut"), "--checksums", cwd=root)
    assert p.returncode == 0, p.stderr
    assert f"({'global_step' + str(STEPS)})" in p.stdout.splitlines()[0]
    assert f"  step      {STEPS}" in p.stdout and "LlamaForCausalLM" in p.stdout
    assert "layout    dp_replicate=1 × dp_shard=2 × cp=1 × tp=2 (4 ranks, ZeRO stage 3)" in p.stdout
    assert re.search(r"model_states\.pt  [\d,]+ B  crc32 [0-9a-f]{8}  ok", p.stdout), p.stdout
    assert "  integrity size and CRC-32 of its 8 files recorded at save; checked below" in p.stdout, p.stdout
    p = _cli("plan", str(cfg), cwd=root)
    assert "resumable by this layout, at the same layout" in " ".join(p.stdout.split()), p.stdout[-3000:]
    moved = ("--set", "parallelism.tp_size=1", "--set", "parallelism.dp_shard_size=4")
    p = _cli("plan", str(cfg), *moved, cwd=root)
    assert "resumable by this layout, resharded from another layout (dp_shard 2 there, 4 here, tp 2 there, 1 here)" \
        in " ".join(p.stdout.split()), p.stdout[-3000:]
    p = _cli("train", "--config", str(cfg), "--resume", *moved, "--set", "optimizer.name=adamw_8bit", cwd=root)
    lines = [ln for ln in said(p.stderr) if ln.startswith("nd-adapter:")]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-2000:]
    assert f"cannot resume global_step{STEPS}: 8-bit optimizer moments" in lines[0], lines
    p = _cli("checkpoint", "info", str(root / "nowhere"), cwd=root)
    assert p.returncode == 2 and p.stderr.startswith("nd-adapter: error: DIR=") and "no checkpoint here" in p.stderr


def _two(raw: dict, max_steps: int) -> dict:
    """The same run on 2 processes (dp_shard=2): what the fault tests need, at half the start-up cost."""
    return {**raw, "parallelism": {"dp_shard_size": 2}, "hardware": {"gpus_per_node": 2},
            "optimizer": {**raw["optimizer"], "max_steps": max_steps}}


def test_a_failed_save_is_one_line_and_the_last_checkpoint_resumes(base):
    import resource

    root, raw, _ = base
    out, err = _train(_cfg(root / "disk-1.yaml", _two(raw, 2), root / "ck-disk")).communicate(timeout=600)
    assert (root / "ck-disk/latest").read_text().strip() == "global_step2", err[-2000:]
    cfg = _cfg(root / "disk.yaml", _two(raw, 6), root / "ck-disk", save_every=2)

    def small_files():  # every checkpoint file of this model is larger: the save's writes fail (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16_384, 16_384))

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    p = subprocess.run([sys.executable, "-m", "adapter", "train", "--config", str(cfg), "--resume"], cwd=root,
                       env=env, capture_output=True, text=True, timeout=600, preexec_fn=small_files)
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr[-2000:])
    lines = [ln for ln in said(p.stderr) if ln.startswith("nd-adapter:")]
    assert len(lines) == 1 and "writing the checkpoint of step 4 failed" in lines[0], p.stderr[-3000:]
    assert "global_step2 is the last complete checkpoint" in lines[0] and "Traceback" not in p.stderr
    assert (root / "ck-disk/latest").read_text().strip() == "global_step2"
    assert not list((root / "ck-disk").glob("tmp-*")) and not (root / "ck-disk/global_step4").exists()
    p = _train(cfg, "--resume")  # room again: it continues from step 2
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0 and sorted(_losses(out)) == [3, 4, 5, 6], (out[-2000:], err[-2000:])


def test_retention_that_cannot_fit_is_refused_before_step_one(tmp_path):
    """The full-disk case (a run that filled its disk at step 15) in the large: an 8B model's checkpoints (ZeRO-3
    over 2 ranks here, 96 GB each), a hundred kept, cannot fit this disk; the run says so before it builds anything."""
    cfg = tmp_path / "big.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"path": str(ROOT / "configs/models/llama-3.1-8b")}, "parallelism": {"dp_shard_size": 2},
        "seq_len": 128, "precision": "bf16", "data": {"synthetic": True}, "optimizer": {"max_steps": 120},
        "checkpoint": {"dir": str(tmp_path / "ck"), "save_every": 1, "keep_last": 100}}))
    p = _train(cfg)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 2, (out[-2000:], err[-2000:])
    line = [ln for ln in said(err) if ln.startswith("nd-adapter:")]
    assert len(line) == 1 and line[0].startswith("nd-adapter: error: checkpoint.keep_last=100: the run's "
                                                 "checkpoints will not fit: checkpoints: 96.4 GB each, up to 101 at "
                                                 "once"), err
    assert "Fix: lower checkpoint.keep_last" in line[0] and not (tmp_path / "ck").exists()


def test_sigterm_to_the_job_before_step_one_ends_it_at_once(base):
    """SIGTERM to every process while the ranks set up (before step 1 there is nothing to save): the job ends at
    once with status 75 and one line, and leaves nothing running. It used to end in status 1 (the fork server
    died of it), or, sent before the ranks started, leave the launcher dead without a word and its ranks running."""
    root, raw, _ = base
    slow = root / "slow-start"  # the ranks reach their training loop 60 s late: the signal surely comes first
    slow.mkdir(exist_ok=True)  # (setup takes ~1 s here; a busy CI machine once read the line after step 2)
    (slow / "sitecustomize.py").write_text(SLOW_START)
    p = _train(_cfg(root / "early.yaml", _two(raw, 500), root / "ck-early"), pythonpath=slow)
    for line in p.stdout:
        if line.startswith("signals: "):  # rank 0 is setting up: converted weights, data, the engine to come
            os.killpg(p.pid, signal.SIGTERM)
            t = time.monotonic()
            break
    out, err = p.communicate(timeout=120)
    took = time.monotonic() - t
    assert p.returncode == 75, (out[-2000:], err[-2000:])
    assert [ln for ln in said(err) if ln.startswith("nd-adapter:")] == [
        "nd-adapter: stopped by SIGTERM before step 1: nothing to save (exit status 75: requeue)"], err[-3000:]
    assert "Traceback" not in err and "Exception" not in err, err[-3000:]
    assert took < 15 and not _ends(p.pid, within=10), took
    assert not list(root.glob("ck-early/global_step*"))


def test_ranks_end_when_their_launcher_is_killed(base):
    """SIGKILL to the launcher alone (the OOM killer, a user's kill -9): it can pass nothing on, so the ranks
    notice that their parent is gone and end within seconds. They used to train on, unobserved, to the end."""
    root, raw, _ = base
    p = _train(_cfg(root / "orphan.yaml", _two(raw, 500), root / "ck-orphan"))
    for line in p.stdout:
        if line.startswith("step 2/"):
            assert len(_ranks(__import__("psutil").Process(p.pid))) == 2
            p.kill()
            break
    p.wait(timeout=60)
    assert not _ends(p.pid, within=15)


def test_a_killed_rank_ends_the_run_in_one_line(base):
    """A rank killed from outside (the OOM killer, a node failure) while the others wait for it in a collective: the
    run ends at once, not at the process-group timeout, with one line naming the rank; the tracebacks of the ranks
    whose collective broke (consequences, not the cause) are not shown."""
    import psutil

    root, raw, _ = base
    p = _train(_cfg(root / "kill.yaml", _two(raw, 500), root / "ck-kill"))
    for line in p.stdout:
        if line.startswith("step 2/"):
            ranks = _ranks(psutil.Process(p.pid))
            assert len(ranks) == 2, ranks
            ranks[1].kill()
            t = time.monotonic()
            break
    _ends_at_once_in_one_line(p, t, ranks, "nd-adapter: error: rank 1 was killed by SIGKILL (out of memory, or "
                              "killed from outside?); the other ranks were stopped")


def test_a_dead_fork_server_stops_the_ranks_in_one_line(base):
    """On CPUs the ranks' parent is multiprocessing's fork server (adapter/train/spawn.py), which reports their
    status: if it dies, the ranks run on unobserved and every one reads as status 255. The launcher stops them and
    ends at once with one line that says what died."""
    import psutil

    root, raw, _ = base
    p = _train(_cfg(root / "server.yaml", _two(raw, 500), root / "ck-server"))
    for line in p.stdout:
        if line.startswith("step 2/"):
            server = [c for c in psutil.Process(p.pid).children()
                      if "multiprocessing.forkserver" in " ".join(c.cmdline())]
            ranks = server[0].children()
            assert len(server) == 1 and len(ranks) == 2, (server, ranks)
            server[0].kill()
            t = time.monotonic()
            break
    _ends_at_once_in_one_line(p, t, ranks, "nd-adapter: error: the process that forked the ranks (multiprocessing's "
                              "fork server) died (out of memory, or killed from outside?); the ranks were stopped")


def _ends_at_once_in_one_line(p, t: float, ranks: list, line: str) -> None:
    """The launcher `p` ends with status 1 within a minute of `t` (nobody waits for the process-group timeout,
    1800 s), says `line` and nothing else, and leaves no rank of `ranks` running."""
    import psutil

    out, err = p.communicate(timeout=300)
    assert time.monotonic() - t < 60
    assert p.returncode == 1, (out[-2000:], err[-2000:])
    assert [ln for ln in said(err) if ln.startswith("nd-adapter:")] == [line], err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    time.sleep(1)
    assert not [r for r in ranks if r.is_running() and r.status() != psutil.STATUS_ZOMBIE]
    assert not _ends(p.pid, within=10)


def _ranks(launcher) -> list:
    """The launcher's ranks in rank order: on CPUs they fork from its forkserver (adapter/train/spawn.py)."""
    server = [c for c in launcher.children() if "multiprocessing.forkserver" in " ".join(c.cmdline())]
    return sorted(server[0].children() if server else launcher.children(), key=lambda c: c.pid)


def test_a_damaged_checkpoint_or_directory_is_one_line_and_changes_nothing(base):
    root, raw, _ = base

    def one_line(p: subprocess.Popen, *needles: str) -> str:
        out, err = p.communicate(timeout=600)
        lines = [ln for ln in said(err) if ln.startswith("nd-adapter:")]
        assert p.returncode == 2 and len(lines) == 1, (out[-2000:], err[-3000:])
        assert all(n in lines[0] for n in needles) and "Traceback" not in out + err, lines[0]
        return lines[0]

    # before any process starts: a fresh start over the whole run's checkpoints, a directory that is a file
    one_line(_train(_cfg(root / "again.yaml", raw, root / "ck-whole")), "holds checkpoints of an earlier run "
             f"(the newest: global_step{STEPS})", "--resume")
    one_line(_train(_cfg(root / "file.yaml", raw, root / "whole.yaml")), "checkpoint.dir=", "is a file")
    assert (root / "ck-whole/latest").read_text() == f"global_step{STEPS}"

    ck = root / "ck-damaged"
    shutil.copytree(root / "ck-whole", ck)
    shard = ck / f"global_step{STEPS}" / "zero_pp_rank_1_mp_rank_01_optim_states.pt"
    whole = shard.read_bytes()
    moved = _cfg(root / "damaged.yaml", _two(raw, STEPS), ck)  # dp_shard=2, tp=1: resharded from tp=2
    shard.write_bytes(whole[:-1])
    one_line(_train(moved, "--resume"), f"checkpoint file global_step{STEPS}/{shard.name} is truncated")
    data = bytearray(whole)
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    one_line(_train(moved, "--resume"), f"checkpoint file global_step{STEPS}/{shard.name} is damaged (CRC-32 ")
    p = _cli("checkpoint", "info", str(ck), "--checksums", cwd=root)
    assert p.returncode == 2 and f"{shard.name}" in p.stderr and "DAMAGED" in p.stdout, (p.stdout, p.stderr)
    assert sorted(x.name for x in ck.iterdir()) == sorted(x.name for x in (root / "ck-whole").iterdir())
