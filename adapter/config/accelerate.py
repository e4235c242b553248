"""An Accelerate launch config, unchanged, mapped onto the native dict: its `parallelism_config:` block (Accelerate's
`ParallelismConfig` fields), `num_processes`, `num_machines`, `mixed_precision`. It names no model (`--model`)."""
from __future__ import annotations

from typing import Any

from adapter.config.schema import SIZE_KEYS, set_dotted
from adapter.errors import bad

MARKERS = {"parallelism_config", "compute_environment", "distributed_type", "num_processes", "num_machines"}


def from_accelerate(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"source": "accelerate", "model": {"path": raw.get("model", "")}}
    block = raw.get("parallelism_config") or {}
    if not isinstance(block, dict):
        raise bad("parallelism_config", block, "must be a mapping", "write `parallelism_config:` with its keys below")
    for key, value in block.items():
        name = key.removeprefix("parallelism_config_")
        if name in SIZE_KEYS:
            set_dotted(out, f"parallelism.{name}", value)
        elif name == "cp_comm_strategy":
            if value not in ("allgather", "all_gather"):
                raise bad(key, value, "only the all-gather strategy maps onto this project (as all_gather)",
                          "use allgather, or set parallelism.cp_comm_type: p2p in a native config for the ring")
            set_dotted(out, "parallelism.cp_comm_type", "all_gather")
        else:
            raise bad(f"parallelism_config.{key}", value, "unknown key",
                      f"use parallelism_config_{{{','.join(SIZE_KEYS)}}}")
    nodes, procs = raw.get("num_machines", 1), raw.get("num_processes")
    set_dotted(out, "hardware.nodes", nodes)
    if isinstance(procs, int) and isinstance(nodes, int) and nodes >= 1 and procs % nodes == 0:
        set_dotted(out, "hardware.gpus_per_node", procs // nodes)
    elif procs is not None:
        raise bad("num_processes", procs, f"not divisible by num_machines={nodes}", "make num_processes a multiple")
    mp = raw.get("mixed_precision")
    if mp is not None:
        if mp not in ("bf16", "fp16", "no"):
            raise bad("mixed_precision", mp, "unsupported", "use bf16, fp16 or no")
        out["precision"] = "fp32" if mp == "no" else mp
    return out
