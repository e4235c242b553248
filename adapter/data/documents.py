"""Raw documents from local files: `.jsonl`/`.json` (JSON Lines, text under `text_key`), `.txt`/`.md` (documents
separated by blank lines, so a book becomes one document per paragraph), `.parquet` (column `text_key`; pyarrow).
Directories expand to their supported files, sorted, so every rank sees the same order."""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from adapter.errors import bad

TEXT_SUFFIXES = {".txt", ".md"}
JSONL_SUFFIXES = {".jsonl", ".json"}
PARQUET_SUFFIXES = {".parquet"}


def expand_files(files: str | Path | Sequence[str | Path], key: str = "data.files") -> list[Path]:
    """Files as given, directories expanded to their supported files (sorted, so every rank agrees)."""
    items = [files] if isinstance(files, (str, Path)) else list(files or [])
    if not items:
        raise bad(key, items, "no data files given", "list at least one .jsonl, .txt or .parquet file")
    known = TEXT_SUFFIXES | JSONL_SUFFIXES | PARQUET_SUFFIXES
    out: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in known)
            if not found:
                raise bad(key, str(p), "directory holds no .jsonl, .txt or .parquet files", "point it at data files")
            out += found
        elif not p.is_file():
            raise bad(key, str(p), "no such file", "fix the path (relative paths are from the working directory)")
        elif p.suffix.lower() not in known:
            raise bad(key, str(p), f"unknown file type {p.suffix!r}", "use .jsonl, .txt/.md or .parquet")
        else:
            out.append(p)
    return out


def iter_documents(path: Path, text_key: str = "text") -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        yield from _parquet_docs(path, text_key)
        return
    try:
        with open(path, encoding="utf-8") as f:
            yield from (_jsonl_docs(f, path, text_key) if suffix in JSONL_SUFFIXES else _paragraphs(f))
    except UnicodeDecodeError as e:
        raise bad("data.files", str(path), f"not UTF-8 text (byte {e.start})", "convert the file to UTF-8")


def _jsonl_docs(lines: Iterable[str], path: Path, text_key: str) -> Iterator[str]:
    first = True
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            if not (first and line.lstrip().startswith("[")):
                raise bad("data.files", f"{path}:{n}", "line is not valid JSON",
                          "write one JSON object per line") from None
            obj = []  # the first line of a JSON array spread over many
        if first and isinstance(obj, list):  # a JSON array, on one line or spread over many
            out = f"{path.stem}{'-lines' if path.suffix.lower() == '.jsonl' else ''}.jsonl"
            raise bad("data.files", str(path), "is one JSON array, not JSON Lines (one object per line)",
                      f"convert it, e.g. jq -c '.[]' {path.name} > {out}, and list that file")
        first = False
        text = obj.get(text_key) if isinstance(obj, dict) else None
        if not isinstance(text, str):
            raise bad("data.text_key", text_key, f"{path} line {n} has no string field of that name",
                      "set data.text_key to the field that holds the text")
        if text.strip():
            yield text


def _paragraphs(lines: Iterable[str]) -> Iterator[str]:
    buf: list[str] = []
    for line in lines:
        if line.strip():
            buf.append(line)
        elif buf:
            yield "".join(buf).strip("\n")
            buf = []
    if buf:
        yield "".join(buf).strip("\n")


def _parquet_docs(path: Path, text_key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq  # only for parquet files, and an optional dependency
    except ImportError:
        raise bad("data.files", str(path), "reading parquet needs pyarrow, which is not installed",
                  "pip install pyarrow, or convert the file to jsonl")
    pf = pq.ParquetFile(path)
    if text_key not in pf.schema_arrow.names:
        raise bad("data.text_key", text_key, f"{path} has no such column (it has {pf.schema_arrow.names})",
                  "set data.text_key to the text column")
    for batch in pf.iter_batches(columns=[text_key], batch_size=1024):
        yield from (t for t in batch.column(0).to_pylist() if isinstance(t, str) and t.strip())
