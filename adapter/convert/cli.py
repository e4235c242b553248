"""`nd-adapter convert {hf-to-megatron, megatron-to-hf, verify}` and `nd-adapter merge-lora`.

The parser is built for every `nd-adapter` command (its --help included), so torch and Megatron are imported only
when a verb runs."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from adapter.config import parse_sets, spell
from adapter.errors import bad
from adapter.models import lora, source


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("convert", help="HF <-> Megatron-Core checkpoint conversion (streamed, any TP)")
    verbs = p.add_subparsers(dest="verb", required=True, parser_class=type(p))
    dtypes = ("bf16", "fp16", "fp32")

    h = verbs.add_parser("hf-to-megatron", help="HF checkpoint dir -> Megatron torch_dist checkpoint")
    h.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors or .bin)")
    h.add_argument("--out", required=True, help="output checkpoint directory (created atomically)")
    h.add_argument("--tp", type=int, default=1, help="TP size for on-disk chunking and vocab padding (loads at any tp)")
    h.add_argument("--dtype", choices=dtypes, help="cast weights (default: keep the checkpoint's dtype)")
    h.add_argument("--vocab-divisible-by", type=int, default=128,
                   help="pad the vocab to a multiple of this times --tp (Megatron-LM's rule; default 128)")
    h.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    h.add_argument("--no-progress", action="store_true", help="no progress bar")

    m = verbs.add_parser("megatron-to-hf", help="Megatron checkpoint (from hf-to-megatron) -> HF checkpoint dir")
    m.add_argument("--megatron", required=True, help="checkpoint directory written by hf-to-megatron")
    m.add_argument("--out", required=True, help="output HF directory (created atomically)")
    m.add_argument("--dtype", choices=dtypes, help="cast weights (default: keep the checkpoint's dtype)")
    m.add_argument("--shard-size", default="5GB", help="max safetensors shard size (default 5GB)")
    m.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    m.add_argument("--no-progress", action="store_true", help="no progress bar")

    v = verbs.add_parser("verify", help="compare every tensor and the logits of an HF checkpoint and its conversion")
    v.add_argument("--hf", required=True)
    v.add_argument("--megatron", required=True)
    v.add_argument("--no-logits", action="store_true", help="weights only (logits need both models in fp32 memory)")
    v.add_argument("--seq-len", type=int, default=32)
    v.add_argument("--atol", type=float, default=1e-5, help="max |delta logit| accepted (fp32)")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)
    return p


def add_merge_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("merge-lora", help="base HF model + a LoRA adapter (PEFT format) -> one merged HF model "
                              "(like `axolotl merge-lora`)")
    p.add_argument("--config", required=True, help="the LoRA run's YAML (base model, lora settings, output_dir)")
    p.add_argument("--adapter", help="adapter directory (default: the config's lora_model_dir, else its output_dir)")
    p.add_argument("--out", help="merged model directory (default: <output_dir>/merged, as Axolotl writes it)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="stored dtype (default: the base's); the "
                   "merge itself runs in fp32")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    p.set_defaults(func=run_merge)
    return p


def run_merge(args) -> int:
    # merging runs in one process whatever layout the run trained at
    cfg = source.load_config(args.config, overrides=parse_sets(args.set), world_size=None, layout=False)
    arch = source.arch_for(cfg)
    spec = lora.from_config(cfg, arch) if arch.native else None
    if cfg.lora is None:
        raise bad("adapter", None, "the config trains every weight: there is no adapter to merge",
                  "pass the LoRA run's config (adapter: lora)")
    out_dir = cfg.checkpoint.export_hf or cfg.checkpoint.dir
    adapter_dir = args.adapter or cfg.lora.init_from or out_dir
    if adapter_dir is None:
        raise bad("--adapter", None, "no adapter directory: the config has neither lora_model_dir nor output_dir",
                  "pass --adapter DIR")
    out = args.out or (str(Path(out_dir) / "merged") if out_dir else None)
    if out is None:
        raise bad("--out", None, "no output directory", "pass --out DIR")
    from adapter.convert import peft  # torch: imported when the verb runs (module docstring)
    from adapter.convert.hf_io import parse_dtype  # torch, likewise

    key = "--adapter" if args.adapter else spell(cfg, "lora.init_from")
    if spec is None:  # the transformers engine's adapter: PEFT's own merge on transformers' model
        done = peft.merge_transformers(source.hf_dir(cfg), adapter_dir, out, key=key, dtype=parse_dtype(args.dtype),
                                       trust_remote_code=cfg.model.trust_remote_code,
                                       linearized=cfg.model.linearized_experts)
    else:
        done = peft.merge(source.hf_dir(cfg), adapter_dir, out, spec, arch, key=key, dtype=parse_dtype(args.dtype))
    print(f"merged {adapter_dir} into {source.hf_dir(cfg)}: wrote {done} (in fp32, stored as "
          f"{args.dtype or 'the base'}'s dtype)")
    return 0


def run(args) -> int:
    if args.verb == "hf-to-megatron":
        from adapter.convert.to_megatron import hf_to_megatron

        out = hf_to_megatron(args.hf, args.out, tp=args.tp, dtype=args.dtype,
                             vocab_divisible_by=args.vocab_divisible_by, overwrite=args.overwrite,
                             progress=not args.no_progress)
        print(f"wrote Megatron checkpoint {out} (loads at any tp that divides its padded vocab)")
        return 0
    if args.verb == "megatron-to-hf":
        from adapter.convert.to_hf import megatron_to_hf

        out = megatron_to_hf(args.megatron, args.out, dtype=args.dtype, shard_size=args.shard_size,
                             overwrite=args.overwrite, progress=not args.no_progress)
        print(f"wrote HF checkpoint {out}")
        return 0
    from adapter.convert.verify import verify

    report = verify(args.hf, args.megatron, logits=not args.no_logits, seq_len=args.seq_len, atol=args.atol)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print(f"tensors: {report['exact']}/{report['tensors']} bit-exact, "
              f"max |delta weight| {report['max_abs_weight_diff']:.3g}")
        for t in report["mismatched"]:
            print(f"  differs: {t['name']} max |delta| {t['max_abs_diff']:.3g}")
        if "max_abs_logit_diff" in report:
            print(f"logits: max |delta| {report['max_abs_logit_diff']:.3g} (atol {report['atol']:g})")
        print("OK" if report["ok"] else "MISMATCH")
    return 0 if report["ok"] else 1
