"""A Hugging Face hub cache on local disk (the layout huggingface_hub writes), for hub ids without network."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path


def add_to_hub_cache(hf_home: Path, repo_id: str, src: Path, *, sparse_weights: int | None = None,
                     kind: str = "models") -> Path:
    """Put `src`'s files into HF_HOME/hub as the snapshot of `repo_id` (blobs + symlinks + refs/main), as a download
    would. `sparse_weights`: also add a sharded safetensors index whose two shards are sparse files of that many
    bytes in all (plan reads only sizes), for real-sized models. `kind="datasets"` for a dataset repo; files in
    subdirectories of `src` keep their relative paths. Returns the snapshot directory."""
    repo = hf_home / "hub" / f"{kind}--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snap, blobs = repo / "snapshots" / commit, repo / "blobs"
    snap.mkdir(parents=True, exist_ok=True)
    blobs.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)

    def link(name: str, data_from: Path | None = None, text: str | None = None, size: int | None = None) -> None:
        blob = blobs / hashlib.sha1(f"{repo_id}/{name}".encode()).hexdigest()
        if data_from is not None:
            shutil.copyfile(data_from, blob)
        elif text is not None:
            blob.write_text(text)
        else:
            with open(blob, "wb") as f:
                f.truncate(size)
        target = snap / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        os.symlink(os.path.relpath(blob, target.parent), target)

    for f in sorted(src.rglob("*")):
        if f.is_file():
            link(str(f.relative_to(src)), data_from=f)
    if sparse_weights:
        shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        index = {"metadata": {"total_size": sparse_weights}, "weight_map": {"model.embed_tokens.weight": shards[0],
                                                                           "lm_head.weight": shards[1]}}
        link("model.safetensors.index.json", text=json.dumps(index))
        for s in shards:
            link(s, size=sparse_weights // 2)
    return snap
