"""Streamed HF checkpoint I/O: one tensor in memory at a time.

Safetensors are read and written with plain positioned file I/O rather than safe_open's mmap, because touched mmap
pages count towards RSS and a 5 GB shard would blow the memory bound. Every header is validated up front (missing
shard, truncated file, index pointing at absent tensors) so a bad input fails before any output exists.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from adapter.errors import UserError, bad

ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")
SAFE_INDEX, BIN_INDEX = "model.safetensors.index.json", "pytorch_model.bin.index.json"
DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
               "fp32": torch.float32, "float32": torch.float32}


def parse_dtype(name: str | torch.dtype | None, key: str = "dtype") -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    if str(name).lower() not in DTYPE_NAMES:
        raise bad(key, name, "unknown dtype", "use bf16, fp16 or fp32")
    return DTYPE_NAMES[str(name).lower()]


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def parse_size(text: str | int, key: str = "shard_size") -> int:
    """'5GB' / '500MB' / bytes -> bytes (HF's decimal units)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    for u, m in units.items():
        if s.endswith(u):
            try:
                n = float(s[: -len(u)])
            except ValueError:
                break
            if n > 0:
                return int(n * m)
            break
    else:
        if s.isdigit() and int(s) > 0:
            return int(s)
    raise bad(key, text, "not a size", "write it like 5GB, 500MB or a byte count")


def _read_header(path: Path) -> tuple[dict, int]:
    """Safetensors header and data start; refuses truncated or corrupt files by name."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise bad("hf", str(path), "truncated safetensors file (no header)", "re-download this shard")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise bad("hf", str(path), "truncated safetensors file (header cut off)", "re-download this shard")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise bad("hf", str(path), "corrupt safetensors header", "re-download this shard")
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end > size:
        raise bad("hf", str(path), f"truncated safetensors file ({size} bytes, header needs {8 + n + end})",
                  "re-download this shard")
    return header, 8 + n


# Pre-transformers-5 names of image-text checkpoints (the hub's original Gemma 3 files), read as transformers 5 reads
# them (its checkpoint conversion mapping for Gemma3ForConditionalGeneration): old prefix -> new prefix
LEGACY_PREFIXES = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                   ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))


def modern_name(name: str) -> str:
    for old, new in LEGACY_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


class HFCheckpoint:
    """Tensor names, shapes and dtypes of an HF checkpoint dir without loading it; `get` reads one tensor. Names are
    transformers 5's (`modern_name`)."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self.meta: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int]] = {}  # name -> file, dtype, shape, offset
        self._bin: dict[Path, dict[str, torch.Tensor]] = {}
        self._stored: dict[str, str] = {}  # name -> its name in a .bin file, where they differ
        files = self._weight_files()
        for path in files:
            if not path.exists():
                raise bad("hf", str(self.dir), f"missing weight shard {path.name}",
                          "download the complete checkpoint (every file the index lists)")
            if path.suffix == ".safetensors":
                header, start = _read_header(path)
                for name, v in header.items():
                    if v["dtype"] not in ST_DTYPES:
                        raise bad(name, v["dtype"], f"unsupported safetensors dtype in {path.name}",
                                  "convert the checkpoint to bf16/fp16/fp32 first")
                    self.meta[modern_name(name)] = (path, ST_DTYPES[v["dtype"]], tuple(v["shape"]),
                                                    start + v["data_offsets"][0])
            else:
                sd = self._load_bin(path)
                for name, t in sd.items():
                    self.meta[modern_name(name)] = (path, t.dtype, tuple(t.shape), -1)
                    self._stored[modern_name(name)] = name
        if self._index_map is not None:
            for name, fname in self._index_map.items():
                if modern_name(name) not in self.meta:
                    raise bad("hf", str(self.dir / fname), f"index lists {name} but the shard does not contain it",
                              "re-download the checkpoint; the index and shards disagree")

    def _weight_files(self) -> list[Path]:
        self._index_map = None
        for index in (SAFE_INDEX, BIN_INDEX):
            p = self.dir / index
            if p.exists():
                try:
                    self._index_map = dict(json.loads(p.read_text())["weight_map"])
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    raise bad("hf", str(p), "not a valid weight index (no weight_map)", "re-download the checkpoint")
                wrong = [f for f in self._index_map.values() if not isinstance(f, str) or not f]
                if wrong:
                    raise bad("hf", str(p), f"its weight_map names a weight file as {wrong[0]!r}, not a file name",
                              "re-download the checkpoint")
                return [self.dir / f for f in sorted(set(self._index_map.values()))]
        for single in ("model.safetensors", "pytorch_model.bin"):
            if (self.dir / single).exists():
                return [self.dir / single]
        found = sorted(self.dir.glob("*.safetensors"))
        if found:
            return found
        raise bad("hf", str(self.dir), "no model weights found (*.safetensors or pytorch_model*.bin)",
                  "point --hf at a complete HF checkpoint directory")

    def _load_bin(self, path: Path) -> dict[str, torch.Tensor]:
        if path not in self._bin:
            try:  # mmap: tensors are paged in on use, so memory stays bounded by what is being converted
                self._bin[path] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:  # noqa: BLE001 - any unreadable pickle is the user's file
                raise bad("hf", str(path), f"cannot read PyTorch weights ({e.__class__.__name__}: {e})",
                          "re-download this shard") from None
        return self._bin[path]

    def names(self) -> list[str]:
        return list(self.meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.meta[name][2]

    def dtype(self, name: str) -> torch.dtype:
        return self.meta[name][1]

    def get(self, name: str) -> torch.Tensor:
        t = torch.empty(self.shape(name), dtype=self.dtype(name))
        return self.read_rows(name, 0, t.shape[0], t)

    def read_rows(self, name: str, row0: int, n: int, out: torch.Tensor) -> torch.Tensor:
        """Rows [row0, row0+n) of `name` into `out` (contiguous, any float dtype: cast if it differs)."""
        path, dt, shape, offset = self.meta[name]
        if offset < 0:
            return out.copy_(self._load_bin(path)[self._stored.get(name, name)][row0:row0 + n])
        if out.dtype != dt:
            return out.copy_(self.read_rows(name, row0, n, torch.empty(out.shape, dtype=dt)))
        row_bytes = dt.itemsize * (torch.Size(shape[1:]).numel() if len(shape) > 1 else 1)
        pread_into(path, offset + row0 * row_bytes, out, name)
        return out


def read_fused_experts(hf: HFCheckpoint, rules, arch) -> int:
    """transformers 5's own layout of a mixture of experts (save_pretrained(save_original_format=False)): per layer
    `model.layers.{i}.mlp.experts.gate_up_proj` [E, 2F, h] (each expert's gate rows, then its up rows) and
    `...down_proj` [E, h, F], the router as `model.layers.{i}.mlp.gate.weight`. They are read as the per-expert
    tensors the family's table names (hub layout): expert e's gate, up and down matrices are contiguous slices of
    the fused tensors, so they stay positioned reads. Returns the layers read so."""
    if not getattr(arch, "moe", False):
        return 0
    fc1, fc2, router = (next(r for r in rules if r.per_layer and test(r)) for test in (
        lambda r: r.per_expert and len(r.hf) == 2, lambda r: r.per_expert and len(r.hf) == 1,
        lambda r: not r.per_expert and r.hf[0][0].endswith(".gate.weight")))
    fused = 0
    for i in range(arch.num_layers):
        found = False
        for name, rule in ((f"model.layers.{i}.mlp.experts.gate_up_proj", fc1),
                           (f"model.layers.{i}.mlp.experts.down_proj", fc2)):
            if name not in hf.meta:
                continue
            path, dt, shape, offset = hf.meta.pop(name)
            parts = len(rule.hf)
            if offset < 0 or len(shape) != 3 or shape[0] != arch.num_experts or shape[1] % parts:
                raise bad("hf", str(path), f"{name} has shape {list(shape)} (or is not in a safetensors file): not "
                          f"{arch.num_experts} experts' fused weights", "save the model with safetensors, or in the "
                          "hub's per-expert layout (save_pretrained's default)")
            rows = shape[1] // parts
            for e in range(shape[0]):
                for k, per_expert in enumerate(rule.hf_names((i, e))):
                    at = offset + (e * shape[1] + k * rows) * shape[2] * dt.itemsize
                    hf.meta[per_expert] = (path, dt, (rows, shape[2]), at)
            found = True
        own, modern = router.hf_names(i)[0], f"model.layers.{i}.mlp.gate.weight"
        if found and own not in hf.meta and modern in hf.meta:  # Mixtral: block_sparse_moe.gate in the hub's layout
            hf.meta[own] = hf.meta.pop(modern)
        fused += found
    return fused


def pread_into(path: Path, pos: int, out: torch.Tensor, what: str, key: str = "hf") -> None:
    """Fill contiguous `out` from file bytes at `pos` (positioned reads: no mmap pages charged to our RSS)."""
    if not out.numel():
        return
    view = memoryview(out.view(-1).view(torch.uint8).numpy())
    fd = os.open(path, os.O_RDONLY)
    try:
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], pos + got)
            if n <= 0:
                raise bad(key, str(path), f"truncated while reading {what}", "the file is damaged; re-create it")
            got += n
    finally:
        os.close(fd)


def copy_side_files(src: Path, dst: Path, config_dtype: torch.dtype | None = None) -> list[str]:
    """Copy config, generation config and tokenizer files (every top-level non-weight file); skip subdirs."""
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name.endswith(WEIGHT_SUFFIXES) or p.name.startswith("."):
            continue
        if p.name == "config.json" and config_dtype is not None:
            cfg = json.loads(p.read_text())
            cfg["dtype"] = dtype_name(config_dtype)  # transformers 5 key; older ones read torch_dtype
            if "torch_dtype" in cfg:
                cfg["torch_dtype"] = cfg["dtype"]
            (dst / p.name).write_text(json.dumps(cfg, indent=2) + "\n")
        else:
            shutil.copyfile(p, dst / p.name)
        copied.append(p.name)
    return copied


def _fsync(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def write_safetensors_sharded(out_dir: Path, items: list[tuple[str, tuple[int, ...], torch.dtype]],
                              produce: Callable[[str], Iterable[torch.Tensor]], shard_size: int,
                              on_bytes: Callable[[int], None] = lambda n: None) -> list[str]:
    """Write tensors in `items` order into HF-named shards (+ index when more than one), streaming.

    The header is computed from (name, shape, dtype) up front, so `produce(name)` may hand a tensor over in row
    blocks (any number, in order) and nothing larger than a block is ever held.
    """
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype, int]]] = [[]]
    used = 0
    for name, shape, dt in items:
        nbytes = torch.Size(shape).numel() * dt.itemsize
        if shards[-1] and used + nbytes > shard_size:
            shards.append([])
            used = 0
        shards[-1].append((name, shape, dt, nbytes))
        used += nbytes
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map, total = {}, 0
    for fname, shard in zip(files, shards):
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dt, nbytes in shard:
            header[name] = {"dtype": ST_NAMES[dt], "shape": list(shape), "data_offsets": [off, off + nbytes]}
            off += nbytes
            weight_map[name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out_dir / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name, shape, dt, nbytes in shard:
                done = 0
                for t in produce(name):
                    if t.dtype != dt or tuple(t.shape[1:]) != tuple(shape[1:]):
                        raise AssertionError(f"{name}: produced {tuple(t.shape)} {t.dtype}, planned {shape} {dt}")
                    if t.numel():
                        f.write(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))
                    done += t.nbytes
                    on_bytes(t.nbytes)
                if done != nbytes:
                    raise AssertionError(f"{name}: produced {done} bytes, planned {nbytes}")
                total += nbytes
            _fsync(f)
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return files


def unexpected_names(names: Iterable[str], expected: set[str], ignored: Iterable[str]) -> list[str]:
    ign = tuple(ignored)
    return [n for n in names if n not in expected and not n.endswith(ign)]


__all__ = ["HFCheckpoint", "write_safetensors_sharded", "copy_side_files", "parse_dtype", "parse_size", "UserError"]
