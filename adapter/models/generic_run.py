"""What a run on the transformers engine trains, and what that engine does not run yet: PEFT's LoRA (and QLoRA's
bitsandbytes base) on transformers' own model, counted on the model built on the meta device
(adapter/models/generic.py; `unfrozen_parameters` there: adapter/models/generic_freeze.py), and the one-line
refusals of `check_run`. Torch-free to import: the meta-device model is built (torch, transformers, peft) only when
a transformers-engine run is resolved.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any

from adapter.errors import bad
from adapter.models import quant_experts
from adapter.models.generic import meta_facts, meta_model, runs_unpacked, text_part, unsplittable

_KEPT = "the other weights in the run's precision (no prepare_model_for_kbit_training fp32 upcast)"
QUANTIZED = {"nf4": "NF4 through bitsandbytes (transformers' load_in_4bit: double quantisation, blocks of 64); "
                    + _KEPT,
             "int8": f"int8 through bitsandbytes (transformers' load_in_8bit); {_KEPT}"}


@dataclass(frozen=True)
class PeftSpec:
    """LoRA on the transformers engine: PEFT's own `LoraConfig` on transformers' model (Axolotl's lora_* keys, with
    PEFT's semantics as they are), and what it adds, counted exactly on the meta-device model."""
    r: int
    alpha: float
    dropout: float
    rslora: bool
    target_modules: tuple[str, ...] | str   # PEFT's target_modules: names, a regex, or "all-linear"
    layers: tuple[int, ...] | None
    modules_to_save: tuple[str, ...]
    init_from: str | None
    added: int                              # the adapters' parameters
    trained: int                            # the adapters and the modules_to_save copies
    matched: tuple[str, ...]                # the module names (last part) that carry an adapter
    quantize_base: str | None = None        # "nf4" / "int8": bitsandbytes' 4/8-bit base, as transformers loads it
    target_parameters: tuple[str, ...] = ()  # PEFT's target_parameters: parameter names (fused 3-D expert weights)
    linears: tuple[int, int] = (0, 0)       # weights of the linears a 4/8-bit base quantises (all but the output
                                            # layer, as transformers' bitsandbytes loading skips it), the largest one
    adapter_inputs: int = 0                 # Σ in_features of the linears that carry an adapter (plan: what PEFT's
                                            # fp32 adapters keep and move of their inputs)
    experts: tuple[int, ...] | None = None  # quantize_experts: each quantised expert weight's size (None: not asked)
    task_type: str = "CAUSAL_LM"            # PEFT's task: SEQ_CLS for a reward model (its score trained in full)
    use_dora: bool = False                  # PEFT's DoRA: a trained magnitude vector beside each adapter
    rank_pattern: tuple[tuple[str, int], ...] = ()      # PEFT's rank_pattern / alpha_pattern, as (key, value) pairs
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    init_weights: str = "default"           # PEFT's init_lora_weights: default (True) or gaussian
    token_indices: str = ""                 # PEFT's trainable_token_indices as JSON (a list, or a dict of them)

    def lora_config(self) -> dict[str, Any]:
        """`peft.LoraConfig`'s keywords."""
        return {"r": self.r, "lora_alpha": self.alpha, "lora_dropout": self.dropout, "use_rslora": self.rslora,
                "target_modules": list(self.target_modules) if isinstance(self.target_modules, tuple)
                else self.target_modules,
                "target_parameters": list(self.target_parameters) or None,
                "layers_to_transform": list(self.layers) if self.layers else None,
                "modules_to_save": list(self.modules_to_save) or None, "task_type": self.task_type,
                **({"use_dora": True} if self.use_dora else {}),
                **({"rank_pattern": dict(self.rank_pattern)} if self.rank_pattern else {}),
                **({"alpha_pattern": dict(self.alpha_pattern)} if self.alpha_pattern else {}),
                **({"init_lora_weights": "gaussian"} if self.init_weights == "gaussian" else {}),
                **({"trainable_token_indices": json.loads(self.token_indices)} if self.token_indices else {})}

    def describe(self, arch, key: str) -> str:
        total = arch.param_count or 1
        size = f"{total / 1e9:.2f}B" if total >= 1e8 else f"{total / 1e6:.2f}M"
        kind = "DoRA" if self.use_dora else "LoRA"
        return (f"{key}: {kind} r {self.r}, alpha {self.alpha:g}{', rslora' if self.rslora else ''} on "
                f"{', '.join(self.matched)} (PEFT on transformers' model)"
                + (f"; ranks {dict(self.rank_pattern)} by pattern" if self.rank_pattern else "")
                + (f"; alphas {dict(self.alpha_pattern)} by pattern" if self.alpha_pattern else "")
                + ("; A initialised gaussian (std 1/r)" if self.init_weights == "gaussian" else "")
                + (f"; token rows {self.token_indices} trained" if self.token_indices else "")
                + (f"; {' and '.join(self.modules_to_save)} trained in full" if self.modules_to_save else "")
                + f": {self.trained:,} trained parameters ({100 * self.trained / total:.2f}% of {size}); "
                "the base frozen" + (f", {QUANTIZED[self.quantize_base]}" if self.quantize_base else "")
                + ("" if self.experts is None else
                   f"; {len(self.experts)} 3-D expert weights ({sum(self.experts) / 1e6:,.2f}M) quantised too, "
                   + ("by bitsandbytes' NF4 parametrisation" if self.quantize_base == "nf4" else
                      "in int8 by Axolotl's parametrisation (bitsandbytes' row-wise absmax)")
                   + " (Axolotl's quantize_moe_experts), dequantised at each use"
                   if self.experts else "; quantize_moe_experts: the model has no 3-D expert weights to quantise")
                + (f"; adapters start from {self.init_from}" if self.init_from else ""))


def resolve_peft(cfg, config_json: dict[str, Any], *, trust_remote_code: bool, model_dir: str | None) -> PeftSpec:
    """The run's `lora:` section as PEFT applies it to transformers' model: a target that matches no module, or a
    value PEFT refuses, is one line naming the user's key."""
    from adapter.config import spell

    c = cfg.lora
    if c.target_linear:
        targets: tuple[str, ...] | str = "all-linear"
    elif isinstance(c.target_modules, str):
        targets = c.target_modules
    else:
        targets = tuple(c.target_modules) if c.target_modules else ()
    params = tuple(c.target_parameters or ())
    spec = PeftSpec(c.r, c.alpha, c.dropout, c.rslora, targets, tuple(c.layers) if c.layers else None,
                    tuple(c.modules_to_save), c.init_from, 0, 0, (), c.quantize_base, params, use_dora=c.use_dora,
                    rank_pattern=tuple((c.rank_pattern or {}).items()),
                    alpha_pattern=tuple((c.alpha_pattern or {}).items()), init_weights=c.init_weights,
                    token_indices=json.dumps(c.trainable_token_indices) if c.trainable_token_indices else "")
    kw = spec.lora_config()
    if not targets and not params:
        kw.pop("target_modules")  # PEFT's default for the model type, as Axolotl leaves it
    text = json.dumps(config_json, sort_keys=True)
    lin = cfg.model.linearized_experts  # the meta model in Axolotl's per-expert linears (adapter/models/linearized.py)
    experts = None
    if c.quantize_experts:  # Axolotl's quantize_moe_experts (adapter/models/quant_experts.py)
        quant_experts.check(cfg)
        experts = tuple(n for name, n, _, dims in _parameters(text, trust_remote_code, model_dir, lin)[1]
                        if quant_experts.is_expert_weight(name, dims))
    if params:  # Axolotl passes lora_target_modules or [] beside them: the parameters alone when none are listed
        _check_parameters(cfg, params, c.dropout, text, trust_remote_code, model_dir)
    try:
        added, trained, matched, default, linears, inputs = _peft_counts(text, trust_remote_code, model_dir,
                                                                         json.dumps(kw, sort_keys=True), lin)
    except (ValueError, TypeError, KeyError) as e:
        cls = meta_facts(text, trust_remote_code, model_dir, lin)["cls"]
        problem = f"PEFT cannot apply it to {cls}: {str(e).splitlines()[0][:200]}"
        if params and ("nn.Parameter" in str(e) or not targets):  # a parameter of a targeted module, say
            raise bad(spell(cfg, "lora.target_parameters"), list(params), problem, "name parameters of modules "
                      "that no target_modules entry adapts (a mixture of experts' fused expert weights)")
        if "lora_dropout" in str(e):  # PEFT 0.21 maps v4 expert names (gate_proj, ...) onto fused expert weights
            raise bad(spell(cfg, "lora.dropout"), c.dropout, f"{problem} (PEFT adapts {cls}'s fused expert weights "
                      "as parameters, which take no dropout, where the targets name its experts' projections)",
                      "set lora_dropout: 0, or name only modules outside the experts in lora_target_modules")
        key = "lora.target_linear" if c.target_linear else "lora.target_modules"
        raise bad(spell(cfg, key), c.target_modules if not c.target_linear else True, problem,
                  "name modules the model has (its linear layers' names), or use lora_target_linear: true")
    if experts:  # plan: the expert weights quantised beside the linears, one whole 3-D weight dequantised at a time
        linears = (linears[0] + sum(experts), max(linears[1], max(experts)))
    spec = dataclasses.replace(spec, added=added, trained=trained, matched=matched, linears=linears,
                               target_modules=targets or (() if params else default), adapter_inputs=inputs,
                               experts=experts)
    scored = cfg.objective == "reward" or cfg.model.num_labels is not None
    return scoring_peft(spec, config_json, cfg.model.num_labels) if scored else spec


def scoring_peft(spec: PeftSpec, config_json: dict[str, Any], classes: int | None = None) -> PeftSpec:
    """A reward model's LoRA as Axolotl builds it (its loader picks PEFT's SEQ_CLS task for a sequence classifier,
    TOKEN_CLS for a process reward model's token classifier): PEFT then trains the score head in full beside the
    adapters (its classifier modules_to_save) and leaves it out of `all-linear`, as the causal LM's counts above
    leave out the LM head; the head is one label × hidden (a token classifier's: `classes` × hidden, and a bias)."""
    hidden = int(text_part(config_json)[0].get("hidden_size") or 0)
    saved = spec.modules_to_save if "score" in spec.modules_to_save else (*spec.modules_to_save, "score")
    head = hidden if classes is None else (hidden + 1) * classes
    return dataclasses.replace(spec, task_type="SEQ_CLS" if classes is None else "TOKEN_CLS", modules_to_save=saved,
                               trained=spec.trained + head)


def _check_parameters(cfg, params: tuple[str, ...], dropout: float, config_text: str, trust_remote_code: bool,
                      model_dir: str | None) -> None:
    """Each `target_parameters` entry names a parameter of the model (PEFT's matching: the full name, or its end
    after a dot; PEFT itself only warns for an entry that matches nothing, and refuses only when nothing at all is
    adapted), and the adapters run without dropout: PEFT adapts a parameter by adding s·B·A to the weight before
    the module runs, where there is no input to drop out (its ParamWrapper refuses lora_dropout, as Axolotl does);
    and no layer list beside them, which PEFT would not apply to them."""
    from adapter.config import spell

    key = spell(cfg, "lora.target_parameters")
    layers = cfg.lora.layers
    if dropout:
        raise bad(spell(cfg, "lora.dropout"), dropout, f"PEFT adds the adapters of {key} to the weights before the "
                  "layer runs, so there is no input to drop out", f"set {spell(cfg, 'lora.dropout')}: 0")
    cls, named = _parameters(config_text, trust_remote_code, model_dir, cfg.model.linearized_experts)
    for entry in params:
        if not any(name == entry or name.endswith("." + entry) for name, *_ in named):
            fused = sorted({".".join(name.split(".")[-2:]) for name, _, _, dims in named if dims == 3})
            raise bad(key, entry, f"matches no parameter of {cls}",
                      f"name one it has, e.g. {', '.join(fused)}" if fused else
                      f"{cls} has no fused (3-D) expert weights: target its linear layers with "
                      f"{spell(cfg, 'lora.target_modules')}")
    if layers:  # PEFT's _inject_parameters reads no layers_to_transform: every layer's would be adapted
        full = next((n for n, *_ in named if n.endswith("." + params[0]) and f".{layers[0]}." in n), params[0])
        raise bad(spell(cfg, "lora.layers"), layers, f"PEFT applies it to target_modules only, so {key} would still "
                  f"adapt every layer", f"name those layers' parameters in full in {key} (e.g. {full}), or remove "
                  f"{spell(cfg, 'lora.layers')}")


@functools.lru_cache(maxsize=8)
def _peft_counts(config_text: str, trust_remote_code: bool, model_dir: str | None, lora_kw: str,
                 linearized: bool = False):
    """(adapter parameters, trained parameters, adapted module names, PEFT's default targets, (weights of the
    linears bitsandbytes would quantise, the largest), Σ in_features of the adapted linears) of PEFT's LoRA on the
    meta-device model; cached, as `plan --search` resolves one run per candidate layout."""
    import peft
    import torch

    model, _ = meta_model(json.loads(config_text), trust_remote_code=trust_remote_code, model_dir=model_dir,
                          linearized=linearized)
    out = model.get_output_embeddings()
    sizes = [m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not out]
    with torch.device("meta"):
        wrapped = peft.get_peft_model(model, peft.LoraConfig(**json.loads(lora_kw)))
    trained = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    added = sum(p.numel() for n, p in wrapped.named_parameters() if "lora_" in n)
    matched = _collapsed({_adapted(n, m) for n, m in wrapped.named_modules() if len(getattr(m, "lora_A", {})) > 0})
    default = getattr(wrapped.peft_config["default"], "target_modules", None) or ()  # PEFT's for the model type
    inputs = 0
    for m in wrapped.modules():
        a = getattr(m, "lora_A", None)
        first = a["default"] if isinstance(a, torch.nn.ModuleDict) and "default" in a else None
        if isinstance(first, torch.nn.Linear):  # (a parameter's adapter, PEFT's ParamWrapper, has no input to cast)
            inputs += first.in_features
    return added, trained, tuple(matched), tuple(default), (sum(sizes), max(sizes, default=0)), inputs


def _adapted(name: str, module) -> str:
    """What a PEFT layer adapts, as `describe` names it: its module's last name (q_proj), or for a parameter
    (PEFT's ParamWrapper, nested on the module that holds it) the module's and the parameter's (experts.down_proj);
    an entry of a module list by the list's name and its index (linearized experts: gate_projs.3)."""
    param = getattr(module, "parameter_name", None)
    parts = name.replace(".base_layer", "").split(".")
    last = ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]
    return f"{last}.{param}" if param else last


def _collapsed(names: set[str]) -> list[str]:
    """Sorted, with more than four entries of one module list said once (gate_projs.0-15: 16 of them)."""
    lists: dict[str, list[int]] = {}
    for n in names:
        head, _, idx = n.rpartition(".")
        if head and idx.isdigit():
            lists.setdefault(head, []).append(int(idx))
    out = {n for n in names if n.rpartition(".")[0] not in lists or len(lists[n.rpartition(".")[0]]) <= 4}
    out |= {f"{head}.{min(ix)}-{max(ix)} ({len(ix)} of them)" for head, ix in lists.items() if len(ix) > 4}
    return sorted(out)


@functools.lru_cache(maxsize=8)
def _parameters(config_text: str, trust_remote_code: bool, model_dir: str | None, linearized: bool = False):
    """(class name, ((parameter name, numel, rows, dims), ...)) of the meta-device model; cached like
    `_peft_counts`."""
    model, cls = meta_model(json.loads(config_text), trust_remote_code=trust_remote_code, model_dir=model_dir,
                            linearized=linearized)
    return cls, tuple((n, p.numel(), p.shape[0] if p.dim() else 1, p.dim()) for n, p in model.named_parameters())


def check_run(cfg, arch) -> list[str]:
    """What the transformers engine does not run yet, each refused in one line naming the key; the warnings for
    what it runs but the user should know. Layouts over data-parallel ranks (dp_shard with ZeRO-1/2/3,
    dp_replicate, exact HSDP), tensor parallelism from the model's own plan and context parallelism through
    transformers' attention interface are built, and expert parallelism from the model's own plan."""
    from adapter.config import spell

    name, p = arch.architecture, cfg.parallelism
    why = f"on the transformers engine ({arch.engine_reason})"
    if cfg.model.checkpoint:
        raise bad("model.checkpoint", cfg.model.checkpoint, f"a converted Megatron checkpoint is the native engine's "
                  f"format; {name} trains {why.removeprefix('on ')}", "remove it: the transformers engine reads the "
                  "HF weights in model.path (base_model) as they are")
    if cfg.data.processor_type:  # image-text rows through the processor
        from adapter.models.image_text import check

        check(cfg, arch)
    if p.tp_size > 1:
        _check_tp(cfg, arch, p.tp_size)
    if p.cp_size > 1:
        _check_cp(cfg, arch, p.cp_size)
    notes = []
    layer = runs_unpacked(arch.layer_kinds, cfg.document_attention)
    if layer:
        notes.append(f"packed documents: {name}'s {layer} layers carry state along the sequence, so each document "
                     "runs as its own row of a padded batch (exact; the padding costs time)")
    if p.ep_size > 1:
        _check_ep(cfg, arch, p.ep_size, why)
    m = cfg.model
    if m.liger:
        _check_liger(cfg, arch)
    unbuilt = [  # (on, key, value, what is not built)
        (m.unfrozen_parameters is not None and cfg.lora is not None, "model.unfrozen_parameters",
         m.unfrozen_parameters, "freezing base weights beside LoRA adapters"),
        (cfg.precision == "fp8", "precision", cfg.precision, "fp8 matmuls"),
        (cfg.recompute == "selective", "recompute", "selective", "recomputing the attention alone (transformers "
         "checkpoints whole layers)"),
        (cfg.recompute == "full" and not arch.layer_recompute, "recompute", "full", f"recomputing layers ({name} "
         "does not support transformers' gradient checkpointing)"),
        # the load-balancing loss: a statistic over the micro-batch's tokens, which tp's and cp's ranks would each
        # compute over their own; a preference loss's forwards (reference, KL rows) would each add one
        (arch.output_router_logits and (p.tp_size > 1 or p.cp_size > 1 or cfg.objective != "sft" or any(
            "cross_entropy" in k for k in m.liger)), "model.output_router_logits", True, "the load-balancing loss "
         "beside tensor or context parallelism, a preference objective or Liger's cross-entropy"),
        (arch.output_router_logits and not _balancing(arch.hf_model_type), "model.output_router_logits", True,
         f"a load-balancing loss for {name} (transformers' own model defines none)")]
    fixes = {"precision": "use bf16",
             "recompute": "use full (gradient_checkpointing: true) or none" if cfg.recompute == "selective" else
             "turn it off (gradient_checkpointing: false)",
             "model.output_router_logits": "set it false (model_config: {output_router_logits: false})"}
    for on, key, value, what in unbuilt:
        if on:
            raise bad(spell(cfg, key), value, f"{what} is not built {why}", fixes.get(key, "remove it"))
    return notes


def _balancing(model_type: str) -> bool:
    """Whether transformers' modelling file of `model_type` defines its load_balancing_loss_func (the transformers
    engine adds it per forward: adapter/modeling/hf_build.LoadBalancing). Remote code: checked when it is built."""
    import importlib

    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        return True
    return hasattr(module, "load_balancing_loss_func")


def _check_ep(cfg, arch, ep: int, why: str) -> None:
    """Expert parallelism from the model's own `base_model_ep_plan` (adapter/modeling/hf_ep.py), as transformers'
    EP runs it at tp = 1; what it does not run, refused in one line."""
    from adapter.config import spell

    key = spell(cfg, "parallelism.ep_size")
    fix = "remove it: each rank holds every expert, sharded by ZeRO over dp_shard"
    if not arch.ep_experts:
        raise bad(key, ep, f"{arch.architecture} ships no expert-parallel plan (base_model_ep_plan) {why}", fix)
    if arch.ep_experts % ep:
        raise bad(key, ep, f"does not divide the {arch.ep_experts} experts of each layer (each expert-parallel rank "
                  "holds whole experts)", f"use a divisor of {arch.ep_experts} that divides dp_shard × cp")
    unbuilt = [(cfg.parallelism.tp_size > 1, "tensor parallelism beside it (the experts' tokens would be split "
                "over TP ranks first)", f"use {key} 1 or {spell(cfg, 'parallelism.tp_size')} 1"),
               (cfg.lora is not None and any("experts" in t for t in cfg.lora.target_parameters or ()),
                "LoRA on the experts' own parameters (lora_target_parameters) beside it",
                f"use {key} 1, or adapters on the linear layers only"),
               (cfg.model.unfrozen_parameters is not None, "unfrozen_parameters beside it (its row ranges are "
                "rows of the whole experts)", f"use {key} 1")]
    for on, what, how in unbuilt:
        if on:
            raise bad(key, ep, f"{what} is not built {why}", how)


def _check_liger(cfg, arch) -> None:
    """Liger's kernels (model.liger, Axolotl's liger_* keys) where Liger has them for the model type (checked where
    Liger is installed: elsewhere, CPUs included, the run uses transformers' own kernels); its cross-entropy over
    the whole vocabulary, which neither a TP-split output layer nor ZeRO-3's partitioned one gives it."""
    import importlib.util

    from adapter.config import spell

    key = spell(cfg, "model.liger")
    if importlib.util.find_spec("liger_kernel") is not None:
        try:
            from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
        except ImportError:  # no Triton here: nothing will be applied
            MODEL_TYPE_TO_APPLY_LIGER_FN = None
        if MODEL_TYPE_TO_APPLY_LIGER_FN is not None and arch.hf_model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
            raise bad(key, list(cfg.model.liger), f"Liger has no kernels for model type {arch.hf_model_type!r}",
                      "remove the liger_* keys for this model")
    ce = {"cross_entropy", "fused_linear_cross_entropy"} & set(cfg.model.liger)
    if ce and cfg.parallelism.tp_size > 1:
        raise bad(key, sorted(ce), "Liger's cross-entropy needs the whole vocabulary, which tensor parallelism "
                  "splits", "remove liger_cross_entropy / liger_fused_linear_cross_entropy (or use tp 1)")


def check_prequantized(cfg, raw: dict[str, Any]) -> None:
    """A bitsandbytes checkpoint's NF4 / int8 codes (adapter/models/prequant.py) are a frozen base: only a QLoRA run
    of the same codes trains on them (load_in_4bit for NF4, load_in_8bit for int8), as Axolotl's QLoRA does. A
    dequantized MXFP4 / FP8 checkpoint is not quantised again."""
    from adapter.config import spell
    from adapter.models.prequant import loadable_codes

    if cfg.model.dequantize and cfg.lora is not None and cfg.lora.quantize_base:
        raise bad(spell(cfg, "lora.quantize_base"), cfg.lora.quantize_base, "the checkpoint is dequantized as it "
                  "loads (model.dequantize); quantising those weights again with bitsandbytes is not built",
                  "use adapter: lora (a 16-bit frozen base)")
    codes = loadable_codes(raw)
    if codes is None:
        return
    want = cfg.lora.quantize_base if cfg.lora is not None else None
    if want != codes:
        bits = "load_in_8bit" if codes == "int8" else "load_in_4bit"
        raise bad(spell(cfg, "lora.quantize_base"), want, f"the checkpoint holds bitsandbytes {codes} codes "
                  "(pre-quantised): only adapters train on them, over that frozen base", f"use adapter: qlora with "
                  f"{bits}: true, or point base_model (model.path) at the 16-bit checkpoint")


def check_zero3(cfg, stage: int) -> None:
    """What this engine does not run under ZeRO-3 (with something to partition: `stage` is the run's,
    adapter/parallel/deepspeed_config.zero_stage). Compiled layers under ZeRO-3 are built on the native engine only
    (its layers are ZeRO-3's gather units; here a layer with frozen weights is gathered module by module, inside the
    graph). (Liger's fused linear cross-entropy runs: lm_head's weight is gathered for the whole forward,
    adapter/train/engine._transformers_model.)"""
    from adapter.config import setting, spell

    if cfg.model.compile and stage == 3:
        raise bad(spell(cfg, "model.compile"), True, "compiled layers under ZeRO-3 are built on the native engine "
                  "only (the transformers engine's ZeRO-3 gathers can run inside a layer's graph)",
                  f"use ZeRO-2 (deepspeed.zero_stage: 2), or {setting(cfg, 'model.compile', False)}")


# generic.attention_features -> why context parallelism cannot run it exactly (adapter/modeling/hf_cp.py)
CP_REFUSED = {
    "interface": "it does not declare that its attention runs through transformers' attention interface "
                 "(_supports_attention_backend), where nd-adapter's context-parallel attention plugs in",
    "sinks": "its attention sinks (per-head sink logits in the softmax) are not in nd-adapter's context-parallel "
             "kernels",
    "chunked": "its chunked attention (attention_chunk_size) is not in nd-adapter's context-parallel kernels",
    "softcap": "its soft-capped attention scores (attn_logit_softcapping) are not in nd-adapter's context-parallel "
               "kernels",
    "dropout": "attention dropout (attention_dropout in config.json) is not in nd-adapter's context-parallel kernels"}


def _check_cp(cfg, arch, cp: int) -> None:
    """Context parallelism through transformers' attention interface (adapter/modeling/hf_cp.py): refused in one
    line for a layer kind that cannot be split over the sequence and for an attention feature its kernels do not
    compute exactly (generic.attention_features)."""
    from adapter.config import spell

    key, name, flat = spell(cfg, "parallelism.cp_size"), arch.architecture, \
        "use context_parallel_size: 1 (shard over dp_shard_size instead)"
    layer = unsplittable(arch.layer_kinds)
    if layer:
        raise bad(key, cp, f"its {layer} layers cannot be split over the sequence", flat)
    features = arch.attention_features
    refused = next((f for f in features if f in CP_REFUSED), None)
    if refused:
        raise bad(key, cp, f"{name}: {CP_REFUSED[refused]}", flat)
    window = next((int(f.split(":")[1]) for f in features if f.startswith("window:")), None)
    if window is not None and cfg.seq_len > window and cfg.parallelism.cp_comm_type == "p2p":  # some window matters
        raise bad(spell(cfg, "parallelism.cp_comm_type"), "p2p", f"{name} has sliding-window layers"
                  + (f" ({window} tokens)" if window else "") + ", and a window on the ring is not built",
                  "use cp_comm_type: all_gather (ring_attn_func: varlen_llama3)")
    rope = next((int(f.split(":")[1]) for f in features if f.startswith("dynamic_rope:")), None)
    if rope is not None and cfg.seq_len > rope:
        raise bad(key, cp, f"{name}'s RoPE picks its frequencies by the largest position in the forward once past "
                  f"{rope} positions (dynamic / LongRoPE scaling), and a rank holds only part of the sequence",
                  f"use context_parallel_size: 1, or a sequence_len of at most {rope}")


def _check_tp(cfg, arch, tp: int) -> None:
    """Tensor parallelism from the model's own plan (adapter/modeling/hf_tp.py): refused in one line where it has
    none, where the plan uses a style not built or a width tp does not divide, where a rank would hold part of a
    head, and for what is not built beside it yet (a quantised base, LoRA on parameters, unfrozen_parameters)."""
    from adapter.config import spell

    key, name, flat = spell(cfg, "parallelism.tp_size"), arch.architecture, "use tensor_parallel_size: 1 (shard " \
        "over dp_shard_size instead)"
    share = next((s for s in arch.tp_shares if s[0] == tp), None)
    if not arch.tp_shares:
        raise bad(key, tp, f"transformers ships no tensor-parallel plan (base_model_tp_plan) for {name}", flat)
    if share is None:
        raise bad(key, tp, f"tensor parallelism above {arch.tp_shares[-1][0]} ranks is not built on the transformers "
                  "engine", "use a smaller tensor_parallel_size and shard the rest over dp_shard_size")
    if share[2]:
        raise bad(key, tp, f"{name}: {share[2]}", flat)
    if arch.num_heads % tp or arch.num_kv_heads % tp:
        raise bad(key, tp, f"each rank must hold whole heads, and {name} has {arch.num_heads} attention and "
                  f"{arch.num_kv_heads} key/value heads", "use a tensor_parallel_size that divides both")
    if cfg.lora is not None and cfg.lora.quantize_base:
        raise bad(key, tp, "a 4/8-bit base split over tensor-parallel ranks is not built on the transformers "
                  "engine", flat)
    if cfg.lora is not None and cfg.lora.target_parameters:  # PEFT's per-expert factors, not split with the experts
        raise bad(key, tp, f"LoRA on parameters ({spell(cfg, 'lora.target_parameters')}) split over tensor-parallel "
                  "ranks is not built on the transformers engine", flat)
    if cfg.model.unfrozen_parameters is not None:
        raise bad(key, tp, "unfrozen_parameters with tensor parallelism is not built on the transformers engine",
                  flat)
    if cfg.lora is not None and cfg.lora.use_dora:  # DoRA's norm of each weight row spans a row-split weight
        raise bad(key, tp, f"DoRA ({spell(cfg, 'lora.use_dora')}) split over tensor-parallel ranks is not built on the "
                  "transformers engine", flat)


def quantized_base_stage(cfg, dp_replicate: int):
    """A 4/8-bit base on this engine where the config names no ZeRO stage (no FSDP or DeepSpeed keys: Axolotl then
    replicates the model over the data-parallel ranks, DDP): ZeRO-2, which keeps the small quantised base whole on
    every rank and shards gradients and optimizer states, said in the first lines; `cfg` unchanged otherwise."""
    if cfg.lora is None or not cfg.lora.quantize_base or "zero_stage" in cfg.deepspeed.model_fields_set \
            or dp_replicate > 1:
        return cfg
    note = ("deepspeed.zero_stage: 2 (a 4/8-bit base on the transformers engine stays whole on every rank, as "
            "Axolotl's DDP keeps it; gradients and optimizer states are sharded)")
    return cfg.model_copy(update={"deepspeed": cfg.deepspeed.model_copy(update={"zero_stage": 2}),
                                  "notes": cfg.notes if note in cfg.notes else (*cfg.notes, note)})


def quantized_base_zero3(cfg, stage: int):
    """A 4/8-bit base under ZeRO-3: bitsandbytes' quantised weights are frozen parameters of their own type, which
    ZeRO-3 partitions and gathers like any other (NF4's packed codes; their quantisation statistics stay whole on
    every rank), exactly as transformers computes with them, the way Axolotl's QLoRA shards them under FSDP.
    LLM.int8() keeps its own reference to the whole int8 codes (bitsandbytes' Linear8bitLt state), so an 8-bit base
    stays whole on every rank: said in the first lines and counted so by `plan`. `cfg` with that note."""
    if cfg.lora is None or not cfg.lora.quantize_base or stage != 3:
        return cfg
    note = ("ZeRO-3 partitions the NF4 base's codes" + (" (the experts' too)" if cfg.lora.quantize_experts else "")
            + " over the data-parallel ranks and gathers a layer's at a time (their quantisation statistics whole on "
            "every rank)" if cfg.lora.quantize_base == "nf4" else
            "under ZeRO-3 the int8 base stays whole on every rank (LLM.int8() keeps its own reference to the codes); "
            "adapters, gradients and optimizer states are sharded")
    return cfg.model_copy(update={"notes": cfg.notes if note in cfg.notes else (*cfg.notes, note)})


__all__ = ["QUANTIZED", "PeftSpec", "resolve_peft", "quantized_base_stage", "quantized_base_zero3",
           "check_run", "check_zero3", "check_prequantized"]
