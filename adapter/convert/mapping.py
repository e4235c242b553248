"""Declarative HF <-> Megatron-Core weight tables: one table per architecture family, no per-model loops.

A `Rule` maps one Megatron distributed-checkpoint key to the HF tensors it is built from. Megatron keys are the
sharded keys GPTModel.sharded_state_dict() uses (TE-style norm names, layers stacked on a leading axis), so the
global tensor of each key is independent of TP: TP only decides how the key is chunked on disk and the vocab padding.
Adding a model = adding a table (and its family in adapter/arch.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from adapter.arch import ModelArch
from adapter.errors import bad

LAYER = "decoder.layers."  # Megatron keys under this prefix are stacked: global shape (num_layers, *per_layer)


@dataclass(frozen=True)
class Rule:
    megatron: str                      # sharded key in the torch_dist checkpoint
    hf: tuple[tuple[str, str], ...]    # (HF name with {i} for the layer, shape in symbols h q kv f v d)
    op: str = "copy"                   # name in OPS: how the HF tensors become the Megatron tensor
    tp_axis: int | None = None         # axis TP splits (0 column-parallel / vocab, 1 row-parallel), None replicated
    parts: int = 1                     # independently TP-split blocks along tp_axis ([gate; up] has 2)
    when: str | None = None            # ModelArch flag that must hold ("!flag" negates); None = always

    @property
    def per_layer(self) -> bool:
        return self.megatron.startswith(LAYER)

    def applies(self, arch: ModelArch) -> bool:
        if self.when is None:
            return True
        neg = self.when.startswith("!")
        return bool(getattr(arch, self.when.lstrip("!"))) != neg

    def hf_names(self, layer: int | None) -> list[str]:
        return [n.format(i=layer) for n, _ in self.hf]


@dataclass(frozen=True)
class Ctx:
    """What a transform may depend on besides the tensors."""
    arch: ModelArch
    padded_vocab: int
    tp: int = 1


def _qkv_fuse(ts: Sequence[torch.Tensor], c: Ctx) -> torch.Tensor:
    # Megatron keeps, per query group, [its q heads; k; v] contiguous so a plain TP chunk gives whole groups.
    q, k, v = ts
    a = c.arch
    ng, d, rest = a.num_kv_heads, a.head_dim, q.shape[1:]
    hpg = a.num_heads // ng
    return torch.cat([q.reshape(ng, hpg * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], 1
                     ).reshape(-1, *rest)


def _qkv_split(t: torch.Tensor, c: Ctx) -> list[torch.Tensor]:
    a = c.arch
    ng, d, rest = a.num_kv_heads, a.head_dim, t.shape[1:]
    hpg = a.num_heads // ng
    q, k, v = t.reshape(ng, (hpg + 2) * d, *rest).split([hpg * d, d, d], 1)
    return [x.reshape(-1, *rest).contiguous() for x in (q, k, v)]


def _vocab_pad(ts: Sequence[torch.Tensor], c: Ctx) -> torch.Tensor:
    # GPTModel does not pad; Megatron-LM converters add zero rows so TP divides the vocab.
    (t,) = ts
    extra = c.padded_vocab - t.shape[0]
    return t if extra == 0 else torch.cat([t, t.new_zeros(extra, *t.shape[1:])])


def _cat(ts, c):
    return torch.cat(list(ts))


def _chunk(n: int) -> Callable:
    return lambda t, c: [x.contiguous() for x in t.chunk(n)]


def _glu_naive(ts, c):
    """WRONG on purpose (negative control): what a converter that chunks [gate; up] per rank would store."""
    gate, up = ts
    ranks = torch.cat([gate, up]).chunk(c.tp)                 # naive: rank r gets chunk r of [gate; up]
    halves = [r.chunk(2) for r in ranks]                      # Megatron reads rank r as [w_r; v_r]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves])


# op -> (to_megatron(hf_tensors, ctx) -> tensor, to_hf(tensor, ctx) -> hf_tensors)
OPS: dict[str, tuple[Callable, Callable]] = {
    "copy": (lambda ts, c: ts[0], lambda t, c: [t]),
    "vocab": (_vocab_pad, lambda t, c: [t[: c.arch.vocab_size].contiguous()]),
    "qkv": (_qkv_fuse, _qkv_split),
    "glu": (_cat, _chunk(2)),
    # negative controls only (tests prove a wrong table is caught)
    "cat3": (_cat, lambda t, c: [x.contiguous() for x in t.split(
        [c.arch.num_heads * c.arch.head_dim] + [c.arch.num_kv_heads * c.arch.head_dim] * 2)]),
    "glu_naive": (_glu_naive, _chunk(2)),
}

_L = "model.layers.{i}."
LLAMA: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", (("model.embed_tokens.weight", "v h"),), "vocab", 0),
    Rule(LAYER + "self_attention.linear_qkv.layer_norm_weight", ((_L + "input_layernorm.weight", "h"),)),
    Rule(LAYER + "self_attention.linear_qkv.weight", ((_L + "self_attn.q_proj.weight", "q h"),
                                                     (_L + "self_attn.k_proj.weight", "kv h"),
                                                     (_L + "self_attn.v_proj.weight", "kv h")), "qkv", 0),
    Rule(LAYER + "self_attention.linear_qkv.bias", ((_L + "self_attn.q_proj.bias", "q"),
                                                   (_L + "self_attn.k_proj.bias", "kv"),
                                                   (_L + "self_attn.v_proj.bias", "kv")), "qkv", 0, when="qkv_bias"),
    Rule(LAYER + "self_attention.linear_proj.weight", ((_L + "self_attn.o_proj.weight", "h q"),), tp_axis=1),
    Rule(LAYER + "mlp.linear_fc1.layer_norm_weight", ((_L + "post_attention_layernorm.weight", "h"),)),
    Rule(LAYER + "mlp.linear_fc1.weight", ((_L + "mlp.gate_proj.weight", "f h"),
                                          (_L + "mlp.up_proj.weight", "f h")), "glu", 0, parts=2),
    Rule(LAYER + "mlp.linear_fc2.weight", ((_L + "mlp.down_proj.weight", "h f"),), tp_axis=1),
    Rule("decoder.final_layernorm.weight", (("model.norm.weight", "h"),)),
    Rule("output_layer.weight", (("lm_head.weight", "v h"),), "vocab", 0, when="!tie_embeddings"),
)
MISTRAL = LLAMA
QWEN2 = LLAMA  # q/k/v biases: arch.qkv_bias is always true for qwen2
QWEN3 = LLAMA + (
    Rule(LAYER + "self_attention.q_layernorm.weight", ((_L + "self_attn.q_norm.weight", "d"),)),
    Rule(LAYER + "self_attention.k_layernorm.weight", ((_L + "self_attn.k_norm.weight", "d"),)),
)
REGISTRY: dict[str, tuple[Rule, ...]] = {"llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2, "qwen3": QWEN3}

# Linear layers whose (empty for the local spec) `_extra_state` GPTModel checkpoints as one ShardedObject per layer.
EXTRA_STATE = tuple(LAYER + s + "._extra_state" for s in (
    "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"))
# HF tensors that carry no weights and are safe to drop.
IGNORED_HF = ("rotary_emb.inv_freq",)


def table_for(arch: ModelArch, table: Sequence[Rule] | None = None) -> list[Rule]:
    rules = REGISTRY.get(arch.family) if table is None else table
    if rules is None:
        raise bad("architectures", arch.architecture, "no conversion table for this family",
                  f"add a table to adapter/convert/mapping.py REGISTRY (have: {', '.join(sorted(REGISTRY))})")
    return [r for r in rules if r.applies(arch)]


def hf_shape(spec: str, arch: ModelArch) -> tuple[int, ...]:
    sym = {"h": arch.hidden_size, "q": arch.num_heads * arch.head_dim, "kv": arch.num_kv_heads * arch.head_dim,
           "f": arch.ffn_hidden_size, "v": arch.vocab_size, "d": arch.head_dim}
    return tuple(sym[s] for s in spec.split())


def check_tp(arch: ModelArch, tp: int, key: str = "tp") -> None:
    """Refuse a TP size GPTModel cannot run, before anything is written."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise bad(key, tp, "must be a positive integer", "pass e.g. --tp 2")
    for name, n in (("num_attention_heads", arch.num_heads), ("intermediate_size", arch.ffn_hidden_size)):
        if n % tp:
            raise bad(key, tp, f"does not divide {name}={n}", f"use a tp that divides {n}")
    g = arch.num_kv_heads
    if g % tp and tp % g:
        raise bad(key, tp, f"neither divides nor is a multiple of num_key_value_heads={g}",
                  "use a tp that divides the KV heads or is a multiple of them")
