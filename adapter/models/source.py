"""Where a run's model comes from: the HF folder it reads, and the weights it starts from. Torch-free: `plan`,
preflight, training and export all ask here, so the answer cannot differ between them.

The HF folder (config.json, tokenizer, generation config) is `model.checkpoint`'s `hf/` when a converted checkpoint
names one, else `model.path` (Axolotl's `base_model`). The first weights are a converted checkpoint
(`model.checkpoint`), the HF weights in `model.path` -- converted once into a cache entry (adapter/convert/cache.py
builds it) -- or random: only when that path holds no weights (a bare config.json, as the bench configs) or
`model.init: random` says so. A cache entry is named by the checkpoint's identity: config.json and the weight index
as text, every weight and side file's name, size and mtime, the vocab padding and CACHE_VERSION; computing it reads
no weights.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapter import config
from adapter.config import RunConfig, spell
from adapter.config.values import path_problem
from adapter.errors import UserError, bad
from adapter.models import lora, vocab
from adapter.models.arch import ModelArch, NotNative, UnknownArchitecture, config_path, load_arch
from adapter.models.generic import check_loadable, scoring_class_name

# A converted checkpoint's layout (Megatron-LM's for a converted model); adapter/convert writes and reads it.
TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"  # Megatron-LM's tag for converted checkpoints (it refuses iteration 0 in the tracker)
META = "nd_adapter.json"
HF_SUBDIR = "hf"

CACHE_VERSION = 1  # bump when the conversion's output changes: old entries are then simply not found
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE = ("model.safetensors", "pytorch_model.bin")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")


def load_config(path: str | Path, **kw: Any) -> RunConfig:
    """`config.load`, with the model the file names checked first: a model nd-adapter cannot train (an unknown
    architecture, a feature it cannot reproduce) is said before any key of the file, so following the config's
    refusals one by one never ends at "unknown model architecture"."""
    model = config.model_path_of(path, kw.get("overrides"))
    if model is not None and config_path(model).is_file():
        try:  # the native reading only: the engine and remote code are the config's to decide
            load_arch(model, "megatron")
        except UnknownArchitecture:  # the transformers engine's, if transformers can load it at all
            check_loadable(json.loads(config_path(model).read_text()))
        except NotNative:
            pass  # the transformers engine's to train (resolved with the config: arch_for)
    return config.load(path, **kw)


def model_dir(path: str | Path) -> Path:
    """The directory of `model.path` (which may name its config.json)."""
    p = Path(path)
    return p.parent if p.is_file() else p


def hf_dir(cfg) -> Path:
    """The HF folder the run reads: the converted checkpoint's hf/ when it has a config.json, else model.path's."""
    ckpt = cfg.model.checkpoint
    if ckpt and (Path(ckpt) / HF_SUBDIR / "config.json").is_file():
        return Path(ckpt) / HF_SUBDIR
    return model_dir(cfg.model.path)


def dequantize_key(cfg) -> str | None:
    """`model.dequantize` as the config spells it, where on (adapter/models/prequant.py); else None."""
    return spell(cfg, "model.dequantize") if cfg.model.dequantize else None


def arch_for(cfg) -> ModelArch:
    """The architecture the run trains (from `hf_dir`), with the run's overrides of its config.json. A native family
    whose run asks what the native engine does not build (lora.check_native) trains on the transformers engine under
    `model.engine: auto`, the reason said in its engine line; `megatron` refuses it in that line."""
    engine, trust, deq = cfg.model.engine, cfg.model.trust_remote_code, dequantize_key(cfg)
    arch = load_arch(hf_dir(cfg), engine, trust, deq, cfg.model.linearized_experts)
    if arch.native:
        try:
            lora.check_native(cfg, arch)
        except NotNative as e:
            if engine != "auto":
                raise
            arch = dataclasses.replace(load_arch(hf_dir(cfg), "transformers", trust, deq, cfg.model.linearized_experts),
                                       engine_reason=f"the native engine does not reproduce it: {e}")
    return scoring(cfg, with_overrides(cfg, arch))


def scoring(cfg, arch: ModelArch) -> ModelArch:
    """A reward model's architecture (`objective: reward`): transformers' sequence-classification class of the model
    type, one label in place of the LM head; a process reward model's (`model.num_labels`): its token-classification
    class, a head of num_labels outputs with their bias; so its name, parameter count and head are the ones that
    train (the facts were read from the causal LM: adapter/models/generic.py)."""
    classes = cfg.model.num_labels
    if (cfg.objective != "reward" and classes is None) or arch.native:
        return arch
    name = scoring_class_name(arch.hf_model_type, remote=arch.remote_code, tokens=classes is not None)
    h = arch.hidden_size
    head = 0 if arch.tie_embeddings else arch.vocab_size * h
    added = h if classes is None else (h + 1) * classes
    count = None if arch.param_count is None else arch.param_count - head + added
    return dataclasses.replace(arch, architecture=name, score_head=True, score_labels=classes or 1,
                               param_count=count)


# Fields of ModelArch that must agree between the config's model and a converted checkpoint.
ARCH_KEYS = ("family", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size",
             "vocab_size", "tie_embeddings", "qkv_bias", "qk_norm")


def check_converted(cfg) -> None:
    """A converted checkpoint (`model.checkpoint`) must hold model.path's model: the run trains the checkpoint's
    architecture (`arch_for` reads its hf/) with model.path's tokenizer, so a checkpoint of another model would
    train without a word. Compared against the architecture the conversion recorded in its META."""
    ckpt = cfg.model.checkpoint
    meta = Path(ckpt) / META if ckpt else None
    if meta is None or not meta.is_file():
        return  # nothing converted there (preflight says so) or an old conversion without the record
    try:
        stored = json.loads(meta.read_text()).get("arch", {})
    except (OSError, json.JSONDecodeError, AttributeError):
        raise bad("model.checkpoint", ckpt, f"its {META} is not valid JSON", "convert the checkpoint again")
    base = with_overrides(cfg, load_arch(model_dir(cfg.model.path), cfg.model.engine, cfg.model.trust_remote_code,
                                         dequantize_key(cfg)))
    diff = [k for k in ARCH_KEYS if k in stored and stored[k] != getattr(base, k)]
    if diff:
        k = diff[0]
        raise bad("model.checkpoint", ckpt, f"does not match the model: {k} is {stored[k]} in the checkpoint, "
                  f"{getattr(base, k)} in {cfg.model.path}", "point model.path and model.checkpoint at the same model")


def with_overrides(cfg, arch: ModelArch) -> ModelArch:
    """`model.output_router_logits` over config.json's (Axolotl's model_config); refused on a dense model."""
    over = cfg.model.output_router_logits
    if over is None:
        return arch
    if not arch.moe and arch.native:
        raise bad(spell(cfg, "model.output_router_logits"), over, f"{arch.architecture} is not a mixture of experts "
                  "(no router, no load-balancing loss)", "remove the key")
    return dataclasses.replace(arch, output_router_logits=over)


_GROWTH: dict[tuple, vocab.Growth | None] = {}  # plan --search resolves one run per layout: read the tokenizer once


def growth(cfg, rows: int) -> vocab.Growth | None:
    """What `data.tokens` and new `data.special_tokens` do to a vocabulary of `rows` embedding rows (None: nothing
    asked or nothing new)."""
    specials = cfg.data.special_tokens.model_dump(exclude_none=True)
    if not cfg.data.tokens and not cfg.data.resize_vocab_to_32x and not specials:
        return None
    if not cfg.data.tokens and not cfg.data.resize_vocab_to_32x:  # special tokens alone: without a tokenizer.json
        try:  # here they may still be known ones; preparing the data reads the tokenizer and says what is wrong
            tok = tokenizer_dir(cfg)
        except UserError:
            return None
        if not (tok / "tokenizer.json").is_file():
            return None
    tok = tokenizer_dir(cfg)
    stat = (tok / "tokenizer.json").stat() if (tok / "tokenizer.json").is_file() else None
    key = (str(tok), stat and (stat.st_size, stat.st_mtime_ns), tuple(cfg.data.tokens), cfg.data.resize_vocab_to_32x,
           rows, cfg.model.mean_resizing_embeddings, cfg.source, json.dumps(specials))
    if key not in _GROWTH:
        _GROWTH[key] = vocab.growth(cfg, tok, rows)
    return _GROWTH[key]


def grown(cfg, arch: ModelArch) -> tuple[ModelArch, vocab.Growth | None]:
    """`arch` (config.json's vocabulary) with the rows `data.tokens` adds, and what they are."""
    g = growth(cfg, arch.vocab_size)
    return (dataclasses.replace(arch, vocab_size=g.new_rows) if g is not None and g.resized else arch), g


def vocab_rows(cfg) -> int:
    """The embedding rows the run trains: config.json's, grown by `data.tokens` (what token ids are checked
    against when the data is prepared)."""
    return grown(cfg, arch_for(cfg))[0].vocab_size


def tokenizer_dir(cfg) -> Path:
    """The first of (the converted checkpoint's hf/, model.path) that holds tokenizer files."""
    for cand in (Path(cfg.model.checkpoint) / HF_SUBDIR if cfg.model.checkpoint else None, model_dir(cfg.model.path)):
        if cand is not None and cand.is_dir() and (any(cand.glob("tokenizer*")) or (cand / "tekken.json").is_file()):
            return cand
    raise bad("model.path", cfg.model.path, "no tokenizer files found there (or in the checkpoint's hf/)",
              "point model.path at the HF checkpoint directory that holds the tokenizer")


def weight_files(directory: Path) -> tuple[Path | None, list[Path]]:
    """(index file or None, weight files) as HF loads them; (None, []) for a directory without weights."""
    for name in INDEXES:
        index = directory / name
        if index.is_file():
            try:
                names = set(json.loads(index.read_text())["weight_map"].values())
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError, AttributeError):
                raise bad("model.path", str(index), "not a valid weight index (no weight_map)",
                          "re-download the checkpoint")
            wrong = [s for s in names if not isinstance(s, str) or not s or path_problem(s)]
            if wrong:
                raise bad("model.path", str(index), f"its weight_map names a weight file as {wrong[0]!r}, not a file "
                          "name", "re-download the checkpoint")
            return index, [directory / s for s in sorted(names)]
    for name in SINGLE:
        if (directory / name).is_file():
            return None, [directory / name]
    return None, sorted(directory.glob("*.safetensors"))


def cache_root(cfg) -> Path:
    root = cfg.model.cache_dir or os.environ.get("ND_ADAPTER_CACHE") or "~/.cache/nd-adapter"
    return Path(root).expanduser()


def file_stat(p: Path) -> tuple[str, int, int]:
    try:
        st = p.stat()
    except FileNotFoundError:
        raise bad("model.path", str(p.parent), f"missing weight file {p.name} (the index lists it)",
                  "download the complete checkpoint")
    return p.name, st.st_size, st.st_mtime_ns


def identity(directory: Path, index: Path | None, files: list[Path], vocab_divisible_by: int) -> str:
    """The cache key: cheap (stat and two small files), so every rank and `plan` compute it without reading weights."""
    side = [p for p in sorted(directory.iterdir()) if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES)
            and not p.name.startswith(".")]
    doc = {"v": CACHE_VERSION, "config": (directory / "config.json").read_text(),
           "index": index.read_text() if index else None, "weights": [file_stat(f) for f in files],
           "side": [file_stat(p) for p in side], "vocab_divisible_by": vocab_divisible_by, "dtype": "as stored"}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def _label(directory: Path) -> str:
    """A readable entry name: the model's directory name, or `org--name` for an HF hub cache snapshot."""
    parts = directory.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        name = parts[-3].removeprefix("models--")
    else:
        name = directory.resolve().name
    return re.sub(r"[^\w.\-]+", "_", name)[:60] or "model"


def complete(entry: Path) -> bool:
    """A converted directory is published by one rename, so present means complete; damage is found by the load's
    checksums."""
    return (entry / META).is_file() and (entry / TRACKER).is_file() and (entry / RELEASE / "metadata.json").is_file()


@dataclass(frozen=True)
class WeightsSource:
    kind: str                      # "checkpoint" (model.checkpoint), "pretrained" (model.path's weights), "random"
    model_dir: str
    checkpoint: str | None = None  # the converted directory loaded: model.checkpoint or the cache entry
    cached: bool = False           # pretrained: the cache entry exists (no conversion to do)
    source_bytes: int = 0          # pretrained: bytes of HF weights (what a conversion reads and about what it writes)
    dtype: str | None = None
    reason: str = ""               # random: why
    node_local: bool = False

    @property
    def to_convert(self) -> bool:
        return self.kind == "pretrained" and not self.cached


def resolve(cfg, native: bool = True) -> WeightsSource:
    """Decide, from the config and the file system alone, which weights the run starts from. `native`: False for
    the transformers engine, which reads model.path's weights itself (no converted cache entry)."""
    m = cfg.model
    directory = model_dir(m.path)
    if m.checkpoint:
        if m.init == "random":
            raise bad("model.init", "random", f"conflicts with model.checkpoint={m.checkpoint!r}",
                      "drop one of them")
        return WeightsSource("checkpoint", str(directory), checkpoint=m.checkpoint)
    if m.init == "random":
        return WeightsSource("random", str(directory), reason="model.init: random")
    index, files = weight_files(directory)
    if not files:
        if m.init == "pretrained":
            raise bad("model.init", "pretrained", f"{directory} holds no weights (no *.safetensors or "
                      "pytorch_model*.bin, only a config)", "point model.path (base_model) at a checkpoint with its "
                      "weights, name a converted one in model.checkpoint, or set model.init: random")
        return WeightsSource("random", str(directory), reason=f"{directory} holds a config.json but no weights")
    if not native:
        return WeightsSource("pretrained", str(directory), cached=True,
                             source_bytes=sum(file_stat(f)[1] for f in files), dtype=_dtype_of(directory))
    key = identity(directory, index, files, m.vocab_divisible_by)
    entry = cache_root(cfg) / "weights" / f"{_label(directory)}-{key}"
    return WeightsSource("pretrained", str(directory), checkpoint=str(entry), cached=complete(entry),
                         source_bytes=sum(file_stat(f)[1] for f in files), dtype=_dtype_of(directory),
                         node_local=m.cache_node_local)


def _dtype_of(directory: Path) -> str | None:
    try:
        hf = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return (hf.get("dtype") or hf.get("torch_dtype")) if isinstance(hf, dict) else None


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def describe(w: WeightsSource, seed: int, native: bool = True, dequantize: bool = False) -> str:
    """The run's first line, in words: which weights it starts from (and whether it converts them first).
    `native`: False for the transformers engine, which reads the HF weights as they are (no conversion), or
    dequantized (`dequantize`: model.dequantize)."""
    if not native and w.kind == "pretrained":
        how = ("dequantized by transformers' loader into 16-bit weights that train (model.dequantize)" if dequantize
               else "read by transformers as they are")
        return (f"weights: fine-tuning from the pre-trained weights in {w.model_dir} ({gb(w.source_bytes)}"
                f"{', ' + w.dtype if w.dtype else ''}), {how}")
    if w.kind == "checkpoint":
        return f"weights: from the converted checkpoint {w.checkpoint} (model.checkpoint)"
    if w.kind == "random":
        return (f"weights: RANDOM initialisation (seed {seed}), not pre-trained weights: {w.reason}")
    what = f"the pre-trained weights in {w.model_dir} ({gb(w.source_bytes)}{', ' + w.dtype if w.dtype else ''})"
    where = f"{w.checkpoint}{' on every node' if w.node_local else ''}"
    if w.cached:
        return f"weights: fine-tuning from {what}, converted once before; reusing {where}"
    return (f"weights: fine-tuning from {what}; converting them once for Megatron-Core into {where} "
            "(later runs and every rank reuse it)")


__all__ = ["TRACKER", "RELEASE", "META", "HF_SUBDIR", "WeightsSource", "hf_dir", "dequantize_key", "arch_for",
           "tokenizer_dir", "growth", "grown", "vocab_rows",
           "model_dir", "weight_files", "cache_root", "complete", "resolve", "describe"]
