"""What a training checkpoint's integrity check costs: one rank's shard written as a save writes it, and read back
as a resume verifies it.

    python bench/ckpt_checksum.py --gib 2 [--dir /path/on/the/checkpoint/filesystem] [--repeat 3]

Times, for one state dict of fp32 tensors of that size: `torch.save` to the path (DeepSpeed's own write, no check),
the same write through adapter/train/ckpt_files.py's `CrcFile` (the CRC-32 taken from the bytes as they go to
the file) with and without the fsync a save now ends each file with, and `ckpt_info.crc32` reading the file
(what `_verified` does per file at a resume, split over the ranks), from the page cache and from the disk. Each is
the best of --repeat runs.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
import zlib
from pathlib import Path

import torch

from adapter.train.ckpt_files import CrcFile
from adapter.train.ckpt_info import crc32


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="shard size")
    ap.add_argument("--dir", help="where to write (default: a temporary directory)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n = int(args.gib * (1 << 30)) // 4
    chunk = 1 << 26  # tensors of 256 MiB at most, as a ZeRO partition's flat groups are
    state = {f"t{i}": torch.randn(min(chunk, n - i * chunk)) for i in range(-(-n // chunk))}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = Path(d) / "shard.pt"

        def plain():
            torch.save(state, path)

        def streamed(sync: bool):
            with open(path, "wb") as f:
                out = CrcFile(f)
                torch.save(state, out)
                f.flush()
                if sync:
                    os.fsync(f.fileno())

        def cold_crc():
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache, as after a restart
            os.close(fd)
            crc32(path)

        size = (plain(), path.stat().st_size)[1]
        block = os.urandom(1 << 26)
        in_memory = lambda: [zlib.crc32(block) for _ in range(-(-size // len(block)))]  # noqa: E731
        rows = [("torch.save (no check)", _best(plain, args.repeat)),
                ("torch.save + CRC-32 while writing", _best(lambda: streamed(False), args.repeat)),
                ("torch.save + CRC-32 while writing + fsync (a save)", _best(lambda: streamed(True), args.repeat)),
                ("CRC-32 of the file from the page cache", _best(lambda: crc32(path), args.repeat)),
                ("CRC-32 of the file from the disk (a resume, per file)", _best(cold_crc, args.repeat)),
                ("zlib.crc32 alone, in memory", _best(in_memory, args.repeat))]
    print(f"shard {size / 1e9:.2f} GB, {os.cpu_count()} CPUs, best of {args.repeat}")
    for name, t in rows:
        print(f"  {name:52s} {t:7.2f} s  {size / t / 1e9:6.2f} GB/s")


if __name__ == "__main__":
    main()
