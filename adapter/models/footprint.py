"""What a run holds, trains and writes (torch-free, config × architecture): parameters held and trained per TP rank,
the 4/8-bit base, the size of a checkpoint and of the final export, and whether the configured retention fits the
disk. `plan` prints these; the trainer checks the disk with them before its first step (a run on the GPU host
died at step 15 inside torch.save with a traceback, after choosing to keep four 15 GB checkpoints on a 64 GB
disk)."""
from __future__ import annotations

import shutil
from pathlib import Path

from adapter.config import RunConfig, spell
from adapter.errors import bad
from adapter.models import freeze, lora
from adapter.models.arch import padded_vocab_size
from adapter.models.counts import local_params, num_params
from adapter.models.resolved import ResolvedRun

# AdamW's two moments, bytes per parameter: fp32, or 8-bit codes with one fp32 absmax per block of 256 (bitsandbytes'
# AdamW8bit, adapter/train/optim.py), or 4-bit codes (two a byte) with one fp32 scale per block of 256 (torchao's
# AdamW4bit, adapter/train/optim_4bit.py); tensors under 4096 elements, and the rest of a ZeRO partition past its
# whole 4-bit blocks (under 256 elements), keep fp32 moments, not counted here
STATE_BYTES = {"adamw": 8, "adamw_8bit": 2 + 2 * 4 / 256, "adamw_4bit": 1 + 2 * 4 / 256}
GB = 1e9
FREQUENT_SAVES, LARGE_CHECKPOINT = 100, 10 * GB  # cadence_warning's thresholds: steps between saves, bytes


def optimizer_bytes(cfg: RunConfig, zero12: bool = False) -> float:
    """Bytes the optimizer keeps per trained parameter: a 16-bit weight's fp32 master and AdamW's two moments
    (`optimizer.state_dtype: bf16`: no master, bf16 moments; `zero12`: under DeepSpeed's ZeRO-1/2, whose bf16 master
    partition is a copy of the weights' (ZeRO-3's is the weights' partition itself))."""
    if cfg.optimizer.state_dtype == "bf16":
        return 6 if zero12 else 4
    return (4 if cfg.param_precision in ("bf16", "fp16") else 0) + STATE_BYTES[cfg.optimizer.name]


def held_and_trained(run: ResolvedRun, tp: int) -> tuple[int, int]:
    """(parameters one TP rank holds, those it trains): the one view of adapters and freezing (plan's memory,
    traffic and step time; the checkpoint sizes here). A LoRA run holds its frozen base, the adapters and (for a tied
    model whose embedding or LM head is trained) the untied copy, and trains the adapters and modules_to_save;
    `unfrozen_parameters` trains what its patterns match."""
    cfg, arch, spec = run.cfg, run.arch, run.lora
    vdb = cfg.model.vocab_divisible_by
    lp = local_params(arch, tp, vdb)
    held = lp.total(arch.num_layers)
    if spec is not None:
        untied = lp.embedding if spec.modules_to_save and arch.tie_embeddings else 0
        return (held + spec.params(tp) + untied,
                lora.trained_params(spec, arch, tp, padded_vocab_size(arch.vocab_size, tp, vdb)))
    if run.peft is not None:  # the transformers engine's adapters: counted on the meta model (tp = 1)
        return held + run.peft.added, run.peft.trained
    if run.unfrozen is not None:
        return held, freeze.trained_local(run.unfrozen, arch, tp, vocab_divisible_by=vdb)
    return held, held


def quantized_base(run: ResolvedRun, tp: int) -> tuple[int, float, int]:
    """(decoder-linear weights one TP rank holds quantised, bytes each, the largest one linear's local count) for a
    LoRA run on a 4- or 8-bit base (adapter/modeling/quant.py); (0, 0, 0) otherwise. Those weights are buffers:
    neither ZeRO-sharded nor gathered, and dequantised one linear at a time. On the transformers engine they are
    bitsandbytes' parameters, which ZeRO-3 partitions (adapter/plan/memory.py)."""
    spec, arch = run.lora, run.arch
    if run.peft is not None and run.peft.quantize_base:  # the transformers engine (no tp with a 4/8-bit base there)
        total, largest = run.peft.linears
        return total, lora.BASE_FORMATS[run.peft.quantize_base][0], largest
    if spec is None or not spec.quantize_base:
        return 0, 0.0, 0
    per_layer = [lin.weights // tp for lin in lora.nn_linears(arch)]
    return arch.num_layers * sum(per_layer), lora.BASE_FORMATS[spec.quantize_base][0], max(per_layer)


def saves(total_steps: int, every: int) -> int:
    """Checkpoints a run of `total_steps` writes saving every `every` steps (0: only at the end), the end included."""
    return (total_steps // every if every else 0) + (1 if not every or total_steps % every else 0)


def checkpoint_bytes(run: ResolvedRun, stage: int) -> int:
    """Bytes one checkpoint writes, all ranks together (exact HSDP's replicas write one copy): the fp32 master
    weights and AdamW's moments of what is trained, and the 16-bit weights DeepSpeed stores beside them (ZeRO-1/2
    and the flat AdamW: every held weight; ZeRO-3: its partitions live in the optimizer's files; a LoRA run: only
    what it trains, its base comes from the converted weights again)."""
    cfg = run.cfg
    held, trained = held_and_trained(run, 1)
    held -= quantized_base(run, 1)[0]  # buffers: not in the module's state
    half = cfg.param_precision in ("bf16", "fp16")
    pb = 2 if half else 4
    weights = pb * trained if run.adapters else (0 if stage == 3 else pb * held)
    return int(weights + optimizer_bytes(cfg) * trained)


def export_bytes(run: ResolvedRun) -> int:
    """The final export: the HF model in the training dtype, or a LoRA run's PEFT adapter."""
    cfg = run.cfg
    if not cfg.checkpoint.export_hf:
        return 0
    pb = 2 if cfg.param_precision in ("bf16", "fp16") else 4
    return pb * (held_and_trained(run, 1)[1] if run.adapters else num_params(run.arch))


def _existing_dir(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(run: ResolvedRun, *, stage: int, saves: int, existing: int = 0,
               free: int | None = None, refuse: bool = True) -> str | None:
    """The line the first lines say about the checkpoints' disk use; a one-line refusal (UserError) when the
    retention cannot fit the free space of `checkpoint.dir`. `saves`: checkpoints the run will write; `existing`:
    those already in the directory (counted in the used space, pruned as the run goes). `refuse=False` (plan): the
    line says that they will not fit instead. A run without checkpoints (Axolotl's save_strategy: no) still checks
    its export."""
    cfg = run.cfg
    c = cfg.checkpoint
    if not c.dir or saves < 1:
        return _check_export(run, free=free, refuse=refuse)
    size = checkpoint_bytes(run, stage)
    at_once = min(saves + existing, c.keep_last + 1)  # a new one is written before the oldest is pruned
    need = max(1, at_once - existing) * size + export_bytes(run)
    free = shutil.disk_usage(_existing_dir(Path(c.dir))).free if free is None else free
    said = (f"checkpoints: {size / GB:.1f} GB each, up to {at_once} at once "
            f"({spell(cfg, 'checkpoint.keep_last')}={c.keep_last} + the one being written); {need / GB:.1f} GB "
            f"needed with the export, {free / GB:.1f} GB free in {c.dir}")
    if need > free and not refuse:  # plan: said as a warning
        return f"{said}: the checkpoints will NOT fit"
    if need > free and at_once - existing <= 1:  # one checkpoint already too large: the retention is not the cause
        raise bad(spell(cfg, "checkpoint.dir"), c.dir, f"the run's checkpoint will not fit: {said}",
                  f"point {spell(cfg, 'checkpoint.dir')} at a larger disk, or free space there")
    if need > free:
        raise bad(spell(cfg, "checkpoint.keep_last"), c.keep_last, f"the run's checkpoints will not fit: {said}",
                  f"lower {spell(cfg, 'checkpoint.keep_last')}, save less often ({spell(cfg, 'checkpoint.save_every')}"
                  f" / {spell(cfg, 'checkpoint.saves_per_epoch')}), or point {spell(cfg, 'checkpoint.dir')} at a "
                  "larger disk")
    return said


def _check_export(run: ResolvedRun, *, free: int | None, refuse: bool) -> str | None:
    """The export alone (no checkpoints): one line, or a refusal naming the export's key when it cannot fit."""
    cfg = run.cfg
    out, need = cfg.checkpoint.export_hf, export_bytes(run)
    if not out or not need:
        return None
    free = shutil.disk_usage(_existing_dir(Path(out))).free if free is None else free
    said = f"export: {need / GB:.1f} GB at the end, {free / GB:.1f} GB free in {out}"
    if need > free and not refuse:
        return f"{said}: it will NOT fit"
    if need > free:
        key = spell(cfg, "checkpoint.export_hf")
        raise bad(key, out, f"the trained model will not fit: {said}", f"point {key} at a larger disk")
    return said


def cadence_warning(run: ResolvedRun, *, stage: int, every: int) -> str | None:
    """A save every few steps of a large checkpoint spends much of the run writing: said in the first lines."""
    cfg = run.cfg
    size = checkpoint_bytes(run, stage)
    if not cfg.checkpoint.dir or not every or every >= FREQUENT_SAVES or size < LARGE_CHECKPOINT:
        return None
    return (f"a {size / GB:.0f} GB checkpoint every {every} steps: writing them may take much of the run; "
            f"{spell(cfg, 'checkpoint.save_every')} of a few hundred steps is usual")


__all__ = ["STATE_BYTES", "optimizer_bytes", "cadence_warning", "saves", "held_and_trained", "quantized_base",
           "checkpoint_bytes", "export_bytes", "check_disk"]
