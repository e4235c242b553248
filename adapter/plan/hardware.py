"""Hardware profiles for the step-time model: what one GPU, its links and its host achieve, as JSON.

Three ship under `profiles/` (H100, H200, A100: public figures and this project's H200 measurements, each number's
source written next to it); `nd-adapter calibrate` writes the same format from micro-benchmarks on the machine
itself. A profile holds *achieved* rates, not datasheet peaks, because the step-time model divides work by them.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from adapter.errors import bad

if TYPE_CHECKING:
    from adapter.config.schema import HardwareSection

PROFILE_DIR = Path(__file__).parent / "profiles"
# `hardware.gpu` (the memory check's capacity) -> the shipped profile used when `hardware.profile` is unset. The
# 40 GB A100 has 1.56 TB/s of HBM, not the 80 GB part's 2.04: its memory-bound terms come out ~25% optimistic.
GPU_PROFILE = {"h100-80gb": "h100", "h200": "h200", "a100-80gb": "a100", "a100-40gb": "a100"}


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


GEMM_ALIGN = 8  # bf16 elements in 16 bytes: the row stride cuBLAS's fast kernels (TMA on Hopper) need


class Gemm(_Doc):
    """Achieved bf16 matmul rate: max_flops · Π d/(d + half_dim) over the three dimensions (small dims waste),
    times `unaligned` where n or k -- a row stride of one of the operands in forward or backward -- is not a multiple
    of GEMM_ALIGN elements: cuBLAS then falls back to kernels with 4-byte loads. One H100, Olmo-3's output layer
    (8,192 tokens × 4,096 × 100,278 rows) forward + both backward GEMMs: 81.3 ms, against 29.1 ms at 100,352 rows
    (bench/linear_ce_bench.py, docs/BENCHMARKS.md 2026-12-06): 0.36 of the rate."""

    max_flops: float = Field(gt=0)
    half_dim: float = Field(ge=0)
    unaligned: float = Field(default=0.36, gt=0, le=1)

    def rate(self, m: int, n: int, k: int) -> float:
        c = self.half_dim
        aligned = n % GEMM_ALIGN == 0 and k % GEMM_ALIGN == 0
        return self.max_flops * (m / (m + c)) * (n / (n + c)) * (k / (k + c)) * (1.0 if aligned else self.unaligned)


class Attention(_Doc):
    """Achieved flash-attention rate (fwd+bwd, counted as 3.5 × the causal forward's 4·b·s²·h·d/2, like
    bench/attention_bench.py): max_flops · L/(L + half_seq), L the attention span (sequence or document)."""

    max_flops: float = Field(gt=0)
    half_seq: float = Field(ge=0)

    def rate(self, span: float) -> float:
        return self.max_flops * span / (span + self.half_seq)


class Link(_Doc):
    """A collective's time: latency_s + bytes each rank sends / busbw (nccl-tests' bus bandwidth convention)."""

    busbw: float = Field(gt=0, description="bytes/s")
    latency_s: float = Field(ge=0)


class Network(_Doc):
    busbw_per_gpu: float = Field(gt=0, description="bytes/s one GPU's NIC carries (one NIC per GPU)")
    latency_s: float = Field(ge=0)


class Host(_Doc):
    """CPU-side costs (Python, kernel launches, DeepSpeed's hooks) that BENCHMARKS showed to set the pace of small
    models. Measured on the GPU host's CPU (sessions 3-5); other hosts differ, and calibrate does not measure them."""

    layer_s: float = Field(ge=0, description="one eager transformer layer, fwd+bwd, per micro-batch")
    compiled_layer_s: float = Field(ge=0, description="the same with model.compile (one graph per layer)")
    moe_layer_s: float = Field(ge=0, description="one eager mixture-of-experts layer, fwd+bwd, per micro-batch "
                               "(router, token permutation, grouped experts); model.compile compiles its "
                               "attention half only")
    param_s: float = Field(ge=0, description="per parameter tensor per micro-batch (AccumulateGrad, grad hooks)")
    tp_collective_s: float = Field(ge=0, description="per TP/SP collective (Megatron's autograd function + launch)")
    zero3_unit_s: float = Field(ge=0, description="ZeRO-3 stall per gather unit per pass (fetch/release hooks)")
    step_s: float = Field(ge=0, description="ZeRO-1/2 step's Python (runs while the optimizer kernels do)")
    step_per_tensor_s: float = Field(ge=0, description="its per-parameter-tensor part")
    overflow_scan_per_tensor_s: float = Field(ge=0, description="DeepSpeed's bf16 check_grad_overflow, per tensor")


class Profile(_Doc):
    name: str
    gpu: str = Field(description="the hardware.gpu this profile describes")
    description: str = ""
    peak_flops: float = Field(gt=0, description="dense bf16 datasheet peak (for MFU only)")
    gemm: Gemm
    attention: Attention
    hbm_bytes_per_s: float = Field(gt=0, description="large device copies (the optimizer's streams)")
    elementwise_bytes_per_s: float = Field(gt=0, description="training's memory-bound kernels, launch gaps included")
    optimizer_bytes_per_s: float = Field(gt=0, description="DeepSpeed's optimizer step, per byte it streams")
    intra_node: Link
    inter_node: Network
    host: Host
    sources: dict[str, str] = Field(default_factory=dict)
    measurements: dict[str, list[dict[str, Any]]] = Field(default_factory=dict, description="calibrate's raw points")
    source_path: str | None = None


def shipped() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def read(ref: str, base_dir: Path | None = None, key: str = "hardware.profile") -> Profile:
    """A shipped profile by name, or a JSON file (relative paths also tried against the config's directory)."""
    path = PROFILE_DIR / f"{ref}.json" if ref in shipped() else Path(ref)
    if not path.is_file() and base_dir is not None and not path.is_absolute():
        path = base_dir / ref
    if not path.is_file():
        raise bad(key, ref, "no such hardware profile or file",
                  f"use one of {', '.join(shipped())} or a JSON written by `nd-adapter calibrate`")
    try:
        data = json.loads(path.read_text())
        prof = Profile.model_validate(data)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(key, str(path), f"not a readable JSON file ({e.__class__.__name__})",
                  "regenerate it with `nd-adapter calibrate`")
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "profile"
        raise bad(key, str(path), f"not a hardware profile ({where}: {first['msg']})",
                  "regenerate it with `nd-adapter calibrate` or start from adapter/plan/profiles/")
    return prof.model_copy(update={"source_path": None if ref in shipped() else str(path)})


def resolve(hw: HardwareSection, base_dir: Path | None = None) -> Profile | None:
    """The profile a run's `hardware` section selects, with its bandwidth overrides applied; None when neither
    `hardware.profile` nor a shipped profile for `hardware.gpu` exists (then plan predicts no time)."""
    ref = hw.profile or GPU_PROFILE.get(hw.gpu)
    if ref is None:
        return None
    prof = read(ref, base_dir)
    update: dict[str, Link | Network] = {}
    if hw.intra_node_gb_per_s is not None:
        update["intra_node"] = prof.intra_node.model_copy(update={"busbw": hw.intra_node_gb_per_s * 1e9})
    if hw.inter_node_gb_per_s is not None:
        update["inter_node"] = prof.inter_node.model_copy(update={"busbw_per_gpu": hw.inter_node_gb_per_s * 1e9})
    return prof.model_copy(update=update) if update else prof
