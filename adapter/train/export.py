"""Trained ZeRO-3 engine -> HF directory, through the conversion code (one mapping table, both directions).

All ranks gather their TP shard's full parameters and save one torch_dist checkpoint collectively (Megatron
dedups replicas); rank 0 then converts it to HF like `nd-adapter convert megatron-to-hf`, with the source's
config, generation config and tokenizer, and the run's chat template when it has one (`chat_template.jinja`, the
file transformers reads). The gathered model must fit per GPU for the moment of the save (a TP shard in training
dtype).

The target may already hold other things: Axolotl's `output_dir` is also the checkpoint directory. A new target is
published by one rename; into an existing one the export moves its files one by one (each replace atomic) and
removes only weight files of an earlier export that this one does not write, so checkpoints and anything else
there survive.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import deepspeed
import torch.distributed as dist
from megatron.core import dist_checkpointing

from adapter.convert import hf_io
from adapter.convert import megatron_io as mio
from adapter.convert import peft as peft_io
from adapter.convert.to_hf import megatron_to_hf
from adapter.data.sft.prepare import load_tokenizer
from adapter.modeling.hf_linearized import fused_state
from adapter.modeling.hf_tp import whole_state
from adapter.modeling.lora import full_state
from adapter.models import linearized
from adapter.models.source import hf_dir, tokenizer_dir

# files an earlier export may have left that this one would not overwrite (other shard counts, no chat template)
_STALE = ("model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json",
          "chat_template.jinja")


# what the transformers engine's export copies from the checkpoint beside transformers' save_pretrained
SIDE_FILES = ("tokenizer", "special_tokens", "preprocessor", "processor", "chat_template", "vocab", "merges",
              "tekken")  # tekken.json: mistral-common's tokenizer (data.mistral_common)


def write_chat_template(hf_dir: Path, template: str) -> None:
    """The template as transformers 5 saves it (chat_template.jinja); an inline copy in tokenizer_config.json would
    otherwise compete with it."""
    (hf_dir / "chat_template.jinja").write_text(template)
    tc = hf_dir / "tokenizer_config.json"
    if tc.is_file():
        conf = json.loads(tc.read_text())
        if conf.pop("chat_template", None) is not None:
            tc.write_text(json.dumps(conf, indent=2) + "\n")


def publish(built: Path, out: Path) -> None:
    """Move the finished export `built` to `out`: one rename for a new target, file by file into an existing one."""
    if not out.exists():
        os.replace(built, out)
        return
    new = {p.name for p in built.iterdir()}
    for pattern in _STALE:
        for old in out.glob(pattern):
            if old.is_file() and old.name not in new:
                old.unlink()
    for p in sorted(built.iterdir(), key=lambda p: p.name.endswith(".json")):  # weights first, index and config last
        os.replace(p, out / p.name)
    shutil.rmtree(built, ignore_errors=True)


def write_special_tokens(hf_dir: Path, cfg, arch) -> None:
    """The tokenizer as the data was prepared with it (the config's `special_tokens` and `tokens`), and its EOS among
    the ones `generate` stops at: a chat model trained to end turns with <|im_end|> must stop there."""
    tok = load_tokenizer(cfg, tokenizer_dir(cfg), arch.vocab_size)
    tok.save_pretrained(str(hf_dir))
    gen = hf_dir / "generation_config.json"
    if tok.eos_token_id is not None and gen.is_file():
        conf = json.loads(gen.read_text())
        eos = conf.get("eos_token_id")
        ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
        if tok.eos_token_id not in ids:
            conf["eos_token_id"] = [*ids, tok.eos_token_id]
            gen.write_text(json.dumps(conf, indent=2) + "\n")


def tokenizer_changed(cfg) -> bool:
    """Whether the run's tokenizer differs from the checkpoint's files: `special_tokens` set for SFT data, or
    `tokens` added (adapter/models/vocab.py); the export then writes it as the data was prepared with it."""
    return bool(cfg.data.tokens) or bool(cfg.data.datasets and cfg.data.special_tokens.model_dump(exclude_none=True))


def set_vocab_size(config_json: Path, rows: int) -> None:
    """config.json's vocab_size (its text_config's, where that holds it) as the resized model has it."""
    conf = json.loads(config_json.read_text())
    text = conf.get("text_config")
    (text if isinstance(text, dict) and "vocab_size" in text else conf)["vocab_size"] = rows
    config_json.write_text(json.dumps(conf, indent=2) + "\n")


def export_hf(engine, arch, cfg, out_dir: str | Path, *, rank: int, chat_template: str | None = None) -> Path:
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
        built = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent)) / "hf"
        try:
            dtype = next(p for p in model.parameters()).dtype
            meta = mio.converted_meta(arch, padded_vocab=model.vocab_size,
                                      vocab_divisible_by=cfg.model.vocab_divisible_by, dtype=dtype,
                                      source_tp=cfg.parallelism.tp_size)
            meta["hf_files"] = hf_io.copy_side_files(hf_dir(cfg), stage / mio.HF_SUBDIR, dtype)
            if cfg.model.output_router_logits is not None:  # as Axolotl's model_config leaves it in the saved config
                conf = stage / mio.HF_SUBDIR / "config.json"
                conf.write_text(json.dumps({**json.loads(conf.read_text()),
                                            "output_router_logits": cfg.model.output_router_logits}, indent=2) + "\n")
            if cfg.data.tokens:  # the embedding and head as resized for them (arch counts the new rows)
                set_vocab_size(stage / mio.HF_SUBDIR / "config.json", arch.vocab_size)
            if tokenizer_changed(cfg):
                write_special_tokens(stage / mio.HF_SUBDIR, cfg, arch)
            if chat_template:
                write_chat_template(stage / mio.HF_SUBDIR, chat_template)
            (stage / mio.META).write_text(json.dumps(meta, indent=2) + "\n")
            mio.write_tracker(stage)
            megatron_to_hf(stage, built, progress=False, check=False)  # written just now
            publish(built, out)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
            shutil.rmtree(built.parent, ignore_errors=True)
    dist.barrier()
    return out


def export_transformers(engine, arch, cfg, out_dir: str | Path, *, rank: int, tp_group=None, ep_group=None,
                        chat_template: str | None = None) -> Path:
    """The transformers engine's result: transformers' own `save_pretrained` of the trained model (gathered out of
    ZeRO-3's partitions, over TP and over EP; its config as the run's dtype writes it), the tokenizer as the data
    was prepared with it and the chat template, built beside the target and published like `export_hf`.
    Collective; rank 0 writes."""
    out = Path(out_dir).absolute()
    model = engine.module.model  # adapter/modeling/hf_build.CausalLMLosses holds transformers' model
    tp = cfg.parallelism.tp_size
    state: dict = {}

    def write(built: Path) -> None:
        model.save_pretrained(str(built), state_dict=state, safe_serialization=True)
        src = hf_dir(cfg)
        gen = src / "generation_config.json"
        if gen.is_file() and not (built / gen.name).is_file():
            shutil.copy(gen, built / gen.name)
        for side in src.glob("*"):  # processor and tokenizer files as the checkpoint ships them
            if side.is_file() and (side.name.startswith(SIDE_FILES) or side.suffix == ".model"):
                shutil.copy(side, built / side.name)
        if tokenizer_changed(cfg):
            write_special_tokens(built, cfg, arch)
        if chat_template:
            write_chat_template(built, chat_template)

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        state.update(whole_state(model, tp_group, tp, ep_group=ep_group, ep=cfg.parallelism.ep_size))
        record = linearized.for_model_type(arch.hf_model_type) if cfg.model.linearized_experts else None
        if record is not None:  # back in transformers' layout: the export loads in transformers as it is
            fused = fused_state(state, record)
            state.clear()
            state.update(fused)
        _written_by_rank0(out, rank, "hf", write)
    dist.barrier()
    return out


def _written_by_rank0(out: Path, rank: int, name: str, write) -> None:
    """Rank 0 writes the export into a fresh directory beside `out` (`write(dir)`), then publishes it there. `out`'s
    parent is made first: a run that saved no checkpoint (Axolotl's save_strategy: no) may never have created it,
    and the export is the end of the run (2026-12-07: an image-text run trained fully, then failed here)."""
    if rank != 0:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    built = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent)) / name
    try:
        write(built)
        publish(built, out)
    finally:
        shutil.rmtree(built.parent, ignore_errors=True)


def export_peft(engine, cfg, out_dir: str | Path, *, rank: int, arch, tp_group=None,
                chat_template: str | None = None) -> Path:
    """The transformers engine's LoRA run: PEFT's own `save_pretrained` of the adapters (gathered out of ZeRO-3's
    partitions and over TP), naming the base as model.path, with the tokenizer and chat template. Collective; rank 0
    writes."""
    out = Path(out_dir).absolute()
    model = engine.module.model  # a PeftModel (adapter/modeling/hf_build.py)
    trained = [p for p in model.parameters() if p.requires_grad]
    tp = cfg.parallelism.tp_size
    state: dict = {}

    def write(built: Path) -> None:
        model.peft_config["default"].base_model_name_or_path = str(cfg.model.path)
        model.save_pretrained(str(built), **({"state_dict": state} if tp > 1 else {}))
        write_special_tokens(built, cfg, arch)
        if chat_template:
            write_chat_template(built, chat_template)

    with deepspeed.zero.GatheredParameters(trained, modifier_rank=None):
        if tp > 1:
            state.update(whole_state(model, tp_group, tp, trained_only=True))
        _written_by_rank0(out, rank, "adapter", write)
    dist.barrier()
    return out


def export_lora(engine, spec, arch, cfg, out_dir: str | Path, *, rank: int, tp_group,
                chat_template: str | None = None) -> Path:
    """A LoRA run's result in PEFT's format (adapter/convert/peft.py): the adapters and modules_to_save gathered
    over TP (and out of ZeRO-3's partitions) under HF names, with the tokenizer as the data was prepared with it.
    Collective; rank 0 writes."""
    out = Path(out_dir).absolute()
    model = engine.module
    trained = [p for p in model.parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters(trained, modifier_rank=None):
        tensors = full_state(model, spec, arch, tp_group)
    if rank == 0:
        def side_files(d: Path) -> None:
            write_special_tokens(d, cfg, arch)
            if chat_template:
                write_chat_template(d, chat_template)

        peft_io.write_adapter(out, tensors, spec, base_model=str(hf_dir(cfg)), side_files=side_files)
    dist.barrier()
    return out


def export_run(t) -> Path:
    """The end of a run's `checkpoint.export_hf` (adapter/train/trainer.Trainer `t`): the format its model asks for
    (PEFT's adapter format from either engine's LoRA, transformers' save_pretrained, the native engine's HF
    conversion), said in one line."""
    cfg, out, ds = t.cfg, t.cfg.checkpoint.export_hf, t.engine.ds
    extra = " and chat template" if t.chat_template else ""
    if t.lora is not None:
        path = export_lora(ds, t.lora, t.arch, cfg, out, rank=t.rank, tp_group=t.groups.tp,
                           chat_template=t.chat_template)
        t._say(f"exported the LoRA adapter to {path} (PEFT's format, HF module names; tokenizer{extra} included; "
               "`nd-adapter merge-lora` merges it into the base)")
    elif t.run.peft is not None:
        path = export_peft(ds, cfg, out, rank=t.rank, arch=t.arch, tp_group=t.groups.tp, chat_template=t.chat_template)
        t._say(f"exported the LoRA adapter to {path} (PEFT's own save_pretrained; tokenizer{extra} included)")
    elif not t.arch.native:
        path = export_transformers(ds, t.arch, cfg, out, rank=t.rank, tp_group=t.groups.tp, ep_group=t.groups.ep,
                                   chat_template=t.chat_template)
        t._say(f"exported HF model to {path} (transformers' save_pretrained; tokenizer{extra} included)")
    else:
        path = export_hf(ds, t.arch, cfg, out, rank=t.rank, chat_template=t.chat_template)
        t._say(f"exported HF model to {path} (tokenizer{extra} included)")
    return path
