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


__all__ = ["Best"]
