"""`nd-adapter` command line. Every user mistake ends as one line on stderr and exit status 2.

Everything imported here is torch-free (tests/unit/test_structure.py checks it): `plan`, `--help` and the config
checks before `train` starts its processes run on a laptop in well under a second. Conversion and training import
torch, Megatron-Core and DeepSpeed in the commands that run them (adapter/convert/cli.py, adapter/train/worker.py).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from collections.abc import Sequence

from adapter import __version__, config
from adapter.config.values import MAX_WORLD
from adapter.convert.cli import add_merge_parser
from adapter.convert.cli import add_parser as add_convert_parser
from adapter.data.sft import report
from adapter.data.sft.prepare import check_choices
from adapter.errors import EXIT_USAGE, UserError
from adapter.models import source
from adapter.models.resolved import resolve_run
from adapter.plan import calibrate, search
from adapter.plan.build import build_plan
from adapter.plan.render import render, render_search
from adapter.train import ckpt_info, rehearse, spawn


def _count(text: str) -> int:
    """A number of nodes, GPUs or processes: a whole number in [1, MAX_WORLD]."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= n <= MAX_WORLD:
        raise argparse.ArgumentTypeError(f"{n} is outside 1..{MAX_WORLD:,} (nd-adapter plans and runs at most "
                                         f"{MAX_WORLD:,} GPUs)")
    return n


def _gib(text: str) -> float:
    """GPU memory in GiB: a finite number above 0."""
    try:
        gib = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not (math.isfinite(gib) and gib > 0):
        raise argparse.ArgumentTypeError(f"{text} is not a positive, finite number of GiB (e.g. 80)")
    return gib


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + message
        raise UserError(f"{self.prog}: {message}. Fix: see `{self.prog} --help`")


def _world_overrides(args) -> dict:
    return {"hardware.nodes": args.nodes, "hardware.gpus_per_node": args.gpus_per_node, "hardware.gpu": args.gpu,
            "model.path": args.model, "deepspeed.replicate_mode": getattr(args, "replicate_mode", None)}


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF checkpoint dir or config.json (overrides the config's model path)")
    p.add_argument("--nodes", type=_count, help="number of nodes")
    p.add_argument("--gpus-per-node", type=_count, help="GPUs (processes) per node")
    p.add_argument("--gpu", help="GPU kind for the memory check (h100-80gb, h200, a100-80gb, a100-40gb, l40s)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. seq_len=8192")


def cmd_plan(args) -> int:
    if args.nodes is not None and args.gpus_per_node is None:
        raise UserError("--nodes given without --gpus-per-node. Fix: pass both, e.g. --nodes 2 --gpus-per-node 8")
    world = args.nodes * args.gpus_per_node if args.gpus_per_node is not None and args.nodes is not None else None
    if world is None and args.gpus_per_node is not None:
        world = args.gpus_per_node
    flags = {k: v for k, v in _world_overrides(args).items() if v is not None}  # an absent flag keeps a --set
    if args.search:
        if args.top < 1:
            raise UserError(f"--top={args.top}: must be at least 1. Fix: e.g. --top 10")
        found = search.run(args.config, config.parse_sets(args.set), flags, world, gpu_mem_gib=args.gpu_mem_gib)
        print(found.model_dump_json(indent=2)) if args.format == "json" else render_search(found, top=args.top)
        return 0
    cfg = source.load_config(args.config, overrides={**config.parse_sets(args.set), **flags}, world_size=world)
    run = resolve_run(cfg, gpu=True)  # the model's reasons first, then the data's that need no file: what
    check_choices(cfg)  # preprocess refuses; plan plans for GPUs
    doc = build_plan(run, config_path=args.config, gpu_mem_gib=args.gpu_mem_gib)
    doc.notes.extend(_resume_note(cfg, doc.model["architecture"]))
    if args.format == "json":
        print(doc.model_dump_json(indent=2))
    else:
        render(doc)
    return 0


def _resume_note(cfg, architecture: str) -> list[str]:
    """Whether this layout can resume the checkpoint the config's checkpoint.dir already holds."""
    key = config.spell(cfg, "checkpoint.dir")
    if not cfg.checkpoint.dir or ckpt_info.resume_tag(cfg.checkpoint.dir, key) is None:
        return []
    info = ckpt_info.read(cfg.checkpoint.dir, key=key)
    why, how = ckpt_info.resumable(info, cfg, architecture)
    return [f"--resume would continue {info.path} (step {(info.record or {}).get('step', '?')}, {info.layout_text()})"
            + (f": NOT by this run: {why}" if why else f": resumable by this layout, {how}")]


def cmd_calibrate(args) -> int:
    return calibrate.main(args, {k: v for k, v in _world_overrides(args).items() if v is not None})


def cmd_train(args) -> int:
    return spawn.main(args)


def cmd_rehearse(args) -> int:
    return rehearse.main(args)


def cmd_checkpoint(args) -> int:
    return ckpt_info.main(args)


def cmd_preprocess(args) -> int:
    return report.main(args)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="nd-adapter", description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="version", version=f"nd-adapter {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plan", help="dry-run: layout, groups, Megatron call, DeepSpeed JSON, memory, traffic")
    p.add_argument("config", help="YAML config (native, Axolotl or Accelerate)")
    _add_run_args(p)
    p.add_argument("--gpu-mem-gib", type=_gib, help="usable GPU memory, overrides --gpu")
    p.add_argument("--replicate-mode", choices=("hsdp", "hpz"), help="how dp_replicate maps onto DeepSpeed")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--search", action="store_true",
                   help="rank every valid layout for this world by predicted tokens/s/GPU (--set pins a part)")
    p.add_argument("--top", type=int, default=10, help="rows of --search's table (JSON has all)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("calibrate", help="micro-benchmark this machine's GPUs into a hardware profile for plan")
    p.add_argument("config", help="YAML config: the model and layout whose shapes are measured")
    _add_run_args(p)
    p.add_argument("--out", required=True, help="profile JSON to write (then: --set hardware.profile=PATH)")
    p.add_argument("--base", help="profile whose unmeasured parts (network, host costs) are kept (default: the GPU's)")
    p.add_argument("--iters", type=int, default=10, help="timed repetitions per measurement")
    p.set_defaults(func=cmd_calibrate)

    add_convert_parser(sub)
    add_merge_parser(sub)

    for name, func, text in (("train", cmd_train, "train on this machine's GPUs (single node; or use launch/)"),
                             ("rehearse", cmd_rehearse, "run the config's layout on CPU processes with a tiny model")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", required=True)
        p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
        p.add_argument("--max-steps", type=int, help="override optimizer.max_steps")
        p.add_argument("--nproc", type=_count, help="processes to start (default: the config's world size)")
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
        if name == "rehearse":
            p.add_argument("--steps", type=int, default=4, help="steps to rehearse")
            p.add_argument("--seq-len", type=int, help="shorter sequence for the rehearsal")
            p.add_argument("--gpu", action="store_true", help="every rank on this machine's one GPU (gloo; the "
                           "layout's CUDA kernels, at the run's precision): a correctness mode, not a speed mode")
        p.set_defaults(func=func)

    p = sub.add_parser("checkpoint", help="what a training checkpoint holds: `checkpoint info DIR`")
    p.add_argument("verb", choices=("info",))
    p.add_argument("dir", help="a run's checkpoint.dir (Axolotl: output_dir)")
    p.add_argument("--tag", help="global_stepN (default: what `latest` names)")
    p.add_argument("--checksums", action="store_true", help="CRC-32 of every file (reads them all)")
    p.set_defaults(func=cmd_checkpoint)

    p = sub.add_parser("preprocess", help="tokenise, mask and pack the SFT datasets once (the run's cache); stats")
    p.add_argument("--config", required=True)
    p.add_argument("--debug", action="store_true", help="print (token, label) pairs of a few samples")
    p.add_argument("--samples", type=int, default=3, help="samples --debug prints")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    p.set_defaults(func=cmd_preprocess)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    shown: set[str] = set()

    def show_warning(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        ours = os.sep + "adapter" + os.sep in filename  # only our own warnings reach the user, once each
        if category is UserWarning and ours and text not in shown:
            shown.add(text)
            print(f"nd-adapter: warning: {text}", file=sys.stderr)

    warnings.showwarning = show_warning
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"nd-adapter: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug in nd-adapter, not the user's input
        if os.environ.get("ND_ADAPTER_DEBUG"):
            raise
        print(f"nd-adapter: internal error: {e.__class__.__name__}: {e} "
              "(a bug; rerun with ND_ADAPTER_DEBUG=1 for the traceback and report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
