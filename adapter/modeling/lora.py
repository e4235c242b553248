"""LoRA adapters on Megatron's fused, tensor-parallel linears (what adapter/models/lora.py's `LoraSpec` describes).

`add_adapters` freezes the base model and gives each targeted Megatron linear a `LoraAdapters` child; the linear's
class is swapped for a subclass whose forward adds the adapters' output, so every base weight keeps its name (the
converter's keys, DeepSpeed's checkpoints and the export do not change) and the adapters sit beside it as
`<linear>.lora.A.<hf name>` / `.B.<hf name>`.

The TP arithmetic, with r-wide tensors on the wire instead of hidden-wide ones:
- column-parallel linears (q, k, v, gate, up; outputs split): z = x Aᵀ on this rank's tokens, then Megatron's
  `copy_to_tensor_model_parallel_region` (backward: all-reduce of dz, so A's gradient is whole on every rank) or,
  under sequence parallelism, `gather_from_sequence_parallel_region` (all-gather of z; A's gradient is then a
  partial sum over the token shards, tagged `sequence_parallel` for the engine's TP sum); y = z Bᵀ with this rank's
  rows of B.
- row-parallel linears (o, down; inputs split): z = x A_localᵀ is a partial sum, reduced over TP (under sequence
  parallelism reduce-scattered to this rank's tokens, so B's gradient is tagged `sequence_parallel`); y = z Bᵀ.
Each HF linear has its own (A, B) (PEFT's model); their outputs are laid into the fused output by `Placement`.
With dropout 0 the A's of one fused linear run as one GEMM over their concatenation; with dropout, each adapter
draws its own mask as PEFT's separate modules do.
"""
from __future__ import annotations

import contextlib
import math
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from adapter.models.arch import ModelArch
from adapter.models.families import packed_rule
from adapter.models.lora import LoraSpec, Placement, Target, peft_key, placement, saved_key
from adapter.models.mapping import Ctx, cut_blocks, merge_blocks

# The random stream of each HF linear's A, numbered by name so that a seed keeps drawing the adapters it drew
# before. Not a description of any layer (counts.linears is): another family's names get streams of their own from
# their bytes, above these.
A_STREAMS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")


def init_a(target: Target, r: int, seed: int) -> torch.Tensor:
    """PEFT's A for the whole matrix, U(−1/√in, 1/√in) (Kaiming-uniform, a = √5), drawn from the run's seed, the
    layer and the linear alone, so every TP layout starts from the same adapters."""
    name, base = target.linear.name, seed * 1_000_003 + target.layer * 101
    stream = base + A_STREAMS.index(name) if name in A_STREAMS else base ^ (zlib.crc32(name.encode()) << 32)
    g = torch.Generator().manual_seed(stream % (2**63))
    bound = 1.0 / math.sqrt(target.linear.inp)
    return (torch.rand(r, target.linear.inp, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).float()


def shard(full: torch.Tensor, axis: int, tp: int, tp_rank: int) -> torch.Tensor:
    return full.chunk(tp, dim=axis)[tp_rank] if tp > 1 else full


class LoraAdapters(torch.nn.Module):
    """The adapters of one Megatron linear: one (A, B) per targeted HF linear, applied to the linear's input and
    added into its output."""

    def __init__(self, targets: list[Target], place: Placement, spec: LoraSpec, *, column: bool,
                 sequence_parallel: bool, tp: int, tp_rank: int, tp_group, seed: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.names = [t.linear.name for t in targets]
        self.place, self.column, self.sp, self.tp, self.tp_group = place, column, sequence_parallel, tp, tp_group
        self.scale, self.p = spec.scale, spec.dropout
        self.off = False  # `disabled`: the base alone (a DPO reference)
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for t in targets:
            a = shard(init_a(t, spec.r, seed), 0 if column else 1, tp if not column else 1, tp_rank)
            b = torch.zeros(t.b_shape(spec.r, tp))
            self.A[t.linear.name] = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
            self.B[t.linear.name] = torch.nn.Parameter(b.to(device=device, dtype=dtype))
            split, whole = (self.B, self.A) if column else (self.A, self.B)
            set_tensor_model_parallel_attributes(split[t.linear.name], tp > 1, 0 if column else 1, 1)
            if sequence_parallel and tp > 1:  # a partial sum over this rank's tokens: summed over TP by the engine
                whole[t.linear.name].sequence_parallel = True

    def _z(self, x: torch.Tensor) -> torch.Tensor:
        """x Aᵀ for every adapter, concatenated along the last dim (the r-wide tensor TP moves)."""
        if self.p > 0 and self.training:  # one mask per adapter, as PEFT's modules draw them
            return torch.cat([F.linear(F.dropout(x, self.p, True), self.A[n]) for n in self.names], -1)
        a = self.A[self.names[0]] if len(self.names) == 1 else torch.cat([self.A[n] for n in self.names])
        return F.linear(x, a)

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        z = self._z(x) * self.scale
        if self.tp > 1:
            if self.column:
                z = (gather_from_sequence_parallel_region(z, True, group=self.tp_group) if self.sp
                     else copy_to_tensor_model_parallel_region(z, group=self.tp_group))
            else:
                z = (reduce_scatter_to_sequence_parallel_region(z, group=self.tp_group) if self.sp
                     else reduce_from_tensor_model_parallel_region(z, group=self.tp_group))
        width = out.shape[-1]
        return torch.addmm(out.reshape(-1, width), z.reshape(-1, z.shape[-1]), self._fused_b().t()).view_as(out)

    def _fused_b(self) -> torch.Tensor:
        """Every adapter's B in one [local outputs, adapters × r] matrix in the fused linear's row order, zero
        outside each adapter's block: z·Bᵀ then lands in place and adds into the base output inside one GEMM
        (addmm), with no output-sized intermediate. The zero blocks cost a (adapters − 1)·r-wide sliver of FLOPs."""
        place, names = self.place, self.names
        if len(place.pieces) == 1:
            return self.B[names[0]]
        r, n, g = self.A[names[0]].shape[0], len(names), place.groups
        blocks = []
        for name, _, size in sorted(place.pieces, key=lambda p: p[1]):
            if name in self.B:
                j = names.index(name)
                blocks.append(F.pad(self.B[name].view(g, size, r), (j * r, (n - 1 - j) * r)))
            else:
                blocks.append(self.B[names[0]].new_zeros(g, size, n * r))
        return torch.cat(blocks, 1).view(g * place.width, n * r)


class _WithLora:
    """Mixed into a Megatron linear's class: its output plus its adapters' (`self.lora`). A post-normed linear
    (GLM-4's output linears, adapter/modeling/gpt.PostNormed) takes the adapters' output before its norm."""

    def forward(self, input_, *args, **kwargs):
        if hasattr(self, "post_norm"):  # its forward norms what linear_output (below) returns
            return super().forward(input_, *args, **kwargs)
        out, bias = super().forward(input_, *args, **kwargs)
        return (out if self.lora.off else self.lora(input_, out)), bias

    def linear_output(self, input_, *args, **kwargs):
        out, bias = super().linear_output(input_, *args, **kwargs)
        return (out if self.lora.off else self.lora(input_, out)), bias


_CLASSES: dict[type, type] = {}


def _with_lora(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Lora{cls.__name__}", (_WithLora, cls), {})
    return _CLASSES[cls]


def _untie(model) -> None:
    """Give the output layer its own copy of the tied embedding (PEFT's modules_to_save trains its own copy)."""
    emb = model.embedding.word_embeddings.weight
    w = torch.nn.Parameter(emb.detach().clone(), requires_grad=False)
    set_tensor_model_parallel_attributes(w, True, 0, 1)
    model.output_layer.weight = w
    model.share_embeddings_and_output_weights = False


def add_adapters(model, spec: LoraSpec, arch: ModelArch, *, seed: int, tp_rank: int, tp_group=None) -> None:
    """Freeze the built GPTModel and add `spec`'s adapters (and train its modules_to_save). Call after the base
    weights are loaded and before DeepSpeed sees the model."""
    for p in model.parameters():
        p.requires_grad_(False)
    c = model.config
    tp, sp = c.tensor_model_parallel_size, bool(c.sequence_parallel)
    for i, layer in enumerate(model.decoder.layers):
        for fused, targets in spec.layer_targets(i).items():
            linear = layer.get_submodule(targets[0].linear.module)
            w = linear._parameters.get("weight")  # None where the base is quantised (adapter/modeling/quant.py)
            linear.lora = LoraAdapters(targets, placement(arch, fused, tp), spec,
                                       column=targets[0].linear.tp_axis == 0, sequence_parallel=sp, tp=tp,
                                       tp_rank=tp_rank, tp_group=tp_group, seed=seed, dtype=c.params_dtype,
                                       device=w.device if w is not None else linear.qcodes.device)
            linear.__class__ = _with_lora(type(linear))
    if spec.modules_to_save and model.share_embeddings_and_output_weights:
        _untie(model)
    if "embed_tokens" in spec.modules_to_save:
        model.embedding.word_embeddings.weight.requires_grad_(True)
    else:  # a frozen embedding's output needs no gradient, so nothing would carry one into the layers' inputs
        model.embedding.register_forward_hook(_input_requires_grad)
    if "lm_head" in spec.modules_to_save:
        model.output_layer.weight.requires_grad_(True)


@contextlib.contextmanager
def disabled(model):
    """The base model alone inside: every adapter's contribution left out (PEFT's `disable_adapter()`), for a
    preference objective's reference forward (adapter/train/dpo.py)."""
    mods = [m for m in model.modules() if isinstance(m, LoraAdapters)]
    for m in mods:
        m.off = True
    try:
        yield
    finally:
        for m in mods:
            m.off = False


def _input_requires_grad(module, args, output):
    """The layers' input asks for a gradient, as transformers' `enable_input_require_grads` does for PEFT: without
    one, activation recompute (a reentrant autograd function) would give the adapters no gradient at all, and a
    layer's backward hook (ZeRO-3 releases the layer's parameters in it) would fire before its adapters' gradients
    exist. The cost is the first layer's input gradient."""
    if isinstance(output, torch.Tensor) and not output.requires_grad:
        output.requires_grad_(True)


def adapters(model) -> dict[tuple[int, str], tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """(layer, HF linear name) -> (A, B) on this rank, for every adapter of the model."""
    out = {}
    for i, layer in enumerate(model.decoder.layers):
        for mod in layer.modules():
            lora = getattr(mod, "lora", None)
            if isinstance(lora, LoraAdapters):
                for n in lora.names:
                    out[(i, n)] = (lora.A[n], lora.B[n])
    return out




def gather_list(t: torch.Tensor, tp_group) -> list[torch.Tensor]:
    """`t` of every rank of `tp_group`, in rank order (collective)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, t.contiguous(), group=tp_group)
    return parts


def gather(t: torch.Tensor, dim: int, tp_group) -> torch.Tensor:
    """`t` of every rank of `tp_group`, concatenated along `dim` (collective)."""
    return torch.cat(gather_list(t, tp_group), dim)


def full_state(model, spec: LoraSpec, arch: ModelArch, tp_group=None) -> dict[str, torch.Tensor]:
    """PEFT-keyed whole tensors of what the run trains (adapters, modules_to_save), gathered over TP; collective
    over the TP group. Under ZeRO-3, call inside deepspeed.zero.GatheredParameters of these parameters."""
    tp = model.config.tensor_model_parallel_size
    out = {}
    ads = adapters(model)
    for t in spec.targets:
        a, b = (p.detach() for p in ads[(t.layer, t.linear.name)])
        packed = packed_rule(arch, t.linear.name)
        if tp > 1:
            if packed is not None:  # Megatron's order: rank r holds [block_r of each part]
                b = merge_blocks(gather_list(b, tp_group), 0, packed.parts)
            else:
                a, b = (a, gather(b, 0, tp_group)) if t.linear.tp_axis == 0 else (gather(a, 1, tp_group), b)
        if packed is not None:  # back to the HF tensor's row order, as PEFT keeps B
            b = packed.to_hf(b, Ctx(arch, 0))[0]
        out[peft_key(t, "A")], out[peft_key(t, "B")] = a.cpu(), b.cpu()
    for name, w in _saved_weights(model, spec).items():
        w = w.detach()
        out[saved_key(arch, name)] = (gather(w, 0, tp_group) if tp > 1 else w)[:arch.vocab_size].cpu()
    return out


def _saved_weights(model, spec: LoraSpec) -> dict[str, torch.nn.Parameter]:
    return {n: (model.embedding.word_embeddings.weight if n == "embed_tokens" else model.output_layer.weight)
            for n in spec.modules_to_save}


@torch.no_grad()
def load_state(model, spec: LoraSpec, arch: ModelArch, tensors: dict[str, torch.Tensor], tp_rank: int) -> None:
    """Whole PEFT-keyed tensors (checked by adapter.convert.peft.check_adapter) into this rank's shards."""
    tp = model.config.tensor_model_parallel_size
    ads = adapters(model)
    for t in spec.targets:
        a, b = ads[(t.layer, t.linear.name)]
        col = t.linear.tp_axis == 0
        a.copy_(shard(tensors[peft_key(t, "A")], 1, 1 if col else tp, tp_rank))
        packed = packed_rule(arch, t.linear.name)
        if packed is not None:  # HF row order -> Megatron's, then this rank's block of each part
            whole = packed.to_megatron([tensors[peft_key(t, "B")]], Ctx(arch, 0))
            b.copy_(cut_blocks(whole, 0, packed.parts, tp, tp_rank))
            continue
        b.copy_(shard(tensors[peft_key(t, "B")], 0, tp if col else 1, tp_rank))
    for name, w in _saved_weights(model, spec).items():
        full = tensors[saved_key(arch, name)]
        padded = full.new_zeros(w.shape[0] * tp, full.shape[1])
        padded[: full.shape[0]] = full
        w.copy_(shard(padded, 0, tp, tp_rank))


__all__ = ["LoraAdapters", "add_adapters", "disabled", "gather", "adapters", "init_a", "shard", "full_state",
           "load_state", "A_STREAMS"]
