"""Per-process entry: what `launch/train.py` runs under deepspeed/torchrun, and what `nd-adapter train` spawns."""
from __future__ import annotations

import argparse
import os
import sys
import warnings

from adapter.errors import EXIT_USAGE, DivergedError, UserError

ERROR_DIR = "ND_ADAPTER_ERROR_DIR"  # where non-zero ranks leave their one-line error for the local launcher


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="launch/train.py", description="nd-adapter training process")
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    ap.add_argument("--rehearse", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", "--local-rank", type=int, help="set by the deepspeed launcher")
    return ap.parse_args(argv)


def quiet_third_party() -> None:
    """Megatron, DeepSpeed and torch warn about optional kernels and deprecations at every rank: keep the log
    readable."""
    import logging

    for category in (FutureWarning, UserWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(torch|megatron|deepspeed)\.")
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|CUDA_DEVICE_MAX_CONNECTIONS|cuda_graph).*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


def main(argv=None) -> int:
    args = parse(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    rank = int(os.environ.get("RANK", 0))
    quiet_third_party()
    try:
        from adapter import config
        from adapter.train.engine import init_distributed
        from adapter.train.trainer import run

        world = int(os.environ.get("WORLD_SIZE", 1))
        overrides = config.parse_sets(args.set)
        if args.max_steps is not None:
            overrides["optimizer.max_steps"] = args.max_steps
        if args.rehearse:
            from adapter.train.rehearse import rehearsal_config

            cfg, arch = rehearsal_config(config.load(args.config, world_size=world), args.steps, args.seq_len,
                                         args.workdir)
        else:
            cfg, arch = config.load(args.config, world_size=world, overrides=overrides), None
        # Large one-off allocations (the optimizer step's fp32 gradient partition) otherwise fail on fragmentation
        # with memory free in total (issue 19); torchtitan sets the same. Read at CUDA's first allocation, so here.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        if cfg.parallelism.tp_size > 1:  # Megatron's TP/SP comm is issued in order with compute; without TP it would
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # only serialise ZeRO's side-stream collectives
        timeout = cfg.dist_timeout_s  # an explicit $DEEPSPEED_TIMEOUT (minutes) wins over the default
        if "dist_timeout_s" not in cfg.model_fields_set and os.environ.get("DEEPSPEED_TIMEOUT"):
            timeout = None
        init_distributed(timeout)
        log = lambda s: print(s, flush=True)  # noqa: E731
        if not args.rehearse:
            run(cfg, resume=args.resume, arch=arch, log=log)
            return 0
        # rehearsal: train half, save; resume from that checkpoint in a fresh engine; train to the end
        synthetic = not cfg.data.files and not cfg.data.datasets
        half = cfg.checkpoint.save_every
        first = cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(update={"max_steps": half})})
        a = run(first, synthetic_data=synthetic, arch=arch, log=log)
        b = run(cfg, resume=True, synthetic_data=synthetic, arch=arch, log=log)
        if b.start_step != half:
            raise RuntimeError(f"rehearsal resumed at step {b.start_step}, expected {half}")
        if rank == 0:
            print(f"rehearsal ok: {cfg.world_size} processes, layout {cfg.parallelism.dp_replicate_size}x"
                  f"{cfg.parallelism.dp_shard_size}x{cfg.parallelism.cp_size}x{cfg.parallelism.tp_size}, "
                  f"saved at step {half} and resumed, losses {[round(x, 4) for x in a.losses + b.losses]}", flush=True)
        return 0
    except UserError as e:
        _report(rank, f"nd-adapter: error: {e}")
        return EXIT_USAGE
    except DivergedError as e:
        _report(rank, f"nd-adapter: training stopped: {e}")
        return EXIT_USAGE


def _report(rank: int, line: str) -> None:
    """One line for the user. Rank 0 prints it; every rank also leaves it for `nd-adapter train`'s local launcher,
    which prints the first failed rank's line only when rank 0 left none (so an error only one rank sees still
    reaches the user, and a collective one is said once)."""
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
    if os.environ.get(ERROR_DIR):
        from pathlib import Path

        Path(os.environ[ERROR_DIR], f"rank{rank}.txt").write_text(line)


if __name__ == "__main__":
    raise SystemExit(main())
