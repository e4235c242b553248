"""The best checkpoint and early stopping, kept as HF's Trainer keeps them (what Axolotl users get).

HF's bookkeeping, transformers 5.24 (`Trainer._determine_best_metric`, `_save_checkpoint`, `EarlyStoppingCallback`):
an evaluation after a training step is a new best when its eval loss is strictly lower than every earlier one;
a save at step s makes s the best checkpoint when s is that best step (an evaluation at a step that is not saved
can be the best loss and still name no checkpoint, and then the earlier best checkpoint stays). Early stopping
counts evaluations in a row that did not beat the best before them; at `patience` the run ends after that step.
The evaluation before the first step counts for neither (HF's eval_on_start goes around both).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch.distributed as dist


@dataclass
class Best:
    patience: int | None = None
    loss: float | None = None      # the lowest eval loss after a training step
    step: int | None = None        # where it was measured
    saved: int | None = None       # the best checkpoint: the step whose save recorded a new best
    saved_loss: float | None = None
    stale: int = 0                 # evaluations in a row without a new best

    def observe(self, step: int, loss: float) -> bool:
        """An evaluation after `step`; True when early stopping ends the run here."""
        if step <= 0:
            return False
        if self.loss is None or loss < self.loss:
            self.loss, self.step, self.stale = loss, step, 0
        else:
            self.stale += 1
        return self.patience is not None and self.stale >= self.patience

    def on_save(self, step: int) -> None:
        if self.step == step:
            self.saved, self.saved_loss = step, self.loss

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key in ("loss", "step", "saved", "saved_loss", "stale"):
            setattr(self, key, state.get(key))
        self.stale = self.stale or 0


def load(trainer, final: int) -> None:
    """HF's load_best_model_at_end: the weights of the best checkpoint replace the last ones before the export
    (`trainer`: adapter/train/trainer.Trainer, collective)."""
    from adapter.train import checkpoint as ckpt

    b = trainer.best
    if b.saved is None:
        trainer._say("best checkpoint: no saved step had a new best eval loss; the last model is exported")
        return
    trainer.result.best_step = b.saved
    if b.saved == final:
        trainer._say(f"best checkpoint: step {b.saved} (eval_loss {b.saved_loss:.4f}) is the last one")
        return
    ckpt.load(trainer.engine.ds, trainer.cfg.checkpoint.dir, tag=ckpt.tag_for(b.saved), restore_rng_state=False,
              trained_only=trainer.run.adapters, arch=trainer.arch, **trainer._where())
    trainer._say(f"best checkpoint: reloaded step {b.saved} (eval_loss {b.saved_loss:.4f}) in place of step "
                 f"{final}'s weights (load_best_model_at_end)")


def keep_only(trainer) -> None:
    """HF's end of a run with save_total_limit 1 (checkpoint.keep_last 1) and a best checkpoint (the eval loss
    tracked for load_best_model_at_end or early stopping): only the best checkpoint stays and `latest` names it
    (transformers' Trainer.train deletes the others). Collective."""
    from adapter.train import checkpoint as ckpt

    cfg, sched, b = trainer.cfg, trainer.schedule, trainer.best
    if not (cfg.checkpoint.dir and cfg.checkpoint.keep_last == 1 and b.saved is not None
            and (sched.load_best or sched.patience is not None)):
        return
    lineage = ckpt.run_lineage(trainer.engine.ds)
    if trainer.rank == 0:
        gone = ckpt.keep_only_best(cfg.checkpoint.dir, b.saved, lineage)
        if gone:
            trainer._say(f"checkpoints: kept only the best, {ckpt.tag_for(b.saved)} (save_total_limit 1, as HF's "
                         f"Trainer ends a run); deleted {', '.join(gone)}")
    dist.barrier()


__all__ = ["Best", "load", "keep_only"]
