"""LoRA as one record that every consumer reads (torch-free): which HF linears of which layers carry an adapter, the
adapters' shapes and how TP splits them, where each one's output lands in Megatron's fused linears, PEFT's names.
The builder (adapter/modeling/lora.py), the PEFT export and import (adapter/convert/peft.py), `plan`'s memory and
step time and the rehearsal all read `LoraSpec`; none of them decides these things again.

The semantics are PEFT's (0.21, `LoraConfig`), which Axolotl hands its `lora_*` keys to:
- a list of target names matches a module whose name is the entry or ends with "." + entry; a string is a regex
  that must match the whole module name (`re.fullmatch`); "all-linear" (Axolotl: `lora_target_linear`) takes every
  linear but the LM head; `layers_to_transform` keeps only those layer indices;
- y = W x + s · B A dropout(x), s = alpha / r (rslora: alpha / √r); A starts Kaiming-uniform with a = √5, i.e.
  U(−1/√in, 1/√in), and B at zero, so the first forward is the base model's;
- `modules_to_save` (embed_tokens, lm_head) are trained in full, as their own copies: with tied embeddings the one
  named is untied from the other, which stays frozen.
Each HF linear keeps its own adapter even where Megatron fuses it with others (q, k, v in linear_qkv; gate and up
in linear_fc1): `Placement` says where each adapter's output rows sit in the fused output. Under TP a
column-parallel linear (TP splits its outputs) keeps A whole on every rank and splits B's rows with the weight's;
a row-parallel one (o, down: TP splits its inputs) splits A's columns and keeps B whole.
"""
from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from adapter.config import spell
from adapter.errors import bad
from adapter.models.arch import ModelArch, unbuilt
from adapter.models.counts import Linear, linears, num_params
from adapter.models.families import family, linear_rule, packed_rule

SAVABLE = ("embed_tokens", "lm_head")  # modules_to_save nd-adapter trains in full
# the Megatron keys holding them: the family's table names their HF modules (which match in modules_to_save too)
_SAVED_KEYS = {"embedding.word_embeddings.weight": "embed_tokens", "output_layer.weight": "lm_head"}
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's default for the llama/mistral/qwen families
PEFT_PREFIX = "base_model.model."  # what PEFT's saved keys start with (a PeftModel around a CausalLM)
ALL_LINEAR = "all-linear"
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # a PEFT adapter directory
NF4_BLOCK = 64  # bitsandbytes' QLoRA blocksize (Axolotl's and transformers' default)
# The frozen base's formats (adapter/modeling/quant.py): bytes a decoder-linear weight takes, and the run's words.
BASE_FORMATS = {
    "nf4": (0.5 + 4 / NF4_BLOCK, "NF4 (QLoRA: bitsandbytes' 4-bit format, blocks of 64, double quantisation), "
                                 "dequantised to the compute dtype per GEMM"),
    "int8": (1.0, "int8 (bitsandbytes' row-wise absmax, as load_in_8bit stores it), dequantised to the compute "
                  "dtype per GEMM (no activation quantisation)"),
}


def nn_linears(arch: ModelArch) -> tuple[Linear, ...]:
    """The linears of one layer that are `nn.Linear` modules in transformers: what PEFT's target_modules (and
    "all-linear") reach, and what bitsandbytes quantises when the model is loaded in 4 or 8 bits. A mixture of
    experts' router and experts are parameters of modules of their own there (the experts 3-D): neither adapted nor
    quantised (the family's table says which: `Rule.nn_linear`)."""
    return tuple(lin for lin in linears(arch) if lin.nn_linear)


@dataclass(frozen=True)
class Target:
    """One adapter: the HF linear `linear` of layer `layer`."""
    layer: int
    linear: Linear
    hf_module: str  # the HF module's name, e.g. model.layers.3.self_attn.q_proj

    def a_shape(self, r: int, tp: int = 1) -> tuple[int, int]:
        return (r, self.linear.inp // (tp if self.linear.tp_axis == 1 else 1))

    def b_shape(self, r: int, tp: int = 1) -> tuple[int, int]:
        return (self.linear.out // (tp if self.linear.tp_axis == 0 else 1), r)


@dataclass(frozen=True)
class Placement:
    """Where the HF linears' output rows sit in one TP rank's output of a Megatron linear: viewed as
    [..., groups, width], linear `name` fills columns [start, start + size) of every group."""
    groups: int
    width: int
    pieces: tuple[tuple[str, int, int], ...]  # (HF linear, start, size)

    def piece(self, name: str) -> tuple[int, int]:
        return next((s, n) for p, s, n in self.pieces if p == name)


def packed_of(arch: ModelArch | None, fused: str):
    """The family's rule when one HF tensor packs all of Megatron's `fused` linear (Phi-3's qkv_proj, gate_up_proj;
    GLM-4's gate_up_proj), else None."""
    if arch is None:
        return None
    rule = linear_rule(arch, fused)
    return rule if rule.packed else None


def placement(arch: ModelArch, fused: str, tp: int) -> Placement:
    """Megatron's local output layout, as the family's rule for `fused` writes it into checkpoints
    (adapter/models/mapping.py, `Rule.layout`): linear_qkv is, per query group, [its q heads; k; v]; linear_fc1 is
    [gate; up] of this rank's FFN columns. A packed HF linear covers the whole local output (its B is in that order
    already)."""
    return Placement(*linear_rule(arch, fused).layout(arch, tp))


@dataclass(frozen=True)
class LoraSpec:
    r: int
    alpha: float
    dropout: float
    rslora: bool
    targets: tuple[Target, ...]
    modules_to_save: tuple[str, ...]   # of SAVABLE
    target_names: tuple[str, ...]      # the HF linear names targeted somewhere
    peft_targets: str | tuple[str, ...]  # adapter_config.json's target_modules: the names, or the user's regex
    layers: tuple[int, ...] | None     # layers_to_transform, or None for all
    init_from: str | None = None       # a PEFT adapter directory to start from (Axolotl's lora_model_dir)
    quantize_base: str | None = None   # of BASE_FORMATS: the frozen decoder linears quantised (None: 16-bit)
    skipped: tuple[str, ...] = ()      # listed names this family packs into another linear: matched by nothing

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)

    def layer_targets(self, layer: int) -> dict[str, list[Target]]:
        """Megatron linear -> its targeted HF linears in this layer, in HF order."""
        out: dict[str, list[Target]] = {}
        for t in self.targets:
            if t.layer == layer:
                out.setdefault(t.linear.fused, []).append(t)
        return out

    def params(self, tp: int = 1) -> int:
        """Adapter parameters one TP rank holds (tp = 1: the whole adapter)."""
        return sum(math.prod(t.a_shape(self.r, tp)) + math.prod(t.b_shape(self.r, tp)) for t in self.targets)

    def replicated_params(self, tp: int) -> int:
        """Of `params(tp)`, those every TP rank holds whole (A of column-parallel, B of row-parallel linears)."""
        return sum(math.prod(t.a_shape(self.r) if t.linear.tp_axis == 0 else t.b_shape(self.r))
                   for t in self.targets) if tp > 1 else self.params(1)


def hf_modules(arch: ModelArch) -> dict[str, str]:
    """HF linear name (q_proj, ...) -> its module name with {i} for the layer ({e} an expert's), from the family's
    weight table; plus embed_tokens and lm_head."""
    out = {lin.name: lin.hf_module for lin in linears(arch)}
    for rule in family(arch.family).table:  # every rule, also those this architecture leaves out (tied lm_head)
        if rule.megatron in _SAVED_KEYS:
            out[_SAVED_KEYS[rule.megatron]] = rule.hf[0][0].rpartition(".")[0]
    return out


def _matches(targets: str | list[str], module: str) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def resolve(arch: ModelArch, *, r: int, alpha: float, dropout: float = 0.0, rslora: bool = False,
            target_modules: str | list[str] | None = None, target_linear: bool = False,
            modules_to_save: list[str] | None = None, layers: list[int] | None = None, init_from: str | None = None,
            quantize_base: str | None = None, spell: Callable[[str], str] = lambda k: k) -> LoraSpec:
    """The adapters a config asks for, checked against this architecture; `spell(native key)` names a key as the
    user's file does. Raises UserError (one line) for what cannot be honoured."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise bad(spell("lora.r"), r, "the adapter rank must be a positive integer", "use e.g. 8, 16 or 32")
    if not 0 <= dropout < 1:
        raise bad(spell("lora.dropout"), dropout, "must be in [0, 1)", "use e.g. 0.05, or 0")
    mods = hf_modules(arch)
    per_layer = {lin.name: lin for lin in nn_linears(arch)}  # a mixture of experts' experts and router: not here
    unreachable = [lin for lin in linears(arch) if not lin.nn_linear]
    layer_ids: Sequence[int] = range(arch.num_layers)
    if layers is not None:
        wrong = [i for i in layers if not 0 <= i < arch.num_layers]
        if wrong or not layers:
            raise bad(spell("lora.layers"), layers, f"layer indices run from 0 to {arch.num_layers - 1}",
                      "list existing layers, or remove the key for all of them")
        layer_ids = sorted(set(layers))
    names = list(per_layer)
    if target_modules is None and not target_linear:
        if not set(PEFT_DEFAULT_TARGETS) <= set(names):  # PEFT itself has no default for e.g. phi3
            raise bad(spell("lora.target_modules"), None, f"PEFT has no default target modules for {arch.family}",
                      f"list some of {', '.join(names)}, or set {spell('lora.target_linear')}: true")
        target_modules = list(PEFT_DEFAULT_TARGETS)  # PEFT's default for these families
    if isinstance(target_modules, str) and target_modules == ALL_LINEAR:
        target_modules, target_linear = None, True
    key = spell("lora.target_modules")
    if isinstance(target_modules, str):
        try:
            re.compile(target_modules)
        except re.error as e:
            raise bad(key, target_modules, f"not a valid regex ({e})", "fix the pattern, or list module names")
    for lin in unreachable:  # a mixture of experts' experts or router named: refused, not silently skipped
        name = lin.name
        if target_modules and _matches(target_modules, mods[name].format(i=0, e=0)):
            what = "experts" if lin.copies > 1 else "router"
            raise bad(key, target_modules, f"LoRA on the {what} of a mixture of experts ({name}) is not built: "
                      "transformers keeps the experts as 3-D parameters and the router as its own module, not linear "
                      "layers, so PEFT's target_modules do not reach them either",
                      f"target the attention ({', '.join(per_layer)}; {spell('lora.target_linear')}: true takes "
                      "them all)")
    for special in SAVABLE:  # LoRA on the embedding or the LM head: not built
        if target_modules and _matches(target_modules, mods[special]):
            raise bad(key, target_modules, f"LoRA on {special} is not supported",
                      f"list {special} under {spell('lora.modules_to_save')} to train it in full, and target the "
                      "layers' linears")
    targets = []
    for i in layer_ids:
        for name in names:
            module = mods[name].format(i=i)
            if target_linear or (target_modules and _matches(target_modules, module)):
                targets.append(Target(i, per_layer[name], module))
    packs = _packed_parts(arch)
    skipped = []
    if isinstance(target_modules, list):
        for t in target_modules:
            if not any(_matches([t], tg.hf_module) for tg in targets):
                if t in packs and targets:  # PEFT (so Axolotl) adapts the other names and none of these
                    skipped.append(t)
                    continue
                raise bad(key, t, f"matches no linear of this {arch.family} model's layers"
                          + ("" if layers is None else " among the chosen layers"),
                          f"use names it has: {', '.join(names)} ({spell('lora.target_linear')}: true takes all)")
    if not targets:
        raise bad(key, target_modules, "matches no linear of this model's layers",
                  f"the layers' linears are {mods[names[0]].format(i=0)} ... (names: {', '.join(names)})")
    save = []
    for m in modules_to_save or []:
        hit = next((s for s in SAVABLE if s == m or mods[s].endswith("." + m) or mods[s] == m), None)
        if hit is None:
            raise bad(spell("lora.modules_to_save"), m, "nd-adapter trains only embed_tokens and lm_head in full "
                      "beside the adapters", "list embed_tokens and/or lm_head, or remove it")
        if hit not in save:
            save.append(hit)
    if quantize_base is not None and quantize_base not in BASE_FORMATS:
        raise bad(spell("lora.quantize_base"), quantize_base, "unknown base format",
                  "use nf4 (QLoRA), int8, or null (16-bit)")
    hit_names = tuple(n for n in names if any(t.linear.name == n for t in targets))
    # a regex (not target_linear) is PEFT's target_modules as the user wrote it; else the names it resolved to
    peft_targets = target_modules if isinstance(target_modules, str) and not target_linear else hit_names
    return LoraSpec(r=r, alpha=float(alpha), dropout=float(dropout), rslora=bool(rslora), targets=tuple(targets),
                    modules_to_save=tuple(save), target_names=hit_names, peft_targets=peft_targets,
                    layers=None if layers is None else tuple(layer_ids), init_from=init_from,
                    quantize_base=quantize_base, skipped=tuple(skipped))


def check_native(cfg, arch: ModelArch) -> None:
    """What a run asks that the native engine does not build, as NotNative: `model.engine: auto` then trains
    transformers' model (with PEFT for adapters; source.arch_for), `megatron` refuses with this line. LoRA on
    parameters (PEFT's target_parameters: a mixture of experts' fused 3-D expert weights, which PEFT adapts as delta
    weights per expert) has no counterpart among the Megatron linears' adapters here. Preference objectives run on
    both engines (adapter/train/dpo.py) but for KTO, a mixture of experts (its load-balancing term in a pair loss),
    the fused linear cross-entropy (it returns a sum, not the per-token losses a pair's log-probability needs) and a
    reference beside trained embeddings (PEFT's disabled adapters use the original embed_tokens / lm_head, which the
    native adapters train in place). Freezing parts of a mixture of experts (`unfrozen_parameters`) likewise."""
    if cfg.objective != "sft":
        key, value = ("objective", cfg.objective) if cfg.source != "axolotl" else \
            ("reward_model", True) if cfg.objective == "reward" else ("rl", cfg.objective)
        fix = "set model.engine: auto (or transformers), which runs it on transformers' model"
        trained_embedding = cfg.lora is not None and bool(cfg.lora.modules_to_save) and cfg.objective in ("dpo", "ipo")
        for on, what in ((cfg.objective == "kto", "KTO"),
                         (cfg.objective == "reward", "a reward model (a sequence-classification head)"),
                         (arch.moe, "a preference objective on a mixture of experts"),
                         (cfg.model.fused_linear_ce is True,
                          "a preference objective with the fused linear cross-entropy"),
                         (trained_embedding, "a DPO reference beside LoRA's modules_to_save")):
            if on:
                raise unbuilt(key, value, f"{what} is built on the transformers engine only", fix)
    if cfg.model.num_labels is not None:
        raise unbuilt(spell(cfg, "model.num_labels"), cfg.model.num_labels, "a process reward model (a token-"
                      "classification head) is built on the transformers engine only",
                      "set model.engine: auto (or transformers), which trains transformers' token classifier")
    if cfg.data.processor_type:
        raise unbuilt(spell(cfg, "data.processor_type"), cfg.data.processor_type, "image-text training (the "
                      "model's vision tower fed by the processor) is built on the transformers engine only",
                      "set model.engine: auto (or transformers), which trains transformers' own image-text model")
    if cfg.qat is not None:
        raise unbuilt("qat", cfg.qat.weight_dtype, "quantisation-aware training (torchao's fake-quantised linears) is "
                      "built on the transformers engine only", "set model.engine: auto (or transformers), which "
                      "fake-quantises transformers' own linears")
    if arch.moe and cfg.model.unfrozen_parameters is not None:  # the native experts are grouped across layers' ranks
        raise unbuilt(spell(cfg, "model.unfrozen_parameters"), cfg.model.unfrozen_parameters, "freezing parts of a "
                      "mixture-of-experts model is built on the transformers engine only",
                      "set model.engine: auto (or transformers), which freezes by transformers' own parameter names")
    if cfg.lora is not None and cfg.lora.quantize_experts and arch.moe:
        raise unbuilt(spell(cfg, "lora.quantize_experts"), True, "4-bit experts are built on the transformers engine "
                      "only", "set model.engine: auto (or transformers), which quantises transformers' own experts")
    c = cfg.lora
    for key, value, what in () if c is None else (  # PEFT's options, passed to its LoraConfig as they are
            ("lora.rank_pattern", c.rank_pattern, "per-module ranks and alphas (PEFT's rank_pattern / alpha_pattern) "
                                                  "are"),
            ("lora.alpha_pattern", c.alpha_pattern, "per-module ranks and alphas (PEFT's rank_pattern / "
                                                    "alpha_pattern) are"),
            ("lora.init_weights", c.init_weights != "default" and c.init_weights, "PEFT's gaussian initialisation is"),
            ("lora.trainable_token_indices", c.trainable_token_indices, "training single token rows (PEFT's "
                                                                        "trainable_token_indices) is"),
            ("lora.use_dora", c.use_dora, "DoRA (PEFT's weight-decomposed LoRA) is")):
        if value:
            raise unbuilt(spell(cfg, key), value, f"{what} built on the transformers engine only", "set model.engine: "
                          "auto (or transformers), which runs it with PEFT on transformers' model")
    if cfg.lora is not None and cfg.lora.target_parameters:
        raise unbuilt(spell(cfg, "lora.target_parameters"), cfg.lora.target_parameters, "LoRA on parameters "
                      "(PEFT's target_parameters) is built on the transformers engine only",
                      "set model.engine: auto (or transformers), which trains it with PEFT on transformers' model")


def from_config(cfg, arch: ModelArch) -> LoraSpec | None:
    """The run's adapters (`lora:`), or None for a full fine-tune; keys named as the user's file spells them."""
    if cfg.lora is None:
        return None
    c = cfg.lora
    return resolve(arch, r=c.r, alpha=c.alpha, dropout=c.dropout, rslora=c.rslora, target_modules=c.target_modules,
                   target_linear=c.target_linear, modules_to_save=c.modules_to_save, layers=c.layers,
                   init_from=c.init_from, quantize_base=c.quantize_base, spell=lambda k: spell(cfg, k))


def trained_params(spec: LoraSpec, arch: ModelArch, tp: int = 1, padded_vocab: int | None = None) -> int:
    """Parameters one TP rank trains: its adapters and its rows of the modules_to_save."""
    rows = (padded_vocab or arch.vocab_size) // tp
    return spec.params(tp) + len(spec.modules_to_save) * rows * arch.hidden_size


def flops_per_token(spec: LoraSpec, arch: ModelArch, seq_len: int) -> int:
    """MFU's model FLOPs per token of a LoRA run (adapter/models/counts.py's convention): a frozen weight costs its
    forward and input-gradient matmuls (4 per weight), a trained one also its weight gradient (6); the adapters are
    trained; attention is as in full training (12·L·heads·head_dim·S). A mixture of experts' token passes through
    its router and top-k experts, as in `counts.matmul_params`."""
    layer = sum(lin.weights * lin.active for lin in linears(arch))
    head = arch.hidden_size * arch.vocab_size
    adapters = sum(t.linear.inp + t.linear.out for t in spec.targets) * spec.r
    return (4 * arch.num_layers * layer + (6 if "lm_head" in spec.modules_to_save else 4) * head + 6 * adapters
            + 12 * arch.num_layers * arch.num_heads * arch.head_dim * seq_len)


def describe(spec: LoraSpec, arch: ModelArch, key: str = "lora") -> str:
    """The run's first lines say what is trained."""
    layers = sorted({t.layer for t in spec.targets})
    where = (f"all {arch.num_layers} layers" if len(layers) == arch.num_layers else
             f"layers {', '.join(map(str, layers))}")
    total, n = trained_params(spec, arch), num_params(arch)
    count = (lambda x: f"{x / 1e9:.2f}B" if x >= 1e9 else f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x:,}")
    base = BASE_FORMATS[spec.quantize_base][1] if spec.quantize_base else "16-bit"
    saved = f"; {' and '.join(spec.modules_to_save)} trained in full" if spec.modules_to_save else ""
    drop = f", dropout {spec.dropout:g}" if spec.dropout else ""
    return (f"{key}: LoRA r {spec.r}, alpha {spec.alpha:g} (scale {spec.scale:g}{', rslora' if spec.rslora else ''})"
            f"{drop} on {', '.join(spec.target_names)} of {where}{saved}: {count(total)} trained parameters "
            f"({100 * total / max(1, n):.2f}% of {count(n)}); the base frozen, "
            f"{base}" + (f"; adapters start from {spec.init_from}" if spec.init_from else "") + _skipped(spec, arch)
            + ("; the experts and the router are not linear layers in transformers (no adapters there, as PEFT's)"
               if arch.moe else ""))


def _packed_parts(arch: ModelArch) -> dict[str, str]:
    """The names a Llama-shaped layer gives the parts of this family's packed linears (gate_proj, up_proj) -> the
    packed linear (gate_up_proj): PEFT matches them nowhere here (`Rule.holds`)."""
    return {part: lin.name for lin in nn_linears(arch) if (rule := packed_rule(arch, lin.name))
            for part in rule.holds}


def _skipped(spec: LoraSpec, arch: ModelArch) -> str:
    if not spec.skipped:
        return ""
    packs = _packed_parts(arch)
    into = sorted({packs[s] for s in spec.skipped})
    return (f"; {', '.join(spec.skipped)} match no linear: {arch.family} packs them into {', '.join(into)}, which "
            f"PEFT (and so Axolotl) leaves without an adapter for these names; list {', '.join(into)} to adapt it")


def peft_key(target: Target, which: str) -> str:
    """The adapter_model.safetensors key of a target's A or B."""
    return f"{PEFT_PREFIX}{target.hf_module}.lora_{which}.weight"


def saved_key(arch: ModelArch, name: str) -> str:
    """The key PEFT saves a module_to_save's weight under (embed_tokens, lm_head)."""
    return f"{PEFT_PREFIX}{hf_modules(arch)[name]}.weight"


def check_adapter(conf: dict, shapes: dict[str, tuple[int, ...]], spec: LoraSpec, arch: ModelArch, key: str) -> None:
    """An adapter (its adapter_config.json and tensor shapes) must be LoRA, of this run's rank, and cover exactly this
    run's targets with this base's shapes: one line naming what differs otherwise."""
    if conf.get("peft_type", "LORA") != "LORA":
        raise bad(key, conf.get("peft_type"), "not a LoRA adapter", "point it at a LoRA adapter")
    if conf.get("use_dora"):
        raise bad(key, "use_dora: true", "a DoRA adapter cannot continue as LoRA", "point it at a LoRA adapter")
    if conf.get("rank_pattern") or conf.get("alpha_pattern"):
        raise bad(key, "rank_pattern", "per-module ranks or alphas are not supported", "use one r and lora_alpha")
    if conf.get("r") != spec.r:
        raise bad(key, f"r={conf.get('r')}", f"the adapter's rank differs from this run's {spec.r}",
                  f"set the run's rank to {conf.get('r')}, or start a new adapter")
    scale = (conf.get("lora_alpha", 8), bool(conf.get("use_rslora", False)))
    if scale != (spec.alpha, spec.rslora):  # PEFT would run the adapter at its own scale
        raise bad(key, f"lora_alpha={scale[0]}, use_rslora={scale[1]}", f"the adapter's scale differs from this run's "
                  f"(alpha {spec.alpha:g}, rslora {spec.rslora})", "set the run's alpha and rslora to the adapter's")
    want = {peft_key(t, w) for t in spec.targets for w in "AB"} | {saved_key(arch, m) for m in spec.modules_to_save}
    have = set(shapes)
    if want != have:
        missing, extra = sorted(want - have), sorted(have - want)
        what = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which this run does not train"
        raise bad(key, conf.get("target_modules"), f"the adapter {what} ({len(missing)} missing, {len(extra)} extra)",
                  "set the run's target modules (and modules_to_save) to the adapter's")
    for t in spec.targets:
        for w, shape in (("A", t.a_shape(spec.r)), ("B", t.b_shape(spec.r))):
            got = tuple(shapes[peft_key(t, w)])
            if got != shape:
                raise bad(key, peft_key(t, w), f"shape {list(got)} is not this base's {list(shape)}: the adapter "
                          "was trained on another base model", "start from an adapter of this base model")
    for m in spec.modules_to_save:
        got = tuple(shapes[saved_key(arch, m)])
        if got != (arch.vocab_size, arch.hidden_size):
            raise bad(key, saved_key(arch, m), f"shape {list(got)} is not this base's "
                      f"{[arch.vocab_size, arch.hidden_size]}", "start from an adapter of this base model")


def read_adapter_meta(path: str, key: str) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """(adapter_config.json, tensor shapes) of a PEFT adapter directory without torch (the safetensors header):
    what the checks before any process starts need."""
    root = Path(path)
    if not (root / CONFIG).is_file() or not (root / WEIGHTS).is_file():
        raise bad(key, str(path), f"not a PEFT adapter directory (needs {CONFIG} and {WEIGHTS})",
                  "point it at a directory PEFT's save_pretrained (or nd-adapter) wrote")
    try:
        conf = json.loads((root / CONFIG).read_text())
        with open(root / WEIGHTS, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, OSError, struct.error, UnicodeDecodeError) as e:
        raise bad(key, str(path), f"unreadable adapter ({e.__class__.__name__}: {e})", "re-create the adapter")
    header.pop("__metadata__", None)
    return conf, {k: tuple(v["shape"]) for k, v in header.items()}


def peft_config(spec: LoraSpec, base_model: str | None) -> dict:
    """adapter_config.json as PEFT 0.21 writes it for these settings (the keys PeftModel.from_pretrained reads)."""
    targets = spec.peft_targets if isinstance(spec.peft_targets, str) else list(spec.peft_targets)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": spec.r, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout, "use_rslora": spec.rslora,
            "target_modules": targets, "modules_to_save": list(spec.modules_to_save) or None,
            "layers_to_transform": list(spec.layers) if spec.layers is not None else None,
            "layers_pattern": None, "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True,
            "use_dora": False, "inference_mode": True, "rank_pattern": {}, "alpha_pattern": {}}


__all__ = ["Target", "Placement", "LoraSpec", "placement", "hf_modules", "resolve", "from_config", "trained_params",
           "flops_per_token", "describe", "peft_key", "saved_key", "peft_config", "check_adapter", "read_adapter_meta",
           "SAVABLE", "PEFT_DEFAULT_TARGETS", "NF4_BLOCK", "BASE_FORMATS", "nn_linears", "PEFT_PREFIX",
           "ALL_LINEAR", "CONFIG", "WEIGHTS", "packed_of"]
