"""A `base_model` / `model.path` that names a Hugging Face hub id, resolved to its snapshot in the local HF cache.

Never downloads: clusters are often offline, and a run must not start fetching 16 GB on every rank. The lookup is
what transformers does with HF_HUB_OFFLINE=1 (huggingface_hub's `snapshot_download(..., local_files_only=True)`),
with the cache location read from the environment at call time (HF_HUB_CACHE, else HF_HOME/hub, else
~/.cache/huggingface/hub), so a test or a job script can point it elsewhere after import.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from adapter.errors import bad

# owner/name (or a bare name, as some legacy models): what the hub accepts as a repo id.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def hub_cache_dir() -> Path:
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    home = Path(env["HF_HOME"]).expanduser() if env.get("HF_HOME") else Path("~/.cache/huggingface").expanduser()
    return home / "hub"


def looks_like_hub_id(text: str) -> bool:
    return bool(_HUB_ID.match(text)) and not text.endswith((".json", ".yaml", ".yml")) and ".." not in text


def resolve_hub_id(repo_id: str, key: str = "model.path (base_model)", revision: str | None = None) -> Path:
    """The local snapshot directory of `repo_id`, or a one-line UserError naming the id and how to make it local."""
    cache = hub_cache_dir()
    fix = (f"download it where there is network (`hf download {repo_id}` with the same HF_HOME, or "
           "`huggingface-cli download`), or point it at a local checkpoint directory")
    try:
        from huggingface_hub import snapshot_download  # only for hub ids; config checks stay light
    except ImportError:
        raise bad(key, repo_id, "not a local path, and huggingface_hub (to look it up in the HF cache) is not "
                  "installed", "pip install huggingface_hub, or give a local checkpoint directory")
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=str(cache), local_files_only=True)
    except Exception:  # noqa: BLE001 - every miss (not cached, malformed id) is the user's to fix
        raise bad(key, repo_id, f"not a local directory, and not in the local Hugging Face cache ({cache})", fix)
    p = Path(path)
    if not (p / "config.json").is_file():
        raise bad(key, repo_id, f"its cached snapshot {p} has no config.json (an incomplete download)", fix)
    return p


__all__ = ["hub_cache_dir", "looks_like_hub_id", "resolve_hub_id"]
