"""One optimizer step's numbers: the device vector they travel in (one all-reduce and one host copy, read one
micro-batch late so the host never waits for the GPU between steps), their reading on the host, and the masked loss
sum every micro-batch contributes (the loss normalisation is adapter/train/trainer.py's module docstring), and the
held-out loss computed the same way."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from adapter.data import collate
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


def held_out_loss(trainer) -> tuple[float | None, int, dict[str, float]]:
    """(loss, trained tokens, extra metrics) over the whole held-out set: Σ per-token loss / trained tokens, the
    training step's masking and normalisation, no gradients; extra: a token classifier's accuracy over its labelled
    tokens (TRL's PRMTrainer compute_accuracy), else nothing. Every DP rank runs the same number of micro-batches
    (ZeRO gathers are collective); the last round is padded with fully masked copies of sample 0."""
    val, mb, layout = trainer.val_dataset, trainer.cfg.batch.micro_batch_size, trainer.layout
    n, per_round, dp_rank = len(val), layout.dp * mb, layout.data_rank(trainer.rank)
    sums = torch.zeros(3, dtype=torch.float64, device=trainer.device)  # + a token classifier's hits (hf_heads)
    ds = trainer.engine.ds
    head = getattr(ds, "module", ds)
    hits = hasattr(head, "hits")
    ds.eval()
    try:
        with torch.no_grad():
            for r in range(-(-n // per_round)):
                items = []
                for i in range(r * per_round + dp_rank * mb, r * per_round + (dp_rank + 1) * mb):
                    it = val[i] if i < n else dict(val[0])
                    if i >= n:
                        it["loss_mask"] = np.zeros_like(it["loss_mask"])
                    items.append(it)
                batch = trainer._on_device(trainer._trim(collate(val, items), eval=True))
                sums[:2] += torch.stack([trainer._loss_sum(batch).double(), batch["loss_mask"].double().sum()])
                sums[2] += head.hits.double() if hits else 0.0
    finally:
        ds.train()
    dist.all_reduce(sums, group=trainer.groups.dp_cp)
    total, count, right = sums.tolist()
    trainer.clock.reset()  # evaluation is not training time
    return (total / count if count else None), int(count), ({"accuracy": right / count} if hits and count else {})


__all__ = ["StepStats", "PendingStep", "masked_loss_sum", "nonfinite", "held_out_loss", "LOSS", "NONFINITE",
           "TRAINED_TOKENS", "COMPUTED_TOKENS", "GRAD_NORM", "GRAD_NORM_ON_DEVICE", "STOP", "AUX"]
