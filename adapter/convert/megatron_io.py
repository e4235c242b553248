"""Megatron-Core torch_dist checkpoints written and read one chunk at a time, without building a GPTModel.

The on-disk format is plain torch.distributed.checkpoint (DCP) plus Megatron's `metadata.json` and `common.pt`.
A planner hands DCP write items we describe ourselves (same keys, global shapes and per-(layer, TP rank) chunks a
tp-N `dist_checkpointing.save` of GPTModel produces) and produces each chunk only when asked for it, into one of two
reused buffers. That reuse is only safe if each chunk is written before the next is produced, which DCP's own
writer does not promise: with CUDA visible it switches to a loader that resolves items ahead of writing them (up to
`per_thread_copy_ahead` bytes), and the reused buffers then overwrote chunks still queued -- a wrong checkpoint and
no error (found on the GPU host: docs/BENCHMARKS.md, 2026-12-01, "conversion on the GPU host"). So `_SerialWriter`
owns the write loop: resolve one item, write it, then the next.

Every chunk's CRC-32 is taken from the bytes handed to the file, every chunk is read back and compared before the
directory is published, and the checksums go into nd_adapter.json, so any later load can refuse a damaged file.
Reading goes straight through the DCP index to one chunk at a time. Megatron-Core then loads the result at any TP
through its usual sharded_state_dict path (resharding by overlap).
"""
from __future__ import annotations

import io
import json
import os
import pickle
import warnings
import zlib
from argparse import Namespace
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from torch.utils.serialization import config as serialization_config

from adapter.convert.hf_io import dtype_name, pread_into
from adapter.convert.rows import contiguous_strides
from adapter.errors import UserError, bad
from adapter.models.mapping import lead
from adapter.models.source import HF_SUBDIR, META, RELEASE, TRACKER
from adapter.patches.dcp import DEFAULT_SUFFIX, create_file_view, storage_info

FORMAT = "nd-adapter/megatron-torch_dist"
MCORE_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                "common_backend": "torch", "common_backend_version": 1}
CHECKSUM = "crc32"  # of each chunk's raw bytes (C order); ~7 GB/s here, against ~1 GB/s for the whole conversion


def chunk_id(key: str, offsets) -> str:
    """How nd_adapter.json names one stored chunk: `key@o0,o1,...` (its global offsets)."""
    return f"{key}@{','.join(str(int(o)) for o in offsets)}"


def tensor_crc(t: torch.Tensor) -> str:
    if not t.numel():
        return f"{0:08x}"
    return f"{zlib.crc32(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())):08x}"


@dataclass(frozen=True)
class TensorSpec:
    key: str
    shape: tuple[int, ...]        # global shape (layers first for stacked keys)
    dtype: torch.dtype
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (offsets, sizes)


def grid_chunks(shape: tuple[int, ...], stacked: int, axis: int | None, n: int) -> tuple:
    """Chunks of a tp-sharded key: one per unit of its `stacked` leading axes (a layer, or a layer's expert) x n
    equal slices of `axis` of the rest (when it divides)."""
    import itertools

    per = list(shape[stacked:])
    ax = None if axis is None or n <= 1 or per[axis] % n else axis
    slices = n if ax is not None else 1
    out = []
    for unit in itertools.product(*(range(d) for d in shape[:stacked])):
        for s in range(slices):
            off, size = [0] * len(per), list(per)
            if ax is not None:
                size[ax] = per[ax] // n
                off[ax] = s * size[ax]
            out.append((unit + tuple(off), (1,) * stacked + tuple(size)))
    return tuple(out)


class _StreamingPlanner(DefaultSavePlanner):
    """Describes write items itself and produces each chunk lazily (DCP's writer resolves items serially)."""

    def __init__(self, specs: list[TensorSpec], objects: dict[str, bytes],
                 produce: Callable[[str, tuple[int, ...], tuple[int, ...]], torch.Tensor]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.specs, self.objects, self.produce = specs, objects, produce
        self.sizes = {(s.key, off): size for s in specs for off, size in s.chunks}
        self.error: BaseException | None = None  # DCP wraps everything (even Ctrl-C) in CheckpointException

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.objects]
        for s in self.specs:
            props = TensorProperties(dtype=s.dtype)
            for off, size in s.chunks:
                items.append(WriteItem(
                    index=MetadataIndex(s.key, torch.Size(off)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(size)),
                                                properties=props, size=torch.Size(s.shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, item: WriteItem):
        key = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.objects[key])
        off = tuple(item.index.offset)
        try:
            t = self.produce(key, off, self.sizes[(key, off)])
        except BaseException as e:
            self.error = e
            raise
        if tuple(t.shape) != self.sizes[(key, off)]:
            raise AssertionError(f"{key}@{off}: produced {tuple(t.shape)}, planned {self.sizes[(key, off)]}")
        return t


class _SerialWriter(FileSystemWriter):
    """DCP's FileSystemWriter with a write loop that writes each item to the file before resolving the next.

    Same on-disk format as DCP's single file per rank (torch.save blobs back to back, indexed by `.metadata`), so
    Megatron and DCP read it as their own. The order is the plan's, whatever the torch version or device. Records the
    CRC-32 of every tensor chunk as it is written (`self.checksums`, by `chunk_id`)."""

    def __init__(self, path: Path):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        self.checksums: dict[str, str] = {}

    def write_data(self, plan: SavePlan, planner) -> Future:
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results = []
        with open(Path(self.path) / name, "wb") as f:
            for item in plan.items:
                data = planner.resolve_data(item)
                offset = f.tell()
                if item.type == WriteItemType.BYTE_IO:
                    f.write(data.getbuffer())
                else:
                    t = data.detach()
                    if t.untyped_storage().nbytes() != t.nbytes:  # torch.save writes whole storages
                        t = t.clone()
                    self.checksums[chunk_id(item.index.fqn, item.index.offset)] = tensor_crc(t)
                    torch.save(t, f)
                length = f.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=storage_info(name, offset, length)))
            f.flush()
            os.fsync(f.fileno())
        done: Future = Future()
        done.set_result(results)
        return done


def write_dist_checkpoint(ckpt_dir: Path, specs: list[TensorSpec], objects: dict[str, object],
                          produce: Callable, common: dict) -> dict[str, str]:
    """Write a torch_dist checkpoint dir (metadata.json last, as Megatron does, so it marks completeness), read every
    chunk back and compare it with what was written. Returns the chunks' checksums (by `chunk_id`)."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    blobs = {}
    for key, value in objects.items():
        buf = io.BytesIO()
        torch.save([value], buf)  # Megatron stores the list of a ShardedObject's local replicas
        blobs[key] = buf.getvalue()
    torch.save(common, ckpt_dir / "common.pt")
    planner = _StreamingPlanner(specs, blobs, produce)
    writer = _SerialWriter(ckpt_dir)
    crc = _crc32_enabled()
    torch.serialization.set_crc32_options(False)  # zip CRC runs at ~0.6 GB/s, 10x the write; torch.load skips it
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
            dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
    except BaseException:  # CheckpointException derives from BaseException
        if planner.error is not None:  # the user's Ctrl-C or a UserError, not DCP's wrapper
            raise planner.error.with_traceback(planner.error.__traceback__) from None
        raise
    finally:
        torch.serialization.set_crc32_options(crc)
    want = {chunk_id(s.key, off) for s in specs for off, _ in s.chunks}
    if set(writer.checksums) != want:
        missing = sorted(want - set(writer.checksums))[:1] or sorted(set(writer.checksums) - want)[:1]
        raise RuntimeError(f"the checkpoint writer wrote a different set of chunks than planned (e.g. {missing})")
    bad_chunk = DistCheckpointReader(ckpt_dir).first_mismatch(writer.checksums)
    if bad_chunk is not None:
        raise bad("out", str(ckpt_dir.parent), f"chunk {bad_chunk} read back differs from what was written; nothing "
                  "was published", "re-run the conversion; if it repeats, check the disk and report it")
    (ckpt_dir / "metadata.json").write_text(json.dumps(MCORE_CONFIG))
    return writer.checksums


def _crc32_enabled() -> bool:
    return bool(serialization_config.save.compute_crc32)


_STORAGE_DTYPES = {"BFloat16Storage": torch.bfloat16, "HalfStorage": torch.float16, "FloatStorage": torch.float32,
                   "DoubleStorage": torch.float64, "LongStorage": torch.int64, "IntStorage": torch.int32,
                   "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
                   "BoolStorage": torch.bool}


class _Layout(pickle.Unpickler):
    """Reads a torch.save pickle's tensor layout without touching its storage (only the classes a tensor uses)."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (storage, offset, tuple(size), tuple(stride))
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        return pid  # ('storage', storage class, key, location, numel)


class DistCheckpointReader:
    """Rows of a torch_dist checkpoint's tensors, read with positioned I/O straight from each chunk's bytes."""

    def __init__(self, ckpt_dir: str | Path):
        self.dir = Path(ckpt_dir)
        if not (self.dir / ".metadata").exists():
            raise bad("megatron", str(self.dir), "no torch_dist checkpoint here (.metadata missing)",
                      "point --megatron at a directory written by `nd-adapter convert hf-to-megatron`")
        self.md = FileSystemReader(str(self.dir)).read_metadata()
        self._raw: dict[tuple, tuple[Path, int] | None] = {}

    def keys(self) -> list[str]:
        return [k for k, v in self.md.state_dict_metadata.items() if not isinstance(v, BytesStorageMetadata)]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.md.state_dict_metadata[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.md.state_dict_metadata[key].properties.dtype

    def _locate(self, key: str, ch) -> tuple[Path, int] | None:
        """(file, byte offset) of a chunk's raw C-contiguous data, or None if it is stored any other way."""
        k = (key, tuple(ch.offsets))
        if k not in self._raw:
            info = self.md.storage_data[MetadataIndex(key, ch.offsets)]
            path, found = self.dir / info.relative_path, None
            if not getattr(info, "transform_descriptors", None):
                try:
                    with open(path, "rb") as f:
                        zr = torch._C.PyTorchFileReader(create_file_view(f, info.offset, info.length))
                        pid, offset, size, stride = _Layout(io.BytesIO(zr.get_record("data.pkl"))).load()
                        want = tuple(ch.sizes)
                        if (pid[1] == self.dtype(key) and offset == 0 and size == want
                                and stride == contiguous_strides(want)
                                and zr.get_record_size(f"data/{pid[2]}") == torch.Size(want).numel() * pid[1].itemsize):
                            found = (path, info.offset + zr.get_record_offset(f"data/{pid[2]}"))
                except Exception:  # noqa: BLE001 - anything unusual takes the torch.load path below
                    found = None
            self._raw[k] = found
        return self._raw[k]

    def _chunk_rows(self, key: str, ch, row_lo: int, row_hi: int, lead: tuple[int, ...]) -> torch.Tensor:
        """Rows [row_lo, row_hi) (chunk-local, under the fixed leading indices `lead`) of one stored chunk."""
        sizes = tuple(ch.sizes)
        inner = sizes[len(lead) + 1:]
        out = torch.empty((row_hi - row_lo, *inner), dtype=self.dtype(key))
        raw = self._locate(key, ch)
        if raw is None:
            info = self.md.storage_data[MetadataIndex(key, ch.offsets)]
            with open(self.dir / info.relative_path, "rb") as f:
                t = torch.load(create_file_view(f, info.offset, info.length), map_location="cpu", weights_only=True)
            return out.copy_(t[lead][row_lo:row_hi])
        strides = contiguous_strides(sizes)
        first = sum(i * s for i, s in zip(lead + (row_lo,), strides))
        pread_into(raw[0], raw[1] + first * out.element_size(), out, key, key="megatron")
        return out

    def read_rows(self, key: str, unit, row0: int, n: int, out: torch.Tensor) -> torch.Tensor:
        """Rows [row0, row0+n) of `key` (of one stacked unit: a layer, or a (layer, expert) pair) into contiguous
        `out` (cast if dtypes differ)."""
        meta = self.md.state_dict_metadata[key]
        at = lead(unit)
        full = tuple(meta.size)[len(at):]
        covered = 0
        for ch in meta.chunks:
            off, size = tuple(ch.offsets), tuple(ch.sizes)
            if not all(o <= u < o + z for u, o, z in zip(at, off, size)):
                continue
            o, s = off[len(at):], size[len(at):]
            lo, hi = max(row0, o[0]), min(row0 + n, o[0] + s[0])
            if lo >= hi:
                continue
            local_lead = tuple(u - o for u, o in zip(at, off))
            dst = out[lo - row0:hi - row0]
            if all(a == 0 and b == f for a, b, f in zip(o[1:], s[1:], full[1:])) and dst.dtype == self.dtype(key):
                raw = self._locate(key, ch)
                if raw is not None:  # whole rows: read straight into the destination
                    strides = contiguous_strides(size)
                    first = sum(i * st for i, st in zip(local_lead + (lo - o[0],), strides))
                    pread_into(raw[0], raw[1] + first * dst.element_size(), dst, key, key="megatron")
                    covered += dst.numel()
                    continue
            block = self._chunk_rows(key, ch, lo - o[0], hi - o[0], local_lead)
            dst[(slice(None), *(slice(a, a + b) for a, b in zip(o[1:], s[1:])))] = block
            covered += block.numel()
        if covered != out.numel():
            raise bad("megatron", str(self.dir), f"chunks of {key} do not cover it", "the checkpoint is incomplete")
        return out

    def read(self, key: str, unit=None) -> torch.Tensor:
        meta = self.md.state_dict_metadata[key]
        shape = tuple(meta.size)[len(lead(unit)):]
        return self.read_rows(key, unit, 0, shape[0], torch.empty(shape, dtype=meta.properties.dtype))

    def chunks(self) -> list[tuple[str, object]]:
        """Every stored tensor chunk, (key, ChunkStorageMetadata), in index order."""
        return [(k, ch) for k in self.keys() for ch in self.md.state_dict_metadata[k].chunks]

    def chunk(self, key: str, ch) -> torch.Tensor:
        """One stored chunk, as written (its own shape and dtype)."""
        out = torch.empty(tuple(ch.sizes), dtype=self.dtype(key))
        raw = self._locate(key, ch)
        if raw is not None:
            pread_into(raw[0], raw[1], out, key, key="megatron")
            return out
        info = self.md.storage_data[MetadataIndex(key, ch.offsets)]
        with open(self.dir / info.relative_path, "rb") as f:
            return out.copy_(torch.load(create_file_view(f, info.offset, info.length), map_location="cpu",
                                        weights_only=True))

    def first_mismatch(self, checksums: dict[str, str], only: set[str] | None = None) -> str | None:
        """The first chunk (`chunk_id`) whose bytes on disk do not hash to `checksums` (absent counts), else None.
        `only` restricts the check to those chunk ids (ranks split the work)."""
        stored = {chunk_id(k, ch.offsets): (k, ch) for k, ch in self.chunks()}
        for cid in sorted(checksums):
            if only is not None and cid not in only:
                continue
            if cid not in stored:
                return cid
            try:
                got = tensor_crc(self.chunk(*stored[cid]))
            except Exception:  # noqa: BLE001 - unreadable bytes are damage too
                return cid
            if got != checksums[cid]:
                return cid
        return None


def resolve_ckpt_dir(root: str | Path) -> Path:
    """The torch_dist dir of a Megatron-LM style root (tracker -> release/ or iter_N/), or the dir itself."""
    root = Path(root)
    if (root / "metadata.json").exists() and (root / ".metadata").exists():
        return root
    tracker = root / TRACKER
    if not tracker.exists():
        raise bad("megatron", str(root), f"no {TRACKER} and no torch_dist checkpoint here",
                  "point at a directory written by `nd-adapter convert hf-to-megatron` (or a Megatron-LM save dir)")
    tag = tracker.read_text().strip()
    sub = root / (RELEASE if tag == RELEASE else f"iter_{int(tag):07d}" if tag.isdigit() else tag)
    if not (sub / "metadata.json").exists():
        raise bad("megatron", str(sub), "the tracker points at an incomplete checkpoint (metadata.json missing)",
                  "re-run the conversion; an interrupted one never leaves a complete-looking directory")
    return sub


def check_checksums(root: str | Path, meta: dict, *, rank: int = 0, world: int = 1, key: str = "megatron") -> bool:
    """Refuse a converted checkpoint whose chunks no longer match the checksums recorded when it was written
    (UserError naming the chunk). Rank `rank` of `world` checks its share only; the caller combines the answers.
    Returns False when the checkpoint records no checksums (converted before nd-adapter recorded them)."""
    sums = (meta.get("checksums") or {}).get("chunks")
    if not sums:
        return False
    ids = sorted(sums)[rank::world]
    bad_chunk = DistCheckpointReader(resolve_ckpt_dir(root)).first_mismatch(sums, only=set(ids))
    if bad_chunk is not None:
        raise damaged(root, bad_chunk, key)
    return True


class DamagedCheckpoint(UserError):
    """A converted checkpoint whose bytes no longer match its recorded checksums (the weights cache rebuilds it)."""


def damaged(root: str | Path, chunk: str, key: str = "megatron") -> Exception:
    err = bad(key, str(root), f"tensor chunk {chunk} does not match the checksum recorded when it was written "
              "(the file was damaged or changed after conversion)",
              "re-convert it with `nd-adapter convert hf-to-megatron` (or restore an intact copy)")
    return DamagedCheckpoint(str(err))


NO_CHECKSUMS = ("records no checksums: it was converted by an nd-adapter whose writer could silently corrupt "
                "checkpoints on machines with CUDA; check it with `nd-adapter convert verify` or re-convert")


def read_meta(root: str | Path) -> dict:
    p = Path(root) / META
    if not p.exists():
        raise bad("megatron", str(root), f"no {META} beside the checkpoint",
                  "convert with `nd-adapter convert hf-to-megatron`, which records architecture and vocab there")
    return json.loads(p.read_text())


def converted_meta(arch, *, padded_vocab: int, vocab_divisible_by: int, dtype: torch.dtype, source_tp: int) -> dict:
    """nd_adapter.json of a converted checkpoint (the converter's and training's export write the same document);
    `checksums` and `hf_files` are added by the writer."""
    return {"format": FORMAT, "format_version": 1, "family": arch.family, "architecture": arch.architecture,
            "vocab_size": arch.vocab_size, "padded_vocab_size": padded_vocab, "vocab_divisible_by": vocab_divisible_by,
            "dtype": dtype_name(dtype), "source_tp": source_tp, "tag": RELEASE,
            "hf_subdir": HF_SUBDIR, "arch": arch.to_dict()}


def megatron_lm_args(arch, meta: dict) -> Namespace:
    """The `args` Megatron-LM reads from common.pt (tp/pp on load; the rest for --use-checkpoint-args). What its
    arguments cannot say (Gemma's sandwich norms, scaled embeddings, soft-caps, per-layer windows and RoPE bases) is
    in nd_adapter.json's arch."""
    dt = meta["dtype"]
    return Namespace(
        tensor_model_parallel_size=meta["source_tp"], pipeline_model_parallel_size=1, ckpt_format="torch_dist",
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_kv_heads,
        group_query_attention=arch.num_kv_heads != arch.num_heads, kv_channels=arch.head_dim,
        max_position_embeddings=arch.max_position_embeddings, position_embedding_type="rope",
        rotary_base=int(arch.rope_theta), rotary_interleaved=arch.rotary_interleaved,
        rotary_percent=arch.rotary_fraction,
        use_rope_scaling=arch.rope_scaling_factor is not None, rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        normalization="RMSNorm", norm_epsilon=arch.norm_eps, swiglu=arch.activation == "silu",
        apply_layernorm_1p=arch.norm_offset, add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm,
        untie_embeddings_and_output_weights=not arch.tie_embeddings,
        padded_vocab_size=meta["padded_vocab_size"], make_vocab_size_divisible_by=meta["vocab_divisible_by"],
        bf16=dt == "bfloat16", fp16=dt == "float16", iteration=0, consumed_train_samples=0,
        num_experts=arch.num_experts, moe_router_topk=arch.experts_per_token or 2,
        moe_ffn_hidden_size=arch.expert_ffn_hidden_size, moe_router_pre_softmax=arch.moe and not arch.norm_topk_prob,
    )


def write_tracker(root: Path) -> None:
    (root / TRACKER).write_text(RELEASE)


def fsync_tree(root: Path) -> None:
    """Flush small files (json, common.pt) before the final rename makes the directory visible."""
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
