"""What a checkpoint holds and whether it is intact, without torch: `nd-adapter checkpoint info DIR`, `plan`'s word
on resuming, the pre-flight checks of a resume, and the rules adapter/train/checkpoint.py saves and loads by.

Each checkpoint carries the run's own record, `nd_adapter.json`, beside DeepSpeed's files: step, layout, model,
the run's lineage (the chain of runs that resumed one another; rotation deletes only its own checkpoints), and
every file of the checkpoint with its size and CRC-32, taken from the bytes as they were written. The record ends
with the CRC-32 of its own text. A resume checks all of it before anything is loaded: a damaged record, a missing,
truncated, empty or changed file, or a `.pt` file the save did not write is one line naming the file.
"""
from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from adapter.config import RunConfig, spell
from adapter.errors import UserError, bad

LATEST = "latest"  # DeepSpeed's pointer to the newest complete checkpoint (a text file holding its tag)
RECORD = "nd_adapter.json"  # the run's own record of a checkpoint: step, layout, model, files
LAYOUT = ("dp_replicate", "dp_shard", "cp", "tp")
FILES = "files"  # in the record: every file of the checkpoint -> {"bytes": size, "crc32": hex}, as written
CHECKSUM = "checksum"  # the record's last key: CRC-32 of the record's text without it
LINEAGE = "lineage"  # in the record: the id of the chain of runs that wrote it (a fresh start opens a new one)
_TAG = re.compile(r"global_step(\d+)$")


# --- the record and the files' checksums ------------------------------------------------------------------------

def crc32(path: Path, chunk: int = 1 << 24) -> str:
    """CRC-32 of a whole file, read once in 16 MiB blocks (zlib's: 3.3 GB/s on one core of the H200 host, plus
    the read; docs/config.md)."""
    c = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            c = zlib.crc32(block, c)
    return f"{c:08x}"


def _text_crc(body: dict) -> str:
    return f"{zlib.crc32(json.dumps(body, indent=1).encode()):08x}"


def record_text(record: dict) -> str:
    """nd_adapter.json as written: the record, then the CRC-32 of its own text (any changed byte of the content,
    even one that leaves valid JSON, no longer matches)."""
    body = {k: v for k, v in record.items() if k != CHECKSUM}
    return json.dumps({**body, CHECKSUM: _text_crc(body)}, indent=1) + "\n"


def _damaged(key: str, value, ckpt: Path, name: str, why: str, fix: str = "restore that file from a copy") -> UserError:
    return bad(key, value, f"checkpoint file {ckpt.name}/{name} {why}, so {ckpt.name} cannot be resumed",
               f"{fix}, or move {ckpt.name} out of the directory and delete `{LATEST}`: --resume then continues from "
               "the newest complete checkpoint before it")


def read_record(ckpt: Path, key: str = "checkpoint.dir", value=None) -> dict | None:
    """The record of the checkpoint directory `ckpt`, its own checksum checked; None when it has none (saved by an
    nd-adapter that wrote no record). A damaged one: UserError naming it."""
    value = str(ckpt.parent) if value is None else value
    path = ckpt / RECORD
    try:
        text = path.read_bytes().decode()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        raise _damaged(key, value, ckpt, RECORD, "is damaged (not text)") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise _damaged(key, value, ckpt, RECORD, "is damaged (empty)" if not text.strip() else
                       f"is damaged (not valid JSON: {e.msg} at line {e.lineno})") from None
    if not isinstance(record, dict):
        raise _damaged(key, value, ckpt, RECORD, "is damaged (not a JSON object)")
    if CHECKSUM in record:
        said = record.pop(CHECKSUM)
        if said != _text_crc(record):
            raise _damaged(key, value, ckpt, RECORD, f"is damaged (its content no longer matches its own CRC-32, "
                           f"{said})")
    return record


def check_files(ckpt: Path, record: dict, key: str = "checkpoint.dir", value=None, *,
                sums: list[str] | None = None) -> None:
    """Every file the record lists is there at the size it was written, and no `.pt` file is there that the save
    did not write (stat only). `sums`: these files' contents are also checked against their CRC-32 (a full read of
    each). UserError naming the first file that is not as written."""
    value = str(ckpt.parent) if value is None else value
    files = record[FILES]
    for name in sorted(files):
        want = files[name]["bytes"]
        try:
            have = (ckpt / name).stat().st_size
        except FileNotFoundError:
            raise _damaged(key, value, ckpt, name, "is missing") from None
        if have != want:
            why = ("is empty" if have == 0 else "is truncated" if have < want else "is longer than written")
            raise _damaged(key, value, ckpt, name, f"{why} ({have:,} bytes; {want:,} were written)")
    for p in sorted(ckpt.rglob("*.pt")):
        name = p.relative_to(ckpt).as_posix()
        if name not in files:
            raise _damaged(key, value, ckpt, name, f"was not written by the save that made it ({RECORD} does not "
                           "list it)", "remove that file")
    for name in sums or ():
        have = crc32(ckpt / name)
        if have != files[name]["crc32"]:
            raise _damaged(key, value, ckpt, name, f"is damaged (CRC-32 {have}; {files[name]['crc32']} when it was "
                           "written)")


def lineage_of(ckpt: Path) -> str | None:
    """The lineage a checkpoint was written in, or None (no record, a damaged one, or written before lineages)."""
    try:
        return (read_record(ckpt) or {}).get(LINEAGE)
    except UserError:
        return None


# --- which checkpoint a resume continues ------------------------------------------------------------------------

def step_of(tag: str | None) -> int | None:
    m = _TAG.match(tag or "")
    return int(m.group(1)) if m else None


def resumes(cfg: RunConfig, resume: bool) -> bool:
    """Whether the run continues a checkpoint: --resume, or `checkpoint.auto_resume` (Axolotl's
    auto_resume_from_checkpoints) with a checkpoint in checkpoint.dir to continue."""
    d = cfg.checkpoint.dir
    return resume or bool(cfg.checkpoint.auto_resume and d and steps(Path(d)))


def steps(root: Path) -> dict[int, Path]:
    """global_stepN directories of a checkpoint.dir by step."""
    try:
        return {int(m.group(1)): p for p in root.iterdir() if p.is_dir() and (m := _TAG.match(p.name))}
    except (FileNotFoundError, NotADirectoryError):
        return {}


def pointer(root: Path) -> str | None:
    """What `latest` says, or None when it is missing or empty."""
    try:
        return (Path(root) / LATEST).read_text().strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None


def _incomplete(ckpt: Path, key: str, value: str) -> str | None:
    """Why `ckpt` is not a complete checkpoint (stat only), or None."""
    try:
        record = read_record(ckpt, key, value)
        if record is None or FILES not in record:
            return f"{ckpt.name} lists no files (saved by an older nd-adapter), so nothing shows it is complete"
        check_files(ckpt, record, key, value)
    except UserError as e:
        return str(e).split(": ", 1)[1].split(", so ")[0]
    return None


def newest_complete(root: str | Path, key: str = "checkpoint.dir") -> str | None:
    """The tag of the newest complete checkpoint in `root` (stat only), or None."""
    found = steps(Path(root))
    return next((found[s].name for s in sorted(found, reverse=True)
                 if _incomplete(found[s], key, str(root)) is None), None)


def resume_tag(root: str | Path, key: str = "checkpoint.dir") -> str | None:
    """The checkpoint a resume continues: the one `latest` names; when `latest` is missing or empty (lost, or
    removed by hand), the newest complete checkpoint: its record intact and every file it lists there at the size it
    was written. None when the directory holds no checkpoint; one line when it holds some but none is complete."""
    root = Path(root)
    tag = pointer(root)
    if tag is not None:
        return tag
    found = steps(root)
    why = None
    for step in sorted(found, reverse=True):
        why_not = _incomplete(found[step], key, str(root))
        if why_not is None:
            return found[step].name
        why = why or why_not
    if found:
        raise bad(key, str(root), f"`{LATEST}` is missing and no checkpoint here is complete (the newest: {why})",
                  f"restore a complete checkpoint, or write the tag of one you trust into {root / LATEST}")
    return None


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
    found_by: str = LATEST       # how the tag was chosen: `latest`, --tag, or the newest complete one

    @property
    def size(self) -> int:
        return sum(self.files.values())

    @property
    def described(self) -> dict | None:
        """The record when it says what the run was (a save by the trainer), else None."""
        return self.record if self.record and "layout" in self.record and "model" in self.record else None

    def layout_text(self) -> str:
        if not self.described:
            return "unknown (no layout in nd_adapter.json: an older checkpoint)"
        lay = self.record["layout"]
        return (" × ".join(f"{k}={lay[k]}" for k in LAYOUT) + (f" (ep={lay['ep']})" if lay.get("ep", 1) > 1 else "")
                + f" ({self.record['world_size']} ranks, ZeRO stage "
                f"{self.record['zero_stage']})")


def read(directory: str | Path, tag: str | None = None, key: str = "checkpoint.dir") -> CheckpointInfo:
    """The checkpoint `tag` names (default: the one a resume continues), its record checked (a damaged one is one
    line naming it); the files' contents are not read."""
    root = Path(directory)
    found_by = "--tag" if tag is not None else LATEST
    if tag is None:
        tag = resume_tag(root, key)
        if tag is None:
            raise bad(key, str(directory), f"no checkpoint here (no `{LATEST}` file and no global_stepN directory)",
                      "point it at a run's checkpoint.dir (Axolotl: output_dir)")
        if pointer(root) is None:
            found_by = f"the newest complete checkpoint (`{LATEST}` is missing)"
    ckpt = root / tag
    if not ckpt.is_dir():
        newest = newest_complete(root, key)
        raise bad(key, str(directory), f"`{LATEST}` names {tag!r}, which does not exist" if found_by == LATEST else
                  f"{tag} does not exist", f"delete `{LATEST}` to resume from the newest complete checkpoint ({newest})"
                  if newest and found_by == LATEST else "restore the directory or pass --tag global_stepN of one that "
                  "exists")
    record = read_record(ckpt, key, str(directory))
    files = {p.relative_to(ckpt).as_posix(): p.stat().st_size for p in sorted(ckpt.rglob("*")) if p.is_file()}
    return CheckpointInfo(ckpt, tag, record, files, found_by)


def resumable(info: CheckpointInfo, cfg: RunConfig, architecture: str) -> tuple[str | None, str]:
    """(why `cfg` cannot resume `info`, or None; how it would: "at the same layout" or "resharded from ...")."""
    r = info.described
    if not r:
        return None, "at the layout it was saved with (an older checkpoint: the load's own checks decide)"
    if r["model"]["architecture"] != architecture:
        return f"it holds a {r['model']['architecture']} model, this run trains {architecture}", ""
    here = layout_of(cfg)
    diff = layout_diff(r["layout"], here)
    if not diff:
        return None, "at the same layout"
    low = [n for n in (r.get("optimizer"), cfg.optimizer.name) if n in ("adamw_8bit", "adamw_4bit")]
    if low:
        return (f"{low[0][-4]}-bit optimizer moments are quantised in blocks of the layout's own partitions, so they "
                "cannot move to another layout exactly", "")
    return None, "resharded from another layout ({})".format(
        ", ".join(f"{k} {there} there, {now} here" for k, there, now in diff))


def check_resumable(cfg: RunConfig, architecture: str) -> None:
    """Refuse (one line) a --resume that the checkpoint it would continue cannot take: a damaged record, a file
    missing or not at its written size (stat only: the contents are checked as the ranks load them), another model,
    a layout it cannot move to. Nothing when checkpoint.dir holds no checkpoint."""
    if not cfg.checkpoint.dir or resume_tag(cfg.checkpoint.dir, spell(cfg, "checkpoint.dir")) is None:
        return
    key = spell(cfg, "checkpoint.dir")
    info = read(cfg.checkpoint.dir, key=key)
    if info.record is not None and FILES in info.record:
        check_files(info.path, info.record, key, cfg.checkpoint.dir)
    why, _ = resumable(info, cfg, architecture)
    if why:
        raise bad(key, cfg.checkpoint.dir, f"cannot resume {info.tag}: {why}",
                  f"resume with the model, optimizer and layout it was saved with (`nd-adapter checkpoint info "
                  f"{cfg.checkpoint.dir}`), or train into another directory")


def check_dir(cfg: RunConfig, resume: bool) -> None:
    """Before any process starts: checkpoint.dir can be a directory (not a file, nor under one), and a run that does
    not resume does not start over in a directory holding another run's checkpoints (its saves would replace
    them; rotation never deletes what its own lineage did not write)."""
    if not cfg.checkpoint.dir:
        return
    key, root = spell(cfg, "checkpoint.dir"), Path(cfg.checkpoint.dir)
    above = root
    while not above.exists() and above != above.parent:
        above = above.parent
    if above.exists() and not above.is_dir():
        raise bad(key, cfg.checkpoint.dir, "is a file" if above == root else f"{above} is a file, so the directory "
                  "cannot be made", "name a directory (it is made if missing), e.g. the run's output directory")
    if not resume and steps(root):
        newest = max(steps(root))
        raise bad(key, cfg.checkpoint.dir, f"holds checkpoints of an earlier run (the newest: global_step{newest}), "
                  "which this run, starting from step 0, would replace", f"continue it with --resume (or "
                  f"{spell(cfg, 'checkpoint.auto_resume')}: true), or train into another directory (or delete those "
                  "checkpoints to start over)")


def describe(info: CheckpointInfo, checksums: bool = False) -> tuple[list[str], tuple[str, str] | None]:
    """The lines `checkpoint info` prints, and (name, what is wrong) of the first file that is not as written (its
    size; with `checksums` also its CRC-32)."""
    r = info.described or {}
    listed = (info.record or {}).get(FILES)
    lines = [f"checkpoint {info.path} ({info.tag}" + (f", {info.found_by}" if info.found_by != LATEST else "") + ")",
             f"  step      {(info.record or {}).get('step', info.tag.removeprefix('global_step'))}",
             f"  model     {r['model']['architecture']}, {r['model']['params']:,} parameters" if r else
             "  model     unknown (no nd_adapter.json)",
             f"  layout    {info.layout_text()}",
             f"  holds     {r.get('holds', '?')}; optimizer {r.get('optimizer', '?')}",
             f"  size      {info.size / 1e9:.3f} GB in {len(info.files)} files",
             ("  integrity " + (f"size and CRC-32 of its {len(listed)} files recorded at save" +
                                ("; checked below" if checksums else "; --checksums reads and checks them"))
              if listed else "  integrity no checksums recorded (saved by an older nd-adapter)")]
    first_bad = None
    for name, nbytes in info.files.items():
        line = f"    {name}  {nbytes:,} B"
        have = crc32(info.path / name) if checksums else None
        if checksums:
            line += f"  crc32 {have}"
        want = (listed or {}).get(name)
        if want is not None:
            ok = nbytes == want["bytes"] and (not checksums or have == want["crc32"])
            line += "  ok" if ok and checksums else "" if ok else (
                f"  DAMAGED (written: {want['bytes']:,} B, crc32 {want['crc32']})")
            if not ok and first_bad is None:
                first_bad = (name, f"is not as written ({nbytes:,} bytes, crc32 {have}; {want['bytes']:,} bytes, "
                             f"crc32 {want['crc32']} when it was written)" if checksums else
                             f"is not as written ({nbytes:,} bytes; {want['bytes']:,} were written)")
        elif listed and name.endswith(".pt"):
            line += "  NOT WRITTEN BY THE SAVE"
            first_bad = first_bad or (name, f"was not written by the save that made it ({RECORD} does not list it)")
        lines.append(line)
    for name in sorted(set(listed or {}) - set(info.files)):
        lines.append(f"    {name}  MISSING")
        first_bad = first_bad or (name, "is missing")
    return lines, first_bad


def main(args) -> int:
    info = read(args.dir, args.tag, key="DIR")
    lines, first_bad = describe(info, args.checksums)
    print("\n".join(lines))
    if first_bad:
        raise _damaged("DIR", args.dir, info.path, *first_bad)
    return 0


__all__ = ["CheckpointInfo", "read", "resumable", "describe", "layout_of", "layout_diff", "main", "LATEST",
           "RECORD", "FILES", "LINEAGE", "record_text", "read_record", "check_files", "resume_tag", "check_dir",
           "check_resumable", "crc32", "newest_complete", "steps", "step_of", "pointer", "lineage_of"]
