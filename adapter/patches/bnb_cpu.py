"""bitsandbytes' NF4 linear on CPUs with AVX512-BF16: no switch to its inference kernel mid-run.

On such a CPU, bitsandbytes 0.50's `Linear4bit.forward` repacks the weight in place for its CPU inference kernel the
first time it runs in eval mode on an input without gradient, and every later forward, training ones included, then
computes through that kernel (bf16 arithmetic: 1.7e-3 off the training path on weights of 0.02). A QLoRA run on the
transformers engine runs eval-mode forwards before or between training steps (the eval, DPO's and KTO's reference
tables), so on those CPUs it silently trained at another precision from then on -- and differed from the same run on
a CPU without AVX512-BF16. The layers keep the one path they train with (`support_avx512bf16_for_cpu`, set per
instance in `Linear4bit.__init__`); GPUs never take that branch. Checked against bitsandbytes 0.50.2; unlike the other
patches it refuses no version: it only clears a flag where a layer has it (none: no such branch to avoid)."""
from __future__ import annotations

TESTED_BITSANDBYTES_VERSIONS = ("0.50.2",)


def one_cpu_path(model) -> None:
    """Every bitsandbytes 4-bit linear of `model` computes eval-mode forwards on CPU as it computes training ones."""
    import bitsandbytes as bnb

    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit) and hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False


__all__ = ["one_cpu_path", "TESTED_BITSANDBYTES_VERSIONS"]
