"""Documents -> one token stream on disk, built once by one rank and published by a directory rename.

Each document is tokenised with the checkpoint's own tokenizer, special tokens as that tokenizer adds them (e.g.
Llama's BOS), then EOS once per document. Restarts and the other ranks never re-tokenise and never see half a
cache. Its name hashes the files (path, size, mtime), `text_key` and the tokenizer files: editing any of them
builds a new cache.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from adapter.data.documents import expand_files, iter_documents
from adapter.errors import bad
from adapter.osutil import build_once

CACHE_VERSION = 1  # bump when tokenisation or file layout changes: old caches are then simply not found
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json")


class TokenCache(NamedTuple):
    tokens: np.ndarray       # uint32 memmap, all documents back to back
    doc_offsets: np.ndarray  # int64 [n_docs + 1]: document d is tokens[offsets[d]:offsets[d+1]]
    path: Path


def cache_key(files: Sequence[Path], tokenizer_dir: str | Path, text_key: str, tokens: Sequence[str] = ()) -> str:
    """Cheap (stat + tokenizer files only), so every rank computes it without loading anything. `tokens`: added
    to the tokenizer (data.tokens), so they count too."""
    tok = Path(tokenizer_dir)
    tok_files = [tok / n for n in TOKENIZER_FILES if (tok / n).is_file()]
    if not tok_files:
        raise bad("model", str(tok), "no tokenizer files there (tokenizer.json, tokenizer.model, ...)",
                  "point `model` at an HF checkpoint directory that includes its tokenizer")
    doc = {"v": CACHE_VERSION, "text_key": text_key, "files": [
        (str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]}
    if tokens:  # only when set: caches built before the key existed keep their names
        doc["tokens"] = list(tokens)
    h = hashlib.sha256(json.dumps(doc).encode())
    for f in tok_files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:20]


def _open_cache(d: Path) -> TokenCache:
    offsets = np.load(d / "doc_offsets.npy")
    return TokenCache(np.memmap(d / "tokens.u32", dtype=np.uint32, mode="r", shape=(int(offsets[-1]),)), offsets, d)


def _tokenize_into(d: Path, files: Sequence[Path], tokenizer_dir: str | Path, text_key: str, progress: bool,
                   tokens: Sequence[str] = ()) -> dict:
    from tokenizers import AddedToken
    from transformers import AutoTokenizer  # heavy: only where the cache is built (adapter/data/__init__.py)

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if tokens:  # as Axolotl's tokenizer loader adds them (adapter/models/vocab.py)
        tok.add_tokens([AddedToken(t, rstrip=False, lstrip=False, normalized=False) for t in tokens])
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
                      progress: bool = True, tokens: Sequence[str] = ()) -> TokenCache:
    """Return the token cache for these files, building it on the `builder` rank if missing.

    Every rank must call this with the same arguments; `barrier`, when given, is called exactly once on each
    (after the builder finished), so pass torch.distributed.barrier or a group's barrier. Pick the builder as global
    rank 0 for a shared `cache_dir`, or local rank 0 per node for node-local disks. A data error found by the
    builder is raised on every rank, not only on the builder. `tokens`: added to the tokenizer first (data.tokens).
    """
    paths = expand_files(files)
    root = Path(cache_dir)
    key = cache_key(paths, tokenizer_dir, text_key, tokens)
    final = build_once(root, f"tokens-{key}",
                       lambda tmp: _tokenize_into(tmp, paths, tokenizer_dir, text_key, progress, tokens),
                       builder=builder, barrier=barrier,
                       unseen=("data.cache_dir", "the token cache", "put data.cache_dir on storage shared with the "
                               "builder rank, or build with local rank 0 per node"))
    return _open_cache(final)
