"""HF <-> Megatron-Core checkpoint conversion: streamed, TP-resharding, bit-exact round trip, checksummed.

One module per entry point (the CLI is `nd-adapter convert ...`, adapter/convert/cli.py):
    to_megatron.hf_to_megatron(hf_dir, out_dir, tp=1, *, dtype=None, vocab_divisible_by=128, overwrite=False)
    to_hf.megatron_to_hf(megatron_dir, out_dir, *, dtype=None, shard_size="5GB", overwrite=False)
    verify.verify(hf_dir, megatron_dir, *, logits=True, seq_len=32, batch=2, seed=0, atol=1e-5) -> report dict
    load.load_megatron_checkpoint(model, ckpt_dir, *, strict=True) -> nd_adapter.json dict   (collective, any TP)
    cache: the converted pre-trained weights a run starts from (built once, checked, loaded)
They execute a family's mapping table (adapter/models/families.py) through row plans (rows.py) over the HF files
(hf_io.py) and torch_dist chunks (megatron_io.py).

Converted checkpoint layout (Megatron-LM's for a converted model; names in adapter/models/source.py):
    OUT/latest_checkpointed_iteration.txt   "release" (Megatron-LM refuses "0")
    OUT/release/                            torch_dist: metadata.json, common.pt (args, checkpoint_version), .metadata,
                                            __0_0.distcp (keys/chunks as GPTModel.sharded_state_dict at that tp)
    OUT/hf/                                 config.json, generation_config.json, tokenizer files of the source
    OUT/nd_adapter.json                     family, architecture, vocab_size, padded_vocab_size, vocab_divisible_by,
                                            dtype, source_tp, arch (ModelArch fields), checksums, hf_files
"""
