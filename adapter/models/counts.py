"""A model's linears, parameter counts and FLOPs, from its `ModelArch` alone (torch-free).

The one home of this arithmetic: plan's memory, traffic and step-time models, the layout search, the training log's
MFU and the benches all read it, so they cannot drift apart. Everything derives from `linears` (one row per HF
linear of a layer, with the Megatron linear it is fused into and the axis tensor parallelism splits), which reads
them off the family's weight table (adapter/models/mapping.py, `Rule.linear`), so it holds for any head_dim
(Qwen3-4B: 32 heads × 128 = 4096 ≠ hidden 2560) and for any family's names and packing.

MFU's model FLOPs, the convention every number in this project is computed with (bench, peer anchors):

    N               = L · Σ(linear weights of a layer) + H·V       (matmul weights; the LM head, tied or not)

(a mixture of experts counts the weights a token passes through: its router and top-k experts, not all of them)
    flops_per_token = 6·N + 12·L·(heads·head_dim)·S                (fwd+bwd matmuls, attention scores and values)

(S is min(S, window) for a sliding-window layer.)

Norms, biases and the input embedding (a lookup) are left out; activation recomputation is not counted (it is
"model" FLOPs, not hardware FLOPs), and the attention term counts the full S×S, as PaLM's and Megatron's do.

What the attention kernels compute is another count (`attention_flops`, for plan's step time and its attention cost,
and `nd-adapter calibrate`'s fit): the query-key pairs a causal kernel visits, half of each document's ℓ² (ℓ·w − w²/2
under a sliding window w < ℓ), 4 FLOPs per pair and head dimension forward, and ATTN_FWD_BWD times that forward and
backward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from adapter.models.arch import ModelArch, padded_vocab_size
from adapter.models.families import table_for
from adapter.models.mapping import hf_shape, linear_name


@dataclass(frozen=True)
class Linear:
    """One HF linear of a transformer layer, as its family's weight table describes it, sized for an architecture."""
    name: str     # HF module name (q_proj, ..., down_proj; Phi-3's qkv_proj; Mixtral's experts w1, w3, w2)
    out: int      # output features
    inp: int      # input features
    # the Megatron module holding it, under the layer: self_attention.linear_qkv, self_attention.linear_proj,
    # mlp.linear_fc1, mlp.linear_fc2, mlp.router (an expert's as its checkpoint key names it,
    # mlp.experts.experts.linear_fc1)
    module: str
    # what tensor parallelism splits: 0 the outputs (column-parallel), 1 the inputs (row-parallel), None nothing
    # (the MoE router, replicated)
    tp_axis: int | None
    bias: bool = False
    copies: int = 1  # this linear exists once per expert (a mixture of experts' expert MLPs) or once
    active: int = 1  # of those copies, how many each token passes through (top-k)
    hf_module: str = ""  # the HF module, {i} the layer ({e} the expert): model.layers.{i}.self_attn.q_proj
    nn_linear: bool = True  # an nn.Linear in transformers: what PEFT targets and bitsandbytes quantises

    @property
    def fused(self) -> str:
        """The Megatron linear holding it (linear_qkv, linear_proj, linear_fc1, linear_fc2, router)."""
        return self.module.rpartition(".")[2]

    @property
    def weights(self) -> int:
        """One copy's weights."""
        return self.out * self.inp

    @property
    def params(self) -> int:
        """All copies' weights and biases."""
        return self.copies * (self.weights + (self.out if self.bias else 0))

    def local(self, tp: int, ep: int = 1) -> int:
        """Weights and biases one rank holds: split by tp where the linear is, its expert copies split by ep."""
        return self.params // (tp if self.tp_axis is not None else 1) // (ep if self.copies > 1 else 1)


def linears(arch: ModelArch) -> tuple[Linear, ...]:
    """The linears of one layer, in HF order: every HF tensor of the family's linear rules (`Rule.linear`) that
    apply to this architecture, with its rule's Megatron module and TP axis, a bias where the table has an HF bias
    for its module, and its expert copies. A family that packs q, k, v (or gate, up) into one HF tensor (Phi-3's
    qkv_proj, gate_up_proj) has one linear there."""
    rules = table_for(arch)
    biased = {name.rpartition(".")[0] for r in rules if r.per_layer for name, _ in r.hf if name.endswith(".bias")}
    out = []
    for rule in rules:
        if not rule.linear:
            continue
        copies, active = (arch.num_experts or 1, arch.experts_per_token or 1) if rule.per_expert else (1, 1)
        for name, shape in rule.hf:
            module = name.rpartition(".")[0]
            rows, cols = hf_shape(shape, arch)
            out.append(Linear(linear_name(name), rows, cols, rule.module, rule.tp_axis, module in biased, copies,
                              active, hf_module=module, nn_linear=rule.nn_linear))
    return tuple(out)


def fused_linears(arch: ModelArch) -> list[tuple[str, int, int, int | None]]:
    """Megatron's linears of one layer, (name, out, in, tp_axis), in forward order: the HF linears that read the
    same input share one GEMM (an expert's: one per expert)."""
    out: dict[str, list] = {}
    for lin in linears(arch):
        o = out.setdefault(lin.fused, [0, lin.inp, lin.tp_axis])
        o[0] += lin.out
    return [(name, o, i, ax) for name, (o, i, ax) in out.items()]


def _copies(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """Megatron linear -> (copies per layer, copies each token passes through)."""
    return {lin.fused: (lin.copies, lin.active) for lin in linears(arch)}


def _bias(rule) -> bool:
    return all(name.endswith(".bias") for name, _ in rule.hf)


def layer_norm_params(arch: ModelArch) -> int:
    """Norm weights of one layer (replicated across tp), the family's table's per-layer vectors that are no linear's
    bias: the two RMSNorms (four with post-norms) and, with qk-norm, one per q and k head dimension (over the whole
    q and k projections: OLMoE)."""
    return sum(math.prod(hf_shape(shape, arch)) for r in table_for(arch) if r.per_layer and not r.linear
               and not _bias(r) for _, shape in r.hf)


def layer_params(arch: ModelArch) -> int:
    return sum(lin.params for lin in linears(arch)) + layer_norm_params(arch)


def num_params(arch: ModelArch) -> int:
    """Exact parameter count of the HF model (norms and biases included); the transformers engine's is the
    meta-device model's (adapter/models/generic.py)."""
    if arch.param_count is not None:
        return arch.param_count
    emb = arch.vocab_size * arch.hidden_size
    return arch.num_layers * layer_params(arch) + emb * (1 if arch.tie_embeddings else 2) + arch.hidden_size


@dataclass(frozen=True)
class LocalParams:
    """Parameters one tp rank holds (before ZeRO sharding)."""
    layer: int          # one transformer layer
    embedding: int      # input embedding (vocab-parallel, padded)
    output: int         # output layer (0 when tied to the embedding)
    final_norm: int

    def total(self, layers: int) -> int:
        return layers * self.layer + self.embedding + self.output + self.final_norm


def local_params(arch: ModelArch, tp: int, vocab_divisible_by: int = 128, ep: int = 1) -> LocalParams:
    """`ep`: a mixture of experts' experts split over that many expert-parallel ranks."""
    vp = padded_vocab_size(arch.vocab_size, tp, vocab_divisible_by)
    emb = vp * arch.hidden_size // tp
    if arch.param_count is not None:  # the transformers engine: its exact total, spread evenly over the layers
        vocab = arch.vocab_size * arch.hidden_size
        vtp = tp if tp > 1 and arch.vocab_size % tp == 0 else 1  # the plan splits the vocabulary where tp divides it
        # the score head (a reward model's one bias-free label; a token classifier's classes, each with a bias), or
        # the LM head
        out = ((arch.hidden_size + (arch.score_labels > 1)) * arch.score_labels if arch.score_head else
               0 if arch.tie_embeddings else vocab)
        outer = vocab + out + arch.hidden_size
        split = next((s[1] for s in arch.tp_shares if s[0] == tp), 0)  # what its TP plan splits (generic.py)
        body = max(0, split - (outer - arch.hidden_size if vtp > 1 else 0))
        experts = arch.ep_params if ep > 1 else 0  # what its EP plan splits (the experts are not TP-split beside it)
        per_layer = (max(0, arch.param_count - outer - body - experts) + body // tp + experts // ep) \
            // max(1, arch.num_layers)
        return LocalParams(layer=per_layer, embedding=vocab // vtp, output=out if arch.score_head else out // vtp,
                           final_norm=arch.hidden_size)
    return LocalParams(layer=sum(lin.local(tp, ep) for lin in linears(arch)) + layer_norm_params(arch),
                       embedding=emb, output=0 if arch.tie_embeddings else emb, final_norm=arch.hidden_size)


def expert_params(arch: ModelArch, tp: int, ep: int = 1) -> int:
    """The experts' weights one rank holds over all layers (split by tp and ep); 0 for a dense model. The
    transformers engine's: what its EP plan splits (generic.py), by ep alone (tp beside ep is refused there)."""
    if arch.param_count is not None:
        return arch.ep_params // ep
    return arch.num_layers * sum(lin.local(tp, ep) for lin in linears(arch) if lin.copies > 1)


def param_tensors(arch: ModelArch, ep: int = 1, grouped_grads: bool = False) -> tuple[int, int]:
    """(per layer, total): the parameter tensors of Megatron's model on one rank, which DeepSpeed's hooks, the
    optimizer and ZeRO-3's module gathers walk (`ep`: a rank holds num_experts / ep experts). `grouped_grads`: the
    experts' weight gradients arrive as one tensor per expert linear (grouped experts under the flat AdamW), so
    autograd walks one tensor per linear, not one per expert."""
    experts = 1 if grouped_grads else (arch.num_experts or 1) // ep
    per_layer = sum(experts if r.per_expert else 1 for r in table_for(arch) if r.per_layer)  # one tensor per key
    return per_layer, arch.num_layers * per_layer + 2 + (0 if arch.tie_embeddings else 1)


def layer_gemms(arch: ModelArch, tokens: int, tp: int) -> list[tuple[int, int, int]]:
    """The forward GEMMs of one layer on one tp rank, (m, n, k), in Megatron's fused linears: qkv, proj, fc1
    (gate+up), fc2 (a mixture of experts: the router, and each expert linear as one GEMM over the tokens·top-k rows
    its experts receive together)."""
    copies = _copies(arch)
    out = []
    for name, o, i, ax in fused_linears(arch):
        m = tokens * copies[name][1]
        out.append((m, o // tp, i) if ax == 0 else (m, o, i // tp) if ax == 1 else (m, o, i))
    return out


def matmul_params(arch: ModelArch) -> int:
    """N of the MFU formula: the linear weights a token passes through in every layer, and the LM head."""
    return arch.num_layers * sum(lin.weights * lin.active for lin in linears(arch)) + arch.hidden_size * arch.vocab_size


def attended(arch: ModelArch, seq_len: int) -> int:
    """Σ over layers of the keys each layer's attention spans, at most seq_len: a sliding-window layer (Gemma's
    local ones, Mistral v0.1) spans its window, the others the whole sequence."""
    return sum(min(seq_len, arch.window(i) or seq_len) for i in range(arch.num_layers))


def flops_per_token(arch: ModelArch, seq_len: int) -> int:
    """MFU's model FLOPs per token (module docstring); a windowed layer's attention term counts its window."""
    return 6 * matmul_params(arch) + 12 * arch.num_heads * arch.head_dim * attended(arch, seq_len)


ATTN_FWD_BWD = 3.5  # flash attention's backward (five matmuls, the scores recomputed) is 2.5× its forward's two


def attention_pairs(seq_len: int, doc_len: int | None = None, window: int | None = None) -> float:
    """Query-key pairs causal attention visits in one sequence of `seq_len` tokens: seq_len/ℓ documents of ℓ =
    `doc_len` tokens (packed, attending only inside each; default one document per sequence), half of ℓ² each, or
    ℓ·w − w²/2 under a sliding `window` w < ℓ."""
    ell = min(doc_len or seq_len, seq_len)
    return seq_len / ell * (ell * ell / 2 if window is None or window >= ell else ell * window - window * window / 2)


def attention_flops(arch: ModelArch, *, seq_len: int, sequences: int, doc_len: int | None = None,
                    heads: int | None = None, windows: list[int | None] | None = None) -> float:
    """The core attention's matmul FLOPs, forward + backward, for `sequences` sequences of `seq_len` tokens
    (module docstring): over every layer, each with its own window, or over layers with the given `windows` (one
    entry per layer, None for full causal attention); `heads` query heads (default all of them; one TP rank's:
    num_heads // tp)."""
    windows = [arch.window(i) for i in range(arch.num_layers)] if windows is None else windows
    pairs = sum(attention_pairs(seq_len, doc_len, w) for w in windows)
    return ATTN_FWD_BWD * (4 * pairs * (arch.num_heads if heads is None else heads) * arch.head_dim * sequences)


LINEAR_CE_CHUNK_BYTES = 1 << 29  # fp32 bytes of one chunk's logits in the fused linear cross-entropy
LINEAR_CE_MIN_CHUNK = 256        # tokens: below this a chunk's GEMMs get inefficient


def linear_ce_chunk(vocab_rows: int) -> int:
    """Tokens per chunk of nd-adapter's fused linear cross-entropy (adapter/kernels/fusions.py) over a vocabulary
    slice of `vocab_rows` (padded vocabulary / tp): one chunk's logits about LINEAR_CE_CHUNK_BYTES in fp32 (1,024
    tokens of a 128k vocabulary, 512 of Gemma 3's 262k), a multiple of 128 tokens. One H200, 1B shape, output layer
    + CE over 8,192 tokens: 1,024-token chunks cost +2.4 ms against the unfused loss and hold 1.25 GiB where its
    logits and their gradient hold 3.9 (docs/BENCHMARKS.md). The kernel, the run's first lines and `plan` read it."""
    tokens = LINEAR_CE_CHUNK_BYTES // (4 * max(1, vocab_rows))
    return max(LINEAR_CE_MIN_CHUNK, 128 * round(tokens / 128))  # GEMM-friendly: a multiple of 128 tokens


def vision_patches(vision: tuple[int, ...], image_size: int | tuple | list | None) -> int:
    """Patches the vision tower sees per image: (size / patch)², at the run's `image_size` (Axolotl's letterbox;
    a pair: width × height) or the checkpoint's; 0 where neither says."""
    size = image_size or vision[3]
    w, h = (size[0], size[1]) if isinstance(size, (list, tuple)) else (size, size)
    return (w // vision[4]) * (h // vision[4])


def vision_gemms(vision: tuple[int, ...], patches: int) -> list[tuple[int, int, int]]:
    """One vision layer's forward linears over `patches` rows (a ViT block: q, k, v and the output projection, the
    MLP's linears: fc1 and fc2, or gate, up and down). Its attention is `vision_attention_flops`."""
    _, h, f, _, _, ffn_in = vision
    return [(patches, h, h)] * 4 + [(patches, f, h)] * ffn_in + [(patches, h, f)]


def vision_attention_flops(vision: tuple[int, ...], patches: int) -> float:
    """One vision layer's bidirectional attention over one image's `patches`, forward + backward, counted as the
    flash-attention rate counts it (plan/hardware.Attention: ATTN_FWD_BWD × the forward's 4·s²·hidden; no causal
    half). One H100, gemma-3-4b-it's tower (4,096 patches, 16 heads of 72): 173 ms of cuDNN attention a step of 8
    images, where this count at the profile's rate for a 4,096 span says 168 (docs/BENCHMARKS.md, 2026-12-07);
    counted as two GEMMs at the GEMM rate it said 72."""
    return ATTN_FWD_BWD * 4 * patches * patches * vision[1]


# Bytes an eager vision layer's memory-bound kernels move per patch, forward (in units of the layer's 16-bit
# elements): LayerNorm 2 + 2 (read, write), the attention output's copy back from heads 2, two residual adds 3 + 3
# = 12 a hidden element; the MLP's activation 2 (read fc1's output, write) and a gated MLP's product 3 more an FFN
# element. Backward moves about twice the forward, as plan counts the text layers (plan/timing.layer_memory_bytes).
VISION_HIDDEN_PASSES, VISION_FFN_PASSES = 12, 2


def vision_memory_bytes(vision: tuple[int, ...], patches: int, bytes_per: int) -> int:
    """Forward + backward bytes of one vision layer's elementwise kernels over one image's `patches` (eager:
    transformers' towers are not compiled here)."""
    _, h, f, _, _, ffn_in = vision
    return 3 * patches * bytes_per * (VISION_HIDDEN_PASSES * h + (VISION_FFN_PASSES + 3 * (ffn_in - 1)) * f)


def vision_activation_bytes(vision: tuple[int, ...], patches: int, bytes_per: int) -> int:
    """What a trained vision tower keeps for backward per image: per layer and patch its two norms' inputs and
    outputs, q, k, v, the attention output (SDPA keeps no scores) and the MLP's FFN-wide tensors: fc1's output and
    its activation (2·ffn), or gate, up, the activated gate and the product (4·ffn): 8·hidden + 2·ffn·inputs."""
    layers, h, f, _, _, ffn_in = vision
    return layers * patches * bytes_per * (8 * h + 2 * ffn_in * f)


def output_rows(arch: ModelArch, tp: int = 1, divisible_by: int = 128) -> int:
    """The output layer's rows on one TP rank, as the run's engine holds them: the native engine's padded
    vocabulary slice; the transformers engine keeps the checkpoint's vocabulary, split over tp where tp divides it
    (else replicated: adapter/modeling/hf_tp.py). Olmo-3's 100,278 rows stay unaligned there, which `plan` times."""
    if arch.native:
        return padded_vocab_size(arch.vocab_size, tp, divisible_by) // tp
    return arch.vocab_size // tp if arch.vocab_size % tp == 0 else arch.vocab_size


# The fused linear CE's padded logits rows (below), on CUDA too: at Olmo-3's 100,278 rows they took the output layer
# + CE from 87.4 to 73.6 ms on one H100 (bench/gpu_batch.sh lce-olmo3, docs/BENCHMARKS.md 2026-12-06 18:21), and
# they equal the reference there (tests/gpu/test_fusions.py, with the last rows' GEMMs apart); False keeps the
# checkpoint's own stride (bench/linear_ce_bench.py times both)
LINEAR_CE_PAD_ROWS_ON_CUDA = True


def linear_ce_row_stride(rows: int, cuda: bool = True) -> int:
    """Columns a row of the fused linear CE's logits takes for a vocabulary slice of `rows` (the kernel and `plan`
    read it): `rows`, or where that is not a multiple of 8 (Olmo-3's 100,278) and the padding runs on this device,
    `rows` rounded up to 128. An unaligned row stride makes cuBLAS run all three GEMMs that touch the logits on its
    4-byte-load kernels, at 0.36 of the rate (one H100, docs/BENCHMARKS.md 2026-12-06)."""
    if rows % 8 and (LINEAR_CE_PAD_ROWS_ON_CUDA or not cuda):
        return -(-rows // 128) * 128
    return rows


def liger_linear_ce_chunk(tokens: int, vocab_rows: int, hidden: int) -> int:
    """Tokens per chunk of Liger's fused linear cross-entropy (liger-kernel 0.8.5,
    ops/fused_linear_cross_entropy.py: one chunk's logits about the size of the hidden states, rounded up to a power
    of two, at most all the tokens): Olmo-3's 100,278 rows at 4,096 hidden and 8,192 tokens, 512. The memory and the
    time model read it."""
    per = -(-tokens // -(-vocab_rows // hidden))
    return min(tokens, 1 << max(0, (per - 1).bit_length()))


__all__ = ["linear_ce_chunk", "linear_ce_row_stride", "liger_linear_ce_chunk", "output_rows", "vision_patches",
           "vision_gemms", "vision_attention_flops", "vision_memory_bytes", "vision_activation_bytes",
           "Linear", "linears", "fused_linears", "layer_norm_params", "layer_params", "num_params",
           "LocalParams", "local_params", "param_tensors", "layer_gemms", "matmul_params", "attended",
           "flops_per_token", "ATTN_FWD_BWD", "attention_pairs", "attention_flops"]
