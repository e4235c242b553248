"""What a checkpoint holds, without torch: `nd-adapter checkpoint info DIR`, `plan`'s word on resuming, and the
pre-flight refusal of a resume the layout cannot take. Reads the run's own record (`nd_adapter.json`,
written by adapter/train/checkpoint.py beside DeepSpeed's files) and the files' sizes; `--checksums` adds a CRC-32
of every file (a full read)."""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from adapter.config import RunConfig
from adapter.errors import bad

LATEST = "latest"  # DeepSpeed's pointer to the newest complete checkpoint (a text file holding its tag)
RECORD = "nd_adapter.json"  # the run's own record of a checkpoint: step, layout, model
LAYOUT = ("dp_replicate", "dp_shard", "cp", "tp")


def layout_of(cfg: RunConfig) -> dict[str, int]:
    """The layout as a checkpoint's record keeps it."""
    p = cfg.parallelism
    return {"dp_replicate": p.dp_replicate_size, "dp_shard": p.dp_shard_size, "cp": p.cp_size, "tp": p.tp_size,
            "ep": p.ep_size}


def layout_diff(saved: dict[str, int], here: dict[str, int]) -> list[tuple[str, int, int]]:
    """(axis, size there, size here) for every axis where a checkpoint's layout and this run's differ (a record
    without ep: saved without expert parallelism)."""
    return [(k, saved.get(k, 1), here.get(k, 1)) for k in (*LAYOUT, "ep") if saved.get(k, 1) != here.get(k, 1)]


@dataclass
class CheckpointInfo:
    path: Path
    tag: str
    record: dict | None          # None: saved before nd-adapter wrote its record
    files: dict[str, int] = field(default_factory=dict)  # name -> bytes

    @property
    def size(self) -> int:
        return sum(self.files.values())

    def layout_text(self) -> str:
        if not self.record:
            return "unknown (no nd_adapter.json: an older checkpoint)"
        lay = self.record["layout"]
        return (" × ".join(f"{k}={lay[k]}" for k in LAYOUT) + (f" (ep={lay['ep']})" if lay.get("ep", 1) > 1 else "")
                + f" ({self.record['world_size']} ranks, ZeRO stage "
                f"{self.record['zero_stage']})")


def read(directory: str | Path, tag: str | None = None, key: str = "DIR") -> CheckpointInfo:
    root = Path(directory)
    if tag is None:
        try:
            tag = (root / LATEST).read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            raise bad(key, str(directory), f"no checkpoint here (no `{LATEST}` file)",
                      "point it at a run's checkpoint.dir (Axolotl: output_dir)") from None
    ckpt = root / tag
    if not ckpt.is_dir():
        raise bad(key, str(directory), f"`{LATEST}` names {tag}, which does not exist",
                  "restore the directory or pass --tag global_stepN of one that exists")
    record = None
    if (ckpt / RECORD).is_file():
        try:
            record = json.loads((ckpt / RECORD).read_text())
        except json.JSONDecodeError as e:
            raise bad(key, str(ckpt / RECORD), f"unreadable ({e})", "the checkpoint is damaged; use an older one")
    files = {str(p.relative_to(ckpt)): p.stat().st_size for p in sorted(ckpt.rglob("*")) if p.is_file()}
    return CheckpointInfo(ckpt, tag, record, files)


def resumable(info: CheckpointInfo, cfg: RunConfig, architecture: str) -> tuple[str | None, str]:
    """(why `cfg` cannot resume `info`, or None; how it would: "at the same layout" or "resharded from ...")."""
    r = info.record
    if not r:
        return None, "at the layout it was saved with (an older checkpoint: the load's own checks decide)"
    if r["model"]["architecture"] != architecture:
        return f"it holds a {r['model']['architecture']} model, this run trains {architecture}", ""
    here = layout_of(cfg)
    diff = layout_diff(r["layout"], here)
    if not diff:
        return None, "at the same layout"
    eight = "adamw_8bit" in (r.get("optimizer"), cfg.optimizer.name)
    if eight:
        return ("8-bit optimizer moments are quantised in blocks of the layout's own partitions, so they cannot "
                "move to another layout exactly", "")
    return None, "resharded from another layout ({})".format(
        ", ".join(f"{k} {there} there, {now} here" for k, there, now in diff))


def check_resumable(cfg: RunConfig, architecture: str) -> None:
    """Refuse (one line) a --resume that the newest checkpoint in checkpoint.dir cannot take; nothing if none."""
    from adapter.config import spell
    from adapter.errors import bad

    if not cfg.checkpoint.dir or not (Path(cfg.checkpoint.dir) / LATEST).is_file():
        return
    key = spell(cfg, "checkpoint.dir")
    info = read(cfg.checkpoint.dir, key=key)
    why, _ = resumable(info, cfg, architecture)
    if why:
        raise bad(key, cfg.checkpoint.dir, f"cannot resume {info.tag}: {why}",
                  f"resume with the model, optimizer and layout it was saved with (`nd-adapter checkpoint info "
                  f"{cfg.checkpoint.dir}`), or train into another directory")


def crc32(path: Path, chunk: int = 1 << 24) -> str:
    c = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            c = zlib.crc32(block, c)
    return f"{c:08x}"


def describe(info: CheckpointInfo, checksums: bool = False) -> list[str]:
    r = info.record or {}
    lines = [f"checkpoint {info.path} ({info.tag})",
             f"  step      {r.get('step', info.tag.removeprefix('global_step'))}",
             f"  model     {r['model']['architecture']}, {r['model']['params']:,} parameters" if r else
             "  model     unknown (no nd_adapter.json)",
             f"  layout    {info.layout_text()}",
             f"  holds     {r.get('holds', '?')}; optimizer {r.get('optimizer', '?')}",
             f"  size      {info.size / 1e9:.3f} GB in {len(info.files)} files"]
    for name, nbytes in info.files.items():
        lines.append(f"    {name}  {nbytes:,} B" + (f"  crc32 {crc32(info.path / name)}" if checksums else ""))
    return lines


def main(args) -> int:
    info = read(args.dir, args.tag)
    print("\n".join(describe(info, args.checksums)))
    return 0


__all__ = ["CheckpointInfo", "read", "resumable", "describe", "layout_of", "layout_diff", "main", "LATEST",
           "RECORD"]
