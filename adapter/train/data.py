"""Training data: documents -> token cache on disk -> packed samples -> one micro-batch stream per DP rank.

Documents: `.jsonl`/`.json` (JSON Lines: one object per line, text under `text_key`), `.txt`/`.md` (documents
separated by blank lines, so a book becomes one document per paragraph and an essay collection one per essay),
`.parquet` (column `text_key`; needs pyarrow). Each is tokenised with the checkpoint's own tokenizer, special
tokens as that tokenizer adds them (e.g. Llama's BOS), then EOS once per document.

The token cache is built once, by one rank, and published by a directory rename, so restarts and the other ranks
never re-tokenise and never see half a cache. Its name hashes the files (path, size, mtime), `text_key` and the
tokenizer files: editing any of them builds a new cache.

Packing follows Megatron: sample i is tokens [i·S, i·S + S], inputs [:-1], labels [1:]. Documents do not leak into
each other's loss: the label after a document's last token (the next document's first token) has loss_mask 0, and
position_ids restart at 0 at each document start (and at the sample start, as attention cannot see further back).
`segment_ids` number the documents inside a sample, for a block-diagonal mask (`document_attention_mask`) or a
varlen kernel (`cu_seqlens`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from adapter.errors import UserError, bad
from adapter.osutil import atomic_write_text

CACHE_VERSION = 1  # bump when tokenisation or file layout changes: old caches are then simply not found
TEXT_SUFFIXES = {".txt", ".md"}
JSONL_SUFFIXES = {".jsonl", ".json"}
PARQUET_SUFFIXES = {".parquet"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json")


# --- documents --------------------------------------------------------------------------------------------------

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
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise bad("data.files", f"{path}:{n}", "line is not valid JSON", "write one JSON object per line")
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
        import pyarrow.parquet as pq
    except ImportError:
        raise bad("data.files", str(path), "reading parquet needs pyarrow, which is not installed",
                  "pip install pyarrow, or convert the file to jsonl")
    pf = pq.ParquetFile(path)
    if text_key not in pf.schema_arrow.names:
        raise bad("data.text_key", text_key, f"{path} has no such column (it has {pf.schema_arrow.names})",
                  "set data.text_key to the text column")
    for batch in pf.iter_batches(columns=[text_key], batch_size=1024):
        yield from (t for t in batch.column(0).to_pylist() if isinstance(t, str) and t.strip())


# --- token cache ------------------------------------------------------------------------------------------------

class TokenCache(NamedTuple):
    tokens: np.ndarray       # uint32 memmap, all documents back to back
    doc_offsets: np.ndarray  # int64 [n_docs + 1]: document d is tokens[offsets[d]:offsets[d+1]]
    path: Path


def cache_key(files: Sequence[Path], tokenizer_dir: str | Path, text_key: str) -> str:
    """Cheap (stat + tokenizer files only), so every rank computes it without loading anything."""
    tok = Path(tokenizer_dir)
    tok_files = [tok / n for n in TOKENIZER_FILES if (tok / n).is_file()]
    if not tok_files:
        raise bad("model", str(tok), "no tokenizer files there (tokenizer.json, tokenizer.model, ...)",
                  "point `model` at an HF checkpoint directory that includes its tokenizer")
    h = hashlib.sha256(json.dumps({"v": CACHE_VERSION, "text_key": text_key, "files": [
        (str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]}).encode())
    for f in tok_files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:20]


def _open_cache(d: Path) -> TokenCache:
    offsets = np.load(d / "doc_offsets.npy")
    return TokenCache(np.memmap(d / "tokens.u32", dtype=np.uint32, mode="r", shape=(int(offsets[-1]),)), offsets, d)


def _tokenize_into(d: Path, files: Sequence[Path], tokenizer_dir: str | Path, text_key: str, progress: bool) -> dict:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    eos = tok.eos_token_id
    if eos is None:
        raise bad("model", str(tokenizer_dir), "the tokenizer has no eos_token, so documents cannot be separated",
                  "set eos_token in tokenizer_config.json")
    if len(tok) > 2**32:
        raise bad("model", str(tokenizer_dir), f"vocabulary of {len(tok)} does not fit uint32", "use a smaller vocab")
    offsets = [0]
    with open(d / "tokens.u32", "wb") as out, tqdm(unit="doc", desc="tokenising", disable=not progress) as bar:
        def flush(batch: list[str]) -> None:
            if not batch:
                return
            for ids in tok(batch, add_special_tokens=True, verbose=False)["input_ids"]:
                ids = list(ids) if ids and ids[-1] == eos else [*ids, eos]
                out.write(np.asarray(ids, dtype=np.uint32).tobytes())
                offsets.append(offsets[-1] + len(ids))
            bar.update(len(batch))
            batch.clear()
        for path in files:
            batch: list[str] = []
            for doc in iter_documents(path, text_key):
                batch.append(doc)
                if len(batch) == 256:
                    flush(batch)
            flush(batch)
    if len(offsets) == 1:
        raise bad("data.files", [str(f) for f in files], "no documents (all files are empty)", "give non-empty data")
    np.save(d / "doc_offsets.npy", np.asarray(offsets, dtype=np.int64))
    return {"version": CACHE_VERSION, "files": [str(f) for f in files], "text_key": text_key,
            "tokenizer": str(tokenizer_dir), "eos_token_id": eos, "vocab_size": len(tok),
            "num_documents": len(offsets) - 1, "num_tokens": offsets[-1]}


def build_token_cache(files: str | Path | Sequence[str | Path], tokenizer_dir: str | Path, cache_dir: str | Path, *,
                      text_key: str = "text", builder: bool = True, barrier: Callable[[], None] | None = None,
                      progress: bool = True) -> TokenCache:
    """Return the token cache for these files, building it on the `builder` rank if missing.

    Every rank must call this with the same arguments; `barrier`, when given, is called exactly once on each
    (after the builder finished), so pass torch.distributed.barrier or a group's barrier. Pick the builder as global
    rank 0 for a shared `cache_dir`, or local rank 0 per node for node-local disks. A data error found by the
    builder is raised on every rank, not only on the builder.
    """
    paths = expand_files(files)
    root = Path(cache_dir)
    key = cache_key(paths, tokenizer_dir, text_key)
    final, failed = root / f"tokens-{key}", root / f"tokens-{key}.error"
    error: Exception | None = None
    if builder and not (final / "manifest.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        failed.unlink(missing_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tokens-{key}.tmp-", dir=root))
        try:
            manifest = _tokenize_into(tmp, paths, tokenizer_dir, text_key, progress)
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
            try:
                os.rename(tmp, final)  # atomic publish; a concurrent identical build may have won
            except OSError:
                if not (final / "manifest.json").is_file():
                    raise
        except Exception as e:
            error = e  # tell the waiting ranks why, instead of leaving them hanging or without a cache
            atomic_write_text(failed, json.dumps({"user": isinstance(e, UserError), "message": str(e)}))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if barrier is not None:
        barrier()
    if error is not None:
        raise error
    if (final / "manifest.json").is_file():
        return _open_cache(final)
    if failed.is_file():
        why = json.loads(failed.read_text())
        raise (UserError if why["user"] else RuntimeError)(why["message"])
    raise bad("data.cache_dir", str(root), f"the token cache {final.name} made by the builder rank is not visible here",
              "put data.cache_dir on storage shared with the builder rank, or build with local rank 0 per node")


# --- packing ----------------------------------------------------------------------------------------------------

class PackedDataset:
    """Fixed-length samples over the concatenated token stream (see the module docstring for the masking rules)."""

    def __init__(self, cache: TokenCache, seq_len: int):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise bad("seq_len", seq_len, "must be a positive integer", "set seq_len to e.g. 2048")
        n = len(cache.tokens)
        if n < seq_len + 1:
            raise bad("data.files", cache.path.name, f"only {n} tokens, fewer than one sample of seq_len+1="
                      f"{seq_len + 1}", "add data or lower seq_len")
        self.cache, self.seq_len = cache, seq_len
        self.starts = cache.doc_offsets[:-1]

    def __len__(self) -> int:
        return (len(self.cache.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        s = i * self.seq_len
        g = np.arange(s, s + self.seq_len + 1)
        window = np.asarray(self.cache.tokens[s:s + self.seq_len + 1], dtype=np.int64)
        doc = np.searchsorted(self.starts, g, side="right") - 1
        doc_start = self.starts[doc]
        return {
            "tokens": window[:-1],
            "labels": window[1:],
            "loss_mask": (doc_start[1:] != g[1:]).astype(np.float32),  # 0 where the label opens a new document
            "position_ids": (g - np.maximum(doc_start, s))[:-1],
            "segment_ids": (doc - doc[0])[:-1],
        }


def open_dataset(files: str | Path | Sequence[str | Path], tokenizer_dir: str | Path, cache_dir: str | Path,
                 seq_len: int, **cache_kwargs: Any) -> PackedDataset:
    return PackedDataset(build_token_cache(files, tokenizer_dir, cache_dir, **cache_kwargs), seq_len)


# --- sampling ---------------------------------------------------------------------------------------------------

class DPSampler:
    """Infinite, deterministic stream of micro-batch indices for one data-parallel rank.

    Each round of dp_size·micro_batch consecutive samples of the epoch's permutation is split by dp_rank, so DP
    ranks are disjoint and the TP/CP ranks that share a dp_rank get the same batch. An epoch's tail that cannot fill
    a round is skipped (every rank must take the same number of steps); the next epoch reshuffles with seed+epoch.
    The state is global (epoch, samples of it consumed by all ranks), so it is the same on every rank and resuming
    with another dp_size or micro_batch continues at the same place in the data.
    """

    def __init__(self, num_samples: int, *, dp_rank: int, dp_size: int, micro_batch: int, seed: int = 0,
                 shuffle: bool = True):
        if micro_batch < 1:
            raise bad("micro_batch_size", micro_batch, "must be at least 1", "set a positive micro-batch size")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside dp_size {dp_size}")
        if num_samples < dp_size * micro_batch:
            raise bad("data.files", num_samples, f"only that many samples, fewer than one round of dp_size×micro_batch"
                      f" = {dp_size * micro_batch}", "add data, or lower seq_len or micro_batch_size")
        self.num_samples, self.dp_rank, self.dp_size, self.micro_batch = num_samples, dp_rank, dp_size, micro_batch
        self.seed, self.shuffle = seed, shuffle
        self.epoch = self.offset = 0
        self._order: tuple[int, np.ndarray] | None = None

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // (self.dp_size * self.micro_batch)

    def order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            perm = (np.random.default_rng([self.seed, epoch]).permutation(self.num_samples) if self.shuffle
                    else np.arange(self.num_samples))
            self._order = (epoch, perm)
        return self._order[1]

    def __iter__(self) -> Iterator[list[int]]:
        step = self.dp_size * self.micro_batch
        while True:
            if self.offset + step > self.num_samples:
                self.epoch, self.offset = self.epoch + 1, 0
            lo = self.offset + self.dp_rank * self.micro_batch
            idx = self.order(self.epoch)[lo:lo + self.micro_batch]
            self.offset += step  # before the yield: the state counts what the consumer has been handed
            yield idx.tolist()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "num_samples": self.num_samples, "seed": self.seed,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_samples"] != self.num_samples:
            raise bad("data.files", self.num_samples, f"the checkpoint was trained on {state['num_samples']} samples,"
                      " this data gives a different count", "resume with the same data files and seq_len, or start a"
                      " fresh run in an empty checkpoint directory")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.seed, self.shuffle = state["seed"], state["shuffle"]  # the checkpoint's order wins, for exact resume


def build_batches(dataset: PackedDataset, sampler: DPSampler) -> Iterator[dict[str, Any]]:
    """Endless dicts of [micro_batch, seq_len] tensors: tokens, labels, position_ids, segment_ids (int64) and
    loss_mask (float32). Take `sampler.state_dict()` between steps: it counts exactly the batches yielded so far."""
    import torch

    for idx in sampler:
        items = [dataset[i] for i in idx]
        yield {k: torch.from_numpy(np.stack([it[k] for it in items])) for k in items[0]}


def document_attention_mask(segment_ids):
    """[b, 1, s, s] bool, True = masked (Megatron's convention): causal and within one document."""
    import torch

    s = segment_ids.shape[-1]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=segment_ids.device), 1)
    return (causal | (segment_ids[:, :, None] != segment_ids[:, None, :]))[:, None]


def cu_seqlens(segment_ids):
    """int32 cumulative document lengths over the flattened [b·s] batch (the THD / varlen-attention format)."""
    import torch

    b, s = segment_ids.shape
    new = torch.ones(b, s, dtype=torch.bool, device=segment_ids.device)
    new[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    starts = new.flatten().nonzero().flatten()
    return torch.cat([starts, starts.new_tensor([b * s])]).to(torch.int32)


__all__ = ["expand_files", "iter_documents", "TokenCache", "cache_key", "build_token_cache", "PackedDataset",
           "open_dataset", "DPSampler", "build_batches", "document_attention_mask", "cu_seqlens"]
