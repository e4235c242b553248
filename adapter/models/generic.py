"""The facts of a model trained by the transformers engine: any architecture transformers can load, read from its
config.json and from the model transformers builds on the meta device (no weights, no memory).

The native families (adapter/models/families.py) are mapped onto Megatron-Core layers tensor by tensor; everything
else -- new architectures, hybrids of attention and state-space layers, image-text checkpoints, a native family with
a feature its record does not reproduce, or `model.engine: transformers` -- is trained as transformers' own model
(adapter/modeling/hf_build.py). Its `ModelArch` carries the sizes `plan` reads under the same names (hidden, layers,
heads, vocabulary, ...) and, for what a formula cannot know about an arbitrary architecture, exact numbers from the
meta-device model: the parameter count and whether the embedding is tied. Its weight table is Llama's, read only by
`plan`'s per-layer formulas as a stand-in shape; the totals are the meta model's.

This module loads without torch; the meta-device build imports torch and transformers when a transformers-engine
model is first resolved (a native model's `plan` never does).
"""
from __future__ import annotations

import functools
import json
import re
from typing import Any

from adapter.errors import bad
from adapter.models import linearized as linearized_layout
from adapter.models.tp_plan import model_plan, plan_matches, split_numel
from adapter.models.vision import vision_tower

ENGINES = ("auto", "megatron", "transformers")

# layer kinds of `layer_types` (or the hybrid configs' own keys) that cannot be split over the sequence: their
# recurrence runs through every position in order
UNSPLITTABLE = ("linear_attention", "mamba", "mamba2", "conv", "hybrid", "recurrent", "ssm")


def text_part(cfg: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """(the language model's config, whether the checkpoint is image-text): VLMs keep it under `text_config`."""
    text = cfg.get("text_config")
    if isinstance(text, dict) and any(k in text for k in ("hidden_size", "num_hidden_layers", "vocab_size")):
        return text, "vision_config" in cfg or "audio_config" in cfg
    return cfg, False


def _first(cfg: dict[str, Any], keys: tuple[str, ...], default: Any = None) -> Any:
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            return v
    return default


def _positive(cfg: dict[str, Any], keys: tuple[str, ...], source: str, default: int | None = None) -> int:
    v = _first(cfg, keys, default)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 2 ** 63:
        raise bad(keys[0], v, f"must be a positive integer in {source}", "fix the model's config.json")
    return v


LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
LAYER_KIND_KEYS = ("layer_types", "layers_block_type", "layer_block_types")


def layer_count(text: dict[str, Any]) -> int | None:
    """The language model's depth: its count key, or else the length of its per-layer pattern, as transformers
    reads it (Nemotron-H's config of transformers 5 keeps `num_hidden_layers` None beside `layers_block_type`)."""
    n = _first(text, LAYER_COUNT_KEYS)
    if n is not None:
        return n
    pattern = next((text[k] for k in (*LAYER_KIND_KEYS, "hybrid_override_pattern")
                    if isinstance(text.get(k), (list, str)) and text.get(k)), None)
    return len(pattern) if pattern is not None else None


def layer_kinds(cfg: dict[str, Any]) -> tuple[str, ...]:
    """Every layer kind the config names (`layer_types`, `layers_block_type`, hybrid patterns), sorted."""
    text, _ = text_part(cfg)
    kinds: set[str] = set()
    for key in ("layer_types", "layers_block_type", "layer_block_types", "hybrid_override_pattern"):
        v = text.get(key)
        if isinstance(v, list):
            kinds.update(str(x) for x in v)
        elif isinstance(v, str) and key == "hybrid_override_pattern":  # Nemotron-H: M (mamba), * (attention), -
            kinds.update({"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}.get(c, c) for c in v)
    if text.get("model_type") in ("mamba", "mamba2", "falcon_mamba"):
        kinds.add("mamba")
    if str(text.get("model_type", "")).startswith(("falcon_h1", "jamba", "zamba", "bamba", "lfm2")):
        kinds.add("hybrid")
    return tuple(sorted(kinds))


def unsplittable(kinds: tuple[str, ...]) -> str | None:
    """The first layer kind that cannot be split over the sequence (context parallelism), or None."""
    return next((k for k in kinds if any(u in k.lower() for u in UNSPLITTABLE)), None)


def runs_unpacked(kinds: tuple[str, ...], document_attention: bool) -> str | None:
    """The recurrent layer kind that makes packed documents run unpacked (each its own row of a padded batch:
    adapter/modeling/hf_unpack.py), or None: a linear-attention / state-space layer would carry its state from one
    packed document into the next. The one rule the run's first lines and the engine's loss both follow."""
    return unsplittable(kinds) if document_attention else None


def check_loadable(cfg: dict[str, Any]) -> None:
    """One line when transformers has no class for the checkpoint's model_type and the checkpoint ships no code of
    its own (auto_map): no engine can train it. Cheap (no model is built): said before any key of the run's file."""
    import transformers

    if not isinstance(cfg, dict) or cfg.get("auto_map"):
        return
    model_type = cfg.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        name = (cfg.get("architectures") or [None])[0]
        raise bad("model_type", model_type, f"transformers {transformers.__version__} cannot load this architecture "
                  f"({name})", "upgrade transformers, or use a checkpoint of an architecture it knows")


def hf_config(cfg: dict[str, Any], *, trust_remote_code: bool, model_dir: str | None):
    """transformers' config object for a config.json (one line for what transformers cannot read)."""
    import transformers
    from huggingface_hub.errors import StrictDataclassError

    name = (cfg.get("architectures") or [None])[0]
    model_type = cfg.get("model_type")
    check_loadable(cfg)
    if cfg.get("auto_map"):
        if not trust_remote_code:
            raise bad("trust_remote_code", False, f"{name or model_type} is built by code in its checkpoint "
                      "(config.json's auto_map)", "set trust_remote_code: true to run that code, or pick a checkpoint "
                      "transformers implements")
        if model_dir is None:
            raise bad("model.path", None, "remote code needs the checkpoint's directory", "point model.path at it")
        try:
            return transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=True)
        except OSError as e:  # the code auto_map names is not in the directory (a config.json copied alone)
            raise _missing_code(name or model_type, e) from e
    body = {k: v for k, v in cfg.items() if k not in ("model_type", "transformers_version")}
    try:
        cls = transformers.CONFIG_MAPPING[str(model_type)]
        decode = getattr(cls, "_decode_special_floats", None)  # Infinity/NaN as transformers writes them
        return cls.from_dict(decode(body) if decode else body)
    except (TypeError, ValueError, KeyError, AttributeError, StrictDataclassError) as e:  # the last: transformers 5's
        # typed fields; AttributeError: a field in another version's shape (a flat rope_parameters in 5.17)
        raise bad("model", model_type, f"transformers cannot read this config.json ({e.__class__.__name__}: "
                  f"{str(e).splitlines()[0][:160]})", "fix the model's config.json")


def model_class(config, name: str | None, *, remote: bool):
    """The class the checkpoint names (`architectures[0]`) when transformers has it, else its causal-LM (or
    image-text-to-text) auto class."""
    import transformers

    if remote:
        return transformers.AutoModelForCausalLM
    cls = getattr(transformers, name, None) if name else None
    if cls is not None and name and hasattr(cls, "from_pretrained") and name.endswith(("ForCausalLM",
                                                                                       "ForConditionalGeneration")):
        return cls
    from transformers.models.auto import modeling_auto as auto

    for mapping in (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        found = mapping.get(config.model_type)
        if found and hasattr(transformers, found):
            return getattr(transformers, found)
    raise bad("architectures", name, f"transformers has no causal language model for model_type "
              f"{config.model_type!r}", "fine-tune a causal (or image-text-to-text) checkpoint")


def scoring_class_name(model_type: str, *, remote: bool = False, tokens: bool = False) -> str:
    """transformers' sequence-classification class for `model_type` (a reward model's; `tokens`: its token-
    classification class, a process reward model's), or one line: a model type it does not classify, or a
    checkpoint that brings its own code."""
    from transformers.models.auto import modeling_auto as auto

    table = (auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES if tokens else
             auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)
    kind = "token" if tokens else "sequence"
    name = table.get(model_type)
    if remote or not name:
        raise bad("model_type", f"AutoModelFor{kind.title()}Classification", f"transformers has no {kind}-"
                  f"classification class for model_type {model_type!r}" + (
                      " built into it (this checkpoint brings its own code)" if remote else ""),
                  f"train the {'process ' if tokens else ''}reward model from a checkpoint of a model type "
                  "transformers classifies")
    return name


def meta_model(cfg: dict[str, Any], *, trust_remote_code: bool = False, model_dir: str | None = None,
               linearized: bool = False):
    """(model on the meta device, its class name): shapes without memory, for `plan` and the checks. `linearized`
    (model.linearized_experts): its experts in Axolotl's per-expert linears (adapter/models/linearized.py)."""
    import torch

    config = hf_config(cfg, trust_remote_code=trust_remote_code, model_dir=model_dir)
    remote = bool(cfg.get("auto_map"))
    name = (cfg.get("architectures") or [None])[0]
    cls = model_class(config, name, remote=remote)
    shown = str(name or cfg.get("model_type")) if remote else cls.__name__
    try:
        with torch.device("meta"):
            model = (cls.from_config(config, trust_remote_code=True) if remote else
                     cls._from_config(for_class(cls, config)))
    except OSError as e:
        if not remote:
            raise
        raise _missing_code(shown, e) from e
    except ImportError as e:  # an optional library a tower needs (timm, ...)
        raise bad("model", shown, f"transformers needs a library to build {shown}: {_first_line(e)}",
                  "install it (pip), or pick a checkpoint that does not need it") from e
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:  # config.json and the class disagree
        raise bad("model", shown, f"transformers cannot build {shown} from this config.json "
                  f"({e.__class__.__name__}: {_first_line(e)})", "fix the model's config.json (compare it with the "
                  "published checkpoint's)") from e
    record = linearized_layout.for_model_type(str(cfg.get("model_type"))) if linearized else None
    if record is not None:
        linearized_layout.meta_layout(model, record)
    return model, type(model).__name__


def for_class(cls, config):
    """A causal-LM class named for an image-text checkpoint's config builds from its language model's config."""
    text = getattr(config, "text_config", None)
    if text is not None and cls.__name__.endswith("ForCausalLM") and not hasattr(config, "vocab_size"):
        return text
    return config


def _first_line(e: BaseException) -> str:
    return next((line.strip() for line in str(e).splitlines() if line.strip()), "")[:160]


def _missing_code(name, e: OSError):
    m = re.search(r"file named (\S+?\.py)", str(e))
    what = m.group(1) if m else _first_line(e)
    return bad("trust_remote_code", True, f"{name} is built by its checkpoint's own code, and {what} is not in its "
               "directory", "download the whole checkpoint (its .py files with config.json), or pick a checkpoint "
               "transformers implements")


@functools.lru_cache(maxsize=16)
def meta_facts(config_text: str, trust_remote_code: bool, model_dir: str | None,
               linearized: bool = False) -> dict[str, Any]:
    """Exact facts of the model transformers builds from this config, on the meta device: parameter count, whether
    the input and output embeddings are one tensor, whether it ships a tensor-parallel plan, the class it builds.
    Raises UserError (one line) when transformers cannot build it."""
    model, cls = meta_model(json.loads(config_text), trust_remote_code=trust_remote_code, model_dir=model_dir,
                            linearized=linearized)
    params = {id(p): p.numel() for p in model.parameters()}
    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()
    tied = out is not None and emb is not None and out.weight is emb.weight
    text = getattr(model.config, "get_text_config", lambda: model.config)()
    ep_experts, ep_params = _ep_split(model) if getattr(text, "base_model_ep_plan", None) else (0, 0)
    shares = tuple((tp, *_tp_share(model, tp)) for tp in TP_SIZES) \
        if getattr(text, "base_model_tp_plan", None) and model_plan(model) else ()  # not the output layer's alone
    return {"params": sum(params.values()), "tied": bool(tied), "tp_shares": shares, "ep_experts": ep_experts,
            "ep_params": ep_params,
            "cls": cls, "embedding": emb.weight.numel() if emb is not None else 0,
            "attention": attention_features(model, text), "plain_head": plain_head(model),
            "recompute": bool(getattr(model, "supports_gradient_checkpointing", False))}


# What a causal LM's forward may do between its body's output and its loss for the fused linear CE to compute the
# same loss from the body's hidden states and lm_head's weight (transformers 5.17-5.25's lines): cut the positions
# kept, apply lm_head, and Gemma's final soft-capping (which the kernel applies per chunk, from the config).
_PLAIN_HEAD = {"hidden_states = outputs.last_hidden_state", "hidden_states = outputs[0]",
               "hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)",
               "slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep",
               "logits = self.lm_head(hidden_states)", "logits = self.lm_head(hidden_states[:, slice_indices, :])",
               "if self.config.final_logit_softcapping is not None:",
               "logits = logits / self.config.final_logit_softcapping", "logits = torch.tanh(logits)",
               "logits = logits * self.config.final_logit_softcapping"}


def plain_linear(module: Any) -> bool:
    """A bias-free torch Linear, nothing wrapped around it (PEFT, QAT): the weight the fused linear CE reads."""
    import torch

    return type(module) is torch.nn.Linear and module.bias is None


def plain_head(model: Any) -> bool:
    """Whether the model's logits are lm_head (a bias-free linear) over its body's (`self.model`) last hidden state,
    soft-capped at most (the lines of its forward between the two, checked against _PLAIN_HEAD): then nd-adapter's
    fused linear CE computes its loss exactly. Cohere's logit scale, Granite's logits scaling, and any forward this
    does not recognise keep the model's own loss."""
    import inspect

    if not plain_linear(model.get_output_embeddings()) or not hasattr(model, "model"):
        return False
    try:
        src = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False
    start, end = src.find("= self.model("), src.find("loss = None")
    cut = src.find("hidden_states = outputs", start)
    if start < 0 or end < 0 or cut < 0 or cut > end:
        return False
    lines = {ln.split("#")[0].strip() for ln in src[cut:end].splitlines()} - {""}
    return lines <= _PLAIN_HEAD


def _ep_split(model: Any) -> tuple[int, int]:
    """(experts per layer, parameters split) by the model's expert-parallel plan (`grouped_gemm` entries: stacked
    experts along dim 0, adapter/modeling/hf_ep.py); (0, 0) where the plan names no such parameter."""
    plan = {k: v for k, v in dict(getattr(model, "ep_plan", None) or {}).items() if v == "grouped_gemm"}
    stacked = [p for name, style, mod in plan_matches(model, plan) if mod is None
               for p in [model.get_parameter(name)]]
    if not stacked:
        return 0, 0
    return min(p.shape[0] for p in stacked), sum(p.numel() for p in stacked)


def attention_features(model: Any, text: Any) -> tuple[str, ...]:
    """What context parallelism on this engine (adapter/modeling/hf_cp.py) must know of the model's attention, read
    from the meta-device model and its (language model's) config; generic_run.check_run says which it refuses.
      "interface": the class does not declare that its attention runs through transformers' attention interface
          (`is_backend_compatible`: `_supports_attention_backend`), so a registered function might not see it;
      "sinks": per-head sink logits in the softmax (gpt-oss); "chunked": attention in fixed chunks (Llama 4);
      "softcap": soft-capped scores (Gemma 2); "dropout": attention dropout; "window:N": sliding-window layers
          (N: the window, 0 where the config names none);
      "dynamic_rope:N": RoPE frequencies chosen by the largest position in the forward (dynamic NTK, LongRoPE) past
          N positions, which a rank holding part of the sequence would choose differently."""
    found = []
    if not type(model).is_backend_compatible():
        found.append("interface")
    if any(name.split(".")[-1] in ("sinks", "s_aux") for name, _ in model.named_parameters()):
        found.append("sinks")
    kinds = getattr(text, "layer_types", None) or ()
    if getattr(text, "attention_chunk_size", None) or "chunked_attention" in kinds:
        found.append("chunked")
    if getattr(text, "attn_logit_softcapping", None):
        found.append("softcap")
    if float(getattr(text, "attention_dropout", 0.0) or 0.0) > 0:
        found.append("dropout")
    if getattr(text, "sliding_window", None) or "sliding_attention" in kinds:
        found.append(f"window:{int(getattr(text, 'sliding_window', None) or 0)}")
    rope = getattr(text, "rope_parameters", None) or {}
    for p in [rope, *rope.values()] if isinstance(rope, dict) else []:
        if isinstance(p, dict) and p.get("rope_type") in ("dynamic", "longrope"):
            limit = p.get("original_max_position_embeddings") or getattr(text, "max_position_embeddings", 0)
            found.append(f"dynamic_rope:{int(limit or 0)}")
            break
    return tuple(found)


TP_SIZES = tuple(range(2, 17))  # the tp sizes `plan` knows a rank's share for (a plan's widths divide few others)


def _tp_share(model: Any, tp: int) -> tuple[int, str]:
    numel, problems = split_numel(model, tp)
    return numel, problems[0] if problems else ""


def generic_arch_fields(cfg: dict[str, Any], source: str, *, trust_remote_code: bool = False,
                        model_dir: str | None = None, linearized: bool = False) -> dict[str, Any]:
    """ModelArch's fields for the transformers engine (adapter/models/arch.py builds the record)."""
    # loadable at all: first
    facts = meta_facts(json.dumps(cfg, sort_keys=True), trust_remote_code, model_dir, linearized)
    text, image_text = text_part(cfg)
    hidden = _positive(text, ("hidden_size", "n_embd", "d_model", "dim"), source)
    heads = _positive(text, ("num_attention_heads", "n_head", "num_heads", "n_heads"), source, default=1)
    kv = _first(text, ("num_key_value_heads", "num_kv_heads", "n_kv_heads"), heads)
    kv = kv if isinstance(kv, int) and kv > 0 else heads
    head_dim = _first(text, ("head_dim", "attention_head_dim"))
    head_dim = head_dim if isinstance(head_dim, int) and head_dim > 0 else max(1, hidden // heads)
    ffn = _first(text, ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"))
    ffn = ffn if isinstance(ffn, int) and ffn > 0 else 4 * hidden
    layers = _positive({"num_hidden_layers": layer_count(text)}, ("num_hidden_layers",), source)
    vocab = _positive(text, ("vocab_size",), source, default=None if "vocab_size" in text else getattr(
        hf_config(cfg, trust_remote_code=trust_remote_code, model_dir=model_dir).get_text_config(), "vocab_size",
        None))  # unset: transformers' default for the config class (Gemma 3's text config leaves it out)
    arch = (cfg.get("architectures") or [facts["cls"]])[0]
    kinds = text.get("layer_types")
    window = text.get("sliding_window")
    # which layers attend through a window: only where layer_types says so (a bare `sliding_window` is often a
    # default that the model does not use, e.g. Qwen2's use_sliding_window: false)
    windowed = tuple(k == "sliding_attention" for k in kinds) if isinstance(kinds, list) and \
        len(kinds) == layers and "sliding_attention" in kinds else None
    return dict(
        family="transformers", architecture=arch, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv, head_dim=head_dim, ffn_hidden_size=ffn, vocab_size=vocab,
        max_position_embeddings=int(_first(text, ("max_position_embeddings", "n_positions"), 4096) or 4096),
        tie_embeddings=facts["tied"], rope_theta=float(text.get("rope_theta") or 10000.0), rope_scaling_factor=None,
        norm_eps=float(_first(text, ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"), 1e-6) or 1e-6),
        qkv_bias=bool(text.get("attention_bias", False)), qk_norm=False,
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or text.get("torch_dtype") or "bfloat16"),
        sliding_window=window if windowed and isinstance(window, int) and window > 0 else None,
        window_layers=windowed if isinstance(window, int) and window > 0 else None,
        engine="transformers", hf_model_type=str(cfg.get("model_type") or ""), param_count=facts["params"],
        layer_kinds=layer_kinds(cfg), tp_shares=facts["tp_shares"], ep_experts=facts["ep_experts"],
        ep_params=facts["ep_params"],
        attention_features=facts["attention"], layer_recompute=facts["recompute"],
        image_text=image_text, vision=vision_tower(cfg) if image_text else None,
        remote_code=bool(cfg.get("auto_map")) and trust_remote_code,
        output_router_logits=bool(text.get("output_router_logits")), plain_head=facts["plain_head"],
        final_softcap=float(text["final_logit_softcapping"]) if text.get("final_logit_softcapping") else None,
        router_aux_loss_coef=float(text.get("router_aux_loss_coef") or 0.0))


# The rehearsal's tiny copy of an arbitrary config (adapter/train/rehearse.py): every size key transformers' configs
# use, set small and mutually consistent (heads × head_dim = hidden; Mamba's heads × head size = expand × hidden);
# layer patterns cut to one layer of each kind, in the model's order; counts (experts, top-k) capped but kept.


__all__ = ["scoring_class_name", "ENGINES", "UNSPLITTABLE", "LAYER_COUNT_KEYS", "LAYER_KIND_KEYS", "text_part",
           "layer_count", "layer_kinds", "unsplittable", "runs_unpacked", "check_loadable", "hf_config", "model_class",
           "for_class", "meta_model", "meta_facts", "attention_features", "generic_arch_fields"]
