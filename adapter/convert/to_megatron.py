"""HF checkpoint -> Megatron-Core torch_dist checkpoint, loadable at any TP (`nd-adapter convert hf-to-megatron`).

Everything a conversion needs is checked before the output directory is created (architecture, TP, every tensor
name and shape against config.json, files complete), then each Megatron chunk is filled straight from the HF files
by its row plan (adapter/convert/rows.py) and written, read back and checksummed (adapter/convert/megatron_io.py).
Layout: OUT/latest_checkpointed_iteration.txt ("release"), OUT/release/ (torch_dist), OUT/hf/, OUT/nd_adapter.json.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from adapter.convert import hf_io, rows
from adapter.convert import megatron_io as mio
from adapter.convert.outdir import atomic_dir, check_target
from adapter.convert.rows import megatron_shape
from adapter.errors import bad
from adapter.models.arch import ModelArch, check_tp, load_arch, padded_vocab_size
from adapter.models.families import family, table_for
from adapter.models.mapping import EXTRA_STATE, IGNORED_HF, Ctx, Rule, hf_shape
from adapter.patches import dcp


def hf_checkpoint_dir(path: str | Path) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise bad("hf", str(path), "not an HF checkpoint directory (no config.json)",
                  "point --hf at the directory holding config.json and the weights")
    return p


def _check_hf(hf: hf_io.HFCheckpoint, arch: ModelArch, rules: list[Rule], dtype: torch.dtype | None) -> dict:
    """Every tensor the table needs, with config.json's shape; nothing unmapped left over. Returns key -> dtype."""
    expected, dtypes = set(), {}
    for rule in rules:
        for unit in rule.units(arch):
            names = rule.hf_names(unit)
            for name, (_, spec) in zip(names, rule.hf):
                want = hf_shape(spec, arch)
                if name not in hf.meta:
                    raise bad("hf", str(hf.dir), f"tensor {name} is missing but config.json implies it",
                              "use the config.json that belongs to these weights (or a complete checkpoint)")
                if hf.shape(name) != want:
                    raise bad(name, list(hf.shape(name)),
                              f"shape disagrees with config.json, which implies {list(want)}",
                              "use the config.json that belongs to these weights")
                expected.add(name)
            kinds = {hf.dtype(n) for n in names}
            if len(kinds) > 1 or not next(iter(kinds)).is_floating_point:
                raise bad(names[0], sorted(map(str, kinds)), "parts of one Megatron tensor need one float dtype",
                          "re-save the checkpoint in a single dtype or pass --dtype")
            dtypes[rule.megatron] = dtype or next(iter(kinds))
    ignored = IGNORED_HF + (("lm_head.weight",) if arch.tie_embeddings else ())
    skip = family(arch.family).hf_skip  # an image-text checkpoint's other towers: not converted (not trained)
    extra = hf_io.unexpected_names([n for n in hf.names() if not n.startswith(skip)], expected, ignored)
    if extra:
        raise bad("hf", extra[:3], f"{len(extra)} tensor(s) the {arch.family} mapping table does not cover",
                  "use a supported checkpoint, or add rules to its table in adapter/models/families.py")
    return dtypes


class _Producer:
    """Fills each Megatron chunk straight from the HF files by its row plan, one chunk ahead of DCP's writer.

    Chunks that cut columns (row-parallel layers) are cut from the rule's whole per-layer tensor, staged once.
    """

    def __init__(self, hf, rules, ctx, dtypes, specs, bar):
        self.hf, self.ctx, self.dtypes, self.bar = hf, ctx, dtypes, bar
        self.by_key = {r.megatron: r for r in rules}
        self.stacked = {r.megatron: len(r.stack(ctx.arch)) for r in rules}  # leading axes: layer (, expert)
        self.sizes = {(s.key, off): size for s in specs for off, size in s.chunks}
        self.pool, self.staged = rows.Pool(), None
        self.builds = 0  # staged tensors built (each once per layer, however many TP chunks cut from it)
        biggest = max(s.dtype.itemsize * torch.Size(size).numel() for s in specs for _, size in s.chunks)
        for slot in ("buf0", "buf1"):
            self.pool.reserve(slot, biggest)
        self.prefetch = rows.Prefetch(list(self.sizes), self._make)

    def _fill(self, rule: Rule, unit, row0: int, out: torch.Tensor) -> None:
        sel, bounds = rows.row_map(rule, self.ctx)
        names = rule.hf_names(unit)
        for dst, part, src, n in rows.runs(sel[row0:row0 + out.shape[0]], bounds):
            if part < 0:
                out[dst:dst + n].zero_()
            else:
                self.hf.read_rows(names[part], src, n, out[dst:dst + n])

    def _make(self, item, slot: str) -> torch.Tensor:
        key, off = item
        size, rule = self.sizes[item], self.by_key[key]
        n = self.stacked[key]
        unit = None if n == 0 else off[0] if n == 1 else tuple(off[:n])
        o, s = off[n:], size[n:]
        full = megatron_shape(rule, self.ctx)
        out = self.pool.tensor(slot, s, self.dtypes[key])
        if all(a == 0 and b == f for a, b, f in zip(o[1:], s[1:], full[1:])):
            self._fill(rule, unit, o[0], out)  # whole rows: straight from the files
        else:
            if self.staged is None or self.staged[0] != (key, unit):
                self.staged = None
                t = self.pool.tensor("stage", full, self.dtypes[key])
                self._fill(rule, unit, 0, t)
                self.staged, self.builds = ((key, unit), t), self.builds + 1
            out.copy_(self.staged[1][tuple(slice(a, a + b) for a, b in zip(o, s))])
        return out.view((1,) * n + tuple(s))  # a view of the same storage: DCP writes it without a copy

    def __call__(self, key: str, off: tuple[int, ...], size: tuple[int, ...]) -> torch.Tensor:
        t = self.prefetch.get((key, tuple(off)))
        self.bar.update(t.nbytes)
        return t


def hf_to_megatron(hf_dir: str | Path, out_dir: str | Path, tp: int = 1, *, dtype: str | torch.dtype | None = None,
                   vocab_divisible_by: int = 128, overwrite: bool = False, progress: bool = True,
                   table: Sequence[Rule] | None = None) -> Path:
    """Convert an HF checkpoint dir into a Megatron-Core torch_dist checkpoint loadable at any TP.

    `tp` sets the on-disk chunking and the vocab padding (multiple of vocab_divisible_by * tp); `dtype` None keeps
    the checkpoint's dtype. `table` overrides the architecture's mapping table (tests use it for negative controls).
    Layout: OUT/latest_checkpointed_iteration.txt ("release"), OUT/release/ (torch_dist), OUT/hf/, OUT/nd_adapter.json.
    """
    hf_dir = hf_checkpoint_dir(hf_dir)
    arch = load_arch(hf_dir, "megatron")
    check_tp(arch, tp)
    if isinstance(vocab_divisible_by, bool) or not isinstance(vocab_divisible_by, int) or vocab_divisible_by < 1:
        raise bad("vocab_divisible_by", vocab_divisible_by, "must be a positive integer", "pass e.g. 128")
    dt = hf_io.parse_dtype(dtype)
    dcp.check_version()
    target = check_target(out_dir, overwrite, (hf_dir,))
    hf = hf_io.HFCheckpoint(hf_dir)
    rules = table_for(arch, table)
    hf_io.read_fused_experts(hf, rules, arch)  # transformers 5's 3-D expert tensors, read per expert
    dtypes = _check_hf(hf, arch, rules, dt)
    padded = padded_vocab_size(arch.vocab_size, tp, vocab_divisible_by)
    ctx = Ctx(arch, padded, tp)

    specs = []
    for rule in rules:
        stack = rule.stack(arch)
        shape = (*stack, *megatron_shape(rule, ctx))
        specs.append(mio.TensorSpec(rule.megatron, shape, dtypes[rule.megatron],
                                    mio.grid_chunks(shape, len(stack), rule.tp_axis, tp * rule.parts)))
    L = arch.num_layers
    objects = {f"{k}/shard_{i}_{L}": None for k in EXTRA_STATE for i in range(L)}
    meta = mio.converted_meta(arch, padded_vocab=padded, vocab_divisible_by=vocab_divisible_by,
                              dtype=dtypes[rules[0].megatron], source_tp=tp)
    common = {"checkpoint_version": 3.0, "iteration": 0, "args": mio.megatron_lm_args(arch, meta)}
    total = sum(torch.Size(s.shape).numel() * s.dtype.itemsize for s in specs)
    with tqdm(total=total, unit="B", unit_scale=True, desc="hf -> megatron", disable=not progress) as bar, \
            atomic_dir(target) as tmp:
        produce = _Producer(hf, rules, ctx, dtypes, specs, bar)
        try:
            sums = mio.write_dist_checkpoint(tmp / mio.RELEASE, specs, objects, produce, common)
        finally:
            produce.prefetch.close()
        meta["checksums"] = {"algorithm": mio.CHECKSUM, "chunks": sums}
        meta["hf_files"] = hf_io.copy_side_files(hf_dir, tmp / mio.HF_SUBDIR, dt)
        (tmp / mio.META).write_text(json.dumps(meta, indent=2) + "\n")
        mio.write_tracker(tmp)
        mio.fsync_tree(tmp)
    return target


__all__ = ["hf_to_megatron", "hf_checkpoint_dir"]
