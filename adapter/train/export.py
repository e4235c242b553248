"""Trained ZeRO-3 engine -> HF directory, through the conversion code (one mapping table, both directions).

All ranks gather their TP shard's full parameters and save one torch_dist checkpoint collectively (Megatron
dedups replicas); rank 0 then converts it to HF like `nd-adapter convert megatron-to-hf`. The gathered model must
fit per GPU for the moment of the save (a TP shard in training dtype).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path


def _source_hf_dir(cfg) -> Path:
    ckpt = cfg.model.checkpoint
    if ckpt and (Path(ckpt) / "hf" / "config.json").is_file():
        return Path(ckpt) / "hf"
    return Path(cfg.model.path)


def export_hf(engine, arch, cfg, out_dir: str | Path, *, rank: int) -> Path:
    import deepspeed
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from adapter.convert import hf_io
    from adapter.convert import megatron_io as mio
    from adapter.convert.ops import FORMAT, megatron_to_hf

    out = Path(out_dir).absolute()
    stage = out.parent / f".{out.name}.megatron-stage"
    if rank == 0:
        shutil.rmtree(stage, ignore_errors=True)
        (stage / mio.RELEASE).mkdir(parents=True)
    dist.barrier()
    model = engine.module
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        dist_checkpointing.save(model.sharded_state_dict(), str(stage / mio.RELEASE))
    dist.barrier()
    if rank == 0:
        try:
            dtype = next(p for p in model.parameters()).dtype
            meta = {"format": FORMAT, "format_version": 1, "family": arch.family, "architecture": arch.architecture,
                    "vocab_size": arch.vocab_size, "padded_vocab_size": model.vocab_size,
                    "vocab_divisible_by": cfg.model.vocab_divisible_by, "dtype": hf_io.dtype_name(dtype),
                    "source_tp": cfg.parallelism.tp_size, "tag": mio.RELEASE, "hf_subdir": mio.HF_SUBDIR,
                    "arch": arch.to_dict()}
            meta["hf_files"] = hf_io.copy_side_files(_source_hf_dir(cfg), stage / mio.HF_SUBDIR, dtype)
            (stage / mio.META).write_text(json.dumps(meta, indent=2) + "\n")
            mio.write_tracker(stage)
            megatron_to_hf(stage, out, overwrite=True, progress=False, check=False)  # written just now
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    dist.barrier()
    return out
