"""PEFT's adapter format, both ways, and `merge-lora` (base + adapter -> one HF model), executing the LoRA record
(adapter/models/lora.py): `adapter_config.json` with HF module names and `adapter_model.safetensors` with PEFT's keys,
which `peft.PeftModel.from_pretrained(base, dir)` loads.

The tensors here are whole (HF shapes, the real vocabulary); cutting them into TP shards and gathering them back is
the model's business (adapter/modeling/lora.py). A directory is published by one rename, so a reader never sees
half of one.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from adapter.convert import hf_io
from adapter.errors import bad
from adapter.models.arch import ModelArch
from adapter.models.lora import (
    CONFIG,
    WEIGHTS,
    LoraSpec,
    check_adapter,
    hf_modules,
    peft_config,
    peft_key,
    read_adapter_meta,
    saved_key,
)


def write_adapter(out_dir: str | Path, tensors: dict[str, torch.Tensor], spec: LoraSpec,
                  base_model: str | None, side_files=None) -> Path:
    """Write a PEFT adapter directory (atomically: built beside it, then renamed; into an existing directory the
    two files are replaced one by one). `side_files(dir)` may add e.g. the tokenizer."""
    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    built = Path(tempfile.mkdtemp(prefix=f".{out.name}.adapter-", dir=out.parent))
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(built / WEIGHTS),
                  metadata={"format": "pt"})
        (built / CONFIG).write_text(json.dumps(peft_config(spec, base_model), indent=2) + "\n")
        if side_files is not None:
            side_files(built)
        if not out.exists():
            os.replace(built, out)
        else:
            for p in sorted(built.iterdir(), key=lambda p: p.name == CONFIG):  # the config last
                os.replace(p, out / p.name)
    finally:
        shutil.rmtree(built, ignore_errors=True)
    return out


def read_adapter(path: str | Path, key: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors) of a PEFT adapter directory; `key` names the setting that pointed here."""
    conf, _ = read_adapter_meta(str(path), key)  # the directory's checks, one line each
    try:
        tensors = load_file(str(Path(path) / WEIGHTS))
    except (OSError, ValueError) as e:
        raise bad(key, str(path), f"unreadable adapter ({e.__class__.__name__}: {e})", "re-create the adapter")
    return conf, tensors


def merge(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path, spec: LoraSpec, arch: ModelArch, *,
          key: str = "lora_model_dir", dtype: torch.dtype | None = None, shard_size: int = 5 << 30) -> Path:
    """base + s·B·A for every adapter, computed in fp32 and stored in the base's dtype (or `dtype`), and the
    modules_to_save weights in place of the base's; streamed one tensor at a time. A tied base whose LM head (or
    embedding) was trained alone is written untied, as PEFT's merge_and_unload leaves it."""
    out = Path(out_dir).absolute()
    if out.exists():
        raise bad("--out", str(out), "already exists", "choose a new directory, or remove it first")
    conf, tensors = read_adapter(adapter_dir, key)
    check_adapter(conf, {k: tuple(v.shape) for k, v in tensors.items()}, spec, arch, key)
    base = hf_io.HFCheckpoint(base_dir)
    delta = {f"{t.hf_module}.weight": t for t in spec.targets}
    saved = {f"{hf_modules(arch)[m]}.weight": saved_key(arch, m) for m in spec.modules_to_save}
    untie = arch.tie_embeddings and bool(spec.modules_to_save)
    names = list(base.names())
    head = "lm_head.weight"
    if untie and head not in names:
        names.append(head)
    emb = f"{hf_modules(arch)['embed_tokens']}.weight"

    def dt(name):
        return dtype or base.dtype(emb if name == head and head not in base.meta else name)

    def produce(name):
        if name in saved:
            yield tensors[saved[name]].to(dt(name))
            return
        w = base.get(emb if name == head and head not in base.meta else name)
        t = delta.get(name)
        if t is not None:
            b, a = tensors[peft_key(t, "B")].double(), tensors[peft_key(t, "A")].double()
            w = (w.float() + (spec.scale * (b @ a)).float()).to(dt(name))  # fp32 (products in fp64), like PEFT
        yield w.to(dt(name))

    out.parent.mkdir(parents=True, exist_ok=True)
    built = Path(tempfile.mkdtemp(prefix=f".{out.name}.merge-", dir=out.parent))
    try:
        items = [(n, base.shape(emb if n == head and head not in base.meta else n), dt(n)) for n in names]
        hf_io.write_safetensors_sharded(built, items, produce, shard_size)
        hf_io.copy_side_files(Path(base_dir), built, dtype)
        if untie:
            cfg = json.loads((built / "config.json").read_text())
            cfg["tie_word_embeddings"] = False
            (built / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        os.replace(built, out)
    finally:
        shutil.rmtree(built, ignore_errors=True)
    return out


def merge_transformers(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path, *, key: str,
                       dtype: torch.dtype | None = None, trust_remote_code: bool = False,
                       linearized: bool = False) -> Path:
    """The transformers engine's adapters (PEFT's own format, on transformers' module names): PEFT's
    `merge_and_unload` on the base loaded in fp32, saved in the base's dtype (or `dtype`) with its side files, as
    `axolotl merge-lora` does; published by one rename. A base that lacks some of the model's weights is refused in
    one line (transformers would start them random and merge into those). `linearized` (model.linearized_experts):
    the base's experts are Axolotl's per-expert linears, built so to take the adapter, and the merged model is
    written in transformers' fused layout, as the training export writes it."""
    import peft
    from transformers import AutoConfig

    from adapter.modeling.hf_build import from_pretrained_whole
    from adapter.modeling.hf_linearized import building, fused_state
    from adapter.models.generic import model_class
    from adapter.models.linearized import for_model_type

    out = Path(out_dir).absolute()
    if out.exists():
        raise bad("--out", str(out), "already exists", "choose a new directory, or remove it first")
    if not (Path(adapter_dir) / CONFIG).is_file():
        raise bad(key, str(adapter_dir), f"no {CONFIG} there (not a PEFT adapter)", "pass the adapter's directory")
    base_conf = json.loads((Path(base_dir) / "config.json").read_text())
    config = AutoConfig.from_pretrained(str(base_dir), trust_remote_code=trust_remote_code)
    cls = model_class(config, (base_conf.get("architectures") or [None])[0], remote=bool(base_conf.get("auto_map")))
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    record = for_model_type(str(base_conf.get("model_type"))) if linearized else None
    with building(record):
        model = from_pretrained_whole(cls, str(base_dir), dtype=torch.float32, trust_remote_code=trust_remote_code)
    merged = peft.PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    out.parent.mkdir(parents=True, exist_ok=True)
    built = Path(tempfile.mkdtemp(prefix=f".{out.name}.merge-", dir=out.parent))
    try:
        merged.to(dtype or (stored if isinstance(stored, torch.dtype) else getattr(torch, str(stored))))
        if record is not None:  # back in transformers' layout
            merged.save_pretrained(str(built), state_dict=fused_state(merged.state_dict(), record))
        else:
            merged.save_pretrained(str(built))
        for side in Path(adapter_dir).iterdir():  # the tokenizer and chat template the run trained with
            if side.is_file() and side.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copyfile(side, built / side.name)
        os.replace(built, out)
    finally:
        shutil.rmtree(built, ignore_errors=True)
    return out


__all__ = ["write_adapter", "read_adapter", "merge", "merge_transformers"]
