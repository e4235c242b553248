"""nd-adapter: run Accelerate/Axolotl ND-parallel configs on Megatron-Core process groups and DeepSpeed ZeRO-3."""

import logging

__version__ = "0.1.0"

# torchao (a dependency: the 4-bit AdamW, adapter/train/optim_4bit.py) is imported by transformers' quantizers in every
# process that loads a model; its import logs the CUDA kernels a CPU build cannot load, and torch's logger the
# deprecation of its pytree registrations: warnings about nothing this run does, kept out of its first lines
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
