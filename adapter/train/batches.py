"""A run's data on one rank: the training set and its resumable sampler, the held-out set, and how a host
micro-batch becomes this rank's device batch (unpacked SFT trimmed, the CP slice or the packed THD stream).

Kept apart from the loop (adapter/train/trainer.py), which asks `load` once and `trim`/`place` per micro-batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from adapter.data import DPSampler, PackedDataset, SyntheticData, build_token_cache
from adapter.data.sft import prepare
from adapter.data.sft.bins import trim_tail
from adapter.data.sft.preference import row_lengths, shared_prefix
from adapter.data.sft.report import stats_lines
from adapter.errors import bad
from adapter.kernels.attention import split_for_cp
from adapter.kernels.thd import local_multiple, pack_batch, pairs_to_shared_stream, rows_to_stream
from adapter.models import source
from adapter.models.resolved import ResolvedRun

TRIM_MULTIPLE = 64  # unpacked SFT micro-batches are cut to a multiple of this (and of 2·cp·tp for CP and SP)


@dataclass
class RunData:
    """What `load` found: the training set, its sampler, and for SFT the held-out set and the chat template (the
    export writes it beside the tokenizer)."""
    dataset: Any
    sampler: DPSampler
    sft: Any = None                 # adapter.data.sft.SFTData, for SFT datasets
    val: Any = None                 # the held-out set, or None
    chat_template: str | None = None


def shuffles(cfg) -> bool:
    """Whether each epoch takes the samples in a new seeded order: not for KTO (TRL's KTOTrainer samples its rows in
    the order they were prepared: adapter/train/kto.py) nor under data.curriculum (Axolotl's curriculum_sampling: a
    SequentialSampler), which train them in their prepared order every epoch."""
    return cfg.objective != "kto" and not cfg.data.curriculum


def load(run: ResolvedRun, rank: int, *, synthetic: bool, log=print) -> RunData:
    """Packed, resumable batches for this rank's data shard: SFT datasets (masked examples, a held-out part),
    pretraining text, or synthetic tokens when the run has no data. Collective: rank 0 builds, the rest wait."""
    cfg, layout = run.cfg, run.layout
    sft = val = template = None
    if cfg.objective != "sft":  # preference pairs (adapter/data/sft/preference.py)
        from adapter.data.sft.preference import stats_lines as pair_lines
        from adapter.data.sft.preference_kto import prepare_rows

        sft = prepare_rows(cfg, source.tokenizer_dir(cfg), run.arch.vocab_size, builder=rank == 0,
                            barrier=dist.barrier, progress=rank == 0)
        dataset, val, template = sft.train, sft.val, sft.chat_template
        for line in pair_lines(sft) if rank == 0 else []:
            log(line.strip())
    elif cfg.data.processor_type:  # image-text rows, batched by the processor (adapter/data/sft/multimodal.py)
        from adapter.data.sft import multimodal

        # every rank runs the towers in every micro-batch where their weights are gathered (ZeRO-3) or their
        # gradients reduced (any data parallelism): multimodal.MultimodalRows.filler
        dataset, val, template = multimodal.load(cfg, run.weights.model_dir, source.tokenizer_dir(cfg),
                                                 run.arch.vocab_size, filler=run.zero_stage == 3 or layout.dp > 1)
        sft = dataset
        if rank == 0:
            log(f"data: {len(dataset)} image-text rows" + (f", {len(val)} held out" if val is not None else "") +
                f"; each micro-batch rendered by the processor (the {dataset.strategy_label()} format)")
    elif cfg.data.datasets and not synthetic:
        sft = prepare(cfg, source.tokenizer_dir(cfg), run.arch.vocab_size, builder=rank == 0, barrier=dist.barrier,
                      progress=rank == 0)
        dataset, val, template = sft.train, sft.val, sft.chat_template
        if rank == 0:
            for line in stats_lines(sft):
                log(line.strip())
    elif synthetic:
        dataset = SyntheticData(run.arch.vocab_size, cfg.seq_len, cfg.seed, doc_len=cfg.data.synthetic_doc_len)
    else:
        if not cfg.data.files:
            raise bad("data.files", [], "no training data given", "list jsonl/txt/parquet files under data.files")
        cache_dir = cfg.data.cache_dir or str(Path(cfg.checkpoint.dir or ".") / "token-cache")
        tok = build_token_cache(cfg.data.files, source.tokenizer_dir(cfg), cache_dir, text_key=cfg.data.text_key,
                                builder=rank == 0, barrier=dist.barrier, progress=rank == 0, tokens=cfg.data.tokens)
        dataset = PackedDataset(tok, cfg.seq_len)
    sampler = DPSampler(len(dataset), dp_rank=layout.data_rank(rank), dp_size=layout.dp,
                        micro_batch=cfg.batch.micro_batch_size, seed=cfg.data.seed,
                        shuffle=shuffles(cfg),
                        data_key="datasets" if sft else "data.files")
    return RunData(dataset, sampler, sft, val, template)


def trim(run: ResolvedRun, sft: bool, b, eval: bool = False):
    """Unpacked SFT micro-batches lose their untrained tail (adapter.data.sft.bins.trim_tail); packed or
    pretraining batches (documents, fixed THD streams) are kept whole."""
    cfg, layout = run.cfg, run.layout
    d = cfg.data
    packed = (d.eval_sample_packing if eval and d.eval_sample_packing is not None else d.sample_packing)
    if not sft or packed or cfg.document_attention or d.processor_type:  # (image tokens stay with their images)
        return b
    sp_tp = layout.tp if cfg.use_sequence_parallel else 1
    return trim_tail(b, math.lcm(TRIM_MULTIPLE, 2 * layout.cp * sp_tp))


CP_MODEL_KEYS = ("tokens", "labels", "loss_mask", "position_ids")  # what the model reads of a micro-batch


def place(run: ResolvedRun, cp_rank: int, device, b):
    """This rank's part of a host micro-batch, on the device: its CP slice, or, for documents
    (cfg.document_attention), one packed stream with its PackedDocs under "packed_seq_params" -- on both engines
    alike, but for transformers' own attention at cp = 1 (checks.own_attention), whose masks confine documents by
    their positions (hf_build)."""
    cfg, layout = run.cfg, run.layout
    if cfg.padding_free_pairs() or run.shares_prompt:
        return _padding_free(run, cp_rank, device, b)
    packed = None
    if not run.arch.native and not cfg.document_attention and ("position_ids" in b or layout.cp > 1):
        # transformers' model: one causal stream per sample, as the native engine runs it
        b = {**b, "position_ids": torch.arange(b["tokens"].shape[1]).expand_as(b["tokens"])}
    # (transformers' model at cp = 1 keeps its documents as positions that restart at each one)
    if cfg.document_attention and (run.arch.native or layout.cp > 1 or run.own_attention):
        sp_tp = layout.tp if cfg.use_sequence_parallel else 1
        b, packed = pack_batch(b, cp_size=layout.cp, cp_rank=cp_rank,
                               multiple=local_multiple(cfg.seq_len, layout.cp, sp_tp))
    elif layout.cp > 1 and cfg.objective != "sft":  # preference rows: the model's inputs split (cp_*), the rest
        # whole, for the per-sequence sums every CP rank then computes alike (adapter/train/dpo.py)
        b = {**b, **{f"cp_{k}": split_for_cp(b[k], layout.cp, cp_rank, seq_dim=1) for k in CP_MODEL_KEYS}}
    elif layout.cp > 1:
        b = {k: split_for_cp(v, layout.cp, cp_rank, seq_dim=1) for k, v in b.items()}
    # non_blocking: a blocking host->device copy would wait for every kernel queued so far (the previous step)
    b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
    if packed is not None:
        b["packed_seq_params"] = packed.to(device)
    return b


def _padding_free(run: ResolvedRun, cp_rank: int, device, b):
    """Preference rows ([rows, s], right-padded) kept whole for the per-sequence sums, and beside them, under pf_*,
    what the model runs: one stream of the rows' real tokens (this CP rank's chunks of each), documents confined
    as packed SFT's are on either engine, `pf_row_index` / `pf_real` saying where each token's loss goes back
    (adapter/train/dpo.py)."""
    cfg, layout = run.cfg, run.layout
    sp_tp = layout.tp if cfg.use_sequence_parallel else 1
    if run.shares_prompt:  # each pair's prompt once (cp = 1: checks.prompt_sharing)
        stream, packed = pairs_to_shared_stream(b, row_lengths(b).long(), shared_prefix(b), multiple=sp_tp)
    else:
        stream, packed = pack_batch(rows_to_stream(b, row_lengths(b).long()), cp_size=layout.cp, cp_rank=cp_rank,
                                    carry=("row_index", "real"), multiple=local_multiple(cfg.seq_len, layout.cp, sp_tp))
    out = {**b, **{f"pf_{k}": v for k, v in stream.items()}}
    out = {k: v.to(device, non_blocking=True) for k, v in out.items()}
    out["pf_packed_seq_params"] = packed.to(device)
    return out


__all__ = ["RunData", "TRIM_MULTIPLE", "load", "trim", "place"]
