"""`nd-adapter convert verify`: an HF checkpoint against its conversion, every tensor (streamed) and fp32 logits."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from transformers import AutoModelForCausalLM

from adapter.convert import hf_io
from adapter.convert.load import load_megatron_checkpoint
from adapter.convert.to_hf import export_parts, hf_order, open_converted
from adapter.convert.to_megatron import hf_checkpoint_dir
from adapter.errors import bad
from adapter.modeling.gpt import build_gpt_model, forward_logits
from adapter.models.arch import ModelArch, load_arch
from adapter.models.mapping import Rule
from adapter.osutil import free_port
from adapter.patches.mcore import install_cpu_shims


def verify(hf_dir: str | Path, megatron_dir: str | Path, *, logits: bool = True, seq_len: int = 32, batch: int = 2,
           seed: int = 0, atol: float = 1e-5, table: Sequence[Rule] | None = None) -> dict:
    """Compare an HF checkpoint with a converted one: every tensor (streamed), then fp32 logits at tp=1.

    Weights are compared after the inverse transform, in the HF checkpoint's dtype (exact unless --dtype changed
    precision). Logits need both models in memory (fp32), so pass logits=False for large models on small hosts.
    """
    hf = hf_io.HFCheckpoint(hf_checkpoint_dir(hf_dir))
    root, meta, arch, reader, rules, ctx = open_converted(megatron_dir, table)
    hf_io.read_fused_experts(hf, rules, arch)
    if dataclasses.replace(load_arch(hf_dir, "megatron"), torch_dtype="") != dataclasses.replace(arch, torch_dtype=""):
        raise bad("hf", str(hf_dir), "config.json differs from the one stored with the Megatron checkpoint",
                  "compare a checkpoint with the HF model it was converted from")
    tensors, worst = [], 0.0
    for rule, layer in hf_order(rules, arch):
        for name, got in zip(rule.hf_names(layer), export_parts(reader, rule, layer, ctx)):
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
        # soft-capped attention (Gemma 2) only in transformers' eager path: 5.17 runs Gemma 2 with SDPA by default,
        # which drops the cap (|Δlogits| 1.45 on a tiny model, GPU host 2026-12-02)
        eager = {"attn_implementation": "eager"} if arch.attn_softcap is not None else {}
        ref_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, **eager).to(device)
        with torch.no_grad():
            ref = ref_model(tokens).logits.float()
        return (ours - ref).abs().max().item()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        if own:
            ps.destroy_model_parallel()
            dist.destroy_process_group()


__all__ = ["verify"]
