"""nd-adapter: run Accelerate/Axolotl ND-parallel configs on Megatron-Core process groups and DeepSpeed ZeRO-3."""

__version__ = "0.1.0"
