"""The training engine's set-up: process group, GPTModel with its weights, the DeepSpeed ZeRO engine around it, and
the hooks DeepSpeed does not provide (TP sums of partial gradients, replica averaging for exact HSDP).

Kept apart from the loop (adapter/train/trainer.py) so the loop only ever sees an `Engine`: the model to call, the
step to take, and what depends on the layout (`after_backward`, `guard_grads`).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import default_pg_timeout
from deepspeed.utils import set_z3_leaf_modules
from megatron.core import tensor_parallel

from adapter.config import RunConfig, spell
from adapter.convert import peft as peft_io
from adapter.convert.load import load_megatron_checkpoint
from adapter.errors import bad
from adapter.kernels.fp8 import install_fp8
from adapter.modeling import hf_cp, hf_ep, hf_qat, hf_tp
from adapter.modeling.compile import compile_layers
from adapter.modeling.gpt import Layer, build_gpt_model, padded_vocab_size, tp_grad_sum_params
from adapter.modeling.hf_build import (
    CausalLMLosses,
    add_peft,
    build_model,
    drop_frozen_input_grads,
    layer_classes,
    liger_available,
    recompute_layers,
)
from adapter.modeling.hf_build import (
    compile_layers as compile_hf_layers,
)
from adapter.modeling.hf_heads import RewardScores, TokenClassLosses
from adapter.modeling.hf_quant_experts import move_expert_states
from adapter.modeling.lora import add_adapters, load_state
from adapter.modeling.moe import deposit_expert_grads
from adapter.modeling.quant import quantize_base
from adapter.models import freeze as freeze_facts
from adapter.models import lora as lora_facts
from adapter.models import source, vocab
from adapter.models.generic import plain_linear, runs_unpacked
from adapter.models.resolved import ResolvedRun
from adapter.parallel import deepspeed_config, shared_gpu
from adapter.parallel.deepspeed_mpu import DeepSpeedMPU
from adapter.parallel.layout import Layout
from adapter.parallel.mcore_groups import Groups
from adapter.patches.ds_comm import one_cuda_device, skip_cpu_shm_op
from adapter.patches.mcore import uneven_gloo_collectives
from adapter.patches.zero import (
    average_over_replicas,
    drive_flat_optimizer,
    expert_norm_with_tp,
    install_zero12_step,
    place_experts,
    set_hpz_group,
    zero12_expert_groups,
    zero12_with_experts,
)
from adapter.train.optim import STATE_BITS, FlatAdamW, zero_client
from adapter.train.schedule import lr_factor


def init_distributed(timeout_s: int | None = None) -> tuple[int, int]:
    """NCCL on GPUs, gloo (and DeepSpeed's CPU accelerator) otherwise; env from any launcher. `timeout_s`: the
    process-group timeout (None: DeepSpeed's default). DS_ACCELERATOR=cpu must be set before deepspeed is first
    imported on a machine without CUDA (adapter/train/worker.py does it), or DeepSpeed warns that it guessed. In the
    shared-GPU mode (adapter/parallel/shared_gpu.py) every rank takes cuda:0 and the group is gloo's."""
    cuda, shared = torch.cuda.is_available(), shared_gpu.on()
    if shared and not cuda:
        raise bad(shared_gpu.ENV, "1", "the shared-GPU mode puts every rank on cuda:0, and this machine has no CUDA "
                  "device", f"unset {shared_gpu.ENV} (or use `nd-adapter rehearse` without --gpu: CPU processes)")
    if cuda:
        torch.cuda.set_device(0 if shared else int(os.environ.get("LOCAL_RANK", 0)))
    if shared:
        one_cuda_device(get_accelerator())
        uneven_gloo_collectives()  # Megatron's CUDA MoE dispatcher gathers uneven token counts (patches/mcore)
    deepspeed.utils.logger.setLevel(logging.ERROR)  # its per-rank INFO/WARNING chatter drowns the step log
    timeout = default_pg_timeout if timeout_s is None else timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if not cuda:
            skip_cpu_shm_op()  # a C++ op only DeepSpeed's inference layers use, compiled at start (patches/ds_comm)
        if shared:  # DeepSpeed would bind the group to cuda:LOCAL_RANK (device_id), which one GPU does not have:
            dist.init_process_group("gloo", timeout=timeout)  # it adopts this group instead
        deepspeed.init_distributed(dist_backend="nccl" if cuda and not shared else "gloo", verbose=False,
                                   timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def param_groups(model, weight_decay: float, names: bool = False, plus: tuple[float, float, float] | None = None):
    """No weight decay on norms and biases (the usual LLM recipe). Only trained parameters; an empty group (a LoRA
    run has no trained norms) is left out. `names`: each group also lists its parameters' names (the flat AdamW
    saves them, so a checkpoint can be resharded).

    `plus` (lr, lora.plus_lr_ratio, lora.plus_lr_embedding): LoRA+'s groups as PEFT's create_loraplus_optimizer
    makes them where Axolotl calls it: every adapter's B and every 1-D trained tensor (DoRA's magnitudes, a bias) at
    lr × ratio, the adapters of embedding layers at plus_lr_embedding, the rest (each A, modules_to_save copies) at
    lr; no weight decay in any group (Axolotl passes PEFT no loraplus_weight_decay, whose default is 0). Each group
    carries its side (`lora_plus`), from which a resumed run's schedule takes this run's rates (follow_schedule)."""
    if plus is not None:
        return _plus_groups(model, names, *plus)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or name.endswith(".bias") else decay).append((name, p))
    groups = [{"params": [p for _, p in ps], "weight_decay": wd} | ({"names": [n for n, _ in ps]} if names else {})
              for ps, wd in ((decay, weight_decay), (no_decay, 0.0))]
    return [g for g in groups if g["params"]]


def _plus_groups(model, names: bool, lr: float, ratio: float, embedding_lr: float) -> list[dict]:
    """LoRA+'s three groups (param_groups): A-side at lr, embedding adapters at embedding_lr, B-side at lr × ratio."""
    from adapter.modeling.lora import LoraAdapters

    native_b = {id(p) for m in model.modules() if isinstance(m, LoraAdapters) for p in m.B.values()}
    sides: dict[str, list] = {"a": [], "embedding": [], "b": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        side = "embedding" if "lora_embedding_" in name else \
            "b" if id(p) in native_b or "lora_B" in name or p.ndim == 1 else "a"
        sides[side].append((name, p))
    scales = plus_scales(lr, ratio, embedding_lr)
    groups = [{"params": [p for _, p in ps], "weight_decay": 0.0, "lr": lr * scales[side], "lora_plus": side}
              | ({"names": [n for n, _ in ps]} if names else {}) for side, ps in sides.items()]
    return [g for g in groups if g["params"]]


def plus_scales(lr: float, ratio: float, embedding_lr: float) -> dict[str, float]:
    """Each LoRA+ group's rate over lr (its `lora_plus` side): what the schedule multiplies."""
    return {"a": 1.0, "embedding": embedding_lr / lr, "b": ratio}


def lora_plus(cfg: RunConfig) -> tuple[float, float, float] | None:
    """(lr, lora.plus_lr_ratio, lora.plus_lr_embedding) where the run asks LoRA+, else None."""
    c = cfg.lora
    return (cfg.optimizer.lr, c.plus_lr_ratio, c.plus_lr_embedding) if c is not None and c.plus_lr_ratio else None


def add_tp_grad_hooks(model, tp_group) -> None:
    """Sum, over TP, the grads Megatron leaves partial (sequence-parallel norms, q/k norms); DeepSpeed does not.

    A tensor hook runs before the grad is accumulated, so ZeRO-3's reduce-scatter sees the summed gradient.
    """

    def hook(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=tp_group)
        return grad

    for p in tp_grad_sum_params(model):
        if p.requires_grad:  # a frozen norm has no gradient to sum
            p.register_hook(hook)


def freeze(model, tensors: list[freeze_facts.Tensor], tp_rank: int, tp: int) -> None:
    """`model.unfrozen_parameters` applied to the built GPTModel (before DeepSpeed sees it): frozen tensors stop
    requiring gradients, so no rank keeps a gradient, a master copy or optimizer state for them; a trained row range
    (vocabulary rows) zeroes the other rows' gradient, as Axolotl's hook does."""
    by_name = {t.name: t for t in tensors}
    for name, p in model.named_parameters():
        t = by_name.get(name)
        if t is None:
            raise RuntimeError(f"{name}: no HF parameter maps to it (adapter/models/freeze.py's names are stale)")
        if not t.trained:
            p.requires_grad_(False)
        elif t.rows is not None:  # vocab-parallel: this rank holds rows [tp_rank·local, (tp_rank + 1)·local)
            local = p.shape[0]
            rows = torch.arange(tp_rank * local, (tp_rank + 1) * local, device=p.device)
            keep = ((rows >= t.rows[0]) & (rows < t.rows[1])).to(p.dtype).unsqueeze(1)
            p.register_hook(lambda grad, keep=keep: grad * keep)


def hold_pad_row(model, pad_row: int | None, tp_rank: int) -> None:
    """HF's nn.Embedding(padding_idx=pad_token_id): the pad row gets no gradient from lookups, so a model whose pad
    is its EOS (Phi-3/4) keeps that row in a transformers fine-tune. `pad_row`: the record's decision
    (ResolvedRun.pad_row: untied models whose embedding trains), None where nothing is held."""
    w = model.embedding.word_embeddings.weight
    if pad_row is None:
        return
    if not w.requires_grad:
        raise RuntimeError("the resolved run holds a pad row of an embedding the engine froze (the record and the "
                           "freezing disagree)")
    local = w.shape[0]
    row = pad_row - tp_rank * local
    if 0 <= row < local:  # vocab-parallel: only the rank holding the row
        keep = torch.ones(local, 1, dtype=w.dtype, device=w.device)
        keep[row] = 0
        w.register_hook(lambda grad: grad * keep)


@dataclass
class Engine:
    """What the loop drives: DeepSpeed's engine, its config, and the layout-dependent per-step duties."""
    ds: Any                 # deepspeed.DeepSpeedEngine
    mpu: DeepSpeedMPU
    conf: dict
    layout: Layout
    recomputed_layers: int = 0  # the transformers engine's gradient-checkpointed layers (the run's first lines)

    @property
    def guard_grads(self) -> bool:
        """Whether the loop must stop on an inf/NaN grad norm itself (DeepSpeed skips such steps only with fp16
        loss scaling, or bf16 with its overflow check on)."""
        return not deepspeed_config.skips_nonfinite_steps(self.conf)

    def after_backward(self) -> None:
        """Exact HSDP: average the gradient partitions over dp_replicate once per optimizer step."""
        if self.ds.is_gradient_accumulation_boundary() and self.layout.dp_replicate > 1 \
                and self.mpu.replica_group is not None:
            average_over_replicas(self.ds, self.mpu.replica_group, self.layout.dp_replicate)

    def follow_schedule(self, cfg: RunConfig) -> tuple[float, float]:
        """After a resume: the learning rate of the next step from this run's schedule, not the checkpoint's. The
        scheduler's state restores only its step count (its lambdas are this run's), but the optimizer's learning
        rates and the scheduler's base rates come back as the checkpoint saved them, so a run whose length or peak
        changed would take its first step at the old schedule's rate. Returns (old, new) rate."""
        sched = self.ds.lr_scheduler
        groups = sched.optimizer.param_groups  # the groups it writes (ZeRO's wrapper hands on the same list)
        old = float(groups[0]["lr"])
        plus = lora_plus(cfg)
        scales = plus_scales(*plus) if plus else {}
        sched.base_lrs = [cfg.optimizer.lr * scales.get(group.get("lora_plus"), 1.0) for group in groups]  # LoRA+
        for group, base, factor in zip(groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * factor(sched.last_epoch)
        sched._last_lr = [group["lr"] for group in groups]
        return old, float(groups[0]["lr"])


def lr_scheduler_for(cfg: RunConfig):
    """DeepSpeed calls this with its optimizer; the LambdaLR it returns is stepped after every optimizer step and
    saved/restored with the checkpoints (its state is the step count)."""
    o = cfg.optimizer
    factor = partial(lr_factor, schedule=o.schedule, warmup_steps=o.warmup_steps or 0,
                     total_steps=o.max_steps or 1, min_ratio=o.min_lr / o.lr)

    def make(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    return make


def _native_model(run: ResolvedRun, groups: Groups, device, load_weights, dtype):
    """Megatron-Core's GPTModel of a native family with its first weights, adapters, freezing and kernels."""
    cfg, arch, layout = run.cfg, run.arch, run.layout
    tp = layout.tp
    fused = torch.cuda.is_available() if cfg.model.fused_kernels is None else cfg.model.fused_kernels
    torch.manual_seed(cfg.seed)  # same init on every dp rank when there is no checkpoint
    if torch.cuda.is_available():  # Megatron's GPU init draws TP-sharded weights from its CUDA RNG tracker
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    model = build_gpt_model(arch, tp=tp, cp=layout.cp, sequence_parallel=cfg.use_sequence_parallel and tp > 1,
                            padded_vocab=padded_vocab_size(arch.vocab_size, tp, cfg.model.vocab_divisible_by),
                            params_dtype=dtype, attention=cfg.model.attention,
                            max_sequence_length=max(cfg.seq_len, arch.max_position_embeddings),
                            recompute=None if cfg.recompute == "none" else cfg.recompute,
                            cp_comm_type=cfg.parallelism.cp_comm_type,
                            fused_kernels=fused,
                            linear_ce=cfg.model.fused_linear_ce, linear_ce_chunk=cfg.model.fused_linear_ce_chunk,
                            moe_grouped_gemm=cfg.model.moe_grouped_gemm)
    model.rope_padded_len = cfg.seq_len  # LongRoPE decides unpacked batches by the padded length, as transformers
    model.eaft = (cfg.eaft.k, cfg.eaft.alpha) if cfg.eaft is not None else None  # EAFT's per-token weights
    loaded = False
    if load_weights is not None:
        loaded = bool(load_weights(model))
    elif cfg.model.checkpoint:
        load_megatron_checkpoint(model, cfg.model.checkpoint)
        loaded = True
    if loaded and run.vocab is not None and run.vocab.resized:  # random weights drew every row already
        grow_vocab(model, run, groups.tp, device)
    spec = run.lora
    if spec is not None:  # the base frozen, the adapters beside its linears (started from an adapter if given)
        tp_rank = dist.get_rank(groups.tp)
        if spec.quantize_base:  # on the device: bitsandbytes' kernels there quantise as Axolotl's load does
            quantize_base(model, arch, spec.quantize_base, tp_rank=tp_rank, tp_group=groups.tp, device=device)
        add_adapters(model, spec, arch, seed=cfg.seed, tp_rank=tp_rank, tp_group=groups.tp)
        if spec.init_from:
            key = spell(cfg, "lora.init_from")
            conf, tensors = peft_io.read_adapter(spec.init_from, key)
            lora_facts.check_adapter(conf, {k: tuple(v.shape) for k, v in tensors.items()}, spec, arch, key)
            load_state(model, spec, arch, tensors, tp_rank)
    model.to(device)
    if run.unfrozen is not None:
        freeze(model, run.unfrozen, dist.get_rank(groups.tp), tp)
    hold_pad_row(model, run.pad_row, dist.get_rank(groups.tp))
    if cfg.precision == "fp8":
        install_fp8(model, cfg.model.fp8_recipe, cfg.model.fp8_linears)
    if cfg.model.compile:
        compile_layers(model, cfg.model.compile_memory_budget, steady=cfg.steady_lengths)
    add_tp_grad_hooks(model, groups.tp)
    return model


def grow_vocab(model, run: ResolvedRun, tp_group, device) -> None:
    """data.tokens' new rows into the loaded GPTModel (adapter/models/vocab.py): the embedding (and an untied
    output layer) gathered over TP, the rows transformers' resize_token_embeddings appends computed from them, and
    each rank's vocabulary slice of them written in. The rows past them stay padding (masked in the loss)."""
    g, cfg = run.vocab, run.cfg
    tp, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)

    def whole(w: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(w, device=device) for _ in range(tp)]
        dist.all_gather(parts, w.detach().to(device), group=tp_group)
        return torch.cat(parts).cpu()[:g.rows]

    emb = model.embedding.word_embeddings.weight
    head = None if run.arch.tie_embeddings else model.output_layer.weight
    new_emb, new_head = vocab.added_rows(
        vocab.config_dict(source.hf_dir(cfg)), whole(emb), None if head is None else whole(head), g.new_rows,
        mean=g.mean, seed=cfg.seed, trust_remote_code=cfg.model.trust_remote_code)
    local = emb.shape[0]
    lo, hi = max(g.rows, tp_rank * local), min(g.new_rows, (tp_rank + 1) * local)  # this rank's share of the rows
    if lo >= hi:
        return
    with torch.no_grad():
        for w, rows in ((emb, new_emb), (head, new_head)):
            if w is not None:
                w[lo - tp_rank * local:hi - tp_rank * local].copy_(rows[lo - g.rows:hi - g.rows])


def _transformers_model(run: ResolvedRun, groups: Groups, device, dtype) -> tuple[Any, int]:
    """transformers' own model of the checkpoint (adapter/modeling/hf_build.py) in the loop's call
    (`CausalLMLosses`): the HF weights read as they are, or random in its shape (seed) where the run starts so;
    at tp > 1 split as its own tensor-parallel plan says (adapter/modeling/hf_tp.py), adapters included; at ep > 1
    its experts as its expert-parallel plan says (adapter/modeling/hf_ep.py); at cp > 1 its attention runs across
    the CP group (adapter/modeling/hf_cp.py). Also returns how many decoder layers recompute (gradient_checkpointing;
    the run's first lines say it)."""
    cfg = run.cfg
    liger = cfg.model.liger if liger_available() else ()  # Triton's kernels: CUDA only
    model = build_model(run.weights.model_dir, weights=run.weights.kind == "pretrained", dtype=dtype, seed=cfg.seed,
                        trust_remote_code=cfg.model.trust_remote_code,
                        quantize=run.peft.quantize_base if run.peft is not None else None, device=device,
                        liger=liger, dequantize=cfg.model.dequantize,
                        scores=reward_pad(run) if cfg.objective == "reward" else None, classes=cfg.model.num_labels,
                        linearized=cfg.model.linearized_experts,
                        towers=("mm_frozen" if cfg.model.freeze_mm_modules else "trained") if cfg.data.processor_type
                        else "frozen")
    vocab.resize_hf(model, run.vocab, seed=cfg.seed)  # data.tokens' rows, by transformers itself
    if cfg.qat is not None:  # torchao's fake-quantised linears, as Axolotl prepares them (adapter/modeling/hf_qat.py)
        hf_qat.prepare(model, cfg.qat)
    recomputed = recompute_layers(model) if cfg.recompute == "full" else 0  # gradient_checkpointing: transformers'
    cp = None
    if run.layout.cp > 1 or run.shares_prompt or run.own_attention:  # (at cp 1: the shared prompts' key gather,
        # checks.prompt_sharing; flash attention for windows and packed documents, checks.own_attention)
        comm = cfg.parallelism.cp_comm_type if run.layout.cp > 1 else "all_gather"
        hf_cp.install(model, dtype=dtype, comm=comm, gpu=torch.device(device).type == "cuda")
        cp = (groups.cp, comm)
    if run.peft is not None:  # PEFT's own LoRA layers, as Axolotl builds them
        model = add_peft(model, run.peft, seed=cfg.seed)
    if run.layout.tp > 1:
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        hf_tp.shard(model, run.layout.tp, dist.get_rank(groups.tp), groups.tp,
                    rope_dim=getattr(text, "qk_rope_head_dim", None))
    if run.arch.ep_experts:  # each rank keeps its block of every layer's experts, as the model's own EP plan says
        hf_ep.shard(model, run.layout.ep, dist.get_rank(groups.ep) if run.layout.ep > 1 else 0, groups.ep)
    if run.unfrozen is not None:  # unfrozen_parameters, on transformers' own names
        freeze(model, list(run.unfrozen), 0, 1)
    if recomputed:  # a frozen tower's input-gradient hook (checkpointing's) would back-propagate through it
        drop_frozen_input_grads(model)
    # the model's own loss where Liger's cross-entropy is asked (transformers' loss function where it is not there)
    model_loss = bool({"cross_entropy", "fused_linear_cross_entropy"} & set(cfg.model.liger))
    unpack = runs_unpacked(run.arch.layer_kinds, cfg.document_attention) is not None
    if cfg.model.compile:  # after PEFT, TP and EP replaced modules: the graphs trace what trains
        compile_hf_layers(model, cfg.model.compile_memory_budget)
    aux = run.arch.router_aux_loss_coef if run.arch.output_router_logits else 0.0  # the load-balancing loss
    # the fused linear CE (checks.linear_ce_where_it_applies): nd-adapter's kernel over the body's hidden states
    linear_ce = (cfg.model.fused_linear_ce_chunk, run.arch.final_softcap) if cfg.model.fused_linear_ce else None
    head = model.get_output_embeddings()
    if linear_ce and not plain_linear(head):  # a wrapper checks did not foresee
        raise bad(spell(cfg, "model.fused_linear_ce"), True, f"lm_head is a {type(head).__name__} here (an adapter, "
                  "QAT or another wrapper): the fused kernel would read a weight the model does not use",
                  "set it false")
    losses = (RewardScores(model, cp) if cfg.objective == "reward" else
              TokenClassLosses(model, cp) if cfg.model.num_labels is not None else
              CausalLMLosses(model, model_loss=model_loss, cp=cp, unpack=unpack, aux_coef=aux,
                             linear_ce=linear_ce,
                             eaft=(cfg.eaft.k, cfg.eaft.alpha) if cfg.eaft is not None else None)).to(device)
    if ("fused_linear_cross_entropy" in liger or linear_ce) and run.zero_stage == 3:  # the fused loss (Liger's or
        # ours) reads lm_head's weight, never calling lm_head: ZeRO-3 gathers it for the whole forward (else a
        # partition of it); its gradient comes from the loss's forward (computed there), reduced like any other
        deepspeed.zero.register_external_parameter(losses, head.weight)
    if run.peft is not None and run.peft.experts:
        move_expert_states(model, device)
    return losses, recomputed


def reward_pad(run: ResolvedRun) -> int:
    """The token a reward model's rows are padded with (the tokenizer's pad token, else EOS: TRL's), which its
    score pooling skips (config.pad_token_id)."""
    from adapter.data.sft.prepare import load_tokenizer, pad_id
    from adapter.models import source

    return pad_id(load_tokenizer(run.cfg, source.tokenizer_dir(run.cfg), run.arch.vocab_size))


def build_engine(run: ResolvedRun, groups: Groups, device, load_weights=None) -> Engine:
    """`load_weights(model)`: the run's first weights into the plain GPTModel (adapter/convert/cache.load: a
    converted checkpoint or the converted pre-trained weights); None loads `model.checkpoint` if set. The
    transformers engine (`run.arch.native` false) builds transformers' model instead; the DeepSpeed side is one."""
    cfg, layout = run.cfg, run.layout
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.param_precision]
    tp = layout.tp
    recomputed = 0
    if run.arch.native:
        model = _native_model(run, groups, device, load_weights, dtype)
        layers = [Layer]
    else:
        model, recomputed = _transformers_model(run, groups, device, dtype)
        # a frozen weight inside a ZeRO-3 leaf module reaches autograd still partitioned (PEFT's base layers,
        # unfrozen_parameters: tests/distributed/test_transformers_engine.py), so such runs gather module by module
        layers = layer_classes(model.model) if all(p.requires_grad for p in model.parameters()) and \
            not cfg.data.processor_type else []  # (an image-text model's towers: gathered module by module too)
    hsdp = cfg.deepspeed.replicate_mode == "hsdp" or layout.dp_replicate == 1
    mpu = DeepSpeedMPU(tp_group=groups.tp, partition_group=groups.dp_shard_cp if hsdp else groups.dp_cp,
                       dp_world_size=layout.dp, replica_group=groups.dp_replicate if hsdp else None)
    if not hsdp:  # hpZ: DeepSpeed would group consecutive global ranks, mixing TP ranks; give it dp_shard×cp
        set_hpz_group(groups.dp_shard_cp)
    conf = deepspeed_config.build(cfg, layout)
    stage = conf["zero_optimization"]["stage"]  # the run's, unless deepspeed.overrides set it
    experts12 = False  # ZeRO-1/2 with trained experts: their own optimizer groups (adapter/patches/zero.py)
    if layout.ep > 1:  # experts kept within (ZeRO-3: partitioned over) the ranks holding them, in this replica
        place_experts(model, groups.ep, groups.expt_dp_shard if hsdp else groups.expt_dp, layout.ep,
                      zero3=stage == 3)
        experts12 = stage in (1, 2) and any(getattr(p, "nd_expert", False) and p.requires_grad
                                            for p in model.parameters())

    o, plus = cfg.optimizer, lora_plus(cfg)

    def optimizer_groups(weight_decay: float) -> list[dict]:
        found = param_groups(model, weight_decay, plus=plus)
        return zero12_expert_groups(found, layout.ep) if experts12 else found

    if stage == 3 and cfg.deepspeed.gather_granularity == "layer" and layers:
        set_z3_leaf_modules(model, layers)
    if run.flat_optimizer:
        opt = FlatAdamW(param_groups(model, o.weight_decay, names=True, plus=plus), lr=o.lr, betas=o.betas, eps=o.eps,
                        clip_grad=o.clip_grad, tp_group=groups.tp if tp > 1 else None,
                        state_bits=STATE_BITS[o.name], state_dtype=o.state_dtype)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=conf, mpu=mpu,
                                          lr_scheduler=lr_scheduler_for(cfg))

        drive_flat_optimizer(engine, opt)
        deposit_expert_grads(model)  # nothing hooks per-parameter gradients here (adapter/modeling/moe.py)
    elif cfg.optimizer.name != "adamw":  # ZeRO steps the 8- or 4-bit AdamW on its fp32 partitions
        opt = zero_client(o.name, optimizer_groups(o.weight_decay), lr=o.lr, betas=o.betas, eps=o.eps)
        with zero12_with_experts(experts12):
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=conf, mpu=mpu,
                                              lr_scheduler=lr_scheduler_for(cfg))
    else:
        with zero12_with_experts(experts12):
            engine, *_ = deepspeed.initialize(model=model, config=conf, mpu=mpu, lr_scheduler=lr_scheduler_for(cfg),
                                              model_parameters=optimizer_groups(cfg.optimizer.weight_decay))
    if stage in (1, 2):
        install_zero12_step(engine.optimizer)
    if layout.ep > 1 and stage == 3:
        expert_norm_with_tp(engine.optimizer)
    return Engine(engine, mpu, conf, layout, recomputed)


__all__ = ["Engine", "build_engine", "init_distributed", "param_groups", "add_tp_grad_hooks"]
