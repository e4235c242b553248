"""The kernels the model runs, independent of Megatron's module structure: core attention with context parallelism
(`attention.py`), attention over packed documents (`varlen.py`) and the THD stream it reads (`thd.py`), the ring
both ring attentions pass K/V around (`ring.py`), fused RoPE and cross-entropy (`fusions.py`), fp8 matmuls
(`fp8.py`)."""
