"""HF <-> Megatron-Core checkpoint conversion: streamed, TP-resharding, bit-exact round trip.

Entry points (adapter/convert/ops.py; the CLI is `nd-adapter convert ...`, adapter/convert/cli.py):
    hf_to_megatron(hf_dir, out_dir, tp=1, *, dtype=None, vocab_divisible_by=128, overwrite=False, progress=True)
    megatron_to_hf(megatron_dir, out_dir, *, dtype=None, shard_size="5GB", overwrite=False, progress=True)
    verify(hf_dir, megatron_dir, *, logits=True, seq_len=32, batch=2, seed=0, atol=1e-5) -> report dict
    load_megatron_checkpoint(model, ckpt_dir, *, strict=True) -> nd_adapter.json dict   (collective, any TP)

Converted checkpoint layout (Megatron-LM's for a converted model):
    OUT/latest_checkpointed_iteration.txt   "release" (Megatron-LM refuses "0")
    OUT/release/                            torch_dist: metadata.json, common.pt (args, checkpoint_version), .metadata,
                                            __0_0.distcp (keys/chunks as GPTModel.sharded_state_dict at that tp)
    OUT/hf/                                 config.json, generation_config.json, tokenizer files of the source
    OUT/nd_adapter.json                     family, architecture, vocab_size, padded_vocab_size, vocab_divisible_by,
                                            dtype, source_tp, arch (ModelArch fields)
"""
from __future__ import annotations


def __getattr__(name):  # keep `import adapter.convert` light: torch/megatron load only when a function is used
    if name in ("hf_to_megatron", "megatron_to_hf", "verify", "load_megatron_checkpoint"):
        from adapter.convert import ops

        return getattr(ops, name)
    raise AttributeError(name)


__all__ = ["hf_to_megatron", "megatron_to_hf", "verify", "load_megatron_checkpoint"]
