"""DeepSpeed's checkpoint files, read without an engine: what resuming at another layout needs of a checkpoint that a
ZeRO-1/2 or ZeRO-3 engine wrote (adapter/train/reshard.py). Checked against the files of TESTED_DEEPSPEED_VERSIONS
(each file records the version that wrote it; another is refused in one line).

Per tensor-parallel rank m and ZeRO partition d, DeepSpeed writes `zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt`
(`bf16_` before it in bf16 runs):
* ZeRO-1/2: `single_partition_of_fp32_groups[g]` (this partition of group g's flat fp32 weights), the base
  optimizer's `state[g]` (its moments over the same partition) and `param_slice_mappings[g]` (name -> where the
  fragment of that parameter lies in the partition). A parameter's fragments, in partition order, are the parameter.
* ZeRO-3: `fp32_flat_groups` (one flat per sub-group) and the moments by sub-group; every parameter is split alone
  into `ceil(numel / partitions)` elements per partition (the last padded), in the order of the model-states
  file's `param_shapes` (the same arithmetic as the zero_to_fp32 script DeepSpeed writes beside its checkpoints).

With expert parallelism (ep > 1, adapter/patches/zero.py) the experts' names are a rank's local ones
(`local_experts.{i}`), their partitions lie among the files of the ranks holding them (data-parallel rank d holds
the experts of ep rank d % ep, as partition d // ep of ep's dp / ep), and ZeRO-1/2 keeps them in groups of their own.
`trained` and `read` speak of global expert names (`expert_name`, from the caller: adapter/train/reshard.py).
"""
from __future__ import annotations

import math
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from adapter.errors import bad
from adapter.patches import ALLOW_UNTESTED, require
from adapter.patches.zero import TESTED_DEEPSPEED_VERSIONS

_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")  # bf16_: bf16 runs
MOMENTS = ("exp_avg", "exp_avg_sq")
# what DeepSpeed keeps in a model-states file for itself; the rest is the client state the run saved
_DS_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
            "shared_params", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
            "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
            "ds_version", "checkpoint_parallel_dimensions"}


def written_by_zero(ckpt: Path) -> bool:
    """Whether the tag holds ZeRO optimizer files (else: the flat AdamW's, inside its model-states files)."""
    return any(_OPTIM.match(p.name) for p in ckpt.iterdir())


def client_state(model_states: dict) -> dict:
    """The client state a run saved in a model-states file (DeepSpeed's load_checkpoint returns the same)."""
    return {k: v for k, v in model_states.items() if k not in _DS_KEYS}


def _load(path: Path) -> dict:
    # DeepSpeed pickles its own classes (loss scaler, enums, fragment addresses); these are the run's own files.
    # mmap: a parameter's slices are read when touched, not the whole partition up front
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


class _Concat:
    """Sub-group flats read as one vector without copying them together."""

    def __init__(self, parts: list[torch.Tensor]):
        self.parts, self.starts = parts, [0]
        for p in parts:
            self.starts.append(self.starts[-1] + p.numel())

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def narrow(self, start: int, n: int) -> torch.Tensor:
        out, end = [], start + n
        for p, lo, hi in zip(self.parts, self.starts, self.starts[1:]):
            if hi > start and lo < end:
                out.append(p.reshape(-1)[max(start, lo) - lo:min(end, hi) - lo])
        return out[0] if len(out) == 1 else torch.cat(out)


class ZeroFiles:
    """One checkpoint tag written by a ZeRO engine: `trained(m)` (name -> shape on TP rank m, the optimizer's order)
    and `read(m, name, what)` (the whole tensor on TP rank m: what = "fp32" master weights, or a moment)."""

    def __init__(self, ckpt: Path, key: str, value: str, ep: int = 1,
                 expert_name: Callable[[str, int], str | None] = lambda name, ep_rank: None):
        """`ep`: the expert-parallel size it was saved with; `expert_name(name, ep_rank)`: an expert parameter's global
        name when ep rank `ep_rank` saved it under `name`, None for a parameter that is no expert's."""
        require("deepspeed", TESTED_DEEPSPEED_VERSIONS, "ZeRO checkpoint reader (adapter/patches/zero_files.py)")
        self.key, self.value, self.ep, self._expert = key, value, ep, expert_name
        found = {}
        for p in ckpt.iterdir():
            if match := _OPTIM.match(p.name):
                found[int(match[1]), int(match[2])] = p
        self.tp = 1 + max((m for _, m in found), default=-1)
        self.partitions = 1 + max((d for d, _ in found), default=-1)
        missing = [(d, m) for d in range(self.partitions) for m in range(self.tp) if (d, m) not in found]
        if not found or missing:
            raise bad(key, value, f"{ckpt} lacks ZeRO optimizer files" + (f" (e.g. partition {missing[0][0]} of tp "
                      f"rank {missing[0][1]})" if missing else ""), "resume from a complete checkpoint")
        files = {dm: _load(p) for dm, p in found.items()}
        self.optim = {dm: f["optimizer_state_dict"] for dm, f in files.items()}
        first = self.optim[0, 0]
        written = str(files[0, 0].get("ds_version", "?"))
        if written not in TESTED_DEEPSPEED_VERSIONS and os.environ.get(ALLOW_UNTESTED) != "1":
            raise bad(key, value, f"written by DeepSpeed {written}; resharding reads the files of "
                      f"{', '.join(TESTED_DEEPSPEED_VERSIONS)} only", "resume at the layout it was saved with, or set "
                      f"{ALLOW_UNTESTED}=1 to try")
        self.stage = 3 if "fp32_flat_groups" in first else 2
        masters = first["fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"]
        # bf16_master_weights_and_grads (optimizer.state_dtype: bf16): DeepSpeed's "fp32" partitions are bf16
        self.state_dtype = "bf16" if masters and masters[0].dtype == torch.bfloat16 else "fp32"
        self.model = [_load(self._model_file(ckpt, m)) for m in range(self.tp)]
        if self.partitions % ep:
            raise bad(key, value, f"its {self.partitions} partitions do not split over ep={ep}", "resume from a "
                      "complete checkpoint")
        self._local, self._shapes = [], []  # per TP rank: name -> shape as saved (local experts), and globally
        for m in range(self.tp):
            shapes: OrderedDict[str, torch.Size] = OrderedDict()
            for group in self.model[m]["param_shapes"]:
                shapes.update((k, torch.Size(v)) for k, v in group.items())
            self._local.append(shapes)
            self._shapes.append(OrderedDict((self._global(n, e), v) for n, v in shapes.items()
                                            for e in range(ep if self._expert(n, 0) else 1)))
        base = self._base(first)
        states = list(base["state"].values())
        if any(k not in s for s in states for k in MOMENTS):
            raise bad(key, value, "its optimizer moments are not AdamW's fp32 exp_avg/exp_avg_sq (8/4-bit states are "
                      "quantised in blocks of the saved partitions)", "resume at the layout it was saved with")
        self.step = int(states[0]["step"]) if states else 0
        self._index = [self._locate(m) for m in range(self.tp)]

    def _model_file(self, ckpt: Path, m: int) -> Path:
        if self.stage == 3:
            return ckpt / f"zero_pp_rank_0_mp_rank_{m:02d}_model_states.pt"
        return ckpt / f"mp_rank_{m:02d}_model_states.pt"

    def _base(self, osd: dict) -> dict:
        return osd["optimizer_state_dict"] if self.stage == 3 else osd["base_optimizer_state"]

    def _global(self, name: str, ep_rank: int) -> str:
        return self._expert(name, ep_rank) or name

    def trained(self, m: int) -> OrderedDict:
        return self._shapes[m]

    def _locate(self, m: int) -> dict:
        """name -> [(partition, start, numel)] of its pieces in the flats, in order."""
        where: dict[str, list[tuple[int, int, int]]] = {}
        ep, parts = self.ep, self.partitions
        if self.stage == 3:
            off = 0
            for name, shape in self._local[m].items():
                if self._expert(name, 0):  # partitioned over the ranks holding the same experts
                    per = math.ceil(shape.numel() / (parts // ep))
                    for e in range(ep):
                        where[self._global(name, e)] = [(d, off, per) for d in range(e, parts, ep)]
                else:
                    per = math.ceil(shape.numel() / parts)
                    where[name] = [(d, off, per) for d in range(parts)]
                off += per
            have = sum(t.numel() for t in self.optim[0, m]["fp32_flat_groups"])
            if off != have:
                raise bad(self.key, self.value, f"its ZeRO-3 partitions hold {have} elements, the parameters it lists "
                          f"need {off}", "resume at the layout it was saved with")
            return where
        for d in range(parts):
            for g, mapping in enumerate(self.optim[d, m]["param_slice_mappings"]):
                for name, frag in mapping.items():
                    where.setdefault(self._global(name, d % ep), []).append((d, g, frag.start, frag.numel))
        return where

    def _flat(self, d: int, m: int, what: str, g: int | None = None):
        osd = self.optim[d, m]
        if self.stage == 3:
            if what == "fp32":
                return _Concat(list(osd["fp32_flat_groups"]))
            state = self._base(osd)["state"]
            return _Concat([state[i][what] for i in sorted(state)])
        if what == "fp32":
            return osd["single_partition_of_fp32_groups"][g]
        return self._base(osd)["state"][g][what]

    def read(self, m: int, name: str, what: str) -> torch.Tensor:
        shape = self._shapes[m][name]
        if self.stage == 3:
            flats = [self._flat(d, m, what) for d in range(self.partitions)]
            pieces = [flats[d].narrow(start, n) for d, start, n in self._index[m][name]]
        else:
            pieces = [self._flat(d, m, what, g).reshape(-1).narrow(0, start, n)
                      for d, g, start, n in self._index[m][name]]
        flat = torch.cat(pieces)[:shape.numel()]
        if flat.numel() != shape.numel():
            raise bad(self.key, self.value, f"its ZeRO files hold {flat.numel()} of {name}'s {shape.numel()} elements",
                      "resume from a complete checkpoint")
        return flat.reshape(shape).float()

    def engine_state(self) -> dict:
        """What the engine saved besides the tensors (rank 0's model-states file): the LR scheduler, step counts and
        the client state (our step record, the sampler)."""
        return self.model[0]


__all__ = ["ZeroFiles", "MOMENTS", "written_by_zero", "client_state"]
