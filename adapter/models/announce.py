"""What a run says about itself before it starts: one pure function of the resolved run (adapter/models/resolved.py).

`plan` prints these lines as its notes and the trainer's rank 0 prints them as the run's first lines, so what a plan
promised and what the run then says cannot differ. Every default that changes what is trained is said here (the
dialect mapping's notes, what is trained, the optimizer's precision, the load-balancing loss, the held pad row,
LongRoPE, fp8). What only the run itself can know (the data's size and the schedule it implies, a checkpoint being
resumed, the disk) is said by the trainer after this.
"""
from __future__ import annotations

import math

from adapter.config import spell
from adapter.errors import EXIT_REQUEUE
from adapter.models import families, freeze, lora, source
from adapter.models.arch import ModelArch
from adapter.models.counts import vision_patches
from adapter.models.resolved import ResolvedRun


def announce(run: ResolvedRun, *, gpu: bool = True) -> list[str]:
    """The run's first lines, in order. `gpu`: whether it runs on GPUs (plan assumes so), which picks the optimizer's
    kernels."""
    cfg, arch = run.cfg, run.arch
    lines = list(cfg.notes)
    lines.append(engine(run))
    if run.vocab is not None and (cfg.data.tokens or run.vocab.resized):
        lines.append(run.vocab.note(cfg))
    if run.unfrozen is not None:
        lines.append(freeze.describe(list(run.unfrozen), arch, spell(cfg, "model.unfrozen_parameters")))
    if run.lora is not None:
        lines.append(lora.describe(run.lora, arch, spell(cfg, "lora")))
    if run.peft is not None:
        lines.append(run.peft.describe(arch, spell(cfg, "lora")))
    if cfg.lora is not None and cfg.lora.plus_lr_ratio:
        lines.append(lora_plus(cfg))
    if cfg.checkpoint.exit_signals:
        lines.append(signals(cfg.checkpoint.exit_signals, cfg.checkpoint.dir))
    lines.append(optimizer(run, gpu=gpu))
    if arch.moe or arch.output_router_logits:  # either engine's
        lines.append(mixture_of_experts(run))
    text = families.family(arch.family).export_as
    if text:  # an image-text checkpoint: what is trained and exported is its language model only
        lines.append(f"model: the language model of {arch.architecture} is trained (its vision tower is not built); "
                     f"exports are {families.family(text).architectures[0]} (text only)")
    if run.pad_row is not None:
        lines.append(f"embedding: row {run.pad_row} (the pad token, pad_token_id in config.json) gets no gradient "
                     "from lookups, as transformers' nn.Embedding(padding_idx) keeps it")
    rope = longrope_note(arch, cfg.seq_len, cfg.document_attention)
    if rope:
        lines.append(rope)
    if cfg.eaft is not None and cfg.source != "axolotl":  # (Axolotl's mapping says it in its note)
        lines.append(f"loss: EAFT: each token's cross-entropy × (entropy of the softmax over its {cfg.eaft.k} largest "
                     f"logits)^{cfg.eaft.alpha:g}, without gradient (train and eval)")
    if cfg.model.num_labels is not None and cfg.source != "axolotl":  # (Axolotl's mapping says it in its note)
        lines.append(f"loss: a process reward model: {arch.architecture} with {cfg.model.num_labels} classes, "
                     "cross-entropy on each labelled token, every dropout of the model off (TRL's PRMTrainer), "
                     "eval_accuracy beside eval_loss")
    if cfg.precision == "fp8":
        lines.append(f"precision: fp8 ({cfg.model.fp8_recipe} scaling) for the {', '.join(cfg.model.fp8_linears)} "
                     "matmuls of every layer; weights, other matmuls, attention and the loss in bf16")
    return lines


def lora_plus(cfg) -> str:
    """LoRA+'s learning rates (adapter/train/engine.param_groups), and the weight decay it drops as PEFT does."""
    c, wd = cfg.lora, cfg.optimizer.weight_decay
    return (f"{spell(cfg, 'lora.plus_lr_ratio')}: LoRA+ (PEFT's create_loraplus_optimizer, as Axolotl calls it): each "
            f"B and each 1-D trained tensor at lr × {c.plus_lr_ratio:g}, adapters on embedding layers at "
            f"{c.plus_lr_embedding:g}, the rest at lr; no weight decay in any group"
            + (f" ({spell(cfg, 'optimizer.weight_decay')} {wd:g} is not applied, as in Axolotl)" if wd else ""))


def _pixels(size) -> str:
    return f"{size[0]}x{size[1]}" if isinstance(size, (list, tuple)) else str(size)


def engine(run: ResolvedRun) -> str:
    """Which engine trains the model, and why (model.engine; adapter/models/generic.py)."""
    arch = run.arch
    if arch.native:
        return f"engine: Megatron-Core layers ({arch.family} family, {arch.architecture})"
    extra = []
    if arch.image_text and run.cfg.data.processor_type:
        extra.append("an image-text run: the processor's images through the model's own towers, " + (
            "the towers and projector frozen (freeze_mm_modules)" if run.cfg.model.freeze_mm_modules else
            "every weight trained (towers too, as Axolotl's)" if run.peft is None else "the adapters trained"))
        v = arch.vision
        image = run.cfg.data.image_size or (v[3] if v else 0)
        if v and image:  # what plan counts: one image a row (the first of its images column)
            extra.append(f"each row's image at {_pixels(image)} pixels: {vision_patches(v, image)} patches through the "
                         f"{v[0]}-layer vision tower")
    elif arch.image_text:
        extra.append("an image-text checkpoint: its language model trains on text, the other towers frozen")
    if arch.remote_code:
        extra.append("built by the checkpoint's own code (trust_remote_code: true)")
    if run.cfg.model.linearized_experts:
        key = spell(run.cfg, "model.linearized_experts")
        extra.append(f"its experts as one linear per expert and projection ({key}: Axolotl's layout, 4-bit where "
                     "the base is)"
                     + (", exported in transformers' fused layout" if run.peft is None else ""))
    if run.cfg.model.fused_linear_ce:  # adapter/modeling/hf_build.CausalLMLosses
        extra.append("its loss by nd-adapter's fused linear CE over the body's hidden states and lm_head's weight")
    if run.cfg.model.liger:
        extra.append(f"Liger's {', '.join(run.cfg.model.liger)} kernels where CUDA runs them (transformers' own on "
                     "CPU)")
    tp = run.layout.tp
    split = next((s[1] for s in arch.tp_shares if s[0] == tp), 0) if tp > 1 else 0
    if split:
        extra.append(f"tp={tp} from its own tensor-parallel plan (base_model_tp_plan): {split / 1e6:.2f}M of its "
                     "parameters split, the rest replicated")
    ep = run.layout.ep
    if ep > 1:  # adapter/modeling/hf_ep.py
        extra.append(f"ep={ep} from its own expert-parallel plan (base_model_ep_plan): each rank holds "
                     f"{arch.ep_experts // ep} of the {arch.ep_experts} experts of each layer, tokens sent to them and "
                     "back by all-to-all")
    cp = run.layout.cp
    if cp > 1:  # adapter/modeling/hf_cp.py
        comm = run.cfg.parallelism.cp_comm_type
        extra.append(f"cp={cp} through transformers' attention interface: nd-adapter's context-parallel attention "
                     f"({'K/V all-gathered' if comm == 'all_gather' else 'K/V passed around a ring'}) over "
                     f"{'each packed document' if run.cfg.document_attention else 'each sample'} in {2 * cp} "
                     "load-balanced chunks")
    elif run.own_attention:  # adapter/modeling/hf_cp.py at cp = 1
        extra.append("attention through transformers' attention interface on nd-adapter's kernels (flash attention "
                     "with sliding windows, packed documents by their boundaries)")
    if run.cfg.model.compile:  # adapter/modeling/hf_build.compile_layers
        extra.append(f"each decoder layer{' and vision layer' if run.cfg.data.processor_type else ''} compiled "
                     "(torch.compile; what Dynamo cannot trace runs eagerly)")
    n = arch.param_count or 0
    size = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
    return (f"engine: transformers' own {arch.architecture} ({arch.engine_reason}; {size} parameters)"
            + "".join(f"; {e}" for e in extra))


def weights(run: ResolvedRun, resumed: str | None = None, moved: str | None = None) -> str:
    """Which weights the run starts from: the checkpoint being resumed (`resumed`, saved at another layout when
    `moved` says how), else the record's first weights (source.describe)."""
    if not resumed:
        return source.describe(run.weights, run.cfg.seed, native=run.arch.native,
                               dequantize=run.cfg.model.dequantize)
    return (f"weights: from the checkpoint {resumed} being resumed"
            + (f" (saved at another layout: {moved}; resharded)" if moved else "")
            + (", the frozen base from the converted weights" if run.lora is not None else "")
            + (", the frozen base from the HF weights" if run.peft is not None else ""))


def resumed(run: ResolvedRun, step: int, old_lr: float, new_lr: float) -> list[str]:
    """After a checkpoint was loaded: its step, and the next step's learning rate from this run's schedule."""
    cfg = run.cfg
    same = math.isclose(old_lr, new_lr, rel_tol=1e-6, abs_tol=1e-12)
    return [f"resuming from {cfg.checkpoint.dir} at step {step} (its weights replace the start's)",
            f"schedule: step {step + 1} of {cfg.optimizer.max_steps} runs at learning rate {new_lr:.3e} from this "
            "run's schedule" + ("" if same else f" (the checkpoint's run was at {old_lr:.3e})")]


def signals(names: list[str], save_dir: str | None) -> str:
    then = f"save a checkpoint in {save_dir}" if save_dir else "stop (no checkpoint.dir: nothing is saved)"
    return (f"signals: {', '.join(names)} finish the current step on every rank, {then} and exit with status "
            f"{EXIT_REQUEUE} (requeue; continue with --resume)")


LOW_BITS = {"adamw_8bit": "8-bit moments (bitsandbytes' AdamW8bit)",
            "adamw_4bit": "4-bit moments (torchao's AdamW4bit)"}


def optimizer(run: ResolvedRun, *, gpu: bool = True) -> str:
    """Which optimizer implementation runs and what it keeps (`optimizer.impl`, `optimizer.state_dtype`)."""
    o = run.cfg.optimizer
    if run.flat_optimizer:
        if o.name != "adamw":
            how = f"fp32 master weights, {LOW_BITS[o.name]}"
        elif o.state_dtype == "bf16":
            how = ("optimizer.state_dtype: bf16: no fp32 master, the bf16 weights updated in place with bf16 "
                   "moments, as torch's AdamW on a bf16 model; updates under half a bf16 step are lost")
        else:  # the one-launch Triton step needs 16-bit weights on CUDA (adapter/train/adamw_kernel.py)
            one_launch = gpu and run.cfg.param_precision in ("bf16", "fp16")
            how = "fp32 master weights and moments, " + (
                "one launch per parameter group" if one_launch else "one fused pass per parameter")
        return f"optimizer: nd-adapter's flat AdamW (nothing to shard; {how}; optimizer.impl: deepspeed for " \
               "DeepSpeed's ZeRO-1)"
    if o.name == "adamw_8bit":
        return (f"optimizer: DeepSpeed's ZeRO-{run.zero_stage} stepping bitsandbytes' AdamW8bit (fp32 master "
                "partitions, 8-bit moments)")
    if o.name == "adamw_4bit":
        return (f"optimizer: DeepSpeed's ZeRO-{run.zero_stage} stepping torchao's AdamW4bit (fp32 master "
                "partitions, 4-bit moments in their whole blocks of 256)")
    if o.state_dtype == "bf16":  # adapter/parallel/deepspeed_config.py: bf16_master_weights_and_grads
        master = "the bf16 weights' own partitions" if run.zero_stage == 3 else "a bf16 copy of the weights' partitions"
        return (f"optimizer: DeepSpeed's ZeRO-{run.zero_stage} AdamW, no fp32 master (optimizer.state_dtype: bf16: "
                f"{master} stepped by torch's fused AdamW with bf16 moments, as torch's AdamW on a bf16 model)")
    return f"optimizer: DeepSpeed's ZeRO-{run.zero_stage} AdamW"


def mixture_of_experts(run: ResolvedRun) -> str:
    """Whether transformers would add the load-balancing loss (output_router_logits), and why."""
    cfg, arch = run.cfg, run.arch
    over = cfg.model.output_router_logits
    why = (f"{spell(cfg, 'model.output_router_logits')}: {str(over).lower()}" if over is not None
           else f"output_router_logits: {str(arch.output_router_logits).lower()} in config.json")
    on = arch.output_router_logits and arch.router_aux_loss_coef > 0
    head = f"{arch.num_experts} experts, top {arch.experts_per_token}" if arch.moe else "transformers' own modules"
    return (f"mixture of experts: {head}, "
            + (f"load-balancing loss × router_aux_loss_coef {arch.router_aux_loss_coef:g} added to every "
               "micro-batch's loss" if on else "no load-balancing loss, as transformers then trains") + f" ({why})")


def longrope_note(arch: ModelArch, seq_len: int, packed: bool) -> str | None:
    """The run's first lines on LongRoPE where its long factors can apply (seq_len past the original context): which
    batches rotate with them, as transformers decides (max position + 1 > original), None where they cannot."""
    orig = arch.rope_original_max
    if arch.rope_long_factor is None or orig is None or seq_len <= orig:
        return None
    return (f"rope: LongRoPE's long factors past {orig} positions (original_max_position_embeddings), chosen per "
            "batch as transformers does: " + ("by each micro-batch's longest packed document" if packed else
                                              f"every batch, its samples padded to seq_len {seq_len} (as Axolotl "
                                              "pads them for transformers)"))


__all__ = ["announce", "engine", "weights", "resumed", "signals", "optimizer", "mixture_of_experts", "longrope_note"]
