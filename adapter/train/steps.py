"""One optimizer step's numbers: the device vector they travel in (one all-reduce and one host copy, read one
micro-batch late so the host never waits for the GPU between steps), their reading on the host, and the masked loss
sum every micro-batch contributes (the loss normalisation is adapter/train/trainer.py's module docstring)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from adapter.train import metrics


@dataclass(frozen=True)
class StepStats:
    """One optimizer step's numbers, on the host."""
    step: int
    loss: float                  # the step's loss, as logged: Σ per-token loss / trained tokens of the step
    trained_tokens: int          # the step's, over all micro-batches and ranks
    computed_tokens: int         # positions the step ran (all of seq_len, or less where unpacked SFT is trimmed)
    nonfinite_grad: bool         # the global grad norm was inf/NaN
    grad_norm: float | None      # None when DeepSpeed computed none (no clipping)
    lr: float
    seconds: float
    aux_loss: float = 0.0        # a mixture of experts' load-balancing loss (no coefficient), mean of the micro-batches


# The device-side vector a step's numbers travel in: one all-reduce and one host copy, read one micro-batch late.
LOSS, NONFINITE, TRAINED_TOKENS, COMPUTED_TOKENS, GRAD_NORM, GRAD_NORM_ON_DEVICE, STOP, AUX = range(8)


@dataclass
class PendingStep:
    """A finished step whose numbers are still on their way to the host (metrics.HostReadback)."""
    step: int
    values: object               # HostReadback of the float64 vector indexed above
    host_grad_norm: float | None  # DeepSpeed's global grad norm when it is a host float (or None), else unused
    lr: float
    clock: tuple                 # metrics.StepClock handle
    extra: object = None         # DPO's reward metrics (HostReadback of adapter/train/dpo.METRICS), else None

    def read(self) -> StepStats:
        v = self.values.values()
        grad_norm = v[GRAD_NORM] if v[GRAD_NORM_ON_DEVICE] else (
            None if self.host_grad_norm is None else float(self.host_grad_norm))
        return StepStats(self.step, v[LOSS], int(v[TRAINED_TOKENS]), int(v[COMPUTED_TOKENS]), v[NONFINITE] > 0,
                         grad_norm, self.lr, metrics.StepClock.seconds(self.clock), v[AUX])


def masked_loss_sum(model, batch, moe: bool = False):
    """Σ loss_mask · per-token loss of one micro-batch (fp32 scalar). A model built with the fused linear
    cross-entropy returns that sum itself when handed the loss_mask (no [tokens × vocab] logits); others return
    per-token losses, summed here. Packed documents travel as `packed_seq_params` (adapter/kernels/thd.py). A
    mixture of experts (`moe`) gets the batch's attention_mask as Megatron's padding_mask: padding is routed but
    left out of the load-balancing statistic, as transformers leaves it out."""
    extra = {"padding_mask": batch["attention_mask"].bool()} if moe and "attention_mask" in batch else {}
    extra.update({k: v for k, v in batch.items() if k.startswith("mm_")})  # an image-text batch's processor tensors
    out = model(batch["tokens"], batch.get("position_ids"), None, labels=batch["labels"], loss_mask=batch["loss_mask"],
                packed_seq_params=batch.get("packed_seq_params"), **extra)
    return out.float() if out.dim() == 0 else (out.float() * batch["loss_mask"]).sum()


def nonfinite(grad_norm, device):
    """1.0 on the device when DeepSpeed's grad norm is inf/NaN (ZeRO-1/2 mask it to -1), else 0.0; no host sync."""
    if grad_norm is None:  # no clipping: DeepSpeed computed no norm
        return torch.zeros((), dtype=torch.float64, device=device)
    g = torch.as_tensor(grad_norm, dtype=torch.float64, device=device)
    return (~torch.isfinite(g) | (g < 0)).double()


__all__ = ["StepStats", "PendingStep", "masked_loss_sum", "nonfinite", "LOSS", "NONFINITE", "TRAINED_TOKENS",
           "COMPUTED_TOKENS", "GRAD_NORM", "GRAD_NORM_ON_DEVICE", "STOP", "AUX"]
