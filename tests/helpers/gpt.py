"""A small GPTModel's setting shared by the CPU and GPU model tests: a tiny HF config of a family (Llama-3.1 rope
scaling, Qwen2, Qwen3's head_dim) and Megatron's parallel state in this process."""
from __future__ import annotations

VOCAB = 200


def hf_config(family: str, **over):
    """The transformers config of `family` (llama, qwen2 or qwen3) at the tiny test size; `over` replaces keys."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16384, rms_norm_eps=1e-6,
                tie_word_embeddings=False)
    if family == "llama":  # Llama-3.1 rope scaling; theta large enough that scaled frequencies are exercised
        base.update(head_dim=16, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                    low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192))
        cls = LlamaConfig
    else:
        base.update(head_dim=24 if family == "qwen3" else 16, rope_parameters=dict(rope_type="default", rope_theta=1e6))
        cls = Qwen2Config if family == "qwen2" else Qwen3Config
    base.update(over)
    return cls(**base)


def init_megatron(tp: int = 1, cp: int = 1) -> None:
    """A gloo process group unless one exists, and Megatron's tp × cp groups over it (earlier ones destroyed)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
