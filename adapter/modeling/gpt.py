"""ModelArch -> Megatron-Core GPTModel that reproduces the HF model exactly (Llama, Mistral, Qwen2, Qwen3).

Weights come from adapter/convert (docs/internals.md has the key mapping); this module only builds the right empty
model. The caller initialises megatron's parallel_state first. On CPU, the CPU shims (adapter/patches/mcore.py) are
applied here.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from adapter.errors import bad
from adapter.kernels.attention import SDPAttention, normalize_cp_comm_type
from adapter.kernels.eaft import entropy_weights
from adapter.kernels.fusions import (
    fused_rope,
    install_rope_fusion,
    linear_cross_entropy,
    rope_tables,
    vocab_parallel_cross_entropy,
)
from adapter.kernels.thd import PackedDocs
from adapter.modeling.moe import AuxLoss, GroupedExperts, HFRouter, WholeRMSNorm, use_local_dispatch
from adapter.models.arch import ModelArch, padded_vocab_size
from adapter.patches import require
from adapter.patches.mcore import (
    TESTED_MEGATRON_VERSIONS,
    check_preprocess,
    fused_rope_is,
    install_cpu_shims,
    with_decoder_input,
    with_rotary,
)

Attention = Literal["sdpa", "local", "te"]


class RMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm with Megatron's norm constructor, usable with sequence parallelism.

    Megatron's WrappedTorchNorm refuses sequence_parallel; the maths is per token, so it is fine: only the weight's
    gradient is a partial sum over TP ranks. The weight is tagged `sequence_parallel` like Megatron's own norms, so
    `tp_grad_sum_params` (and Megatron's finalize_model_grads) find it.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(hidden_size, eps=eps, device=device, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel
        # Gemma's norm (Megatron's zero-centred gamma): scale by 1 + w, so its checkpoints store w centred on zero
        self.offset = config.layernorm_zero_centered_gamma
        if self.offset:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.offset:
            return super().forward(x)
        # as transformers' Gemma3RMSNorm: normed and scaled in fp32, then cast ((x·w) rounded once, not x and w)
        y = F.rms_norm(x.float(), self.normalized_shape, None, self.eps) * (1.0 + self.weight.float())
        return y.type_as(x)


class PostNormed(RowParallelLinear):
    """A sub-layer's output linear (linear_proj, linear_fc2) whose output is RMS-normed before the residual add, as
    GLM-4's post_self_attn_layernorm / post_mlp_layernorm do. The norm runs on the reduced (under sequence
    parallelism, reduce-scattered) output, per token, so it is exact at any tp; its weight is `<linear>.post_norm`."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_norm = RMSNorm(config, output_size, eps=config.layernorm_epsilon)

    def forward(self, input_, *args, **kwargs):
        out, bias = self.linear_output(input_, *args, **kwargs)
        return self.post_norm(out), bias

    def linear_output(self, input_, *args, **kwargs):
        """The linear's own output, before the norm (LoRA's adapters add theirs here: adapter/modeling/lora.py)."""
        return super().forward(input_, *args, **kwargs)


ROPES = ("global", "local")  # the order of a stacked table's tables (PackedGPTModel._preprocess)


class LayerRopeAttention(SelfAttention):
    """Megatron's SelfAttention for a model whose layers rotate with different RoPE bases (Gemma 3: its sliding
    layers with rope_local_base_freq, the others with rope_theta): the model passes both tables stacked in one
    tensor [2, ...] (global, local: PackedGPTModel._preprocess) and this layer takes its own (`rope`, from its layer
    spec). One tensor, not a dict: full recompute's checkpoint saves the layer's inputs with save_for_backward,
    which takes tensors only."""

    def __init__(self, *args, rope: str = "global", **kwargs):
        super().__init__(*args, **kwargs)
        self.rope = rope

    def forward(self, hidden_states, *args, rotary_pos_emb=None, **kwargs):
        if isinstance(rotary_pos_emb, torch.Tensor) and rotary_pos_emb.dim() == 5:  # stacked: the tables are 4-D
            rotary_pos_emb = rotary_pos_emb[ROPES.index(self.rope)]
        elif isinstance(rotary_pos_emb, dict):
            rotary_pos_emb = rotary_pos_emb[self.rope]
        return super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GeGLU's activation (transformers' gelu_pytorch_tanh, Gemma)."""
    return F.gelu(x, approximate="tanh")


class Layer(TransformerLayer):
    """Megatron's TransformerLayer, called with its hidden states as a positional argument.

    Megatron's block passes `hidden_states=` by keyword; torch's full backward hooks only see positional tensors, so
    a hook on the layer would fire before its weight gradients exist. DeepSpeed's ZeRO-3 reduces a gather unit's
    gradients in exactly such a hook (`deepspeed.gather_granularity: layer`), so without this the reduce ran first
    and the weight gradients then landed on released (empty) parameters."""

    def __call__(self, *args, **kwargs):
        if not args and "hidden_states" in kwargs:
            args = (kwargs.pop("hidden_states"),)
        return super().__call__(*args, **kwargs)


def transformer_config(arch: ModelArch, *, tp: int = 1, cp: int = 1, sequence_parallel: bool = False,
                       params_dtype: torch.dtype = torch.float32, bf16: bool = False,
                       recompute: Literal["full", "selective"] | None = None, cp_comm_type: str | None = None,
                       fused_kernels: bool = False, **overrides) -> TransformerConfig:
    """TransformerConfig for `arch` at this run's tp/cp. `overrides` go straight to TransformerConfig.

    `fused_kernels`: Megatron's SwiGLU fusion (needs no TransformerEngine; Megatron builds it with torch.compile)
    and our fused RoPE, installed where TE's would go (adapter/kernels/fusions.py). The cross-entropy half lives in
    `FusedLossGPTModel`."""
    if sequence_parallel and tp == 1:
        sequence_parallel = False  # Megatron refuses SP without TP; it would be a no-op anyway
    kw = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.norm_eps, gated_linear_unit=True,
        activation_func=F.silu if arch.activation == "silu" else gelu_tanh,
        layernorm_zero_centered_gamma=arch.norm_offset, softmax_scale=arch.softmax_scale,
        add_bias_linear=False, add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        bias_activation_fusion=fused_kernels and arch.activation == "silu",  # Megatron fuses SwiGLU, not tanh GeGLU
        # LongRoPE's scaled cos/sin tables run only in our fused RoPE (PackedGPTModel), so it is on for them
        apply_rope_fusion=(fused_kernels or arch.rope_short_factor is not None) and not arch.rotary_interleaved
        and install_rope_fusion(),  # our fused RoPE rotates halves; an interleaved one runs Megatron's own
        rotary_interleaved=arch.rotary_interleaved,
        tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sequence_parallel,
        cp_comm_type=normalize_cp_comm_type(cp_comm_type) if cp > 1 else None,
        params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=bf16,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    if arch.moe:  # dropless top-k routing as transformers' (adapter/modeling/moe.py); no Megatron aux losses
        kw.update(num_moe_experts=arch.num_experts, moe_ffn_hidden_size=arch.expert_ffn_hidden_size,
                  moe_router_topk=arch.experts_per_token, moe_router_pre_softmax=not arch.norm_topk_prob,
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                  moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
                  moe_permute_fusion=False)
    if recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        kw.update(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif recompute is not None:
        raise bad("recompute", recompute, "unknown activation recompute mode", "use 'full', 'selective' or null")
    kw.update(overrides)
    return TransformerConfig(**kw)


def _layer_options(arch: ModelArch) -> bool:
    """Whether the layers differ from Llama's attention (windows per layer, soft-capping, per-layer RoPE), which only
    nd-adapter's SDPAttention runs."""
    return arch.sliding_window is not None or arch.attn_softcap is not None or arch.local_rope_theta is not None


def layer_spec(arch: ModelArch, attention: Attention = "sdpa", index: int = 0) -> ModuleSpec:
    """Megatron-Core spec of layer `index` (0-based); "sdpa" (default) is Megatron's local spec with our
    SDPAttention and RMSNorm. The layer description the record gives (adapter/models/families.py) decides: its
    attention window, soft-cap and RoPE table (Gemma's local and global layers), norm placement and type."""
    if attention != "sdpa" and _layer_options(arch):
        raise bad("attention", attention, f"{arch.architecture}'s sliding windows, soft-capping or per-layer RoPE "
                  "run in nd-adapter's attention only", "use attention: sdpa (the default)")
    if attention == "te":
        try:
            from megatron.core.models.gpt.gpt_layer_specs import (  # needs TransformerEngine, an optional package
                get_gpt_layer_with_transformer_engine_spec,
            )

            spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
            spec.module = Layer
            return spec
        except (ImportError, AssertionError) as e:
            raise bad("attention", "te", f"TransformerEngine is not usable here ({e})", "use attention='sdpa'")
    if attention not in ("sdpa", "local"):
        raise bad("attention", attention, "unknown attention backend", "use 'sdpa' (default), 'local' or 'te'")
    spec = get_gpt_layer_local_spec(num_experts=arch.num_experts, qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    spec.module = Layer
    layer, attn = spec.submodules, spec.submodules.self_attention.submodules
    if arch.moe:
        layer.mlp.submodules.router = HFRouter
        layer.mlp.submodules.experts.module = GroupedExperts  # SequentialMLP's weights, grouped GEMMs
    attn.core_attention = SDPAttention if attention == "sdpa" else DotProductAttention
    if _layer_options(arch):
        attn.core_attention = ModuleSpec(module=SDPAttention, params={"window": arch.window(index),
                                                                      "softcap": arch.attn_softcap})
    if arch.local_rope_theta is not None:
        spec.submodules.self_attention = ModuleSpec(
            module=LayerRopeAttention, params={**spec.submodules.self_attention.params,
                                               "rope": "local" if arch.local_rope(index) else "global"},
            submodules=attn)
    layer.input_layernorm = layer.pre_mlp_layernorm = RMSNorm
    if arch.post_norms:
        attn.linear_proj = layer.mlp.submodules.linear_fc2 = PostNormed
    if arch.qk_norm and arch.qk_norm_whole:  # OLMoE: over the whole q and k projections
        attn.q_layernorm = ModuleSpec(module=WholeRMSNorm, params={"heads": arch.num_heads})
        attn.k_layernorm = ModuleSpec(module=WholeRMSNorm, params={"heads": arch.num_kv_heads})
    elif arch.qk_norm:
        attn.q_layernorm = attn.k_layernorm = RMSNorm
    return spec


class PackedGPTModel(GPTModel):
    """GPTModel that also takes packed documents (`packed_seq_params=adapter.kernels.thd.PackedDocs`): one RoPE
    angle per token, its position inside its document, so a CP rank's chunks of every document rotate as in the
    whole document. Megatron's own THD path finds positions from cu_seqlens in every layer with host syncs, and has
    no per-document CP split without TransformerEngine; a per-token angle table costs one gather per forward."""

    def __init__(self, *args, real_vocab_size: int | None = None, rope_scale: float = 1.0,
                 local_rope_base: float | None = None, embed_scale: float | None = None,
                 final_softcap: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.real_vocab_size = real_vocab_size or self.vocab_size  # the rows past it are padding (128·tp multiple)
        self.embed_scale = embed_scale  # Gemma: embeddings × √hidden
        self.local_rotary_pos_emb = None  # Gemma 3's sliding layers: a second RoPE table (LayerRopeAttention)
        self.long_rotary_pos_emb, self.rope_original_max = None, None  # LongRoPE's long factors (set_long_rope)
        self.rope_padded_len = None  # unpacked batches: the length samples are padded to (set_long_rope)
        if local_rope_base is not None:
            self.local_rotary_pos_emb = RotaryEmbedding(
                kv_channels=self.config.kv_channels, rotary_percent=kwargs.get("rotary_percent", 1.0),
                rotary_interleaved=self.config.rotary_interleaved, rotary_base=local_rope_base,
                use_cpu_initialization=self.config.use_cpu_initialization, cp_group=self.pg_collection.cp)
        self.eaft: tuple[int, float] | None = None  # (k, alpha): EAFT's per-token weights (`token_weights`)
        self.final_softcap = final_softcap
        if final_softcap is not None:  # Gemma 2: logits = c·tanh(logits / c), before every loss and every reader
            self.output_layer.register_forward_hook(
                lambda _m, _i, out: (torch.tanh(out[0] / final_softcap) * final_softcap, *out[1:]))
        c = self.config  # cos/sin once per forward for every layer's RoPE (fusions.rope_tables), where ours runs
        self.rope_tables = bool(c.apply_rope_fusion and fused_rope_is(fused_rope) and c.mrope_section is None
                                and not c.rotary_interleaved)
        self.rope_scale = rope_scale  # LongRoPE's attention factor on cos and sin
        if rope_scale != 1.0 and not self.rope_tables:
            raise bad("rope_scaling.rope_type", "longrope", "LongRoPE's scaled rotary tables need nd-adapter's "
                      "fused rotate-half RoPE (not TransformerEngine's, not an interleaved one)",
                      "use attention: sdpa (the default); interleaved RoPE with LongRoPE is not built")

    def local_real_vocab(self, local: int) -> int:
        """How many of this TP rank's `local` vocabulary columns are real (the padding sits at the end); `local` is
        the whole padded vocabulary when the logits were gathered (parallel_output=False)."""
        if local == self.vocab_size:
            return self.real_vocab_size
        tp_rank = self.pg_collection.tp.rank()
        return max(0, min(local, self.real_vocab_size - tp_rank * local))

    def token_weights(self, logits: torch.Tensor) -> torch.Tensor | None:
        """EAFT's weight of each token [b, s] from its logits [s, b, v/tp] (adapter/kernels/eaft.py; the top-k
        merged over TP), or None without `eaft`."""
        if self.eaft is None:
            return None
        k, alpha = self.eaft
        w = entropy_weights(logits, k, alpha, real=self.local_real_vocab(logits.size(-1)),
                            group=self.pg_collection.tp if self.config.tensor_model_parallel_size > 1 else None,
                            vocab=self.real_vocab_size)
        return w.transpose(0, 1)

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Megatron's cross-entropy with the padding columns at −inf: zero-initialised padding rows give logit 0, which
        would enter every softmax (a loss and gradients unlike the HF model's). In place: nothing saved the logits."""
        valid = self.local_real_vocab(logits.size(-1))
        weights = self.token_weights(logits)  # before the loss: Megatron's may work on the logits in place
        if valid < logits.size(-1):
            logits[..., valid:] = float("-inf")
        loss = super().compute_language_model_loss(labels, logits)
        return loss if weights is None else loss * weights

    def set_long_rope(self, inv_freq: torch.Tensor, original_max: int) -> None:
        """LongRoPE's long factors: a micro-batch whose positions go past `original_max` rotates with these
        frequencies instead (transformers' longrope_frequency_update: max(position_ids) + 1 > original). Unpacked
        batches decide by `rope_padded_len` when it is set: transformers sees the samples padded to that length
        (Axolotl pads to sequence_len), while nd-adapter trims a micro-batch's untrained tail (data/sft/bins.py)."""
        c = self.config  # the table's width comes from inv_freq alone (partial rotary: fewer frequencies)
        self.long_rotary_pos_emb = RotaryEmbedding(
            kv_channels=c.kv_channels, rotary_percent=1.0, rotary_interleaved=c.rotary_interleaved,
            use_cpu_initialization=c.use_cpu_initialization, cp_group=self.pg_collection.cp)
        self.long_rotary_pos_emb.inv_freq = inv_freq.to(self.rotary_pos_emb.inv_freq.device)
        self.rope_original_max = original_max

    def _preprocess(self, *args, packed_seq_params=None, **kwargs):
        if isinstance(packed_seq_params, PackedDocs):
            out = super()._preprocess(*args, packed_seq_params=None, **kwargs)
            long = self.rope_original_max is not None and packed_seq_params.longest > self.rope_original_max
            table = {name: emb(packed_seq_params.rope_len, packed_seq=True)  # [rope_len, 1, 1, d], cached
                     .index_select(0, packed_seq_params.positions) for name, emb in self._ropes(long)}
        else:
            out = super()._preprocess(*args, packed_seq_params=packed_seq_params, **kwargs)
            table = {"global": out[1]}
            if out[1] is not None and (self.local_rotary_pos_emb is not None or self.rope_original_max is not None):
                # as GPTModel builds its own table: every position of the (CP-whole) sequence
                n = self.rotary_pos_emb.get_rotary_seq_len(None, self.decoder, out[0], self.config, packed_seq_params)
                thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
                if self.local_rotary_pos_emb is not None:
                    table["local"] = self.local_rotary_pos_emb(n, packed_seq=thd)
                padded = max(n, self.rope_padded_len or 0)  # the length transformers would see
                if self.rope_original_max is not None and padded > self.rope_original_max:
                    table["global"] = self.long_rotary_pos_emb(n, packed_seq=thd)
        for name, t in table.items():
            if self.rope_tables and isinstance(t, torch.Tensor):
                t = rope_tables(t)
                table[name] = t * self.rope_scale if self.rope_scale != 1.0 else t
        if len(table) > 1 and all(isinstance(t, torch.Tensor) for t in table.values()) and \
                len({t.shape for t in table.values()}) == 1:  # one tensor (LayerRopeAttention): recompute saves it
            table = torch.stack([table[name] for name in ROPES if name in table])
        table = table if not isinstance(table, dict) or len(table) > 1 else table["global"]
        out = out if table is out[1] else with_rotary(out, table)
        if self.embed_scale is not None:  # as transformers: the scale rounded to the weights' dtype first, kept a
            # host scalar (a device tensor made here is a blocking host-to-device copy in every forward)
            emb = out[0]
            out = with_decoder_input(out, emb * torch.tensor(self.embed_scale, dtype=emb.dtype).item())
        return out

    def _ropes(self, long: bool = False):
        yield "global", self.long_rotary_pos_emb if long else self.rotary_pos_emb
        if self.local_rotary_pos_emb is not None:
            yield "local", self.local_rotary_pos_emb


class FusedLossGPTModel(PackedGPTModel):
    """GPTModel whose training loss is adapter.kernels.fusions' vocab-parallel cross-entropy (no fp32 copy of the
    logits). Called with `labels` and `loss_mask` (and `linear_ce`), it returns Σ loss_mask · loss as one fp32 scalar
    computed by the fused linear + cross-entropy, so the [tokens × vocab] logits are never built."""

    def __init__(self, *args, linear_ce: bool = False, linear_ce_chunk: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.linear_ce, self.linear_ce_chunk = linear_ce, linear_ce_chunk
        if linear_ce:  # the override below replaces Megatron's private _postprocess for training batches
            require("megatron-core", TESTED_MEGATRON_VERSIONS, "fused linear cross-entropy (GPTModel._postprocess)")

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        weights = self.token_weights(logits)
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), self.pg_collection.tp,  # logits [s, b, v]
                                            real=self.local_real_vocab(logits.size(-1)))
        loss = loss.transpose(0, 1).contiguous()
        return loss if weights is None else loss * weights

    def _postprocess(self, **kw):
        labels, loss_mask = kw.get("labels"), kw.get("loss_mask")
        if (not self.linear_ce or labels is None or loss_mask is None or kw.get("mtp_in_postprocess")
                or kw.get("inference_context") is not None):
            return super()._postprocess(**kw)
        h, group = kw["hidden_states"], self.pg_collection.tp  # [s (/tp under SP), b, h]
        tp = self.config.tensor_model_parallel_size
        if tp > 1:  # what the output layer does to its input, so the TP reduction of the input's gradient happens
            h = (gather_from_sequence_parallel_region(h, group=group) if self.config.sequence_parallel
                 else copy_to_tensor_model_parallel_region(h, group=group))
        weight = (self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights
                  else self.output_layer.weight)
        return linear_cross_entropy(h.reshape(-1, h.size(-1)), weight, labels.t().reshape(-1),
                                    loss_mask.t().reshape(-1).float(), group if tp > 1 else None,
                                    chunk=self.linear_ce_chunk, real=self.local_real_vocab(weight.size(0)),
                                    softcap=self.final_softcap)


def build_gpt_model(arch: ModelArch, *, tp: int = 1, cp: int = 1, padded_vocab: int | None = None,
                    sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                    attention: Attention = "sdpa", max_sequence_length: int | None = None,
                    parallel_output: bool = True, config: TransformerConfig | None = None,
                    fused_kernels: bool = False, linear_ce: bool = False, linear_ce_chunk: int | None = None,
                    moe_grouped_gemm: bool = True, moe_local_dispatch: bool = True, **config_kw) -> GPTModel:
    """GPTModel for `arch` on the current parallel_state (tp/cp must match it). Weights are random: load them after.

    `fused_kernels`: see `transformer_config`; also swaps in the fused cross-entropy (FusedLossGPTModel).
    `linear_ce`: training calls that pass a loss_mask get the fused linear + cross-entropy's masked loss sum;
    `linear_ce_chunk`: its tokens per chunk (ours then, also where Liger's would run).
    `moe_grouped_gemm`: experts as grouped GEMMs where they apply (adapter/modeling/moe.GroupedExperts), else
    Megatron's per-expert loop. `moe_local_dispatch`: layers whose experts are all local dispatch without host syncs
    (adapter/modeling/moe.LocalTokenDispatcher), else Megatron's dispatcher (the one it replaces, for tests)."""
    install_cpu_shims()
    check_preprocess()
    if attention == "local" and cp > 1:
        raise bad("attention", "local", "Megatron's local attention has no context parallelism",
                  "use attention='sdpa' (the default)")
    config = config or transformer_config(arch, tp=tp, cp=cp, sequence_parallel=sequence_parallel,
                                          params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
                                          fused_kernels=fused_kernels, **config_kw)
    if attention == "te":
        spec = layer_spec(arch, attention)
    else:  # one spec per layer (windows, RoPE tables differ); the final norm from the block spec (Megatron's
        # default is WrappedTorchNorm)
        spec = TransformerBlockSubmodules(layer_specs=[layer_spec(arch, attention, i) for i in range(arch.num_layers)],
                                          layer_norm=RMSNorm)
    fused = {"linear_ce": linear_ce, "linear_ce_chunk": linear_ce_chunk} if fused_kernels or linear_ce else None
    model = (PackedGPTModel if fused is None else FusedLossGPTModel)(
        config, spec,
        vocab_size=padded_vocab or padded_vocab_size(arch.vocab_size, tp),
        max_sequence_length=max_sequence_length or arch.max_position_embeddings,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=arch.tie_embeddings,
        position_embedding_type="rope", rotary_percent=arch.rotary_fraction, rotary_base=arch.rope_theta,
        rope_scaling=arch.rope_scaling_factor is not None, rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        real_vocab_size=arch.vocab_size, rope_scale=arch.rope_attention_factor, local_rope_base=arch.local_rope_theta,
        embed_scale=arch.embed_scale, final_softcap=arch.final_softcap, **(fused or {}),
    )
    if arch.moe:  # every layer's router records into one statistic (adapter/modeling/moe.py)
        model.moe_aux = AuxLoss(arch.num_experts, arch.experts_per_token,
                                arch.router_aux_loss_coef if arch.output_router_logits else 0.0)
        # the ranks that split one micro-batch's tokens: TP under sequence parallelism, CP
        model.moe_aux.groups = [g for g, on in ((model.pg_collection.tp, config.sequence_parallel),
                                                (model.pg_collection.cp, cp > 1)) if on]
        for m in model.modules():
            if isinstance(m, HFRouter):
                m.aux = model.moe_aux
            if isinstance(m, GroupedExperts):
                m.grouped = moe_grouped_gemm
        if moe_local_dispatch:
            use_local_dispatch(model)
    if arch.rope_linear_factor is not None:  # linear RoPE scaling (Gemma 3's global layers): frequencies / factor
        model.rotary_pos_emb.inv_freq = model.rotary_pos_emb.inv_freq / arch.rope_linear_factor
    if arch.rope_short_factor is not None:  # LongRoPE's frequencies, as transformers computes them (fp32)
        dim = int(arch.head_dim * arch.rotary_fraction)
        base = arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        model.rotary_pos_emb.inv_freq = 1.0 / (torch.tensor(arch.rope_short_factor, dtype=torch.float32) * base)
        if arch.rope_long_factor is not None:
            model.set_long_rope(1.0 / (torch.tensor(arch.rope_long_factor, dtype=torch.float32) * base),
                                arch.rope_original_max)
    return model


def forward_logits(model: GPTModel, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                   vocab_size: int | None = None) -> torch.Tensor:
    """[b, s, vocab] logits, gathered over TP and cut to `vocab_size` (drops the padding rows).

    GPTModel ignores position_ids for RoPE (positions are 0..s-1, CP-chunked); they are passed for completeness.
    """
    if position_ids is None:
        position_ids = torch.arange(input_ids.size(1), device=input_ids.device).expand_as(input_ids)
    logits = model(input_ids, position_ids, attention_mask=None)
    if model.parallel_output and model.config.tensor_model_parallel_size > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    return logits[..., :vocab_size] if vocab_size else logits


def sequence_parallel_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters tagged sequence_parallel (norm weights under SP): their grads are partial sums over TP ranks."""
    return [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]


def tp_grad_sum_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Every parameter whose gradient must be all-reduced (summed) over TP after backward, as Megatron's
    finalize_model_grads does: sequence-parallel norms, and q/k layernorms (each TP rank sees only its heads)."""
    if model.config.tensor_model_parallel_size == 1:
        return []
    whole = {id(p) for m in model.modules() if isinstance(m, WholeRMSNorm) for p in m.parameters()}
    return [p for n, p in model.named_parameters()
            if (model.config.sequence_parallel and getattr(p, "sequence_parallel", False))
            or (("q_layernorm" in n or "k_layernorm" in n) and id(p) not in whole)]


__all__ = ["RMSNorm", "PackedGPTModel", "FusedLossGPTModel", "padded_vocab_size", "transformer_config", "layer_spec",
           "build_gpt_model", "forward_logits", "sequence_parallel_params", "tp_grad_sum_params"]
