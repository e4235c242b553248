"""`nd-adapter plan` over every config of an Axolotl checkout's examples/, unchanged, with the base models it knows in
a local HF cache (tests/helpers/axolotl_home.py): how many pass, and the first refusal of the others, grouped.

    python bench/axolotl_examples.py --axolotl ~/src/axolotl [--gpus-per-node 8] [--show-failures]

A YAML whose parallel sizes multiply to another GPU count than a node's is planned on that count (on as many
nodes, or one node of fewer GPUs), as its user would launch it.

Not a test: a survey of how many of Axolotl's examples pass (once 4 of 252), to re-run as keys are built.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def first_key(err: str) -> str:
    m = re.match(r"nd-adapter: (?:error|internal error): ([^=:]+)", err)
    return m.group(1).strip() if m else err[:60]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--axolotl", required=True, help="a checkout of axolotl-ai-cloud/axolotl")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--show-failures", action="store_true")
    a = ap.parse_args()
    from adapter.cli import main as cli
    from tests.helpers.axolotl_home import make_home

    examples = sorted(p for p in (Path(a.axolotl) / "examples").rglob("*") if p.suffix in (".yml", ".yaml"))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HF_HOME"] = str(make_home(Path(tmp)))
        os.environ["HF_HUB_OFFLINE"] = "1"
        passed, refused, rows = 0, Counter(), []
        cwd = os.getcwd()
        os.chdir(a.axolotl)  # Axolotl reads deepspeed_configs/... relative to its checkout
        try:
            for ex in examples:
                nodes, gpn = 1, a.gpus_per_node
                while True:  # a YAML whose sizes name another GPU count (its product): planned on that many, on
                    # as many nodes as it takes (llama-3_1-8b-hsdp-tp: 16) or on one node of fewer (a "4gpu" one)
                    out, err = io.StringIO(), io.StringIO()
                    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                        code = cli(["plan", str(ex), "--gpus-per-node", str(gpn), "--nodes", str(nodes)])
                    line = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else ""
                    m = re.search(r"= (\d+) GPUs, but the world size is", line)
                    n = int(m.group(1)) if m else 0
                    if (nodes, gpn) != (1, a.gpus_per_node) or not n or (n > gpn and n % gpn) or (n < gpn and gpn % n):
                        break
                    nodes, gpn = (n // gpn, gpn) if n > gpn else (1, n)
                if code == 0:
                    passed += 1
                else:
                    refused[first_key(line)] += 1
                rows.append((ex.relative_to(a.axolotl), code, line))
        finally:
            os.chdir(cwd)
    print(f"{passed} of {len(examples)} pass `nd-adapter plan` unchanged")
    for key, n in refused.most_common():
        print(f"  {n:4d}  first refusal: {key}")
    if a.show_failures:
        for path, code, line in rows:
            print(f"{'ok  ' if code == 0 else 'FAIL'} {path}: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
