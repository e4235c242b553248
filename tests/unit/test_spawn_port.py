"""`nd-adapter train` starts its ranks again on another port when MASTER_PORT was taken between its choice and rank
0's bind (a busy shared node; two runs starting at once): rank 0 ends with EXIT_PORT_TAKEN before any work, the
others are stopped, and the second attempt runs. Here the first port offered is held by this test."""
from __future__ import annotations

import socket

from adapter.train import spawn

FAKE = """
import os, sys
import torch.distributed as dist
from adapter.train.spawn import EXIT_PORT_TAKEN, PORT_RETRY
try:
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
except dist.DistNetworkError as e:
    if os.environ["RANK"] == "0" and "EADDRINUSE" in str(e) and os.environ.get(PORT_RETRY):
        sys.exit(EXIT_PORT_TAKEN)
    raise
dist.barrier()
print("port", os.environ["MASTER_PORT"], flush=True)
"""


def test_a_taken_master_port_starts_the_ranks_again(tmp_path, monkeypatch, capfd):
    (tmp_path / "fake_worker.py").write_text(FAKE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{spawn.Path(spawn.__file__).parents[2]}")
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    offered = iter([held.getsockname()[1]])
    real = spawn.free_port
    monkeypatch.setattr(spawn, "free_port", lambda: next(offered, None) or real())
    try:
        assert spawn.spawn(2, [], cpu=True, module="fake_worker") == 0
    finally:
        held.close()
    err = capfd.readouterr().err
    assert err.count("MASTER_PORT was taken by another process") == 1, err


def test_master_ports_are_drawn_below_the_ephemeral_range():
    """Ports the kernel hands out (bind to 0) are the ones every gloo connection on the node takes too; MASTER_PORT
    comes from below that range, where only another explicit choice can collide."""
    from adapter.osutil import EPHEMERAL, free_port

    low = int(EPHEMERAL.read_text().split()[0]) if EPHEMERAL.exists() else 32_768
    ports = {free_port() for _ in range(20)}
    assert all(1_024 <= p < low for p in ports) and len(ports) > 1, (low, ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free when chosen
