"""Typed HF <-> Megatron-Core weight rules: what one Megatron distributed-checkpoint key is built from, and how.

A family's table (adapter/models/families.py) is a tuple of these; adapter/convert/ executes them (streamed, any
TP) and tests them through the inverse. Megatron keys are the sharded keys
GPTModel.sharded_state_dict() uses (TE-style norm names, layers stacked on a leading axis), so the global tensor of
each key is independent of TP: TP only decides how the key is chunked on disk and the vocab padding.

Every rule here only permutes, concatenates or zero-pads whole rows (`rowwise`), which is what lets the converter
plan each output chunk as a few positioned reads (adapter/convert/rows.py) and check it through the inverse.
Declarative on import (torch is imported inside the transforms): `plan` reads the family records without torch.

The rules that build a layer's 2-D weights (`Rule.linear`) are also the one description of the layer's linears: each
of their HF tensors is one HF linear (its name, shape and bias), held by the rule's Megatron module, split by its
`tp_axis`, packed as the rule's type says (`layout`: where its rows sit in Megatron's fused output; `packed`: one HF
tensor holding all of it), once per expert when its name carries {e}, and an `nn.Linear` in transformers or not
(`nn_linear`). adapter/models/counts.py sizes them (`counts.linears`); LoRA's targets and placement, the quantised
base and plan's counts all read that.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

if TYPE_CHECKING:
    import torch

Arch = Any  # an adapter.models.arch.ModelArch; not imported, since arch.py reads the families built from these
# which stacked piece of a key: a layer, (layer, expert), None unstacked
Unit: TypeAlias = "int | tuple[int, int] | None"


def lead(unit) -> tuple[int, ...]:
    """A unit's index on the key's stacked axes."""
    return () if unit is None else unit if isinstance(unit, tuple) else (unit,)

LAYER = "decoder.layers."  # Megatron keys under this prefix are stacked: global shape (num_layers, *per_layer)
LOCAL_EXPERT = "mlp.experts.local_experts."  # SequentialMLP's expert i of a rank: global expert ep_rank·local + i


def global_expert_name(name: str, ep_rank: int, local: int) -> str:
    """A rank's parameter name with its local expert index made global (the name every layout agrees on); other
    names unchanged."""
    head, sep, tail = name.partition(LOCAL_EXPERT)
    if not sep:
        return name
    i, dot, rest = tail.partition(".")
    return f"{head}{sep}{ep_rank * local + int(i)}{dot}{rest}"


# A mixture-of-experts layer's expert linears: stacked on (num_layers, num_experts), as Megatron-Core's SequentialMLP
# names them in its sharded state dict (its local_experts.{e} renamed onto one expert axis)
EXPERTS = LAYER + "mlp.experts.experts."
# Linear layers whose (empty for the local spec) `_extra_state` GPTModel checkpoints as one ShardedObject per layer.
EXTRA_STATE = tuple(LAYER + s + "._extra_state" for s in (
    "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"))
# HF tensors that carry no weights and are safe to drop.
IGNORED_HF = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Ctx:
    """What a transform may depend on besides the tensors."""
    arch: Arch
    padded_vocab: int
    tp: int = 1


@dataclass(frozen=True)
class Rule:
    """One Megatron key from HF tensors. Subclasses say how (`to_megatron`) and back (`to_hf`)."""
    megatron: str                      # sharded key in the torch_dist checkpoint
    hf: tuple[tuple[str, str], ...]    # (HF name with {i} for the layer, {e} the expert; shape in symbols h q kv f v d)
    tp_axis: int | None = None         # axis TP splits (0 column-parallel / vocab, 1 row-parallel), None replicated
    when: Callable[[Arch], bool] | None = None  # the rule exists only for architectures where this holds
    # a linear's weight: transformers holds it in an nn.Linear module, which PEFT's target_modules and bitsandbytes'
    # 4/8-bit loading reach; False: a parameter of a module of transformers' own (a mixture of experts' router, its
    # experts as 3-D tensors), neither adapted nor quantised (checked on transformers 5.25: Mixtral, Qwen3-MoE, OLMoE)
    nn_linear: bool = True
    parts: ClassVar[int] = 1           # independently TP-split blocks along tp_axis ([gate; up] has 2)
    rowwise: ClassVar[bool] = True     # transforms move whole rows only (row plans rely on it)
    # one HF tensor holding all of the Megatron linear's blocks (Phi-3's qkv_proj, gate_up_proj): one HF linear, and
    # `holds` the HF linears a Llama-shaped family keeps apart in its place (the names PEFT then matches nowhere)
    packed: ClassVar[bool] = False
    holds: ClassVar[tuple[str, ...]] = ()

    @property
    def per_layer(self) -> bool:
        return self.megatron.startswith(LAYER)

    @property
    def linear(self) -> bool:
        """The weight of one or more of a layer's linears: a per-layer key built from 2-D HF tensors (a layer's
        matrices are its linears' weights; its norms and biases are vectors)."""
        return self.per_layer and all(len(shape.split()) == 2 for _, shape in self.hf)

    @property
    def module(self) -> str:
        """The Megatron module of a per-layer key, under the layer: self_attention.linear_qkv, mlp.router (an
        expert's on the experts' axis: mlp.experts.experts.linear_fc1)."""
        return self.megatron[len(LAYER):].rpartition(".")[0]

    def layout(self, arch: Arch, tp: int) -> tuple[int, int, tuple[tuple[str, int, int], ...]]:
        """Where each HF tensor's rows sit in one TP rank's rows of the Megatron tensor, viewed as [groups, width]:
        (groups, width, ((HF linear, start, size), ...)), the HF tensor filling [start, start + size) of every group.
        One HF tensor (a copy, a packed tensor kept in Megatron's row order): all of the rank's rows."""
        rows = hf_shape(self.hf[0][1], arch)[0] // (tp if self.tp_axis == 0 else 1)
        return 1, rows, ((linear_name(self.hf[0][0]), 0, rows),)

    @property
    def per_expert(self) -> bool:
        """One tensor per expert of each layer (HF names carry {e}): Megatron stacks them on (layers, experts)."""
        return any("{e}" in n for n, _ in self.hf)

    def applies(self, arch: Arch) -> bool:
        return self.when is None or bool(self.when(arch))

    def stack(self, arch: Arch) -> tuple[int, ...]:
        """The leading axes of the Megatron key's global shape: (), (layers,) or (layers, experts)."""
        if not self.per_layer:
            return ()
        return (arch.num_layers, arch.num_experts) if self.per_expert else (arch.num_layers,)

    def units(self, arch: Arch) -> list[Unit]:
        """Every stacked piece of the key: None (not stacked), a layer, or a (layer, expert) pair."""
        if not self.per_layer:
            return [None]
        if self.per_expert:
            return [(i, e) for i in range(arch.num_layers) for e in range(arch.num_experts)]
        return list(range(arch.num_layers))

    def hf_names(self, unit: Unit) -> list[str]:
        i, e = unit if isinstance(unit, tuple) else (unit, None)
        return [n.format(i=i, e=e) for n, _ in self.hf]

    def renamed(self, old: str, new: str) -> Rule:
        """The same rule reading HF names that start with `new` where these start with `old` (a model nested in
        another: Gemma 3's language model inside its image-text checkpoint)."""
        import dataclasses

        hf = tuple((new + n[len(old):] if n.startswith(old) else n, shape) for n, shape in self.hf)
        return dataclasses.replace(self, hf=hf)

    def to_megatron(self, ts: Sequence[torch.Tensor], c: Ctx) -> torch.Tensor:
        raise NotImplementedError

    def to_hf(self, t: torch.Tensor, c: Ctx) -> list[torch.Tensor]:
        raise NotImplementedError


class Copy(Rule):
    """The tensor as it is (norms, o_proj and down_proj with tp_axis=1)."""

    def to_megatron(self, ts, c):
        return ts[0]

    def to_hf(self, t, c):
        return [t]


class Vocab(Rule):
    """Embedding or output rows, zero-padded to the padded vocab (GPTModel does not pad; Megatron-LM converters do)."""

    def to_megatron(self, ts, c):
        import torch  # models/ is torch-free at import: plan reads the tables

        (t,) = ts
        extra = c.padded_vocab - t.shape[0]
        return t if extra == 0 else torch.cat([t, t.new_zeros(extra, *t.shape[1:])])

    def to_hf(self, t, c):
        return [t[: c.arch.vocab_size].contiguous()]


class FusedQKV(Rule):
    """q, k, v into Megatron's linear_qkv: per query group, [its q heads; k; v] contiguous, so a plain TP chunk of
    the rows gives whole groups (and nkv < tp is all-gathered by Megatron in forward)."""

    def to_megatron(self, ts, c):
        import torch  # models/ is torch-free at import: plan reads the tables

        q, k, v = ts
        ng, d, rest = c.arch.num_kv_heads, c.arch.head_dim, q.shape[1:]
        hpg = c.arch.num_heads // ng
        return torch.cat([q.reshape(ng, hpg * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], 1
                         ).reshape(-1, *rest)

    def to_hf(self, t, c):
        ng, d, rest = c.arch.num_kv_heads, c.arch.head_dim, t.shape[1:]
        hpg = c.arch.num_heads // ng
        q, k, v = t.reshape(ng, (hpg + 2) * d, *rest).split([hpg * d, d, d], 1)
        return [x.reshape(-1, *rest).contiguous() for x in (q, k, v)]

    def layout(self, arch, tp):
        """Per query group of this rank: its q heads, then k, then v."""
        d, hpg = arch.head_dim, arch.num_heads // arch.num_kv_heads
        names = [linear_name(n) for n, _ in self.hf]
        return arch.num_kv_heads // tp, (hpg + 2) * d, ((names[0], 0, hpg * d), (names[1], hpg * d, d),
                                                        (names[2], (hpg + 1) * d, d))


class GatedMLP(Rule):
    """gate and up into linear_fc1 = [gate; up]. Split independently under TP (rank r holds [gate_r; up_r]);
    a naive chunk of [gate; up] is wrong (tests/distributed/test_convert_parity.py keeps that negative control)."""
    parts: ClassVar[int] = 2

    def to_megatron(self, ts, c):
        import torch  # models/ is torch-free at import: plan reads the tables

        return torch.cat(list(ts))

    def to_hf(self, t, c):
        return [x.contiguous() for x in t.chunk(2)]

    def layout(self, arch, tp):
        """This rank's block of each HF tensor in turn: [gate_r; up_r]."""
        size = hf_shape(self.hf[0][1], arch)[0] // tp
        return 1, len(self.hf) * size, tuple((linear_name(n), j * size, size) for j, (n, _) in enumerate(self.hf))


class PackedQKV(FusedQKV):
    """One HF tensor holding [q; k; v] (Phi-3's qkv_proj) into Megatron's per-group linear_qkv, and back."""
    packed: ClassVar[bool] = True
    holds: ClassVar[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj")
    layout = Rule.layout  # one HF linear: a packed adapter's B is kept in Megatron's row order

    def to_megatron(self, ts, c):
        (t,) = ts
        q, kv = c.arch.num_heads * c.arch.head_dim, c.arch.num_kv_heads * c.arch.head_dim
        return super().to_megatron(list(t.split([q, kv, kv])), c)

    def to_hf(self, t, c):
        import torch  # models/ is torch-free at import: plan reads the tables

        return [torch.cat(super().to_hf(t, c))]


class PackedGateUp(Rule):
    """One HF tensor holding [gate; up] (Phi-3's gate_up_proj): Megatron's linear_fc1 as it is, split under TP as
    two blocks (rank r holds [gate_r; up_r])."""
    parts: ClassVar[int] = 2
    packed: ClassVar[bool] = True
    holds: ClassVar[tuple[str, ...]] = ("gate_proj", "up_proj")

    def to_megatron(self, ts, c):
        return ts[0]

    def to_hf(self, t, c):
        return [t]


# -- TP pieces of a Megatron tensor ------------------------------------------------------------------------------

def merge_blocks(pieces: Sequence[torch.Tensor], axis: int | None, parts: int = 1) -> torch.Tensor:
    """The whole tensor from its TP pieces (rank order), where each rank holds its block of each of `parts` blocks
    along `axis` (rank r of [gate; up] holds [gate_r; up_r]); axis None: replicated, the first piece."""
    import torch  # models/ is torch-free at import: plan reads the tables

    if axis is None or len(pieces) == 1:
        return pieces[0]
    blocks = [p.chunk(parts, axis) for p in pieces]
    return torch.cat([torch.cat([b[i] for b in blocks], axis) for i in range(parts)], axis)


def cut_blocks(whole: torch.Tensor, axis: int | None, parts: int, tp: int, rank: int) -> torch.Tensor:
    """TP rank `rank`'s piece of the whole tensor (`merge_blocks`' inverse)."""
    import torch  # models/ is torch-free at import: plan reads the tables

    if axis is None or tp == 1:
        return whole
    return torch.cat([b.chunk(tp, axis)[rank] for b in whole.chunk(parts, axis)], axis)


# -- constructors: what a family table is written with ----------------------------------------------------------

def copy(megatron: str, hf: str, shape: str, *, tp_axis: int | None = None, when=None, nn_linear: bool = True
         ) -> Copy:
    return Copy(megatron, ((hf, shape),), tp_axis, when, nn_linear)


def vocab(megatron: str, hf: str, *, when=None) -> Vocab:
    return Vocab(megatron, ((hf, "v h"),), 0, when)


def fused_qkv(megatron: str, q: str, k: str, v: str, *, bias: bool = False, when=None) -> FusedQKV:
    shapes = ("q", "kv", "kv") if bias else ("q h", "kv h", "kv h")
    return FusedQKV(megatron, tuple(zip((q, k, v), shapes)), 0, when)


def gated_mlp(megatron: str, gate: str, up: str, *, ffn: str = "f", nn_linear: bool = True) -> GatedMLP:
    return GatedMLP(megatron, ((gate, f"{ffn} h"), (up, f"{ffn} h")), 0, None, nn_linear)


def packed_qkv(megatron: str, qkv: str) -> PackedQKV:
    return PackedQKV(megatron, ((qkv, "qkv h"),), 0)


def packed_gate_up(megatron: str, gate_up: str) -> PackedGateUp:
    return PackedGateUp(megatron, ((gate_up, "ff h"),), 0)


def linear_name(hf: str) -> str:
    """The HF linear an HF tensor belongs to: model.layers.{i}.self_attn.q_proj.weight -> q_proj."""
    return hf.rpartition(".")[0].rpartition(".")[2]


def untied(arch: Arch) -> bool:
    """The output layer is its own tensor (not the embedding's)."""
    return not arch.tie_embeddings


def has_qkv_bias(arch: Arch) -> bool:
    return arch.qkv_bias


def hf_shape(spec: str, arch: Arch) -> tuple[int, ...]:
    sym = {"h": arch.hidden_size, "q": arch.num_heads * arch.head_dim, "kv": arch.num_kv_heads * arch.head_dim,
           "f": arch.ffn_hidden_size, "v": arch.vocab_size, "d": arch.head_dim,
           "qkv": (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim, "ff": 2 * arch.ffn_hidden_size,
           "E": arch.num_experts, "g": arch.expert_ffn_hidden_size, "gg": 2 * (arch.expert_ffn_hidden_size or 0)}
    return tuple(sym[s] for s in spec.split())


__all__ = ["LAYER", "EXPERTS", "lead", "EXTRA_STATE", "IGNORED_HF", "Ctx", "Rule", "Copy", "Vocab", "FusedQKV",
           "GatedMLP", "PackedQKV",
           "PackedGateUp", "copy", "vocab", "fused_qkv", "gated_mlp", "packed_qkv", "packed_gate_up", "untied",
           "has_qkv_bias", "hf_shape", "merge_blocks", "cut_blocks", "linear_name"]
