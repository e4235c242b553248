"""A run, resolved once: the validated config with every fact the rest of the code derives from it and the model.

`resolve_run` is called once per process where a run starts (the CLI for `plan`, preflight and `rehearse`; each
training process in adapter/train/worker.py) and its `ResolvedRun` is what `plan`, preflight, the rehearsal, the
trainer and the engine receive. None of them reads `model.path` or rebuilds a LoRA or freeze spec again, so the
architecture `plan` reports is the one the trainer builds (both read `source.arch_for`: the converted checkpoint's
hf/ when it has one), and a refusal happens in one place, before any process starts.

Torch-free (plan imports it). What the run then says about itself is `adapter/models/announce.py`, from this record.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from adapter.config import RunConfig
from adapter.models import checks, freeze, generic_freeze, generic_run, lora, source, vocab
from adapter.models.arch import ModelArch, config_path
from adapter.models.source import WeightsSource
from adapter.models.vocab import Growth
from adapter.parallel import deepspeed_config
from adapter.parallel.layout import Layout


@dataclass(frozen=True)
class ResolvedRun:
    """Everything decided about a run before any process starts; frozen, so no consumer can drift from it."""

    cfg: RunConfig                             # validated; the world size resolved
    arch: ModelArch                            # source.arch_for: config.json with the run's overrides
    layout: Layout                             # the mesh, with hardware.gpus_per_node
    lora: lora.LoraSpec | None                 # the adapters on a frozen base; None: no adapters
    unfrozen: tuple[freeze.Tensor, ...] | None  # unfrozen_parameters resolved per tensor; None: every weight trains
    weights: WeightsSource                     # the first weights (converted checkpoint, pre-trained, random)
    zero_stage: int                            # 1 (nothing to shard), 2 or 3: deepspeed_config.zero_stage
    flat_optimizer: bool                       # nd-adapter's flat AdamW instead of DeepSpeed's ZeRO optimizer
    warnings: tuple[str, ...] = ()             # what the run can do but should not (models/checks.py)
    peft: generic_run.PeftSpec | None = None       # the transformers engine's adapters (PEFT's LoRA on its model)
    vocab: Growth | None = None                # data.tokens: what it adds (arch.vocab_size already counts the rows)
    unshared: str | None = checks.NO_PAIRS     # why a pair's prompt does not run once; None: it does
                                               # (checks.prompt_sharing, read once here)
    gpu: bool = True                           # whether it trains on GPUs (model.compile: auto asked it)

    @property
    def shares_prompt(self) -> bool:
        """Whether each preference pair's prompt runs once for both answers (dpo.share_prompt)."""
        return self.unshared is None

    @property
    def own_attention(self) -> bool:
        """Whether the transformers engine's attention runs nd-adapter's kernels at cp = 1 (checks.own_attention), as
        it does at cp > 1 (adapter/modeling/hf_cp.py)."""
        return not self.arch.native and self.layout.cp == 1 and checks.own_attention(self.cfg, self.arch) is None

    @property
    def adapters(self) -> bool:
        """Whether the run trains adapters on a frozen base (either engine): its checkpoints hold only those."""
        return self.lora is not None or self.peft is not None

    @property
    def partition_size(self) -> int:
        """Ranks one ZeRO shard set spans (deepspeed_config.partition_size)."""
        return deepspeed_config.partition_size(self.cfg, self.layout)

    @property
    def trains_embedding(self) -> bool:
        """Whether the input embedding is trained: every weight, a LoRA run's modules_to_save, or a pattern."""
        if self.lora is not None:
            return "embed_tokens" in self.lora.modules_to_save
        if self.unfrozen is not None:
            return any(t.trained for t in self.unfrozen if t.name.endswith("word_embeddings.weight"))
        return True

    @property
    def pad_row(self) -> int | None:
        """The embedding row held out of training as transformers' nn.Embedding(padding_idx=pad_token_id) holds it:
        untied models only (a tied embedding also gets the output layer's gradient, which HF keeps), and only when
        the embedding trains."""
        a = self.arch
        if a.pad_token_id is None or a.tie_embeddings or not self.trains_embedding:
            return None
        return a.pad_token_id

    def with_config(self, cfg: RunConfig) -> ResolvedRun:
        """The same model and weights under another config (plan's replicate-mode comparison): the config's own
        decisions are taken again."""
        base = dataclasses.replace(self.arch, vocab_size=self.vocab.rows) if self.vocab is not None else self.arch
        return resolve_run(cfg, arch=base, weights=self.weights, gpu=self.gpu)

    def with_length(self, cfg: RunConfig) -> ResolvedRun:
        """This run with `cfg`, which differs from its own only in the length and cadences the schedule writes in
        (optimizer max_steps / warm-up, checkpoint and eval cadences): nothing resolved depends on them."""
        return dataclasses.replace(self, cfg=cfg)


def resolve_run(cfg: RunConfig, *, arch: ModelArch | None = None, weights: WeightsSource | None = None,
                layout: Layout | None = None, gpu: bool | None = None) -> ResolvedRun:
    """Resolve `cfg` against its model: one line (UserError) for anything the run cannot do. `arch` replaces the
    checkpoint's (a rehearsal's tiny model, `plan --search`'s shared one); `weights` and `layout`, when given, are
    reused instead of being looked up again (search evaluates hundreds of layouts of one run). `gpu`: whether the
    run trains on GPUs (plan: true, the machine it plans for; None: whether this process sees one)."""
    if arch is None:
        source.check_converted(cfg)
        arch = source.arch_for(cfg)
    gpu = _cuda() if gpu is None else gpu
    cfg = checks.compile_where_it_runs(cfg, arch, gpu)
    arch, grew = source.grown(cfg, arch)  # data.tokens' new rows (adapter/models/vocab.py)
    cfg = checks.linear_ce_where_it_applies(cfg, arch)
    vocab.check_lora(cfg, arch.hf_model_type, grew)
    warnings, spec, unfrozen = checks.checked(cfg, arch)  # before the mesh: the model's reasons come first
    peft = None
    if not arch.native:  # PEFT itself, freezing by HF name, a pre-quantised base: on transformers' (meta) model
        given = weights.model_dir if weights is not None and weights.model_dir else None
        src = source.model_dir(given) if given and config_path(given).is_file() else source.hf_dir(cfg)
        raw, trust = json.loads(config_path(src).read_text()), cfg.model.trust_remote_code
        generic_run.check_prequantized(cfg, raw)
        if cfg.lora is not None:
            peft = generic_run.resolve_peft(cfg, raw, trust_remote_code=trust, model_dir=str(src))
        elif cfg.model.unfrozen_parameters is not None:
            unfrozen, note = generic_freeze.resolve_unfrozen(cfg, raw, trust_remote_code=trust, model_dir=str(src))
            if note is not None:
                cfg = cfg.model_copy(update={"notes": (*cfg.notes, note)})
    layout = layout or Layout.from_config(cfg.parallelism, cfg.hardware.gpus_per_node)
    if peft is not None:
        cfg = generic_run.quantized_base_stage(cfg, layout.dp_replicate)
    stage = deepspeed_config.zero_stage(cfg, layout)
    if peft is not None:
        cfg = generic_run.quantized_base_zero3(cfg, stage)
    if not arch.native:
        generic_run.check_zero3(cfg, stage)
    flat = deepspeed_config.flat_optimizer(cfg, layout)
    return ResolvedRun(cfg=cfg, arch=arch, layout=layout, lora=spec,
                       unfrozen=None if unfrozen is None else tuple(unfrozen),
                       weights=weights or source.resolve(cfg, arch.native),
                       zero_stage=stage, flat_optimizer=flat, warnings=tuple(warnings), peft=peft, vocab=grew,
                       unshared=checks.prompt_sharing(cfg, arch, layout.cp), gpu=gpu)


def _cuda() -> bool:
    """Whether this process trains on a GPU (torch imported only when asked, never by `plan`)."""
    import torch

    return torch.cuda.is_available()


__all__ = ["ResolvedRun", "resolve_run"]
