"""The torch model: Megatron-Core's GPTModel built from a ModelArch with this project's kernels (`gpt.py`), and its
layers compiled (`compile.py`)."""
