"""Megatron-Core checkpoint -> HF checkpoint (`nd-adapter convert megatron-to-hf`; training's export goes through it).

The converted checkpoint is opened with its shapes checked against its hf/config.json (`open_converted`), then each
HF tensor is read back in row blocks through the inverted row plan and written as sharded safetensors, with the
config, tokenizer and generation files of its hf/ dir. Bit-exact when the dtype is kept.
"""
from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from adapter.convert import hf_io, rows
from adapter.convert import megatron_io as mio
from adapter.convert.outdir import atomic_dir, check_target
from adapter.convert.rows import megatron_shape
from adapter.errors import bad
from adapter.models.arch import ModelArch, load_arch
from adapter.models.families import family, table_for, text_config_json
from adapter.models.mapping import Ctx, Rule, Vocab, hf_shape

BLOCK = 256 << 20  # export reads and holds HF tensors in row blocks of at most this many bytes


def open_converted(megatron_dir: str | Path, table: Sequence[Rule] | None, check: bool = True):
    """The converted checkpoint's metadata, architecture, reader and table, its shapes checked against hf/config.json
    and (`check`) every chunk against the checksums recorded when it was written."""
    root = Path(megatron_dir)
    meta = mio.read_meta(root)
    if check and not mio.check_checksums(root, meta):
        warnings.warn(f"{root} {mio.NO_CHECKSUMS}", UserWarning, stacklevel=3)
    arch = load_arch(root / meta.get("hf_subdir", mio.HF_SUBDIR), "megatron")
    reader = mio.DistCheckpointReader(mio.resolve_ckpt_dir(root))
    rules = table_for(arch, table)
    ctx = Ctx(arch, meta["padded_vocab_size"], meta.get("source_tp", 1))
    for rule in rules:
        want = (*rule.stack(arch), *megatron_shape(rule, ctx))
        if rule.megatron not in reader.md.state_dict_metadata:
            raise bad("megatron", str(reader.dir), f"checkpoint lacks {rule.megatron}",
                      "the checkpoint does not match its hf/config.json; re-convert it")
        got = reader.shape(rule.megatron)
        if isinstance(rule, Vocab) and got[1:] == want[1:] and got[0] >= arch.vocab_size:
            continue  # any padding >= the real vocab is fine; export truncates it
        if got != want:
            raise bad(rule.megatron, list(got), f"shape disagrees with hf/config.json, which implies {list(want)}",
                      "the checkpoint and its hf/config.json do not belong together; re-convert")
    return root, meta, arch, reader, rules, ctx


def hf_order(rules: list[Rule], arch: ModelArch) -> list[tuple[Rule, object]]:
    """HF's natural order: embeddings, then layer by layer (a layer's experts one after another), then final norm
    and head. Each entry is (rule, unit): None, a layer, or (layer, expert)."""
    first = next(i for i, r in enumerate(rules) if r.per_layer)
    pre = [(r, None) for r in rules[:first] if not r.per_layer]
    post = [(r, None) for r in rules[first:] if not r.per_layer]
    body = [(r, (i, e) if r.per_expert else i) for i in range(arch.num_layers) for r in rules if r.per_layer
            for e in (range(arch.num_experts) if r.per_expert else (None,))]
    return pre + body + post


def export_parts(reader, rule: Rule, layer, ctx) -> list[torch.Tensor]:
    return rule.to_hf(reader.read(rule.megatron, layer), ctx)


def megatron_to_hf(megatron_dir: str | Path, out_dir: str | Path, *, dtype: str | torch.dtype | None = None,
                   shard_size: str | int = "5GB", overwrite: bool = False, progress: bool = True,
                   table: Sequence[Rule] | None = None, check: bool = True) -> Path:
    """Convert a checkpoint written by hf_to_megatron (or saved by training into the same layout) back to HF:
    sharded safetensors + index, config/tokenizer/generation files from its hf/ dir. Bit-exact when dtype is kept.
    `check=False` skips the checksum check (the training export's own just-written staging checkpoint)."""
    dt = hf_io.parse_dtype(dtype)
    size = hf_io.parse_size(shard_size)
    root, meta, arch, reader, rules, ctx = open_converted(megatron_dir, table, check)
    text = family(arch.family).export_as  # an image-text checkpoint's language model exports as its text model
    if text and table is None:  # same Megatron keys, the text model's HF names
        rules = table_for(arch, family(text).table)
    target = check_target(out_dir, overwrite, (root,))
    order = hf_order(rules, arch)
    where, items = {}, []
    for rule, layer in order:
        src = dt or reader.dtype(rule.megatron)
        for j, (name, (_, spec)) in enumerate(zip(rule.hf_names(layer), rule.hf)):
            where[name] = (rule, layer, j)
            items.append((name, hf_shape(spec, arch), src))
    blocks, order = {}, []
    for name, shape, d in items:  # row blocks of <= BLOCK bytes: the unit read ahead and held in memory
        row_bytes = d.itemsize * torch.Size(shape[1:]).numel()
        step = max(1, BLOCK // row_bytes)
        blocks[name] = [(r, min(r + step, shape[0])) for r in range(0, shape[0], step)]
        order += [(name, b) for b in range(len(blocks[name]))]
    inverses: dict[str, np.ndarray] = {}
    start = np.zeros(1, dtype=np.int64)
    pool = rows.Pool()

    def make(item, slot: str) -> torch.Tensor:
        """Rows of one HF tensor from runs of Megatron rows (the row plan inverted)."""
        name, b = item
        rule, layer, j = where[name]
        sel, bounds = rows.row_map(rule, ctx)
        if rule.megatron not in inverses:
            inverses[rule.megatron] = rows.inverse(sel, int(bounds[-1]))
        r0, r1 = blocks[name][b]
        mine = inverses[rule.megatron][bounds[j] + r0:bounds[j] + r1]
        shape = hf_shape(rule.hf[j][1], arch)
        out = pool.tensor(slot, (r1 - r0, *shape[1:]), dt or reader.dtype(rule.megatron))
        for dst, _, src, n in rows.runs(mine + 1, start):
            reader.read_rows(rule.megatron, layer, src, n, out[dst:dst + n])
        return out

    prefetch = rows.Prefetch(order, make)

    def produce(name: str):
        for b in range(len(blocks[name])):
            yield prefetch.get((name, b))

    total = sum(torch.Size(s).numel() * d.itemsize for _, s, d in items)
    with tqdm(total=total, unit="B", unit_scale=True, desc="megatron -> hf", disable=not progress) as bar, \
            atomic_dir(target) as tmp:
        try:
            hf_io.write_safetensors_sharded(tmp, items, produce, size, bar.update)
        finally:
            prefetch.close()
        src = root / meta.get("hf_subdir", mio.HF_SUBDIR)
        hf_io.copy_side_files(src, tmp, dt)
        if text:  # its config.json: the text model's (the vision tower is not part of the export)
            cfg = text_config_json(json.loads((tmp / "config.json").read_text()), family(arch.family))
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        mio.fsync_tree(tmp)
    return target


__all__ = ["megatron_to_hf", "open_converted", "hf_order", "export_parts"]
