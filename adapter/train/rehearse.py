"""`nd-adapter rehearse`: the config's exact layout and training path on CPU processes, with a tiny model.

The model keeps the family, head and KV-head counts and a mixture of experts' top-k (so every tp/cp/ep divisibility
rule is exercised) but shrinks head_dim, width, depth, each expert and the number of experts to at most
`TINY_EXPERTS` or twice top-k, rounded up to whole experts on every ep rank (Qwen3-30B-A3B's 128 experts at ep=4
become 16: four per rank, top-8 of them; 128 narrow experts made its rehearsal several times slower and exercised
nothing the 16 do not; the first lines say the count); precision becomes fp32 (CPU; `--gpu`: the ranks share this
machine's GPU through gloo at the run's precision, adapter/parallel/shared_gpu.py). It keeps every rule the real
model meets, since the real run has passed them already: a QLoRA base's NF4 blocks of 64 inside each rank's rows (a
head_dim of 8 gives Qwen2-7B's 28 heads a width of 224, so head_dim grows to the smallest multiple of 8 that makes
the width a multiple of 64 × tp), and a check the tiny model still fails is said as the rehearsal's, never as the
user's key. One process per rank, gloo + DeepSpeed's CPU accelerator. It trains a few steps, saves, resumes from
that checkpoint and trains on: config, layout, data and checkpoint mistakes surface here instead of on the GPUs.
Data files are tokenised when the config has them (with the real tokenizer; the tiny model's vocabulary is every id
that tokenizer can produce, so a test tokenizer of a thousand tokens does not pay for config.json's 128k-row LM
head); otherwise synthetic tokens are used.

`main` runs in the launching process (torch-free, like `plan`); `in_process` is the procedure every spawned training
process runs (adapter/train/worker.py).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

from adapter import config
from adapter.config import RunConfig, spell
from adapter.errors import UserError, bad
from adapter.models import announce, source
from adapter.models.arch import ModelArch, config_path, load_arch
from adapter.models.freeze import UnmatchedPattern
from adapter.models.lora import NF4_BLOCK
from adapter.models.resolved import ResolvedRun, resolve_run
from adapter.models.source import WeightsSource
from adapter.models.tiny import tiny_config
from adapter.parallel import shared_gpu
from adapter.train.preflight import preflight
from adapter.train.spawn import GPU_DEVICES, spawn

TINY_HEAD_DIM = 8
TINY_LAYERS = 2
TINY_EXPERTS = 8


def tiny_experts(arch: ModelArch, ep: int) -> int | None:
    """The rehearsal's expert count: the model's when small, else the fewest that still hold top-k and put whole,
    equally many experts on each of the `ep` ranks (module docstring)."""
    if not arch.moe or arch.num_experts is None or arch.num_experts <= TINY_EXPERTS:
        return arch.num_experts
    want = max(TINY_EXPERTS, 2 * arch.experts_per_token)  # top-k of twice as many: the router still chooses
    return min(arch.num_experts, -(-want // ep) * ep)
SYNTHETIC_VOCAB = 1024


def tiny_head_dim(heads: int, tp: int, block: int) -> int:
    """The smallest multiple of TINY_HEAD_DIM whose `heads` heads are a width that is a multiple of `block` × tp:
    every linear's input per TP rank (the hidden size, the attention's heads / tp, the MLP's 2·hidden) then holds
    whole blocks."""
    return math.lcm(heads * TINY_HEAD_DIM, block * tp) // heads


def tiny_arch(arch: ModelArch, tp: int, vocab: int | None, block: int = 1, ep: int = 1) -> ModelArch:
    """`vocab`: the tokenizer's (ids it can produce), None for synthetic tokens; `block`: the multiple every
    linear's input width per TP rank must be (NF4's 64 for a QLoRA base, else 1); `ep`: the run's expert-parallel
    size."""
    head_dim = tiny_head_dim(arch.num_heads, tp, block)
    hidden = arch.num_heads * head_dim
    rot = int(head_dim * arch.rotary_fraction) // 2 * 2  # partial rotary: an even number of rotated dims
    def spread(factors):  # LongRoPE: as many of its factors as the tiny head rotates frequencies, spread evenly
        return None if factors is None else tuple(factors[round(i * (len(factors) - 1) / max(rot // 2 - 1, 1))]
                                                  for i in range(rot // 2))
    kinds = arch.window_layers
    if kinds is not None:  # one layer of each kind the model has (Gemma: a sliding one and a global one)
        kinds = (True, False) if True in kinds and False in kinds else kinds[:TINY_LAYERS]
    return dataclasses.replace(arch, hidden_size=hidden, head_dim=head_dim, num_layers=TINY_LAYERS,
                               ffn_hidden_size=2 * hidden * tp, max_position_embeddings=4096,
                               # rows for every id the tokenizer makes, rounded up to 32 (resize_vocab_to_32x)
                               vocab_size=SYNTHETIC_VOCAB if vocab is None else min(arch.vocab_size,
                                                                                    -(-vocab // 32) * 32),
                               rotary_fraction=rot / head_dim, rope_short_factor=spread(arch.rope_short_factor),
                               rope_long_factor=spread(arch.rope_long_factor), window_layers=kinds,
                               # a window shorter than the rehearsal's sequences, so windowed attention runs
                               sliding_window=None if arch.sliding_window is None else min(arch.sliding_window, 24),
                               embed_scale=None if arch.embed_scale is None else float(hidden) ** 0.5,
                               # a mixture of experts keeps its top-k and ep's divisibility, each expert narrow
                               num_experts=tiny_experts(arch, ep),
                               expert_ffn_hidden_size=2 * TINY_HEAD_DIM * tp if arch.moe else None)


# a checkpoint's processor and tokenizer files, which an image-text run's AutoProcessor reads beside config.json
_PROCESSOR_FILES = (".json", ".jinja", ".model", ".txt", ".tiktoken")
_NOT_PROCESSOR = ("config.json", "generation_config.json")


def tiny_transformers(cfg: RunConfig, arch: ModelArch, vocab: int | None, workdir: str):
    """The transformers engine's tiny model: config.json cut small (adapter/models/tiny.py), written
    into the rehearsal's directory (each rank writes the same file, atomically) with the checkpoint's own code
    files for remote code and, for an image-text run, its processor's files; (its ModelArch, the random weights it
    starts from)."""
    src = source.hf_dir(cfg)
    raw = json.loads(config_path(src).read_text())
    rows = SYNTHETIC_VOCAB if vocab is None else min(arch.vocab_size, -(-vocab // 32) * 32)
    out = Path(workdir) / "tiny-model"
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():  # remote code; an image-text run's processor files (its processor loads from here)
        if f.is_file() and (f.suffix == ".py" or cfg.data.processor_type and f.name not in _NOT_PROCESSOR
                            and f.suffix in _PROCESSOR_FILES and not f.name.endswith(".index.json")):
            shutil.copyfile(f, out / f.name)
    tmp = out / f".config.{os.getpid()}.json"
    ep = cfg.parallelism.ep_size  # whole, equally many experts on each expert-parallel rank
    experts = min(arch.ep_experts, -(-4 // ep) * ep) if arch.ep_experts else 4
    tmp.write_text(json.dumps(tiny_config(raw, rows, max(experts, 4)), indent=2))
    os.replace(tmp, out / "config.json")
    try:
        tiny = load_arch(out, "transformers", cfg.model.trust_remote_code, linearized=cfg.model.linearized_experts)
    except UserError as e:
        raise bad("rehearse", arch.architecture, f"the tiny copy of its config does not build ({e})",
                  "plan the run and start it directly; the rehearsal cannot shrink this architecture yet") from None
    return (dataclasses.replace(tiny, engine_reason=arch.engine_reason),
            WeightsSource("random", str(out), reason="the rehearsal's tiny model"))


def tokenizer_vocab(cfg: RunConfig) -> int | None:
    """One more than the largest id the run's tokenizer (with its added tokens) produces; None where no tokenizer is
    found (the data preparation then says so in its own words)."""
    from transformers import AutoTokenizer  # heavy; the launching side of this module stays torch-free

    try:
        tok_dir = source.tokenizer_dir(cfg)
    except UserError:
        return None
    if cfg.data.mistral_common:  # a tekken.json alone: mistral-common's own vocabulary
        from adapter.data.sft.tokenizer import mistral_tokenizer

        return len(mistral_tokenizer(tok_dir, spell(cfg, "data.mistral_common")))
    return max(AutoTokenizer.from_pretrained(str(tok_dir)).get_vocab().values()) + 1


def rehearsal_seq_len(cfg: RunConfig, seq_len: int | None) -> int:
    p = cfg.parallelism
    unit = math.lcm(2 * p.cp_size if p.cp_size > 1 else 1, p.cp_size * p.tp_size)
    # SFT examples carry their prompt (Alpaca's preamble alone is ~50 tokens): room for whole examples
    want = seq_len or min(cfg.seq_len, 512 if cfg.data.datasets else 64)
    return max(unit, want // unit * unit)


def rehearsal(run: ResolvedRun, steps: int, seq_len: int | None, workdir: str) -> ResolvedRun:
    """The rehearsal of `run`: its config on the tiny model; `workdir` (shared by all ranks) takes its checkpoints
    and token cache."""
    cfg, arch = run.cfg, run.arch
    vocab = (tokenizer_vocab(cfg) or arch.vocab_size) if cfg.data.files or cfg.data.datasets else None
    nf4 = run.lora is not None and run.lora.quantize_base == "nf4"
    weights = None
    if arch.native:
        tiny = tiny_arch(arch, cfg.parallelism.tp_size, vocab, NF4_BLOCK if nf4 else 1, cfg.parallelism.ep_size)
    else:  # transformers builds the tiny model from a small config.json of the same architecture
        tiny, weights = tiny_transformers(cfg, arch, vocab, workdir)
    ckdir = workdir
    half = max(1, steps // 2)
    seq = rehearsal_seq_len(cfg, seq_len)
    gpu = shared_gpu.on()  # `rehearse --gpu`: the run's own precision on the GPU's kernels
    said = [n for n in cfg.notes if gpu or not n.startswith("precision:")]  # on CPU the run's is not this one's
    if not gpu:
        said.append(f"precision: fp32 (the rehearsal's, on CPU; the run itself: {cfg.precision})")
    upd = {
        "notes": tuple(said),
        "seq_len": seq,
        "precision": cfg.precision if gpu else "fp32",
        "model": cfg.model.model_copy(update={"checkpoint": None, "init": "random"}),  # the tiny model's own
        "optimizer": cfg.optimizer.model_copy(update={"max_steps": steps, "warmup_steps": min(1, steps),
                                                      "warmup_ratio": None,
                                                      "state_dtype": cfg.optimizer.state_dtype if gpu else "fp32"}),
        "checkpoint": cfg.checkpoint.model_copy(update={"dir": ckdir, "save_every": half, "saves_per_epoch": None,
                                                        "export_hf": None}),
        "logging": cfg.logging.model_copy(update={"tensorboard": None, "wandb_project": None, "every": 1}),
        "data": cfg.data.model_copy(update={"cache_dir": cfg.data.cache_dir or f"{ckdir}/token-cache",
                                            **_sft_rehearsal(cfg, ckdir, seq)}),
    }
    left_out: list[str] = []
    while True:
        try:  # its weights: random (model.init above)
            return resolve_run(cfg.model_copy(update=upd), arch=tiny, weights=weights)
        except UserError as e:  # the run itself passed every check (main): what fails here is the rehearsal's doing
            pattern = e.pattern if isinstance(e, UnmatchedPattern) else None
            kept = [p for p in upd["model"].unfrozen_parameters or [] if p != pattern]
            if pattern is not None and not kept:  # every pattern names layers the tiny copy lacks
                key = spell(cfg, "model.unfrozen_parameters")
                raise bad("rehearse", key, f"the rehearsal's {tiny.num_layers}-layer tiny model has none of the "
                          f"parameters {key} names ({', '.join([*left_out, pattern])}), so it cannot train a copy "
                          "of this run", "plan the run and start it directly") from None
            if pattern is None:
                raise UserError(f"the rehearsal's tiny model ({tiny.num_heads} heads of {tiny.head_dim}, hidden "
                                f"{tiny.hidden_size}) fails a check the model itself passes, an nd-adapter bug to "
                                f"report (nothing in the config to change): {e}") from None
            left_out.append(pattern)  # names a layer past the tiny model's TINY_LAYERS (the run itself has it)
            upd["model"] = upd["model"].model_copy(update={"unfrozen_parameters": kept})
            upd["notes"] = (*said, f"rehearsal: {spell(cfg, 'model.unfrozen_parameters')} patterns that match "
                            f"nothing in the {tiny.num_layers}-layer tiny model are left out here (the run itself "
                            f"matches them): {', '.join(left_out)}")


def _sft_rehearsal(cfg: RunConfig, workdir: str, seq: int) -> dict:
    """SFT data at the rehearsal's short sequence: truncated rather than dropped (else little may be left), a
    min_sample_len no longer than that sequence (a truncated example must stay), and prepared in the rehearsal's own
    directory, not beside the real run's."""
    if not cfg.data.datasets:
        return {}
    shortest = cfg.data.min_sample_len and min(cfg.data.min_sample_len, seq)
    return {"excess_length_strategy": "truncate", "prepared_path": f"{workdir}/sft", "min_sample_len": shortest}


def in_process(run: ResolvedRun, rank: int, *, steps: int, seq_len: int | None, workdir: str, log=print) -> None:
    """One training process's part of a rehearsal: train half, save; resume from that checkpoint in a fresh engine;
    train to the end."""
    from adapter.train.trainer import run as train  # the launching side of this module stays torch-free

    reh = rehearsal(run, steps, seq_len, workdir)
    cfg = reh.cfg
    synthetic = not cfg.data.files and not cfg.data.datasets
    half = cfg.checkpoint.save_every
    first = reh.with_length(cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(
        update={"max_steps": half})}))  # only the length differs: nothing resolved depends on it
    a = train(first, synthetic_data=synthetic, log=log)
    b = train(reh, resume=True, synthetic_data=synthetic, log=log)
    if b.start_step != half:
        raise RuntimeError(f"rehearsal resumed at step {b.start_step}, expected {half}")
    if rank == 0:
        p = cfg.parallelism
        log(f"rehearsal ok: {cfg.world_size} processes, layout {p.dp_replicate_size}x{p.dp_shard_size}x{p.cp_size}x"
            f"{p.tp_size}{f' ep {p.ep_size}' if p.ep_size > 1 else ''}, saved at step {half} and resumed, losses "
            f"{[round(x, 4) for x in a.losses + b.losses]}")


def main(args) -> int:
    if getattr(args, "gpu", False) and not any(Path(d).exists() for d in GPU_DEVICES):
        raise bad("--gpu", True, "this machine shows no GPU device", "rehearse without --gpu (CPU processes)")
    cfg = source.load_config(args.config, world_size=args.nproc, overrides=config.parse_sets(args.set))
    run = resolve_run(cfg)
    # data files are checked (and tokenised) inside, when given; the rehearsal logs to no TensorBoard or W&B
    preflight(run, need_data=False, saves=False, sinks=False)
    if args.steps < 2:
        raise bad("--steps", args.steps, "a rehearsal saves half-way and resumes", "use --steps 2 or more")
    with tempfile.TemporaryDirectory(prefix="nd-rehearse-") as workdir:
        worker = ["--config", args.config, "--rehearse", "--steps", str(args.steps), "--workdir", workdir]
        if args.seq_len:
            worker += ["--seq-len", str(args.seq_len)]
        for item in args.set or []:  # the same overrides in every rank
            worker += ["--set", item]
        p = cfg.parallelism
        where = "processes sharing this machine's GPU" if getattr(args, "gpu", False) else "CPU processes"
        print(f"rehearsing on {cfg.world_size} {where}: dp_replicate={p.dp_replicate_size} dp_shard="
              f"{p.dp_shard_size} cp={p.cp_size} tp={p.tp_size}" + (f" ep={p.ep_size}" if p.ep_size > 1 else ""),
              flush=True)
        print(f"the run itself: {announce.weights(run)}; the rehearsal's tiny model starts "
              "from random weights", flush=True)
        tiny = tiny_experts(run.arch, p.ep_size) if run.arch.native else run.arch.num_experts
        if run.arch.moe and tiny != run.arch.num_experts:
            print(f"the rehearsal's tiny model: {tiny} of the {run.arch.num_experts} experts, top "
                  f"{run.arch.experts_per_token} (whole experts on each of the {p.ep_size} expert-parallel ranks)",
                  flush=True)
        if getattr(args, "gpu", False):  # every rank on cuda:0 through gloo (adapter/parallel/shared_gpu.py)
            os.environ[shared_gpu.ENV] = "1"  # the ranks inherit it
            return spawn(cfg.world_size, worker)
        return spawn(cfg.world_size, worker, cpu=True)
