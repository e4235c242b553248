"""Checks that need both the run config and the model's architecture (the config alone cannot know head counts)."""
from __future__ import annotations

from adapter.arch import ModelArch
from adapter.config import RunConfig
from adapter.errors import bad


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check(cfg: RunConfig, arch: ModelArch) -> list[str]:
    """Raise UserError for a layout the model cannot run; return warnings for ones it can but should not."""
    tp, cp, seq = cfg.parallelism.tp_size, cfg.parallelism.cp_size, cfg.seq_len
    name = arch.architecture
    if arch.num_heads % tp:
        raise bad("parallelism.tp_size", tp, f"does not divide num_attention_heads={arch.num_heads} of {name}",
                  f"use a tp_size that divides {arch.num_heads} ({_divisors(arch.num_heads)})")
    kv = arch.num_kv_heads
    if kv % tp and tp % kv:
        raise bad("parallelism.tp_size", tp, f"is incompatible with num_key_value_heads={kv} of {name} "
                  "(KV heads must split evenly across tp ranks, or tp must be a multiple of them)",
                  f"use a tp_size that divides {kv} or is a multiple of it")
    if arch.ffn_hidden_size % tp:
        raise bad("parallelism.tp_size", tp, f"does not divide intermediate_size={arch.ffn_hidden_size} of {name}",
                  "use a tp_size that divides the MLP width")
    if cp > 1 and seq % (2 * cp):
        raise bad("seq_len", seq, f"not divisible by 2·cp_size = {2 * cp} (load-balanced context-parallel chunks)",
                  f"use a seq_len that is a multiple of {2 * cp}")
    if cfg.use_sequence_parallel and tp > 1 and (seq // cp) % tp:
        raise bad("seq_len", seq, f"the per-cp-rank sequence {seq // cp} is not divisible by tp_size={tp} "
                  "(sequence parallelism splits it)", f"use a seq_len that is a multiple of {cp * tp}, "
                  "or set sequence_parallel: false")
    if cfg.data.document_mask and cp > 1:
        raise bad("data.document_mask", True, "document masking is not supported with context parallelism",
                  "set data.document_mask: false or cp_size: 1")
    warnings = []
    if seq > arch.max_position_embeddings:
        warnings.append(f"seq_len {seq} exceeds the model's max_position_embeddings {arch.max_position_embeddings}")
    return warnings
