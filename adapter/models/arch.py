"""Model architecture facts read from an HF `config.json` alone (no weights).

Everything downstream (plan, the builders, the conversion tables) reads a `ModelArch`, never the raw JSON, so one
place decides what is supported and refuses the rest before anything runs or is written."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from adapter.config.hub import looks_like_hub_id, resolve_hub_id
from adapter.errors import UserError, bad
from adapter.models import families
from adapter.models.prequant import check_not_quantised

# Megatron-Core hard-codes these for Llama-3.1 rope scaling; other values would silently change the model.
LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF name -> the gated MLP's activation here
# config.json keys read below -> (what transformers' config classes hold there, whether null is allowed), so that a
# malformed value is refused in one line naming it before any arithmetic meets it. Keys with their own checks
# (_int, _positive, the window and LongRoPE keys) are not listed.
_NUM, _INT, _BOOL, _STR, _MAP = "a finite number", "a whole number", "true or false", "a string", "a mapping"
_JSON_KEYS = {
    "model_type": (_STR, True), "max_position_embeddings": (_INT, False), "head_dim": (_INT, True),
    "original_max_position_embeddings": (_INT, True), "rope_theta": (_NUM, False), "rms_norm_eps": (_NUM, False),
    "partial_rotary_factor": (_NUM, True), "rope_local_base_freq": (_NUM, False), "attention_dropout": (_NUM, True),
    "resid_pdrop": (_NUM, True), "embd_pdrop": (_NUM, True), "hidden_dropout": (_NUM, True),
    "rope_scaling": (_MAP, True), "rope_parameters": (_MAP, True), "tie_word_embeddings": (_BOOL, True),
    "attention_bias": (_BOOL, True), "use_sliding_window": (_BOOL, True), "norm_topk_prob": (_BOOL, True),
    "output_router_logits": (_BOOL, True), "use_bidirectional_attention": (_BOOL, True),
    "hidden_act": (_STR, False), "hidden_activation": (_STR, True), "torch_dtype": (_STR, True), "dtype": (_STR, True),
}
# inside rope_scaling / rope_parameters (and rope_parameters' per-layer-type mappings)
_ROPE_KEYS = {"rope_type": (_STR, True), "type": (_STR, True), "rope_theta": (_NUM, False), "factor": (_NUM, False),
              "low_freq_factor": (_NUM, False), "high_freq_factor": (_NUM, False), "attention_factor": (_NUM, True),
              "original_max_position_embeddings": (_INT, False), "partial_rotary_factor": (_NUM, True),
              "sliding_attention": (_MAP, True), "full_attention": (_MAP, True)}


class NotNative(UserError):
    """A feature the native engine does not reproduce: model.engine auto then picks transformers (generic.py)."""


def unbuilt(key: str, value: Any, problem: str, fix: str) -> NotNative:
    return NotNative(str(bad(key, value, problem, fix)))


@dataclass(frozen=True)
class ModelArch:
    family: str
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_embeddings: bool
    rope_theta: float
    rope_scaling_factor: float | None  # Llama-3.1 style ("llama3") scaling, else None
    norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    torch_dtype: str
    sliding_window: int | None = None  # attention sees only this many tokens back (Mistral v0.1); None: all of them
    # HF builds the embedding with padding_idx = pad_token_id: that row gets no gradient from lookups (Phi-3/4's pad
    # is their EOS, which packed SFT inputs are full of); None: no such row
    pad_token_id: int | None = None
    rotary_fraction: float = 1.0  # RoPE on the first int(head_dim · this) dims of each head, the rest pass (Phi-4-mini)
    # LongRoPE (Phi-3.5-mini, Phi-4-mini): per-frequency divisors of the rotary frequencies for sequences up to
    # `rope_original_max` (its short factors), and the factor cos and sin are scaled by; None: plain RoPE
    rope_short_factor: tuple[float, ...] | None = None
    rope_long_factor: tuple[float, ...] | None = None  # past `rope_original_max` (per micro-batch, as transformers)
    rope_attention_factor: float = 1.0
    rope_original_max: int | None = None
    post_norms: bool = False  # an RMSNorm on each sub-layer's output before its residual add (GLM-4)
    rotary_interleaved: bool = False  # RoPE rotates pairs (2i, 2i+1) of the rotated dims (GLM), not halves
    # Gemma's layer: RMSNorm scales by (1 + weight) (weights stored centred on zero), embeddings are multiplied by
    # √hidden (rounded to the weights' dtype, as transformers does), a GeGLU MLP (tanh GELU), scores scaled by
    # query_pre_attn_scalar^-½
    norm_offset: bool = False
    embed_scale: float | None = None
    activation: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    softmax_scale: float | None = None  # None: 1/√head_dim
    # which layers attend through `sliding_window` (Gemma's local layers); None: every layer (Mistral v0.1)
    window_layers: tuple[bool, ...] | None = None
    local_rope_theta: float | None = None  # RoPE base of the windowed layers (Gemma 3: 10k); None: rope_theta
    rope_linear_factor: float | None = None  # linear RoPE scaling (positions / factor) of the other layers (Gemma 3)
    attn_softcap: float | None = None  # attention scores soft-capped, c·tanh(s/c), before the mask (Gemma 2)
    final_softcap: float | None = None  # the output logits soft-capped the same way (Gemma 2)
    # Mixture of experts (Qwen3-MoE, Mixtral, OLMoE): every layer's MLP is `num_experts` gated MLPs of width
    # `expert_ffn_hidden_size`, each token routed to `experts_per_token` of them by softmax over a linear router
    # (renormalised over the chosen ones when `norm_topk_prob`), dropless; None: a dense model
    num_experts: int | None = None
    experts_per_token: int = 0
    expert_ffn_hidden_size: int | None = None
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.0  # transformers adds coef · load-balancing loss when output_router_logits
    output_router_logits: bool = False
    qk_norm_whole: bool = False  # q/k RMSNorm over the whole projection, not per head (OLMoE)
    # Which engine trains it ("megatron": a native family on Megatron-Core layers; "transformers": its own model,
    # adapter/models/generic.py) and why; for the latter, facts from the model built on the meta device
    engine: str = "megatron"
    engine_reason: str = ""
    hf_model_type: str = ""
    param_count: int | None = None      # exact, all parameters (the transformers engine)
    layer_kinds: tuple[str, ...] = ()   # the layer kinds config.json names (linear_attention, mamba, ...)
    tp_shares: tuple[tuple[int, int, str], ...] = ()  # (tp, parameters its TP plan splits, why it cannot); () none
    ep_experts: int = 0                 # experts per layer its expert-parallel plan splits (0: no plan)
    ep_params: int = 0                  # ... and the parameters it splits (all layers)
    attention_features: tuple[str, ...] = ()  # what context parallelism must know (generic.attention_features)
    layer_recompute: bool = True        # transformers' gradient checkpointing (supports_gradient_checkpointing)
    # an image-text checkpoint's vision tower: (layers, hidden, ffn, image_size (0: none in config.json), patch
    # size, MLP input linears), what `plan` counts of the images' activations and FLOPs (vision.vision_tower)
    vision: tuple[int, int, int, int, int, int] | None = None
    plain_head: bool = False  # the transformers engine: its loss computable from the body's output (generic.plain_head)
    image_text: bool = False            # an image-text checkpoint: its language model trains on text
    remote_code: bool = False           # built by the checkpoint's own code (trust_remote_code)
    score_head: bool = False            # a score head in place of the LM head: a reward model (source.scoring)
    score_labels: int = 1               # its outputs: one (a reward), or the classes of a process reward model

    @property
    def native(self) -> bool:
        return self.engine == "megatron"

    @property
    def moe(self) -> bool:
        return self.num_experts is not None

    @property
    def routed_ffn(self) -> int:
        """The MLP width one token passes through: ffn_hidden_size, or top-k × an expert's (a mixture of experts)."""
        if self.experts_per_token is None or self.expert_ffn_hidden_size is None:  # dense: not a mixture of experts
            return self.ffn_hidden_size
        return self.experts_per_token * self.expert_ffn_hidden_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s (0-based) attention window: a query sees itself and window − 1 keys before it (HF's
        sliding-window mask); None: the whole causal prefix."""
        if self.sliding_window is None or (self.window_layers is not None and not self.window_layers[layer]):
            return None
        return self.sliding_window

    def local_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates with the local RoPE base (Gemma 3's sliding layers)."""
        return self.local_rope_theta is not None and bool(self.window_layers and self.window_layers[layer])


def padded_vocab_size(vocab: int, tp: int = 1, divisible_by: int = 128) -> int:
    """Megatron-LM's rule: pad so every tp rank holds a multiple of `divisible_by` rows (zero rows on import,
    dropped on export). One definition for the model builder, the converter and the memory model."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise bad("model", str(path), "no such file", "point `model` at an HF checkpoint directory or its config.json")
    except IsADirectoryError:
        raise bad("model", str(path), "a directory, not a config.json file", "give the checkpoint's config.json file")
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise bad("model", str(path), f"not valid JSON ({e.__class__.__name__})", "give a valid HF config.json")
    except OSError as e:
        raise bad("model", str(path), f"cannot be read ({e.strerror})", "check the file's permissions")


MAX_JSON_NUMBER = 2**63  # no config.json size or rate is larger; Python's JSON reads integers of any length


def _check_json(cfg: dict[str, Any], source: str, keys: dict[str, tuple[str, bool]], prefix: str = "") -> None:
    """Each of `keys` that `cfg` holds has its kind (or null where allowed); rope mappings are checked inside."""
    for key, (kind, nullable) in keys.items():
        if key not in cfg or (cfg[key] is None and nullable):
            continue
        v = cfg[key]
        # JSON integers are unbounded: one past a float's range is no size or rate any model has
        number = (isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < MAX_JSON_NUMBER
                  and math.isfinite(v))
        ok = {_NUM: number, _INT: number and float(v).is_integer(), _BOOL: isinstance(v, bool),
              _STR: isinstance(v, str), _MAP: isinstance(v, dict)}[kind]
        if not ok:
            raise bad(prefix + key, v, f"must be {kind} in {source}", "fix the model's config.json")
        if kind == _MAP and key != "text_config":
            _check_json(v, source, _ROPE_KEYS, f"{prefix}{key}.")


def config_path(model: str | Path) -> Path:
    return Path(model) / "config.json" if Path(model).is_dir() else Path(model)


def load_arch(model: str | Path, engine: str = "auto", trust_remote_code: bool = False,
              dequantize: str | None = None, linearized: bool = False) -> ModelArch:
    """Read an HF checkpoint dir or config.json. `engine` (model.engine): "megatron" refuses anything GPTModel
    cannot reproduce exactly; "transformers" trains transformers' own model; "auto" the first where a native family
    reproduces the checkpoint, else the second (the reason kept in `engine_reason`). `dequantize`: the config's key
    that loads an MXFP4 / FP8 checkpoint dequantized, where on (adapter/models/prequant.py). `linearized`: its
    experts held as Axolotl's per-expert linears (adapter/models/linearized.py)."""
    path = config_path(model)
    if not path.exists():
        if not Path(model).exists() and looks_like_hub_id(str(model)):
            resolve_hub_id(str(model), key="model.path (base_model)")  # raises the hub cache's one line
        raise bad("model", str(model), "no config.json found there",
                  "point `model` at an HF checkpoint directory (with config.json) or at a config.json file")
    raw, src = _read_json(path), str(path)
    if engine == "megatron":
        return arch_from_hf_dict(raw, source=src, dequantize=dequantize)
    why = "model.engine: transformers"
    if engine == "auto":
        try:
            return arch_from_hf_dict(raw, source=src, dequantize=dequantize)
        except NotNative as e:  # a native family, but a feature its layers do not reproduce
            why = f"the native engine does not reproduce it: {e}"
        except UnknownArchitecture:
            why = f"{(raw.get('architectures') or [raw.get('model_type')])[0]} has no native family (Megatron-Core " \
                  "mapping)"
    return _generic(raw, src, why, trust_remote_code, dequantize, linearized)


def _generic(raw: dict[str, Any], source: str, why: str, trust_remote_code: bool,
             dequantize: str | None = None, linearized: bool = False) -> ModelArch:
    from adapter.models.generic import generic_arch_fields

    if not isinstance(raw, dict) or raw.get("use_bidirectional_attention"):
        raise bad("model", source, "not a causal language model's config.json", "fine-tune a causal checkpoint")
    check_not_quantised(raw, source, dequantize=dequantize)  # bitsandbytes' codes load, MXFP4/FP8 dequantize
    fields = generic_arch_fields(raw, source, trust_remote_code=trust_remote_code, model_dir=str(Path(source).parent),
                                 linearized=linearized)
    return ModelArch(**fields, engine_reason=why)


class UnknownArchitecture(UserError):
    """No native family covers the checkpoint (model.engine megatron refuses it; auto picks transformers)."""


def _int(cfg: dict[str, Any], key: str, source: str, default: Any = None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v < MAX_JSON_NUMBER:
        raise bad(key, v, f"must be a positive integer (below 2**63) in {source}", "fix the model's config.json")
    return v


def arch_from_hf_dict(cfg: dict[str, Any], source: str = "config.json", dequantize: str | None = None) -> ModelArch:
    if not isinstance(cfg, dict):
        raise bad("model", source, "config.json is not a JSON object", "give a valid HF config.json")
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise bad("architectures", archs, f"must be a list of class names in {source}", "fix the model's config.json")
    _check_json(cfg, source, {"model_type": _JSON_KEYS["model_type"]})
    name = archs[0] if archs else None
    fam = families.find(name, cfg.get("model_type"))
    if fam is None:
        shown = name or cfg.get("model_type")
        raise UnknownArchitecture(str(bad("architectures", shown, "no native family (Megatron-Core mapping) for "
                  "this architecture", "train it on the transformers engine (model.engine: auto, the default, or "
                  "transformers), which reads the HF weights as they are, without conversion; native families: "
                  f"{', '.join(families.supported_architectures())} (adding a family: docs/adding-a-model.md)")))
    name = name or fam.architectures[0]
    check_not_quantised(cfg, source, native=unbuilt, dequantize=dequantize)
    if fam.text_config:  # an image-text checkpoint (Gemma3ForConditionalGeneration): its language model's config
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise bad("text_config", text, f"{name} keeps its language model's config there; it is missing in "
                      f"{source}", "give the checkpoint's complete config.json")
        cfg = families.text_config_json(cfg, fam)  # the text model's config, as the export writes it
    cfg = {**dict(fam.defaults), **cfg}  # what the family's HF config class fills in where config.json is silent
    _check_json(cfg, source, _JSON_KEYS)
    if cfg.get("use_bidirectional_attention"):
        raise bad("use_bidirectional_attention", True, "bidirectional attention (an embedding model) is not a causal "
                  "language model", "fine-tune the causal checkpoint")

    hidden = _int(cfg, "hidden_size", source)
    heads = _int(cfg, "num_attention_heads", source)
    kv = _int(cfg, "num_key_value_heads", source, heads)
    if heads % kv:
        raise bad("num_key_value_heads", kv, f"does not divide num_attention_heads={heads}",
                  "fix the model's config.json")
    head_dim = cfg.get("head_dim") or hidden // heads
    if not cfg.get("head_dim") and hidden % heads:
        raise bad("hidden_size", hidden, f"not divisible by num_attention_heads={heads}", "set head_dim in config.json")
    act_key = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
    act = cfg.get(act_key, "silu")
    if act not in ACTIVATIONS:
        raise unbuilt(act_key, act, "only gated MLPs with silu (SwiGLU) or gelu_pytorch_tanh (GeGLU) are supported",
                  "use a model with one of them")

    if fam.qkv_bias is False and cfg.get("attention_bias"):  # q, k, v and o biases the family's table has no rule for
        raise unbuilt("attention_bias", True, f"{name} checkpoints with attention biases are not supported",
                  "use a checkpoint without them (the published ones have none)")
    rope = dict(cfg.get("rope_parameters") or {})  # transformers 5 keeps theta, scaling and partial rotary here
    local_rope = rope.pop("sliding_attention", None) or {}  # Gemma 3 (transformers 5): one dict per layer type
    rope = dict(rope.pop("full_attention", None) or rope)
    window_layers = _window_layers(cfg, fam, source)
    partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor"))
    partial = 1.0 if partial is None else partial
    rotary_dim = int(int(head_dim) * float(partial)) if isinstance(partial, (int, float)) else 0
    if isinstance(partial, bool) or not 0 < float(partial) <= 1 or rotary_dim % 2:  # Phi-4-mini: 0.75 of each head
        raise bad("partial_rotary_factor", partial, f"must be in (0, 1] and give an even number of rotated dims "
                  f"of head_dim {head_dim}", "fix the model's config.json")
    for key in ("attention_dropout", "resid_pdrop", "embd_pdrop", "hidden_dropout"):
        if float(cfg.get(key) or 0.0) != 0.0:  # training would drop out where nd-adapter's model does not
            raise unbuilt(key, cfg[key], "dropout in training is not built (nd-adapter's layers run without it)",
                      f"set {key}: 0.0 in the model's config.json (fine-tunes usually do)")

    # A window shorter than the model's context: exact only for sequences no longer than it (models/checks.py), as
    # GPTModel computes full causal attention
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", fam.sliding_window_default)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise bad("sliding_window", window, f"must be a positive integer in {source}", "fix the model's config.json")
    if not (window is not None and uses_window and window < cfg.get("max_position_embeddings", 0)):
        window = None

    scaling = cfg.get("rope_scaling") or ({} if rope.get("rope_type", "default") == "default" else rope)
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    factor = linear = None
    longrope: dict[str, Any] = {}
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "longrope":
            longrope = _longrope(cfg, scaling, rope, int(head_dim), float(partial), source)
        elif kind == "linear":  # positions divided by the factor (Gemma 3 4B+ on its global layers)
            linear = _positive_number(scaling.get("factor"), "rope_scaling.factor", source)
        elif kind not in (None, "default"):
            if kind != "llama3":
                raise unbuilt("rope_scaling.rope_type", kind, "only Llama-3.1 ('llama3'), LongRoPE ('longrope') and "
                          "'linear' rope scaling are supported", "use a checkpoint with one of them or none")
            for k, want in LLAMA3_ROPE_FIXED.items():
                if float(scaling.get(k, want)) != float(want):
                    raise unbuilt(f"rope_scaling.{k}", scaling.get(k), f"Megatron-Core fixes it at {want}",
                              "only the standard Llama-3.1 rope scaling values are supported")
            factor = float(scaling.get("factor", 8.0))

    return ModelArch(
        family=fam.name,
        architecture=name,
        hidden_size=hidden,
        num_layers=_int(cfg, "num_hidden_layers", source),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=int(head_dim),
        ffn_hidden_size=_int(cfg, "intermediate_size", source),
        vocab_size=_int(cfg, "vocab_size", source),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=theta,
        rope_scaling_factor=factor,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=fam.qkv_bias if fam.qkv_bias is not None else bool(cfg.get("attention_bias", False)),
        qk_norm=fam.qk_norm,
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        sliding_window=window,
        pad_token_id=pad if isinstance(pad := cfg.get("pad_token_id"), int) and 0 <= pad < cfg["vocab_size"] else None,
        rotary_fraction=float(partial),
        post_norms=fam.post_norms,
        rotary_interleaved=fam.rotary_interleaved,
        norm_offset=fam.norm_offset,
        embed_scale=float(hidden) ** 0.5 if fam.embed_scale else None,
        activation=ACTIVATIONS[act],
        softmax_scale=None if (qpas := cfg.get("query_pre_attn_scalar")) is None
        else _positive_number(qpas, "query_pre_attn_scalar", source) ** -0.5,
        window_layers=window_layers,
        local_rope_theta=float(local_rope.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
        if fam.local_rope else None,
        rope_linear_factor=linear,
        attn_softcap=_positive(cfg.get("attn_logit_softcapping"), "attn_logit_softcapping", source, none=True),
        final_softcap=_positive(cfg.get("final_logit_softcapping"), "final_logit_softcapping", source, none=True),
        **longrope,
        **_moe(cfg, fam, source),
    )


def _moe(cfg: dict[str, Any], fam, source: str) -> dict[str, Any]:
    """A mixture-of-experts family's routing facts from its config (read as transformers' config class does)."""
    if not fam.moe:
        return {}
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    key = "num_experts" if "num_experts" in cfg else "num_local_experts"
    experts = _int({key: experts}, key, source)
    k = _int(cfg, "num_experts_per_tok", source)
    if k > experts:
        raise bad("num_experts_per_tok", k, f"exceeds {key}={experts} in {source}", "fix the model's config.json")
    step, dense = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
    if step != 1 or dense:  # no published checkpoint of these families mixes dense and MoE layers
        shown = ("mlp_only_layers", dense) if dense else ("decoder_sparse_step", step)
        raise unbuilt(shown[0], shown[1], "a model mixing dense and mixture-of-experts layers is not built",
                  "use a checkpoint whose every layer is a mixture of experts (decoder_sparse_step 1, no "
                  "mlp_only_layers)")
    if cfg.get("router_jitter_noise"):  # Mixtral's training-time noise on the router's input
        raise unbuilt("router_jitter_noise", cfg["router_jitter_noise"], "router jitter is not built",
                  "set router_jitter_noise: 0.0 in the model's config.json (the published configs do)")
    if cfg.get("clip_qkv") is not None:
        raise unbuilt("clip_qkv", cfg["clip_qkv"], "clipping q, k and v is not built",
                  "use a checkpoint without it (clip_qkv: null)")
    coef = cfg.get("router_aux_loss_coef", 0.0)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
        raise bad("router_aux_loss_coef", coef, f"must be a number >= 0 in {source}", "fix the model's config.json")
    return {"num_experts": experts, "experts_per_token": k,
            "expert_ffn_hidden_size": _int(cfg, fam.expert_ffn_key, source),
            "norm_topk_prob": fam.norm_topk_prob if fam.norm_topk_prob is not None
            else bool(cfg.get("norm_topk_prob", False)),
            "router_aux_loss_coef": float(coef), "output_router_logits": bool(cfg.get("output_router_logits")),
            "qk_norm_whole": fam.qk_norm_whole}


def _positive(v: Any, key: str, source: str, none: bool = False) -> float | None:
    """A positive number of config.json (None stays None where `none`)."""
    if v is None and none:
        return None
    return _positive_number(v, key, source)


def _positive_number(v: Any, key: str, source: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise bad(key, v, f"must be a positive number in {source}", "fix the model's config.json")
    return float(v)


def _window_layers(cfg: dict[str, Any], fam, source: str) -> tuple[bool, ...] | None:
    """Which layers are local (sliding-window) ones: the config's `layer_types`, else the family's pattern (every
    n-th layer global; Gemma 3 reads n from `sliding_window_pattern`), else None (every layer alike)."""
    n = cfg.get("num_hidden_layers")
    types = cfg.get("layer_types")
    if types is None and fam.window_every:
        every = cfg.get("sliding_window_pattern", fam.window_every)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise bad("sliding_window_pattern", every, f"must be a positive integer in {source}",
                      "fix the model's config.json")
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n or 0)]
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
        raise bad("layer_types", types, f"must list 'sliding_attention' or 'full_attention' for each of the {n} "
                  f"layers in {source}", "fix the model's config.json")
    return tuple(t == "sliding_attention" for t in types)


def _longrope(cfg: dict[str, Any], scaling: dict[str, Any], rope: dict[str, Any], head_dim: int, partial: float,
              source: str) -> dict[str, Any]:
    """LongRoPE as transformers computes it (modeling_rope_utils._compute_longrope_parameters): the short factors
    apply while a micro-batch's positions stay within `original_max_position_embeddings`, the long ones when any goes
    past it (its `longrope_frequency_update`: max(position_ids) + 1 > original); cos and sin are scaled by the
    attention factor, by default sqrt(1 + ln(max_position_embeddings / original) / ln(original))."""
    import math

    half = int(head_dim * partial) // 2
    factors = {}
    for kind in ("short_factor", "long_factor"):
        f = scaling.get(kind)
        if not isinstance(f, list) or len(f) != half or not all(isinstance(x, (int, float)) and x > 0 for x in f):
            raise bad(f"rope_scaling.{kind}", f, f"LongRoPE needs {half} positive factors (one per rotary "
                      "frequency) in " + source, "fix the model's config.json")
        factors[kind] = tuple(float(x) for x in f)
    original = int(cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
                   or rope.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 4096))
    factor = scaling.get("factor") or cfg.get("max_position_embeddings", original) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_short_factor": factors["short_factor"], "rope_long_factor": factors["long_factor"],
            "rope_attention_factor": float(attention), "rope_original_max": original}


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_tp(arch: ModelArch, tp: int, key: str = "tp") -> None:
    """Refuse a TP size GPTModel cannot run for this architecture (one rule for the converter and the layout)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise bad(key, tp, "must be a positive integer", "use e.g. 2")
    name = arch.architecture
    if arch.num_heads % tp:
        raise bad(key, tp, f"does not divide num_attention_heads={arch.num_heads} of {name}",
                  f"use a tp_size that divides {arch.num_heads} ({_divisors(arch.num_heads)})")
    kv = arch.num_kv_heads
    if kv % tp and tp % kv:
        raise bad(key, tp, f"is incompatible with num_key_value_heads={kv} of {name} "
                  "(KV heads must split evenly across tp ranks, or tp must be a multiple of them)",
                  f"use a tp_size that divides {kv} or is a multiple of it")
    if arch.qk_norm_whole and kv % tp:  # each rank norms its own heads' slice of the whole k projection
        raise bad(key, tp, f"does not divide num_key_value_heads={kv} of {name}, whose k norm spans all of them",
                  f"use a tp_size that divides {kv}")
    if arch.expert_ffn_hidden_size is not None and arch.expert_ffn_hidden_size % tp:
        raise bad(key, tp, f"does not divide an expert's MLP width {arch.expert_ffn_hidden_size} of {name}",
                  "use a tp_size that divides it")
    if not arch.moe and arch.ffn_hidden_size % tp:
        raise bad(key, tp, f"does not divide intermediate_size={arch.ffn_hidden_size} of {name}",
                  "use a tp_size that divides the MLP width")


__all__ = ["ModelArch", "load_arch", "padded_vocab_size", "arch_from_hf_dict", "config_path", "check_tp", "UserError"]
