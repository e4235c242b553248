"""Checks that need both the run config and the model's architecture (the config alone cannot know head counts)."""
from __future__ import annotations

from adapter.config import RunConfig, compile_note, spell
from adapter.config.schema_rl import PAIR_OBJECTIVES
from adapter.errors import bad
from adapter.models import freeze, generic_run, linearized, lora
from adapter.models.arch import ModelArch, check_tp
from adapter.models.counts import linear_ce_chunk, output_rows
from adapter.models.generic import unsplittable


def _check_cp_chunks(cfg: RunConfig) -> None:
    """Both engines cut each sequence into 2·cp load-balanced chunks (adapter/kernels/attention.split_for_cp)."""
    cp, seq = cfg.parallelism.cp_size, cfg.seq_len
    if cp > 1 and seq % (2 * cp):
        raise bad(spell(cfg, "seq_len"), seq, f"not divisible by 2·cp_size = {2 * cp} (load-balanced context-parallel "
                  "chunks)", f"use a seq_len that is a multiple of {2 * cp}")


def _check_eaft(cfg: RunConfig) -> None:
    """EAFT reweights the next-token loss of a supervised run, computed from the logits: another objective, or a loss
    that Liger's kernels compute inside the model (no logits reach nd-adapter), is refused in one line."""
    if cfg.eaft is None:
        return
    key = spell(cfg, "eaft")
    if cfg.objective != "sft":
        raise bad(key, True, f"EAFT weighs the next-token loss of supervised fine-tuning; {cfg.objective} has a loss "
                  "of its own", f"remove {key}")
    liger = {"cross_entropy", "fused_linear_cross_entropy"} & set(cfg.model.liger)
    if liger:
        raise bad(key, True, f"Liger's {', '.join(sorted(liger))} computes the loss inside the model, where EAFT's "
                  "weights cannot reach it", "turn off liger_cross_entropy / liger_fused_linear_cross_entropy")


def _check_token_labels(cfg: RunConfig) -> None:
    """A process reward model (model.num_labels: a token-classification head, TRL's PRMTrainer) trains on rows whose
    labels are classes (stepwise_supervised, or pre-tokenised rows with class labels), and stepwise_supervised rows
    train nothing else; what it is not built beside is refused in one line."""
    d, n = cfg.data, cfg.model.num_labels
    entries = [*d.datasets, *d.test_datasets]
    steps = next((e for e in entries if e.type == "stepwise_supervised"), None)
    if n is None:
        if steps is not None:
            raise bad(spell(cfg, "data.datasets"), "type: stepwise_supervised", "a process reward model's rows (a "
                      "class per step) train a token-classification head", "set process_reward_model: true "
                      "(model.num_labels: 2)")
        return
    key = spell(cfg, "model.num_labels")
    other = next((e.type for e in entries if e.type not in ("stepwise_supervised", None)), None)
    for on, what, fix in (
            (cfg.objective != "sft", f"{cfg.objective} has an objective of its own", f"remove {key}"),
            (not d.datasets, "it trains on labelled rows, and the run has none (synthetic or pretraining tokens "
             "would be read as classes)", "give datasets of type stepwise_supervised"),
            (other is not None, f"its rows' labels are classes: a {other} dataset's are token ids",
             "use type: stepwise_supervised (or pre-tokenised rows with class labels)"),
            (bool(d.processor_type), "image-text rows are not built for it", "remove processor_type"),
            (cfg.eaft is not None, "EAFT weighs a next-token loss", f"remove {spell(cfg, 'eaft')}"),
            (bool({"cross_entropy", "fused_linear_cross_entropy"} & set(cfg.model.liger)),
             "Liger's cross-entropy computes a next-token loss", "turn off liger_cross_entropy / "
             "liger_fused_linear_cross_entropy"),
            (cfg.parallelism.tp_size > 1 or cfg.parallelism.cp_size > 1, "tensor and context parallelism are not "
             "built for its head", "use dp_shard_size (ZeRO) instead"),
            (cfg.lora is not None and cfg.lora.quantize_base is not None, "a 4/8-bit base under its head is not "
             "built (as for a reward model's)", "train LoRA on the 16-bit base (adapter: lora)")):
        if on:
            raise bad(key, n, f"a process reward model: {what}", fix)


def check(cfg: RunConfig, arch: ModelArch) -> list[str]:
    """Raise UserError for a layout the model cannot run; return warnings for ones it can but should not."""
    return checked(cfg, arch)[0]


def checked(cfg: RunConfig, arch: ModelArch) -> tuple[list[str], lora.LoraSpec | None, list[freeze.Tensor] | None]:
    """`check`, also returning what it resolved on the way: the LoRA spec and the unfrozen_parameters tensors
    (adapter/models/resolved.py keeps them, so nothing resolves them again)."""
    linearized.check(cfg, arch)
    _check_eaft(cfg)
    _check_token_labels(cfg)
    if not arch.native:  # transformers' own model: its limits, not the Megatron layers'
        warnings = generic_run.check_run(cfg, arch)
        _check_cp_chunks(cfg)
        return warnings + _preference_note(cfg, arch), None, None
    tp, cp, seq = cfg.parallelism.tp_size, cfg.parallelism.cp_size, cfg.seq_len
    check_tp(arch, tp, key=spell(cfg, "parallelism.tp_size"))
    ep = cfg.parallelism.ep_size
    if ep > 1 and not arch.moe:
        raise bad(spell(cfg, "parallelism.ep_size"), ep, f"{arch.architecture} is not a mixture of experts (no "
                  "experts to split)", "remove it")
    if ep > 1 and arch.num_experts is not None and arch.num_experts % ep:
        raise bad(spell(cfg, "parallelism.ep_size"), ep, f"does not divide num_experts={arch.num_experts} (each "
                  "expert-parallel rank holds whole experts)",
                  f"use a divisor of {arch.num_experts} that divides dp_shard × cp")
    if arch.moe:
        _check_moe(cfg, arch)
    if cfg.model.unfrozen_parameters is not None and cfg.lora is not None:
        theirs = (" (Axolotl applies it after LoRA, to the PEFT model's names, base_model.model.*: it freezes "
                  "every parameter no pattern matches, the adapters included, and patterns written for the base "
                  "model's names match none there)" if cfg.source == "axolotl" else "")
        raise bad(spell(cfg, "model.unfrozen_parameters"), cfg.model.unfrozen_parameters, "a LoRA run trains its "
                  "adapters (and modules_to_save) on a frozen base; unfrozen_parameters would train base weights "
                  f"too{theirs}", f"remove it, or list embed_tokens / lm_head under "
                  f"{spell(cfg, 'lora.modules_to_save')}")
    unfrozen = spec = None
    if cfg.model.unfrozen_parameters is not None:  # patterns that split a tensor or match nothing: refused here
        unfrozen = freeze.resolve(arch, cfg.model.unfrozen_parameters, spell(cfg, "model.unfrozen_parameters"),
                                  vocab_divisible_by=cfg.model.vocab_divisible_by)
    if cfg.lora is not None:  # targets, rank, modules_to_save, the adapter to start from: before any process starts
        spec = lora.from_config(cfg, arch)
        assert spec is not None  # cfg.lora is set
        if tp > arch.num_kv_heads and any(t.linear.fused == "linear_qkv" for t in spec.targets):
            *rest, last = [lin.name for lin in lora.nn_linears(arch) if lin.fused == "linear_qkv"]
            raise bad(spell(cfg, "parallelism.tp_size"), tp, f"exceeds num_key_value_heads={arch.num_kv_heads}: a "
                      "query group then spans several TP ranks, where LoRA on q/k/v is not built yet",
                      f"use a tp_size of at most {arch.num_kv_heads}, or leave "
                      f"{' and '.join(filter(None, (', '.join(rest), last)))} out of "
                      f"{spell(cfg, 'lora.target_modules')}")
        if spec.init_from:
            key = spell(cfg, "lora.init_from")
            lora.check_adapter(*lora.read_adapter_meta(spec.init_from, key), spec, arch, key)
        if cfg.precision == "fp8":
            raise bad("precision", "fp8", "fp8 matmuls are not wired into LoRA runs yet", "use precision: bf16")
        if spec.quantize_base == "nf4" and tp > arch.num_kv_heads:
            raise bad(spell(cfg, "parallelism.tp_size"), tp, f"exceeds num_key_value_heads={arch.num_kv_heads}: "
                      "the 4-bit base quantises each rank's q, k and v rows of whole query groups",
                      f"use a tp_size of at most {arch.num_kv_heads}")
        if spec.quantize_base == "nf4":  # blocks of 64 inside one row of every rank's shard (modeling/quant.py)
            for lin in lora.nn_linears(arch):
                width = lin.inp // (tp if lin.tp_axis == 1 else 1)
                if width % lora.NF4_BLOCK:
                    raise bad(spell(cfg, "lora.quantize_base"), "nf4", f"{lin.name}'s input width per TP rank "
                              f"({width}) is not a multiple of NF4's block of {lora.NF4_BLOCK}",
                              "use a tp_size that keeps it a multiple of 64, or a 16-bit base")
    windowed = arch.sliding_window is not None and seq > arch.sliding_window  # some layer's window matters
    if cp > 1 and arch.attn_softcap is not None:
        raise bad(spell(cfg, "parallelism.cp_size"), cp, f"{arch.architecture}'s attention soft-capping "
                  "(attn_logit_softcapping) runs with materialised scores, which are not built under context "
                  "parallelism", f"use {spell(cfg, 'parallelism.cp_size')}: 1 for this model")
    if cp > 1 and windowed and cfg.parallelism.cp_comm_type == "p2p":
        raise bad("parallelism.cp_comm_type", "p2p", f"{arch.architecture}'s sliding window "
                  f"({arch.sliding_window} tokens) on the ring is not built", "use cp_comm_type: all_gather")
    if cfg.model.attention != "sdpa" and (arch.sliding_window is not None or arch.attn_softcap is not None
                                          or arch.local_rope_theta is not None):
        raise bad("model.attention", cfg.model.attention, f"{arch.architecture}'s sliding windows, soft-capping or "
                  "per-layer RoPE run in nd-adapter's attention only", "set model.attention: sdpa (the default)")
    _check_cp_chunks(cfg)
    if cfg.use_sequence_parallel and tp > 1 and (seq // cp) % tp:
        raise bad(spell(cfg, "seq_len"), seq, f"the per-cp-rank sequence {seq // cp} is not divisible by tp_size={tp} "
                  "(sequence parallelism splits it)", f"use a seq_len that is a multiple of {cp * tp}, "
                  "or set sequence_parallel: false")
    if cfg.document_attention and cfg.model.attention != "sdpa":
        raise bad("model.attention", cfg.model.attention, "packed documents (data.document_mask) run nd-adapter's "
                  "varlen attention", "set model.attention: sdpa (the default)")
    if cfg.precision == "fp8" and tp > 1:
        raise bad("precision", "fp8", "fp8 matmuls are wired for tp_size = 1 only (measured on one GPU; "
                  "docs/BENCHMARKS.md)", "use precision: bf16 with tensor parallelism")
    warnings = []
    if arch.moe:
        warnings.append(f"{arch.architecture} is a mixture of experts: the step time models the experts as one "
                        "GEMM over the routed tokens (grouped GEMMs, model.moe_grouped_gemm); its host cost is "
                        "fitted to one measured shape on one H200 (compiled, bf16 states), whose eager fp32-state "
                        "run it predicts within 5% (docs/BENCHMARKS.md, 2026-12-05)")
    if cfg.precision == "fp8" and not cfg.model.compile:
        warnings.append("precision fp8 without model.compile: the fp8 casts run unfused and cost more than the "
                        "fp8 matmuls save")
    if seq > arch.max_position_embeddings:
        warnings.append(f"seq_len {seq} exceeds the model's max_position_embeddings {arch.max_position_embeddings}")
    qat = ["qat: plan counts no fake-quantisation time or memory (torchao rounds each weight, and each linear's "
           "input, through the format in every forward; not yet measured on a GPU)"] if cfg.qat is not None else []
    if cfg.lora is not None and cfg.lora.use_dora:
        qat.append("lora.use_dora: plan counts DoRA's magnitudes but not the time of its weight norms (PEFT's DoRA "
                   "recomputes each adapted weight's row norms in every forward; not yet measured on a GPU)")
    return warnings + _preference_note(cfg, arch) + qat, spec, unfrozen


def _preference_note(cfg: RunConfig, arch: ModelArch) -> list[str]:
    """What plan counts of a preference objective, from the one table of its passes (config.PREFERENCE_PASSES)."""
    if cfg.objective == "sft":
        return []
    grad, forwards = cfg.preference_passes()
    rows = "both answers of each pair" if grad == 2 else "each row"
    extra = f" and {forwards} forward-only pass{'es' if forwards > 1 else ''} over them a step at a forward's " \
        "share of the step" if forwards else (" (its reference: a table computed once before step 1)"
                                              if cfg.fixed_reference() else "")
    shared = ("; each prompt runs once for both answers (dpo.share_prompt), which plan still counts twice: its "
              "memory and time are an upper bound" if prompt_sharing(cfg, arch, cfg.parallelism.cp_size) is None
              else "")
    checked = " (LoRA DPO against one H100: docs/BENCHMARKS.md)" if cfg.objective in ("dpo", "ipo") else ""
    return [f"objective {cfg.objective}: plan counts {rows} as sequences of the micro-batch{extra}{shared}; each "
            f"sequence at sequence_len, so where the pairs are shorter plan's figures are an upper bound too{checked}"]


NO_PAIRS = "no preference pairs"


def prompt_sharing(cfg: RunConfig, arch: ModelArch, cp: int) -> str | None:
    """None where a preference pair's prompt runs once for both answers (dpo.share_prompt, adapter/kernels/thd.
    pairs_to_shared_stream), else why not. `true` where it is not built is refused in one line."""
    if cfg.objective not in PAIR_OBJECTIVES:
        return NO_PAIRS
    setting = cfg.dpo.share_prompt
    why = ("dpo.share_prompt: false" if setting is False else
           "a reward model scores each whole sequence at its own last token" if cfg.objective == "reward" else
           "context parallelism splits each sequence into chunks of its own" if cp > 1 else
           f"{arch.architecture}'s soft-capped attention scores run per sequence" if arch.attn_softcap else
           "a mixture of experts with its load-balancing loss trained: its statistic counts each prompt twice, as "
           "TRL's batch does" if arch.moe and arch.output_router_logits and arch.router_aux_loss_coef > 0 else
           f"model.attention: {cfg.model.attention} (nd-adapter's varlen attention shares it: sdpa)"
           if cfg.model.attention != "sdpa" else None if arch.native else _transformers_attention(arch))
    if setting is True and why is not None:
        raise bad("dpo.share_prompt", True, f"not built here: {why}", "set dpo.share_prompt: auto (or false)")
    return why


# generic.attention_features the shared stream's kernels do not compute (the transformers engine runs it through
# the attention function adapter/modeling/hf_cp.py registers, at cp 1 as at cp > 1)
_NOT_SHARED = {"interface": "does not declare transformers' attention interface", "sinks": "has attention sinks",
               "chunked": "attends in chunks", "softcap": "soft-caps its scores", "dropout": "has attention dropout",
               "dynamic_rope": "chooses its RoPE frequencies by the longest position in the forward"}


def _transformers_attention(arch: ModelArch) -> str | None:
    """Why the transformers engine cannot share a prompt on this model, or None."""
    kind = unsplittable(arch.layer_kinds)
    if kind:
        return f"its {kind} layers carry a state along the sequence"
    found = [_NOT_SHARED[f.split(":")[0]] for f in arch.attention_features if f.split(":")[0] in _NOT_SHARED]
    return f"{arch.architecture}'s attention {found[0]}" if found else None


def own_attention(cfg: RunConfig, arch: ModelArch) -> str | None:
    """Why the transformers engine keeps transformers' own attention at cp = 1, or None: it runs nd-adapter's kernels
    through the attention interface (adapter/modeling/hf_cp.py: flash attention with a sliding window, packed
    documents by their boundaries), where transformers' sdpa path would take a materialised S×S mask and leave
    flash (masking_utils builds one for a window whenever the keys reach it: Olmo-3's layers at seq 4096 ran
    unflashed). The model's attention must be what those kernels compute (_transformers_attention); compiled layers
    keep transformers' own (the function's per-forward state is not traced)."""
    if cfg.model.attention != "sdpa":
        return f"model.attention: {cfg.model.attention}"
    if cfg.model.compile:
        return "compiled layers (model.compile)"
    if cfg.data.processor_type:  # an image tower's bidirectional attention, image tokens seen both ways (Gemma 3)
        return "image-text rows (the model's own masks over its image tokens)"
    return _transformers_attention(arch)


def _check_moe(cfg: RunConfig, arch: ModelArch) -> None:
    """What a mixture-of-experts model cannot run yet, each in one line."""
    name = arch.architecture  # (freezing parts of one trains on the transformers engine: lora.check_native)
    if cfg.precision == "fp8":
        raise bad("precision", "fp8", f"fp8 experts ({name}) are not built", "use precision: bf16")
    if cfg.parallelism.tp_size > 1 and not cfg.use_sequence_parallel:
        raise bad(spell(cfg, "sequence_parallel"), False, "Megatron-Core's mixture-of-experts layer "
                  "trains with tensor parallelism only beside sequence parallelism",
                  "remove the key (it is on by default when tp_size > 1)")


def compile_where_it_runs(cfg: RunConfig, arch: ModelArch, gpu: bool) -> RunConfig:
    """`model.compile: auto` after the config's own reasons (config/load.py): off on a CPU (compiling costs minutes of
    CPU time there and nothing was measured faster), on the transformers engine (its compiled layers are correct
    on CUDA, tests/gpu/test_train.py, and were measured 2% slower than eager on the Olmo-3 shape with the
    sliding-window masks on flash, 2026-12-07; 12% before) and for a
    preference objective on a mixture of experts (LoRA DPO was measured on a dense model), with the first line said
    again."""
    if not (cfg.compile_auto and cfg.model.compile):
        return cfg
    why = ("no GPU is visible to this process (compiled layers were measured faster on GPUs only)" if not gpu else
           "the transformers engine's compiled layers were measured slower (Olmo-3 shape, 8 layers, one H100: "
           "30.7k tokens/s compiled, 31.5k eager, bf16 states)" if not arch.native else
           f"{cfg.objective} on a mixture of experts was not measured faster compiled (LoRA DPO was, on a dense "
           "model)" if arch.moe and cfg.objective != "sft" else None)
    if why is None:
        return cfg
    notes = tuple(compile_note(cfg, why) if n == compile_note(cfg, None) else n for n in cfg.notes)
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"compile": False}), "notes": notes})


# `auto` keeps the transformers engine's own loss (or Liger's): its fused path, equal to transformers on CPU at every
# layout tested (tests/distributed/test_transformers_engine.py), was measured no faster there than Liger's and held
# more memory (docs/BENCHMARKS.md 2026-12-07); `true` runs it wherever it applies
HF_LINEAR_CE_NO_FASTER = ("on the transformers engine measured no faster than Liger's and 0.6 GiB larger (Olmo-3 "
                           "shape, one H100): the model's own loss (model.fused_linear_ce: true runs nd-adapter's "
                           "kernel)")


def hf_linear_ce_off(cfg: RunConfig, arch: ModelArch) -> str | None:
    """Why the transformers engine keeps its model's own loss (or Liger's), or None where nd-adapter's fused linear
    CE computes it over the body's hidden states (adapter/modeling/hf_build.CausalLMLosses)."""
    lora = cfg.lora
    head_adapted = lora is not None and ("lm_head" in lora.modules_to_save or "lm_head" in (
        lora.target_modules if isinstance(lora.target_modules, str) else " ".join(lora.target_modules or ())))
    return ("a process reward model's token-classification head: its classes' cross-entropy"
            if cfg.model.num_labels is not None else
            "Liger's cross-entropy kernel computes the loss (its key asks)" if
            {"cross_entropy", "fused_linear_cross_entropy"} & set(cfg.model.liger) else
            f"{arch.architecture}'s forward does more than lm_head over its body's output: its own loss"
            if not arch.plain_head else
            "lm_head is an adapter's module (lora_modules_to_save / lora_target_modules): its own loss"
            if head_adapted else
            "qat: the output layer may be fake-quantised: its own loss" if cfg.qat is not None else
            "image-text rows: the model's own loss" if cfg.data.processor_type else
            "tensor parallelism splits the transformers engine's output layer: its own loss"
            if cfg.parallelism.tp_size > 1 else None)


def linear_ce_where_it_applies(cfg: RunConfig, arch: ModelArch) -> RunConfig:
    """`model.fused_linear_ce: auto` (the default): the output layer and the cross-entropy in token chunks, so the
    [tokens × vocab] logits and their gradient never exist whole (the 1B shape at seq 4096 × 2: 3.9 GiB, Gemma 3's
    262k vocabulary 8 GiB; transformers + Liger, the peer, never holds them either), wherever it applies: the native
    engine (on the transformers engine it applies where the model's logits are lm_head over its body's output,
    hf_linear_ce_off says where not; `auto` leaves it off there: measured no faster than Liger's, and larger), for
    a token-level loss (a preference objective needs each token's log-probability, and the kernel returns their
    sum), outside fp16 (its gradients are formed in the forward, unscaled). On, it is nd-adapter's kernel at
    `linear_ce_chunk` tokens a chunk (one H200, 1B shape: +2.4 ms a step, docs/BENCHMARKS.md), not Liger's (+8 ms),
    which `true` keeps at tp = 1 on GPUs. The first lines say which."""
    off = None if arch.native else hf_linear_ce_off(cfg, arch)
    if cfg.eaft is not None:  # its weights are read off each token's logits (adapter/kernels/eaft.py)
        off = off or "EAFT weighs each token by its logits' top-k entropy, so the logits are built"
    if cfg.model.fused_linear_ce is True and cfg.eaft is not None:
        raise bad(spell(cfg, "model.fused_linear_ce"), True, f"{off}; the fused kernel never builds them",
                  f"remove it (or {spell(cfg, 'eaft')})")
    if cfg.model.fused_linear_ce is True and off:
        raise bad(spell(cfg, "model.fused_linear_ce"), True, f"the fused linear cross-entropy is not built on the "
                  f"transformers engine here ({off})", "remove it")
    if cfg.model.fused_linear_ce != "auto":
        return cfg
    why = (f"{cfg.objective} needs each token's log-probability (the fused kernel returns their sum)"
           if cfg.objective != "sft" else
           "fp16: the kernel's output-weight gradient, a sum over the micro-batch's tokens computed before the loss "
           "scale reaches it, could overflow fp16's range" if cfg.precision == "fp16" else
           off if cfg.eaft is not None else None if arch.native else off or HF_LINEAR_CE_NO_FASTER)
    chunk = cfg.model.fused_linear_ce_chunk
    if why is None and chunk is None:
        chunk = linear_ce_chunk(output_rows(arch, cfg.parallelism.tp_size, cfg.model.vocab_divisible_by))
    note = (f"model.fused_linear_ce: auto: on (output layer + cross-entropy in chunks of {chunk} tokens: no "
            "[tokens x vocab] logits)" if why is None else f"model.fused_linear_ce: auto: off: {why}")
    model = cfg.model.model_copy(update={"fused_linear_ce": why is None,
                                         "fused_linear_ce_chunk": chunk if why is None else None})
    return cfg.model_copy(update={"model": model, "notes": (*cfg.notes, note)})
