"""Where an SFT dataset's rows come from, and reading them through Hugging Face `datasets` (arrow, memory-mapped).

`resolve` is cheap (stat calls, a file's first bytes and a local cache lookup), so every rank computes the prepared
cache's key from it without loading anything. A `path` is, in this order: a local file
(jsonl/json/parquet/arrow/csv/txt), a `save_to_disk` directory, a directory of data files, or a hub id found in the
local Hugging Face hub cache (`HF_HUB_CACHE`, else `HF_HOME/hub`); with `HF_HUB_OFFLINE`/`HF_DATASETS_OFFLINE`
set, also `datasets`' own cache of a dataset loaded before. Nothing is ever downloaded: clusters are often
offline, and a run must not hang there.

Bad files are one line each, naming the entry's path: empty (0 bytes or blank lines; `resolve`, so the launcher's
preflight says it before any process starts), no rows (a CSV header, an empty JSON array, a split slice that
selects none), text that is not UTF-8, a JSON line that does not parse (by line number). A full disk while
datasets converts the rows is left to the cache's builder (adapter/osutil.py, build_once), which says so.
"""
from __future__ import annotations

import codecs
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from adapter.errors import bad
from adapter.osutil import disk_full

LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".txt": "text"}
TEXT_LOADERS = ("json", "csv", "text")  # read as UTF-8 text, where blank means empty
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


@dataclass(frozen=True)
class Source:
    where: str                 # the entry's key in messages, e.g. datasets[0]
    kind: str                  # "file", "saved" (save_to_disk), "dir" (a directory or hub snapshot), "hub-cache"
    location: str              # shown in messages: the file/directory, or hub id@revision
    root: str                  # what is read: the file, the directory or snapshot, or the hub id (hub-cache)
    files: tuple[Path, ...]    # whose identity keys the cache
    loader: str | None = None  # datasets' builder for kind "file"
    hub_id: str | None = None

    def identity(self) -> list:
        return [self.kind, self.location, self.loader,
                [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in self.files]]


def _files_under(d: Path) -> tuple[Path, ...]:
    return tuple(sorted(f for f in d.rglob("*") if f.is_file()
                        and not any(part.startswith(".") for part in f.relative_to(d).parts)))


def _is_saved(d: Path) -> bool:
    return (d / "dataset_dict.json").is_file() or ((d / "state.json").is_file() and
                                                   (d / "dataset_info.json").is_file())


def hub_cache_dir() -> str | None:
    """Read at call time (huggingface_hub reads its constants at import), so HF_HOME set later is honoured."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def _offline() -> bool:
    flag = lambda name: os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")  # noqa: E731
    return flag("HF_HUB_OFFLINE") or flag("HF_DATASETS_OFFLINE")


def _datasets_cache_dir(hub_id: str) -> Path:
    root = os.environ.get("HF_DATASETS_CACHE") or str(
        Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "datasets")
    owner, _, name = hub_id.rpartition("/")
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()  # datasets' camelcase_to_snakecase of the repo name
    return Path(root) / "___".join([p for p in (owner, snake) if p])


def resolve(entry, where: str) -> Source:
    p = Path(entry.path)
    if p.is_file():
        if entry.data_files is not None:
            raise bad(f"{where}.data_files", entry.data_files, "only applies when path is a directory or hub id",
                      "drop data_files, or point path at the directory the files are in")
        loader = entry.ds_type or LOADERS.get(p.suffix.lower())
        if loader is None:
            raise bad(f"{where}.path", entry.path, f"unknown file type {p.suffix!r}",
                      f"use {', '.join(LOADERS)} files, or set ds_type (json, parquet, arrow, csv, text)")
        if _blank(p, loader):
            raise bad(f"{where}.path", entry.path, "the file is empty" + (" (blank lines only)" if p.stat().st_size
                                                                          else " (0 bytes)"),
                      "point path at a file with rows, or remove the entry")
        return Source(where, "file", str(p.resolve()), str(p.resolve()), (p.resolve(),), loader)
    if p.is_dir():
        return _directory(p.resolve(), entry, where, str(p.resolve()))
    if not HUB_ID.match(entry.path) or p.suffix.lower() in LOADERS or entry.path.startswith("."):
        raise bad(f"{where}.path", entry.path, "no such file or directory",
                  "fix the path (relative paths are from the config file's directory or the working directory)")
    return _hub(entry, where)


def _directory(d: Path, entry, where: str, location: str, hub_id: str | None = None) -> Source:
    files = _files_under(d)
    if _is_saved(d):
        if entry.data_files is not None:
            raise bad(f"{where}.data_files", entry.data_files, "a save_to_disk directory has no data files to pick",
                      "drop data_files")
        return Source(where, "saved", location, str(d), files, hub_id=hub_id)
    if entry.data_files is not None:
        wanted = [entry.data_files] if isinstance(entry.data_files, str) else list(entry.data_files)
        picked = sorted({f for pattern in wanted for f in d.glob(pattern) if f.is_file()})
        missing = [w for w in wanted if not any(d.glob(w))]
        if missing:
            raise bad(f"{where}.data_files", missing[0], f"no such file in {d}", "list files relative to path")
        files = tuple(picked)
    elif not any(f.suffix.lower() in LOADERS for f in files):
        raise bad(f"{where}.path", entry.path, "the directory holds no data files (jsonl, json, parquet, arrow, "
                  "csv, txt) and is not a save_to_disk directory", "point path at data files")
    data = [f for f in files if f.suffix.lower() in LOADERS]
    if data and all(_blank(f, LOADERS[f.suffix.lower()]) for f in data):
        what = "its data files are" if entry.data_files is None else "the data_files picked are"
        raise bad(f"{where}.path", entry.path, f"{what} all empty ({', '.join(f.name for f in data[:3])}"
                  f"{', ...' if len(data) > 3 else ''})", "point path at files with rows, or remove the entry")
    return Source(where, "dir", location, str(d), files, hub_id=hub_id)


def _blank(f: Path, loader: str) -> bool:
    """0 bytes, or (text formats) whitespace only: read up to the first other byte, so at once for real data."""
    if f.stat().st_size == 0:
        return True
    if loader not in TEXT_LOADERS:
        return False
    with open(f, "rb") as fh:
        while chunk := fh.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _hub(entry, where: str) -> Source:
    from huggingface_hub import snapshot_download  # only for hub ids
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        snap = snapshot_download(entry.path, repo_type="dataset", local_files_only=True, cache_dir=cache)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        snap = None
    if snap is not None:
        return _directory(Path(snap), entry, where, f"{entry.path}@{Path(snap).name}", hub_id=entry.path)
    processed = _datasets_cache_dir(entry.path)
    if _offline() and processed.is_dir():
        return Source(where, "hub-cache", entry.path, entry.path, _files_under(processed), hub_id=entry.path)
    shown = cache or "the default ~/.cache/huggingface/hub"
    raise bad(f"{where}.path", entry.path, f"not a local file or directory, and no snapshot of this hub dataset is in "
              f"the local Hugging Face cache ({shown}); nd-adapter never downloads (clusters are often offline)",
              f"on a machine with network run `hf download {entry.path} --repo-type dataset` and copy the cache "
              "here (HF_HOME or HF_HUB_CACHE), or save it with datasets' save_to_disk and set path to that directory")


def load(src: Source, entry, cache_dir: Path):
    """The entry's split as a `datasets.Dataset`. Converted arrow files go to `cache_dir` (the build's own temp
    directory): nothing is written next to the user's data or into their HF cache."""
    import datasets  # heavy: imported where used (preflight reads this module; adapter/data/__init__.py)

    for f in _text_files(src, entry):
        _check_utf8(f, src.where)
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its loaders log a failure before raising it
    try:
        ds = _load(src, entry, cache_dir)
    finally:
        datasets.logging.set_verbosity(verbosity)
    if len(ds) == 0:
        raise _no_rows(src, entry)
    return ds


def _load(src: Source, entry, cache_dir: Path):
    import datasets  # heavy: imported where used

    try:
        if src.kind == "saved":
            obj = datasets.load_from_disk(src.root)
            if isinstance(obj, datasets.DatasetDict):
                if entry.split not in obj:
                    raise bad(f"{src.where}.split", entry.split, f"the saved dataset has splits {sorted(obj)}",
                              "set split to one of them")
                obj = obj[entry.split]
            elif entry.split != "train":
                raise bad(f"{src.where}.split", entry.split, "the saved dataset is one Dataset, without splits",
                          "drop split, or save a DatasetDict")
            return obj
        if src.kind == "file":
            return datasets.load_dataset(src.loader, data_files=[src.root], split=entry.split,
                                         cache_dir=str(cache_dir))
        if src.kind == "dir":
            data_files = ([str(f.relative_to(src.root)) for f in src.files] if entry.data_files is not None
                          else None)
            return datasets.load_dataset(src.root, name=entry.name, data_files=data_files, split=entry.split,
                                         cache_dir=str(cache_dir))
        return datasets.load_dataset(src.hub_id, name=entry.name, split=entry.split)  # offline: datasets' cache
    except StopIteration:  # datasets' json loader on files without a single row
        raise _no_rows(src, entry) from None
    except ValueError as e:
        if "corresponds to no data" in str(e):  # datasets: the split (or its slice) has no rows
            raise _no_rows(src, entry) from None
        if "split" in str(e).lower():
            raise bad(f"{src.where}.split", entry.split, f"not a split of {src.location} ({str(e).splitlines()[0]})",
                      "set split to one the dataset has (default train)")
        raise _unreadable(src, e)
    except (datasets.exceptions.DatasetGenerationError, OSError, TypeError) as e:
        if disk_full(e):
            raise  # the cache's disk, not the data: build_once says so
        raise _unreadable(src, e)


def _no_rows(src: Source, entry):
    if entry.split != "train":
        return bad(f"{src.where}.split", entry.split, f"selects no rows of {src.location}",
                   "pick a split (or slice) that holds rows")
    like = {"csv": " (a header alone)", "json": " (e.g. an empty JSON array)"}.get(src.loader or "", "")
    return bad(f"{src.where}.path", src.location, f"holds no rows{like}",
               "point path at data with rows, or remove the entry")


def _text_files(src: Source, entry) -> list[Path]:
    """The local files of `src` its loader reads as text (of a directory only those picked by data_files: datasets
    chooses the others by its own split patterns; text that is not UTF-8 there is found while tokenising)."""
    if src.kind == "file":
        return [Path(src.root)] if src.loader in TEXT_LOADERS else []
    if src.kind == "dir" and entry.data_files is not None:
        return [f for f in src.files if LOADERS.get(f.suffix.lower()) in TEXT_LOADERS]
    return []


def _check_utf8(path: Path, where: str) -> None:
    """One line naming the file and line of the first byte that is not UTF-8 (datasets would store it and fail
    later, while tokenising, in a library traceback)."""
    decoder, line = codecs.getincrementaldecoder("utf-8")(), 1
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                line += chunk.count(b"\n", 0, max(0, e.start))
                raise bad(f"{where}.path", str(path), f"is not UTF-8 text (line {line} holds the byte "
                          f"{e.object[e.start:e.start + 1].hex()!r}, not UTF-8)",
                          "convert the file to UTF-8, e.g. iconv -f latin1 -t utf-8") from None
            if not chunk:
                return
            line += chunk.count(b"\n")


def _json_problem(path: Path) -> str | None:
    """Where a JSON file breaks, by line: JSON Lines line by line, or the whole file when it is one JSON array of
    rows (datasets reads that too). None when it parses (the failure was elsewhere)."""
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            return f"line {e.lineno} is not valid JSON ({e.msg}; the file is read as one JSON array)"
        return None
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as e:
                return f"line {n} is not valid JSON ({e.msg})"
    return None


def _unreadable(src: Source, e: Exception):
    cause = e.__cause__ or e
    text = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
    if src.kind == "file" and src.loader == "json":
        where = _json_problem(Path(src.root))
        if where:
            return bad(f"{src.where}.path", src.location, where, "write one JSON object per line (JSON Lines), or "
                       "one JSON array of objects")
    return bad(f"{src.where}.path", src.location, f"could not be read as data: {type(cause).__name__}: {text[:200]}",
               "check the file's format and contents (or set ds_type to its format)")


__all__ = ["Source", "resolve", "load", "hub_cache_dir"]
