"""The transformers engine's model: transformers' own class for the checkpoint, built on the meta device for `plan`'s
facts or for real (with the checkpoint's weights, or random in its shape) for training, and the thin module the
training loop calls.

The loop (adapter/train/trainer.py) calls every model the same way -- tokens, positions, labels, loss mask -- and
takes per-token losses back (adapter/train/steps.py sums them under the loss mask). `CausalLMLosses` is that call on
a transformers model: it runs the model without labels (transformers' own loss would average per micro-batch, not
per step) and returns the fp32 per-token cross-entropy. Packed documents attend only inside themselves through
transformers' own packed-sequence masks: with no attention mask and positions that restart at each document,
transformers' masking utilities build the block-diagonal causal mask (sdpa, eager, flex), the same per-document
attention Axolotl's multipack gets from flash attention's varlen path; adapter/patches/hf_masks.py supplies the
document split to models whose code does not hand transformers their positions (gpt-oss). Under context
parallelism (`cp`: adapter/modeling/hf_cp.py) the rank's tokens are its load-balanced chunks or its packed stream
(adapter/train/batches.place) and attention runs across the CP group instead.
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

from adapter.errors import bad
from adapter.kernels.eaft import entropy_weights
from adapter.modeling import hf_cp, hf_unpack
from adapter.modeling.hf_linearized import building
from adapter.models.generic import for_class, hf_config, model_class, scoring_class_name
from adapter.models.linearized import LAYOUTS, for_model_type
from adapter.patches.hf_masks import documents, prepare

# Axolotl's freeze_mm_modules: a parameter whose dotted name has one of these components (utils/freeze.py)
MM_MODULES = {"vision_tower", "vision_model", "vision_encoder", "embed_vision", "multi_modal_projector", "visual",
              "audio_tower", "audio_model", "embed_audio"}
# parameters of an image-text checkpoint's other towers (vision, audio and their projectors): frozen, as a text
# fine-tune of such a checkpoint leaves them (Axolotl trains the language model on text rows)
OTHER_TOWERS = ("vision", "visual", "audio", "multi_modal_projector", "image_newline", "embed_vision",
                "embed_audio", "mm_projector")


def build_model(model_dir: str, *, weights: bool, dtype: torch.dtype, seed: int, trust_remote_code: bool,
                quantize: str | None = None, device=None, liger: tuple[str, ...] = (), dequantize: bool = False,
                scores: int | None = None, towers: str = "frozen", linearized: bool = False,
                classes: int | None = None):
    """The model to train, on the CPU: the checkpoint's weights (`weights`) or a random one in its shape (seed).
    `quantize` ("nf4" / "int8"): its linears loaded as bitsandbytes quantises them (transformers' load_in_4bit with
    NF4 and double quantisation, as Axolotl's QLoRA asks; load_in_8bit), computing in `dtype`; a random base is
    written out first and loaded the same way. `device`: where a random model is initialised (a GPU initialises an
    8B model in seconds, the CPU in minutes). `liger`: Liger's kernels to patch into the model's classes first
    (`apply_liger`). `dequantize` (model.dequantize): an MXFP4 / FP8 checkpoint's codes turned into `dtype` weights by
    transformers' own loader (its quantization class with dequantize=True, as Axolotl passes it), which then drops
    the quantization config, so the export is a 16-bit checkpoint; a random model in its shape drops it too.
    A mixture's 3-D expert weights (quantize_moe_experts) are quantised later, by `add_peft`. `scores` (a reward
    model: the pad token's id): the checkpoint's sequence-classification class with one label instead, its score
    read at each row's last token that is not that token (TRL's RewardTrainer sets config.pad_token_id so); a
    checkpoint without a score head (a causal LM's) gets a new one, initialised by transformers as it initialises a
    missing head. `towers`: an image-text checkpoint's other
    towers "frozen" (a run on text), "trained" (an image-text run: everything trains, as Axolotl's), or "mm_frozen"
    (Axolotl's freeze_mm_modules: parameters under a module named in MM_MODULES). `linearized`
    (model.linearized_experts): the experts built and loaded as Axolotl's per-expert linears (hf_linearized.py)."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    config = hf_config(cfg, trust_remote_code=trust_remote_code, model_dir=model_dir)
    if liger:
        apply_liger(str(cfg.get("model_type")), liger)
    remote = bool(cfg.get("auto_map"))
    if scores is not None or classes is not None:  # a reward model's one label; a process reward model's classes
        import transformers

        cls = getattr(transformers, scoring_class_name(config.model_type, remote=remote, tokens=classes is not None))
        config.num_labels = classes or 1
        if scores is not None:
            config.pad_token_id = scores
    else:
        cls = model_class(config, (cfg.get("architectures") or [None])[0], remote=remote)
    torch.manual_seed(seed)
    kw = {"trust_remote_code": True} if remote else {}
    with building(for_model_type(str(cfg.get("model_type"))) if linearized else None):
        model = _built(cls, config, cfg, model_dir, weights=weights, dtype=dtype, quantize=quantize,
                       dequantize=dequantize, scores=scores is not None or classes is not None, device=device,
                       remote=remote, kw=kw)
    if classes is not None:  # TRL's PRMConfig.disable_dropout (its default): every dropout of the model off
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    model.config.use_cache = False
    for name, p in model.named_parameters():
        if (towers == "frozen" and any(t in name for t in OTHER_TOWERS)) or (
                towers == "mm_frozen" and MM_MODULES & set(name.split("."))):
            p.requires_grad_(False)
    return model


def _built(cls, config, cfg: dict, model_dir: str, *, weights: bool, dtype, quantize, dequantize, scores, device,
           remote: bool, kw: dict):
    if quantize:
        model = _quantized(cls, config, model_dir if weights else None, dtype=dtype, quantize=quantize, kw=kw)
    elif weights:
        if dequantize:
            from transformers.quantizers.auto import AutoQuantizationConfig

            kw["quantization_config"] = AutoQuantizationConfig.from_dict({**cfg["quantization_config"],
                                                                          "dequantize": True})
        model = from_pretrained_whole(cls, model_dir, config=config, dtype=dtype,
                                      new=("score.", "classifier.") if scores else (), **kw)
    else:
        if dequantize and hasattr(config, "quantization_config"):
            del config.quantization_config  # random 16-bit weights: nothing is quantised, nor will the export be
        with torch.device(device or "cpu"):
            model = (cls.from_config(config, dtype=dtype, **kw) if remote else
                     cls._from_config(for_class(cls, config), dtype=dtype))
    return model


def from_pretrained_whole(cls, model_dir: str, new: tuple[str, ...] = (), **kw):
    """transformers' from_pretrained, refusing in one line a checkpoint that lacks some of the model's weights:
    transformers would only warn and start them random (a checkpoint saved in another module layout, such as
    Axolotl's linearized Llama 4 experts, loads that way), and the run would train another model. Weights under
    the `new` prefixes may be missing: a head the run adds (a reward model's score on a causal LM)."""
    model, info = cls.from_pretrained(model_dir, output_loading_info=True, **kw)
    missing = sorted(k for k in info.get("missing_keys") or [] if not k.startswith(new))
    unexpected = list(info.get("unexpected_keys") or [])
    for record in LAYOUTS:  # a checkpoint in one expert layout read as the other
        linear = {lin.name for lin in record.linears}
        stored = any(linear & set(k.split(".")) for k in unexpected)
        wanted = any(linear & set(k.split(".")) for k in missing)
        if stored or wanted:
            held = "per-expert linears (Axolotl-linearized)" if stored else "transformers' fused layout"
            raise bad(record.axolotl_key, wanted, f"{model_dir} holds its experts in {held}",
                      f"set {record.axolotl_key}: {str(stored).lower()} (model.linearized_experts)")
    if missing:
        raise bad("model.path", model_dir, f"the checkpoint lacks {len(missing)} of the weights of "
                  f"{cls.__name__} (e.g. {', '.join(missing[:3])}), which would start random",
                  "point it at a checkpoint saved by this transformers class (a complete save_pretrained directory)")
    return model


def liger_available() -> bool:
    """Liger's kernels are Triton's: CUDA and the package installed."""
    if not torch.cuda.is_available():
        return False
    try:
        import liger_kernel.transformers  # noqa: F401 - optional package
    except ImportError:
        return False
    return True


def apply_liger(model_type: str, kernels: tuple[str, ...]) -> None:
    """Liger's kernels patched into transformers' classes for `model_type`, as Axolotl's Liger plugin applies them
    (its liger_* keys to the keyword arguments of Liger's apply function for the type: glu_activation is swiglu or
    geglu, whichever the function takes). Before the model is built: Liger replaces module classes and functions.
    The model type is checked at plan time (adapter/models/generic_run.check_run)."""
    import inspect

    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    fn = MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    params = inspect.signature(fn).parameters
    asked = {k: k in kernels for k in ("rope", "rms_norm", "layer_norm", "cross_entropy",
                                       "fused_linear_cross_entropy")}
    kw = {k: v for k, v in asked.items() if k in params}
    glu = "geglu" if "geglu" in params else "swiglu" if "swiglu" in params else None
    if glu:
        kw[glu] = "glu_activation" in kernels
    fn(**kw)


def _quantized(cls, config, model_dir: str | None, *, dtype, quantize: str, kw: dict):
    import tempfile

    from transformers import BitsAndBytesConfig

    from adapter.patches.bnb_cpu import one_cpu_path
    from adapter.patches.bnb_int8 import int8_any_rank_input
    from adapter.patches.hf_save import save_on_this_rank

    int8_any_rank_input()  # an 8-bit base (asked, or stored so) on 4-D inputs (GLM-4.7-Flash's kv_b_proj)
    bnb = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype) if quantize == "nf4" else
           BitsAndBytesConfig(load_in_8bit=True))
    if model_dir is not None and getattr(config, "quantization_config", None) is not None:
        # a pre-quantised bitsandbytes checkpoint (adapter/models/prequant.py): its stored codes, loaded as they are
        model = from_pretrained_whole(cls, model_dir, config=config, dtype=dtype, **kw)
    else:
        with tempfile.TemporaryDirectory(prefix="nd-random-base-") as tmp:
            if model_dir is None:  # random weights in the model's shape, then loaded as a checkpoint would be
                save_on_this_rank(cls._from_config(for_class(cls, config), dtype=dtype), tmp)
            model = from_pretrained_whole(cls, model_dir or tmp, config=config, dtype=dtype, quantization_config=bnb,
                                          **kw)
    one_cpu_path(model)  # eval-mode forwards (the eval, reference tables) compute as training ones on any CPU
    return model


def add_peft(model, spec, *, seed: int):
    """PEFT's LoRA on the model (`spec`: adapter/models/generic_run.PeftSpec): adapters initialised from `seed` (A
    Kaiming-uniform, B zero, as PEFT does), or started from a PEFT adapter directory (`lora_model_dir`). Then the
    mixture's 3-D expert weights where the run quantises them too (quantize_moe_experts: `spec.experts`), in the
    base's format (adapter/modeling/hf_quant_experts.py). After PEFT, so that where PEFT adapts them as well
    (target_parameters) it nests its wrappers in the weights' definition order, as on a 16-bit base (Axolotl's
    loader patches PEFT for that order), and the saved adapter loads on the original model; adapters on other
    modules are the same either way round."""
    import peft

    torch.manual_seed(seed)
    if spec.init_from:
        wrapped = peft.PeftModel.from_pretrained(model, spec.init_from, is_trainable=True)
    else:
        wrapped = peft.get_peft_model(model, peft.LoraConfig(**spec.lora_config()))
    if spec.experts:
        from adapter.modeling.hf_quant_experts import quantize_expert_weights

        if spec.target_parameters:
            from adapter.patches.peft_params import stacked_parametrisations

            stacked_parametrisations()  # PEFT's delta over the dequantising parametrisation, each forward
        quantize_expert_weights(wrapped, spec.quantize_base)
    return wrapped


class LoadBalancing:
    """transformers' load-balancing loss on its own model (output_router_logits), as its Trainer adds it: every
    forward (one micro-batch of one DP process) adds router_aux_loss_coef × the model's own `load_balancing_loss_func`
    of that forward's router logits, over the micro-batch's real tokens (padding left out, as the native engine's
    statistic: adapter/modeling/moe.py), unaveraged over processes. The loop reads it as it reads the native engine's
    (`enabled`, `coef`, `scale`, `value`) and adds `attached()` -- the term with its graph -- to the micro-batch's
    loss (the native routers inject their gradient instead)."""

    def __init__(self, model, coef: float):
        import sys

        from adapter.errors import bad

        inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT wraps it
        self.fn = getattr(sys.modules[type(inner).__module__], "load_balancing_loss_func", None)
        self.num_experts, self.top_k = (getattr(inner, k, None) for k in ("num_experts", "num_experts_per_tok"))
        if self.fn is None or not self.num_experts or not self.top_k:
            raise bad("model.output_router_logits", True, f"transformers' {type(inner).__name__} adds no "
                      "load-balancing loss of its own", "set it false (model_config: {output_router_logits: false})")
        self.coef, self.scale, self.enabled = coef, 1.0, coef > 0
        self.last: torch.Tensor | None = None

    def record(self, router_logits, real: torch.Tensor | None) -> None:
        self.last = self.fn(router_logits, self.num_experts, self.top_k, real).float()

    def value(self) -> torch.Tensor:
        assert self.last is not None
        return self.last.detach()

    def attached(self) -> torch.Tensor:
        assert self.last is not None
        return self.coef * self.last


class CausalLMLosses(torch.nn.Module):
    """The loop's call on a transformers model: per-token cross-entropy [b, s] in fp32 (module docstring), or, with
    `model_loss` (Liger's cross-entropy kernels patched in), the model's own loss over the trained tokens: their
    sum, one fp32 scalar. The model is then handed the targets already shifted (`shift_labels`, untrained tokens
    -100) and `num_items_in_batch=1`, so transformers' loss function (or Liger's fused linear cross-entropy, which
    never builds the [tokens × vocab] logits) sums instead of averaging per micro-batch; the loop's normalisation
    stays the step's (adapter/train/steps.masked_loss_sum takes the scalar as it is). `cp`: (CP group,
    cp_comm_type) where the model's attention runs through hf_cp (installed on it), else None. `unpack`: the model has
    recurrent layers, so packed documents run as rows of their own (adapter/modeling/hf_unpack.py)."""

    def __init__(self, model, model_loss: bool = False, cp: tuple | None = None, unpack: bool = False,
                 aux_coef: float = 0.0, linear_ce: tuple[int, float | None] | None = None,
                 eaft: tuple[int, float] | None = None):
        super().__init__()
        self.model = model
        self.eaft = eaft  # (k, alpha): each token's loss × its logits' top-k entropy^alpha (adapter/kernels/eaft.py)
        self.model_loss = model_loss
        self.linear_ce = linear_ce  # (tokens a chunk, final soft-cap): the fused linear CE (`_fused_loss`)
        self.cp = cp
        self.unpack = unpack  # recurrent layers: packed documents run as rows of their own (hf_unpack)
        self.moe_aux = LoadBalancing(model, aux_coef) if aux_coef > 0 else None  # output_router_logits
        self.routed = hasattr(model.config.get_text_config(), "output_router_logits")  # a mixture of experts
        prepare(model)

    def forward(self, tokens, position_ids, attention_mask=None, *, labels, loss_mask=None, packed_seq_params=None,
                padding_mask=None, **extra):
        media = {k[3:]: v for k, v in extra.items() if k.startswith("mm_")}  # an image-text batch (the processor's
        if media:  # tensors, its attention mask among them): the model places its own positions (M-RoPE, ...)
            return self._losses(tokens, None, labels=labels, loss_mask=loss_mask, media=media)
        if self.unpack and position_ids is not None and hf_unpack.is_packed(position_ids):
            index, valid = hf_unpack.documents_of(position_ids, loss_mask)
            rows = [hf_unpack.unpack(index, x) for x in (tokens, labels)]
            mask = None if loss_mask is None else hf_unpack.unpack(index, loss_mask) * valid
            positions = torch.arange(index.shape[1], device=tokens.device).expand_as(index)
            real = valid if padding_mask is None else hf_unpack.unpack(index, padding_mask.float()) * valid
            out = self._losses(rows[0], positions, labels=rows[1], loss_mask=mask, real=real)
            return out if out.dim() == 0 else hf_unpack.repack(index, valid, out, tokens.shape)
        return self._losses(tokens, position_ids, labels=labels, loss_mask=loss_mask,
                            packed_seq_params=packed_seq_params, real=padding_mask)

    def _losses(self, tokens, position_ids, *, labels, loss_mask, packed_seq_params=None, real=None, media=None):
        across = hf_cp.forward(*self.cp, packed_seq_params) if self.cp else nullcontext()
        media = media or {}
        if self.model_loss and loss_mask is not None:
            target = torch.where(loss_mask > 0, labels, torch.full_like(labels, -100))
            one = torch.ones((), device=tokens.device)
            off = {"output_router_logits": False} if self.routed else {}  # its loss: the tokens' alone
            with documents(position_ids), across:
                out = self.model(input_ids=tokens, position_ids=position_ids, use_cache=False, labels=target,
                                 shift_labels=target, num_items_in_batch=one, **off, **media)
            return out.loss.float()
        aux = self.moe_aux if self.moe_aux is not None and self.training and torch.is_grad_enabled() else None
        routers = {"output_router_logits": True} if aux is not None else {}
        if self.linear_ce is not None and loss_mask is not None and not media:
            return self._fused_loss(tokens, position_ids, labels, loss_mask, across, aux, routers, real)
        with documents(position_ids), across:  # every model's masks confine attention to the packed documents
            out = self.model(input_ids=tokens, position_ids=position_ids, use_cache=False, **routers, **media)
        if aux is not None:  # the real tokens' routing statistic (transformers' attention-masked one)
            aux.record(out.router_logits, None if real is None else real.to(torch.long))
        logits = out.logits.float()
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
        if self.eaft is None:
            return loss
        k, alpha = self.eaft
        return loss * entropy_weights(logits, k, alpha)

    def _fused_loss(self, tokens, position_ids, labels, loss_mask, across, aux, routers, real):
        """`model.fused_linear_ce` on the transformers engine: the model's body (`model.model`, with PEFT's layers in
        it) gives the last hidden states, and nd-adapter's kernel takes them with lm_head's weight, in token chunks:
        Σ loss_mask · CE, one fp32 scalar (as with `model_loss`), the [tokens × vocab] logits never whole. Only for
        models whose forward does nothing else between the two (generic.plain_head; Gemma's final soft-capping is
        the kernel's `softcap`)."""
        from adapter.kernels.fusions import linear_cross_entropy

        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        with documents(position_ids), across:
            out = base.model(input_ids=tokens, position_ids=position_ids, use_cache=False, **routers)
        if aux is not None:
            aux.record(out.router_logits, None if real is None else real.to(torch.long))
        h = out.last_hidden_state
        chunk, cap = self.linear_ce
        return linear_cross_entropy(h.reshape(-1, h.size(-1)), base.get_output_embeddings().weight,
                                    labels.reshape(-1), loss_mask.reshape(-1), chunk=chunk, softcap=cap)


def recompute_layers(model) -> int:
    """`recompute: full` (Axolotl's gradient_checkpointing: true) as transformers runs it: its own gradient
    checkpointing, each decoder layer's activations dropped after its forward and recomputed in backward, with
    torch's non-reentrant checkpoint (it gives a frozen base's LoRA adapters and ZeRO-3's re-gathered parameters
    their gradients; the same losses and gradients, RNG state restored for dropout). Its `context_fn` hands the
    recomputation the forward's attention state (hf_cp.recompute_context): backward runs outside that forward."""
    kwargs = {"use_reentrant": False, "context_fn": hf_cp.recompute_context}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.25's name; the older one warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return sum(1 for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True
               and type(m).__name__ in set(getattr(model, "_no_split_modules", None) or []))  # the layers it took


def drop_frozen_input_grads(model) -> list[str]:
    """Undo transformers' input-gradient hook on the embeddings of sub-models that train nothing; their classes.

    Turning checkpointing on (recompute_layers) calls `enable_input_require_grads`, which hooks the input embeddings
    of every PreTrainedModel inside the model -- an image-text model's vision tower's patch embedding too. Its
    output then asks for a gradient, so a frozen tower (QLoRA on the language model, as Axolotl's Gemma 3 example)
    builds its whole autograd graph, is recomputed layer by layer in backward and back-propagated for a gradient
    that reaches no trained parameter: upstream of that embedding are only the pixels. Every trained parameter's
    gradient is the same without it (the non-reentrant checkpoint needs no input gradient; a trained sub-model
    keeps its hook). An embedding a trained sub-model also takes as its input keeps the hook."""
    from transformers import PreTrainedModel

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    subs = [m for m in base.modules() if isinstance(m, PreTrainedModel)]

    def embeddings(m):
        try:
            return m.get_input_embeddings()
        except (NotImplementedError, AttributeError):
            return None

    trains = {id(m): any(p.requires_grad for p in m.parameters()) for m in subs}
    kept = {id(embeddings(m)) for m in subs if trains[id(m)]}
    dropped = []
    for m in subs:
        emb = embeddings(m)
        if trains[id(m)] or emb is None or id(emb) in kept:
            continue
        hooks = emb._forward_hooks
        found = [k for k, fn in hooks.items() if getattr(fn, "__name__", "") == "make_inputs_require_grads"]
        for key in found:  # (transformers 5.25 hooks a tower's embedding once for each model that holds it)
            del hooks[key]
        dropped += [type(m).__name__] * bool(found)
    return dropped


def compile_layers(model, memory_budget: float | None = None) -> int:
    """`model.compile: true` on transformers' model: each decoder layer's forward as one torch.compile'd graph (its
    backward through AOTAutograd), as the native engine compiles its layers (adapter/modeling/compile.py) and for the
    same reason: a layer's norms, residual adds, casts and RoPE fuse into a few kernels and its per-op Python becomes
    one guarded call; identical layers share a graph. The layers are transformers' `_no_split_modules` instances,
    found inside PEFT's wrapping and after tensor parallelism replaced their linears, so the graphs see what trains.
    What Dynamo cannot trace -- the collectives of tensor, expert and context parallelism (autograd Functions),
    data-dependent expert routing -- breaks the graph there and runs eagerly: the same values, less fused. Forward
    only: module hooks (ZeRO's, gradient checkpointing's wrapper around the layer call) stay eager. Returns how
    many layers. `memory_budget`: AOTAutograd's activation budget, as on the native engine."""
    if memory_budget is not None:
        torch._functorch.config.activation_memory_budget = memory_budget
    # Dynamo keys its caches by code object, and transformers' models share theirs (the checkpointing wrapper every
    # layer's forward is, the experts' dispatch decorator): a second model trained in the same process (tests, a
    # rehearsal's workers) once ran on graphs another model left (a granite run after a phi one drifted by 2e-2 at
    # step 4, exact alone). Each run's layers start from empty caches.
    torch._dynamo.reset()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in base.modules() if type(m).__name__ in names]
    for layer in layers:
        layer.forward = _compiled_forward(layer)
    return len(layers)


def _compiled_forward(layer):
    """The layer's forward compiled, gradient checkpointing (transformers' `_gradient_checkpointing_func`) kept
    eager around it. transformers 5.25 wraps each layer class's forward in its checkpointing (`__wrapped__` is the
    class's own); compiling that wrapper asks Dynamo to trace torch.utils.checkpoint as a higher-order op, which
    breaks on the side effect of the hub kernels' context variable -- and the whole layer then ran eagerly (no graph
    at all). Its own forward compiled inside an eager checkpoint recomputes the compiled forward in backward. Bound
    to the layer (a method, not a partial), so Dynamo takes the module as an input and identical layers share one
    graph; each class has its own code object (the wrapper's is shared by every class)."""
    import types
    from functools import partial

    cls_forward = type(layer).forward
    inner = getattr(cls_forward, "__wrapped__", None)
    if inner is None or cls_forward.__code__.co_name != "forward_with_checkpointing":  # older transformers: the
        return torch.compile(layer.forward)  # checkpoint wraps the module call, outside forward

    compiled = torch.compile(types.MethodType(inner, layer))

    def forward(*args, **kwargs):
        if layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
            return layer._gradient_checkpointing_func(partial(compiled, **kwargs), *args)
        return compiled(*args, **kwargs)

    return forward


def layer_classes(model) -> list[type]:
    """The decoder-layer classes (transformers' `_no_split_modules`): ZeRO-3 gathers each one's parameters at once."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return list({type(m) for m in model.modules() if type(m).__name__ in names})


__all__ = ["OTHER_TOWERS", "build_model", "add_peft", "CausalLMLosses", "drop_frozen_input_grads",
           "compile_layers", "layer_classes", "recompute_layers", "apply_liger", "liger_available"]
