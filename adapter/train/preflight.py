"""Checks a run can fail on before any process starts, beyond those of resolving it (architecture vs layout, the ZeRO
stage, the first weights: adapter/models/resolved.py): data files, the converted checkpoint, tokenizer, metrics
sinks, the checkpoint to resume. Torch-free: `nd-adapter train` and `rehearse` run them in the launching process,
which starts the training processes only when they pass."""
from __future__ import annotations

from pathlib import Path

from adapter.config import RunConfig
from adapter.data import TEXT_SUFFIXES, expand_files, iter_documents
from adapter.data.sft import check as check_sft
from adapter.errors import bad
from adapter.models import source
from adapter.models.resolved import ResolvedRun
from adapter.train import ckpt_info


def check_checkpoint(run: ResolvedRun) -> None:
    """model.checkpoint is a converted checkpoint (that it is the model.path's model was checked when the run was
    resolved: source.check_converted)."""
    ckpt = run.cfg.model.checkpoint
    if ckpt and (not Path(ckpt).is_dir() or not (Path(ckpt) / source.TRACKER).is_file()):
        raise bad("model.checkpoint", ckpt,
                  f"not a converted Megatron checkpoint (no {source.TRACKER})",
                  "convert first: nd-adapter convert hf-to-megatron --hf MODEL --out DIR")


def check_data(cfg: RunConfig) -> None:
    """Read each file's first document: a wrong data.text_key or a non-JSON line is otherwise found by the workers,
    after every process has started, and only once the token cache is being built inside checkpoint.dir."""
    for path in expand_files(cfg.data.files):
        if path.suffix.lower() in TEXT_SUFFIXES:  # no key to get wrong; a first paragraph can be the whole file
            continue
        docs = iter_documents(path, cfg.data.text_key)
        try:
            next(docs, None)
        finally:
            docs.close()


def _importable(module: str) -> bool:
    try:
        __import__(module)  # what the sink will import (torch's writer: only when TensorBoard is asked for)
    except ImportError:
        return False
    return True


def check_sinks(tensorboard_dir: str | None, wandb_project: str | None) -> None:
    """A sink that is asked for but not installed is a config error, found before training starts (HF Trainer's
    `report_to` refuses the same), not a run that silently logs nowhere."""
    if tensorboard_dir and not _importable("torch.utils.tensorboard"):
        raise bad("logging.tensorboard", tensorboard_dir, "the tensorboard package is not installed",
                  "pip install tensorboard (or nd-adapter[logging]), or remove logging.tensorboard")
    if wandb_project and not _importable("wandb"):
        raise bad("logging.wandb_project", wandb_project, "the wandb package is not installed",
                  "pip install wandb (or nd-adapter[logging]), or remove logging.wandb_project")


def preflight(run: ResolvedRun, *, resume: bool = False, need_data: bool = True, saves: bool = True,
              sinks: bool = True) -> None:
    """What `resolve_run` could not check from the config and config.json alone: the files the run will read.
    `saves`: the run writes its checkpoints into checkpoint.dir (a rehearsal writes into its own directory);
    `sinks`: its TensorBoard / W&B logging is installed (a rehearsal logs to neither, so it does not ask)."""
    cfg = run.cfg
    check_checkpoint(run)
    if cfg.data.datasets:  # SFT: types, keys and sources (hub ids in the local cache), nothing tokenised yet
        check_sft(cfg)
    elif need_data and not cfg.data.synthetic:
        if not cfg.data.files:
            raise bad("data.files", [], "no training data given", "list jsonl/txt/parquet files under data.files")
        check_data(cfg)
    if sinks:
        check_sinks(cfg.logging.tensorboard, cfg.logging.wandb_project)
    if resume and not cfg.checkpoint.dir:
        raise bad("checkpoint.dir", None, "--resume needs a checkpoint directory", "set checkpoint.dir in the config")
    if saves:  # a file there, or a fresh start over another run's checkpoints
        ckpt_info.check_dir(cfg, resume)
    if resume:  # before any process starts: the record, every file's size, the layout
        ckpt_info.check_resumable(cfg, run.arch.architecture)
