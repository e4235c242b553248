"""The model: architecture facts from an HF config.json (`arch.py`), one record per family with its weight table
(`families.py`), config×architecture checks (`checks.py`), Megatron-Core GPTModel construction (`gpt.py`) with this
project's attention (`attention.py`), fused kernels (`fusions.py`) and compiled layers (`compile.py`)."""
