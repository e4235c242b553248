"""Checks that need both the run config and the model's architecture (the config alone cannot know head counts)."""
from __future__ import annotations

from adapter.config import RunConfig, spell
from adapter.errors import bad
from adapter.models import freeze
from adapter.models.arch import ModelArch, check_tp


def check(cfg: RunConfig, arch: ModelArch) -> list[str]:
    """Raise UserError for a layout the model cannot run; return warnings for ones it can but should not."""
    tp, cp, seq = cfg.parallelism.tp_size, cfg.parallelism.cp_size, cfg.seq_len
    check_tp(arch, tp, key=spell(cfg, "parallelism.tp_size"))
    if cfg.model.unfrozen_parameters is not None:  # patterns that split a tensor or match nothing: refused here
        freeze.resolve(arch, cfg.model.unfrozen_parameters, spell(cfg, "model.unfrozen_parameters"))
    if arch.sliding_window is not None and seq > arch.sliding_window:
        raise bad(spell(cfg, "seq_len"), seq, f"longer than the sliding_window={arch.sliding_window} of "
                  f"{arch.architecture}: sequences past the window need sliding-window attention, which nd-adapter "
                  "does not run yet (within it, full causal attention is the same)",
                  f"use {spell(cfg, 'seq_len')} <= {arch.sliding_window}, or a checkpoint without a sliding window "
                  "(e.g. Mistral v0.2+)")
    if cp > 1 and seq % (2 * cp):
        raise bad(spell(cfg, "seq_len"), seq, f"not divisible by 2·cp_size = {2 * cp} (load-balanced context-parallel "
                  "chunks)",
                  f"use a seq_len that is a multiple of {2 * cp}")
    if cfg.use_sequence_parallel and tp > 1 and (seq // cp) % tp:
        raise bad(spell(cfg, "seq_len"), seq, f"the per-cp-rank sequence {seq // cp} is not divisible by tp_size={tp} "
                  "(sequence parallelism splits it)", f"use a seq_len that is a multiple of {cp * tp}, "
                  "or set sequence_parallel: false")
    if cfg.document_attention and cfg.model.attention != "sdpa":
        raise bad("model.attention", cfg.model.attention, "packed documents (data.document_mask) run nd-adapter's "
                  "varlen attention", "set model.attention: sdpa (the default)")
    if cfg.precision == "fp8" and tp > 1:
        raise bad("precision", "fp8", "fp8 matmuls are wired for tp_size = 1 only (measured on one GPU; "
                  "docs/BENCHMARKS.md)", "use precision: bf16 with tensor parallelism")
    warnings = []
    if cfg.precision == "fp8" and not cfg.model.compile:
        warnings.append("precision fp8 without model.compile: the fp8 casts run unfused and cost more than the "
                        "fp8 matmuls save")
    if seq > arch.max_position_embeddings:
        warnings.append(f"seq_len {seq} exceeds the model's max_position_embeddings {arch.max_position_embeddings}")
    return warnings
