"""Wall time of `nd-adapter plan --search` over a 64-GPU world (8 nodes × 8), in a fresh interpreter, CPU only.

    python bench/search_time.py [--repeats 5]

The target is under 2 s, without importing torch. The import check is a CI test
(tests/unit/test_search.py); the time is measured here, as a benchmark, because a timed test fails whenever the
CI machine is busy.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
CFG = str(ROOT / "configs/llama-3.1-8b-hsdp-tp.yaml")
SCRIPT = ("import sys, time, io, contextlib\n"
          "from adapter.cli import main\n"
          "t = time.perf_counter()\n"
          "with contextlib.redirect_stdout(io.StringIO()):\n"
          f"    code = main(['plan', {CFG!r}, '--nodes', '8', '--gpus-per-node', '8', '--search', "
          "'--format', 'json'])\n"
          "print(time.perf_counter() - t, code, 'torch' in sys.modules)\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    times = []
    for _ in range(a.repeats):
        out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
        dt, code, torch_loaded = out.stdout.split()
        assert code == "0" and torch_loaded == "False", out.stderr[-2000:]
        times.append(float(dt))
    print(f"plan --search, 64 GPUs: median {median(times):.2f} s, best {min(times):.2f} s over {a.repeats} runs "
          f"(after importing adapter.cli, as the timed test that was here did; target < 2 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
