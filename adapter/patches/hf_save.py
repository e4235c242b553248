"""`save_pretrained` on this rank, whatever the process group.

transformers 5.25's `PreTrainedModel.save_pretrained` writes files only where `should_save_on_this_rank` says so,
which is rank 0 alone once torch.distributed is initialised (transformers/distributed/mixin.py). nd-adapter saves a
random-weight model into each rank's own temporary directory and loads it back there (adapter/modeling/hf_build.py:
a 4/8-bit base from random weights goes through transformers' quantising loader, as a checkpoint would); on every
rank but 0 that directory stayed empty and the load failed. Checked against transformers 5.17 (the GPU host: no
such method, every rank saved) and 5.25 (CI): the instance's method is overridden for the one call and removed
after, so the model is as it was."""
from __future__ import annotations


def save_on_this_rank(model, directory: str) -> None:
    """model.save_pretrained(directory) written by this rank, rank 0 or not."""
    had = "should_save_on_this_rank" in vars(model)
    if hasattr(model, "should_save_on_this_rank"):
        model.should_save_on_this_rank = lambda is_main_process: True
    try:
        model.save_pretrained(directory)
    finally:
        if not had and "should_save_on_this_rank" in vars(model):
            del model.should_save_on_this_rank


__all__ = ["save_on_this_rank"]
