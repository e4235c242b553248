"""HF <-> Megatron-Core conversion, verification, and loading a converted checkpoint into a GPTModel.

Everything a conversion needs is checked before the output directory is created (architecture, TP, every tensor
name and shape against config.json, files complete), then tensors stream through the mapping table one at a time.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from adapter.convert import hf_io, rows
from adapter.convert import megatron_io as mio
from adapter.convert.outdir import atomic_dir, check_target
from adapter.convert.rows import megatron_shape
from adapter.errors import UserError, bad
from adapter.models.arch import ModelArch, check_tp, load_arch, padded_vocab_size
from adapter.models.families import family
from adapter.models.mapping import EXTRA_STATE, IGNORED_HF, Ctx, Rule, Vocab, hf_shape
from adapter.osutil import free_port
from adapter.patches import dcp

FORMAT = "nd-adapter/megatron-torch_dist"
BLOCK = 256 << 20  # export reads and holds HF tensors in row blocks of at most this many bytes


def table_for(arch: ModelArch, table: Sequence[Rule] | None = None) -> list[Rule]:
    """The rules that apply to this architecture: its family's table (or `table`, for tests' negative controls)."""
    return [r for r in (family(arch.family).table if table is None else table) if r.applies(arch)]


def _hf_dir(path: str | Path) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise bad("hf", str(path), "not an HF checkpoint directory (no config.json)",
                  "point --hf at the directory holding config.json and the weights")
    return p


def _layers(rule: Rule, arch: ModelArch) -> Sequence[int | None]:
    return range(arch.num_layers) if rule.per_layer else (None,)


def _check_hf(hf: hf_io.HFCheckpoint, arch: ModelArch, rules: list[Rule], dtype: torch.dtype | None) -> dict:
    """Every tensor the table needs, with config.json's shape; nothing unmapped left over. Returns key -> dtype."""
    expected, dtypes = set(), {}
    for rule in rules:
        for layer in _layers(rule, arch):
            names = rule.hf_names(layer)
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
    extra = hf_io.unexpected_names(hf.names(), expected, ignored)
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
        self.sizes = {(s.key, off): size for s in specs for off, size in s.chunks}
        self.pool, self.staged = rows.Pool(), None
        self.builds = 0  # staged tensors built (each once per layer, however many TP chunks cut from it)
        biggest = max(s.dtype.itemsize * torch.Size(size).numel() for s in specs for _, size in s.chunks)
        for slot in ("buf0", "buf1"):
            self.pool.reserve(slot, biggest)
        self.prefetch = rows.Prefetch(list(self.sizes), self._make)

    def _fill(self, rule: Rule, layer, row0: int, out: torch.Tensor) -> None:
        sel, bounds = rows.row_map(rule, self.ctx)
        names = rule.hf_names(layer)
        for dst, part, src, n in rows.runs(sel[row0:row0 + out.shape[0]], bounds):
            if part < 0:
                out[dst:dst + n].zero_()
            else:
                self.hf.read_rows(names[part], src, n, out[dst:dst + n])

    def _make(self, item, slot: str) -> torch.Tensor:
        key, off = item
        size, rule = self.sizes[item], self.by_key[key]
        stacked = rule.per_layer
        layer = off[0] if stacked else None
        o, s = (off[1:], size[1:]) if stacked else (off, size)
        full = megatron_shape(rule, self.ctx)
        out = self.pool.tensor(slot, s, self.dtypes[key])
        if all(a == 0 and b == f for a, b, f in zip(o[1:], s[1:], full[1:])):
            self._fill(rule, layer, o[0], out)  # whole rows: straight from the files
        else:
            if self.staged is None or self.staged[0] != (key, layer):
                self.staged = None
                t = self.pool.tensor("stage", full, self.dtypes[key])
                self._fill(rule, layer, 0, t)
                self.staged, self.builds = ((key, layer), t), self.builds + 1
            out.copy_(self.staged[1][tuple(slice(a, a + b) for a, b in zip(o, s))])
        return out.unsqueeze(0) if stacked else out  # a view of the same storage: DCP writes it without a copy

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
    hf_dir = _hf_dir(hf_dir)
    arch = load_arch(hf_dir)
    check_tp(arch, tp)
    if isinstance(vocab_divisible_by, bool) or not isinstance(vocab_divisible_by, int) or vocab_divisible_by < 1:
        raise bad("vocab_divisible_by", vocab_divisible_by, "must be a positive integer", "pass e.g. 128")
    dt = hf_io.parse_dtype(dtype)
    dcp.check_version()
    target = check_target(out_dir, overwrite, (hf_dir,))
    hf = hf_io.HFCheckpoint(hf_dir)
    rules = table_for(arch, table)
    dtypes = _check_hf(hf, arch, rules, dt)
    padded = padded_vocab_size(arch.vocab_size, tp, vocab_divisible_by)
    ctx = Ctx(arch, padded, tp)

    specs = []
    for rule in rules:
        per = megatron_shape(rule, ctx)
        shape = (arch.num_layers, *per) if rule.per_layer else per
        specs.append(mio.TensorSpec(rule.megatron, shape, dtypes[rule.megatron],
                                    mio.grid_chunks(shape, rule.per_layer, rule.tp_axis, tp * rule.parts)))
    L = arch.num_layers
    objects = {f"{k}/shard_{i}_{L}": None for k in EXTRA_STATE for i in range(L)}
    meta = {"format": FORMAT, "format_version": 1, "family": arch.family, "architecture": arch.architecture,
            "vocab_size": arch.vocab_size, "padded_vocab_size": padded, "vocab_divisible_by": vocab_divisible_by,
            "dtype": hf_io.dtype_name(dtypes[rules[0].megatron]), "source_tp": tp, "tag": mio.RELEASE,
            "hf_subdir": mio.HF_SUBDIR, "arch": arch.to_dict()}
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


def _megatron_side(megatron_dir: str | Path, table: Sequence[Rule] | None, check: bool = True):
    """The converted checkpoint's metadata, architecture, reader and table, its shapes checked against hf/config.json
    and (`check`) every chunk against the checksums recorded when it was written."""
    root = Path(megatron_dir)
    meta = mio.read_meta(root)
    if check and not mio.check_checksums(root, meta):
        import warnings

        warnings.warn(f"{root} {mio.NO_CHECKSUMS}", UserWarning, stacklevel=3)
    arch = load_arch(root / meta.get("hf_subdir", mio.HF_SUBDIR))
    reader = mio.DistCheckpointReader(mio.resolve_ckpt_dir(root))
    rules = table_for(arch, table)
    ctx = Ctx(arch, meta["padded_vocab_size"], meta.get("source_tp", 1))
    for rule in rules:
        per = megatron_shape(rule, ctx)
        want = (arch.num_layers, *per) if rule.per_layer else per
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


def _hf_order(rules: list[Rule], arch: ModelArch) -> list[tuple[Rule, int | None]]:
    """HF's natural order: embeddings, then layer by layer, then final norm and head."""
    first = next(i for i, r in enumerate(rules) if r.per_layer)
    pre = [(r, None) for r in rules[:first] if not r.per_layer]
    post = [(r, None) for r in rules[first:] if not r.per_layer]
    body = [(r, i) for i in range(arch.num_layers) for r in rules if r.per_layer]
    return pre + body + post


def _export_parts(reader, rule: Rule, layer, ctx) -> list[torch.Tensor]:
    return rule.to_hf(reader.read(rule.megatron, layer), ctx)


def megatron_to_hf(megatron_dir: str | Path, out_dir: str | Path, *, dtype: str | torch.dtype | None = None,
                   shard_size: str | int = "5GB", overwrite: bool = False, progress: bool = True,
                   table: Sequence[Rule] | None = None, check: bool = True) -> Path:
    """Convert a checkpoint written by hf_to_megatron (or saved by training into the same layout) back to HF:
    sharded safetensors + index, config/tokenizer/generation files from its hf/ dir. Bit-exact when dtype is kept.
    `check=False` skips the checksum check (the training export's own just-written staging checkpoint)."""
    dt = hf_io.parse_dtype(dtype)
    size = hf_io.parse_size(shard_size)
    root, meta, arch, reader, rules, ctx = _megatron_side(megatron_dir, table, check)
    target = check_target(out_dir, overwrite, (root,))
    order = _hf_order(rules, arch)
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
        hf_io.copy_side_files(root / meta.get("hf_subdir", mio.HF_SUBDIR), tmp, dt)
        mio.fsync_tree(tmp)
    return target


def verify(hf_dir: str | Path, megatron_dir: str | Path, *, logits: bool = True, seq_len: int = 32, batch: int = 2,
           seed: int = 0, atol: float = 1e-5, table: Sequence[Rule] | None = None) -> dict:
    """Compare an HF checkpoint with a converted one: every tensor (streamed), then fp32 logits at tp=1.

    Weights are compared after the inverse transform, in the HF checkpoint's dtype (exact unless --dtype changed
    precision). Logits need both models in memory (fp32), so pass logits=False for large models on small hosts.
    """
    hf = hf_io.HFCheckpoint(_hf_dir(hf_dir))
    root, meta, arch, reader, rules, ctx = _megatron_side(megatron_dir, table)
    if dataclasses.replace(load_arch(hf_dir), torch_dtype="") != dataclasses.replace(arch, torch_dtype=""):
        raise bad("hf", str(hf_dir), "config.json differs from the one stored with the Megatron checkpoint",
                  "compare a checkpoint with the HF model it was converted from")
    tensors, worst = [], 0.0
    for rule, layer in _hf_order(rules, arch):
        for name, got in zip(rule.hf_names(layer), _export_parts(reader, rule, layer, ctx)):
            ref = hf.get(name)
            exact = got.dtype == ref.dtype and torch.equal(got, ref)
            diff = 0.0 if exact else (got.float() - ref.float()).abs().max().item()
            worst = max(worst, diff)
            tensors.append({"name": name, "exact": exact, "max_abs_diff": diff})
    report = {"tensors": len(tensors), "exact": sum(t["exact"] for t in tensors), "max_abs_weight_diff": worst,
              "mismatched": [t for t in tensors if not t["exact"]][:20]}
    if logits:
        report["max_abs_logit_diff"] = _logit_diff(Path(hf_dir), root, arch, meta, seq_len, batch, seed)
        report["atol"] = atol
    cast = meta["dtype"] != hf_io.dtype_name(hf.dtype(rules[0].hf_names(None)[0]))
    report["ok"] = (cast or report["exact"] == report["tensors"]) and \
        (not logits or report["max_abs_logit_diff"] <= atol)
    return report


def _logit_diff(hf_dir: Path, root: Path, arch: ModelArch, meta: dict, seq_len: int, batch: int, seed: int) -> float:
    """Both models in fp32 on the same tokens, on the GPU when there is one (TF32 off), else on the CPU."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from transformers import AutoModelForCausalLM

    from adapter.models.gpt import build_gpt_model, forward_logits
    from adapter.patches.mcore import install_cpu_shims

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    install_cpu_shims()
    own = not dist.is_initialized()
    if own:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(1)
        if cuda:  # Megatron's GPU init draws weights from its CUDA RNG tracker, which must be seeded first
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, arch.vocab_size, (batch, seq_len), generator=g).to(device)
        model = build_gpt_model(arch, tp=1, padded_vocab=meta["padded_vocab_size"], params_dtype=torch.float32)
        load_megatron_checkpoint(model.to(device), root)
        model.eval()
        with torch.no_grad():
            ours = forward_logits(model, tokens, vocab_size=arch.vocab_size).float()
        del model
        ref_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device)
        with torch.no_grad():
            ref = ref_model(tokens).logits.float()
        return (ours - ref).abs().max().item()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        if own:
            ps.destroy_model_parallel()
            dist.destroy_process_group()


def load_megatron_checkpoint(model, ckpt_dir: str | Path, *, strict: bool = True, check: bool = True) -> dict:
    """Load a converted (or Megatron-LM saved) torch_dist checkpoint into a GPTModel at the run's TP.

    Collective: call on every rank after parallel_state is initialised, on the plain GPTModel (before DeepSpeed
    partitions it, or inside zero.GatheredParameters). The model may pad its vocab differently from the checkpoint
    (Megatron's allow_shape_mismatch zero-fills or drops padding rows) as long as it covers the real vocab.
    Returns the checkpoint's nd_adapter.json metadata ({} for checkpoints without it). `check=False` skips the
    checksum check (the caller ran `check_checksums_collectively` already, e.g. before its data was prepared).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    root = Path(ckpt_dir)
    path = mio.resolve_ckpt_dir(root)
    meta = json.loads((root / mio.META).read_text()) if (root / mio.META).exists() else {}
    if check:
        _check_checksums_collectively(root, meta)
    if meta and getattr(model, "vocab_size", meta["vocab_size"]) < meta["vocab_size"]:
        raise bad("padded_vocab", model.vocab_size, f"smaller than the checkpoint's vocab {meta['vocab_size']}",
                  f"build the model with padded_vocab >= {meta['vocab_size']} (the converter used "
                  f"{meta['padded_vocab_size']})")
    stored = mio.DistCheckpointReader(path).md.state_dict_metadata
    sd = model.sharded_state_dict()
    for k, v in list(sd.items()):
        if isinstance(v, ShardedObject) and v.unique_key not in stored:
            del sd[k]  # e.g. TE's extra state, absent from a local-spec conversion
        elif isinstance(v, ShardedTensor) and v.key not in stored:
            raise bad("megatron", str(path), f"checkpoint lacks {v.key}, which the model has",
                      "build the model with the checkpoint's architecture (nd_adapter.json / hf/config.json)")
        elif (isinstance(v, ShardedTensor) and not v.allow_shape_mismatch
              and tuple(stored[v.key].size) != v.global_shape):
            raise bad(v.key, list(stored[v.key].size),
                      f"checkpoint shape differs from the model's {list(v.global_shape)}",
                      "build the model with the checkpoint's architecture (nd_adapter.json / hf/config.json)")
    try:
        state = dist_checkpointing.load(sd, str(path))
    except CheckpointingException as e:
        raise UserError(f"megatron={str(path)!r}: cannot load into this model ({e}). Fix: build the model with the "
                        "checkpoint's architecture") from None
    wanted = set(sd)
    state = {k: v for k, v in state.items() if k in wanted}  # drop common.pt's args / iteration
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("._extra_state")]
    if strict and (missing or unexpected):
        raise bad("megatron", str(path), f"state mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}",
                  "build the model with the checkpoint's architecture")
    return meta


def check_checksums_collectively(ckpt_dir: str | Path) -> None:
    """Collective: every rank hashes its share of a converted checkpoint's chunks; all raise together
    (`megatron_io.DamagedCheckpoint` naming the first damaged chunk)."""
    root = Path(ckpt_dir)
    meta = json.loads((root / mio.META).read_text()) if (root / mio.META).exists() else {}
    _check_checksums_collectively(root, meta)


def _check_checksums_collectively(root: Path, meta: dict) -> None:
    """Every rank hashes its share of the chunks; all ranks refuse together, naming the first damaged chunk."""
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    found: tuple[str, bool] | None = None
    try:
        recorded = mio.check_checksums(root, meta, rank=rank, world=world)
    except UserError as e:
        found, recorded = (str(e), isinstance(e, mio.DamagedCheckpoint)), True
    if world > 1:
        every: list = [None] * world
        dist.all_gather_object(every, found)
        found = next((x for x in every if x is not None), None)
    if found is not None:
        raise (mio.DamagedCheckpoint if found[1] else UserError)(found[0])
    if not recorded and meta and rank == 0:
        import warnings

        warnings.warn(f"{root} {mio.NO_CHECKSUMS}", UserWarning, stacklevel=3)


__all__ = ["hf_to_megatron", "megatron_to_hf", "verify", "load_megatron_checkpoint", "check_checksums_collectively"]
