"""Step-time model: seconds per optimizer step and tokens/s/GPU, split into what the GPU computes and what it waits on.

Per micro-batch the GPU runs each layer's GEMMs at a shape-dependent rate, flash attention (causal, or over packed
documents) and memory-bound kernels (bytes / achieved bandwidth). TP and CP collectives sit on its critical path
(Megatron issues them on the compute stream). ZeRO's gathers and reductions run on a side stream: only what the
layers' compute cannot hide is exposed (the embedding's first gather and last reduce always are; ZeRO-2's last
bucket and its post-step parameter all-gather too; HSDP's replica all-reduce waits for the whole backward). The host
issues the same work: when its Python and launch cost per micro-batch exceeds the GPU's, the GPU waits, and ZeRO-3's
hooks stall it outright (BENCHMARKS sessions 2-5). Per step come the optimizer's memory streams and DeepSpeed's step.

Inputs: the config, config.json, `traffic.py`'s volumes and a hardware profile (`hardware.py`); no torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from math import ceil
from typing import Any

from adapter.models import lora
from adapter.models.arch import ModelArch, padded_vocab_size
from adapter.models.counts import (
    ATTN_FWD_BWD,
    attention_flops,
    flops_per_token,
    layer_gemms,
    liger_linear_ce_chunk,
    linear_ce_row_stride,
    local_params,
    output_rows,
    param_tensors,
    vision_attention_flops,
    vision_gemms,
    vision_memory_bytes,
)
from adapter.models.footprint import held_and_trained, quantized_base
from adapter.models.resolved import ResolvedRun
from adapter.parallel.deepspeed_config import flat_at_stage, skips_nonfinite_steps
from adapter.parallel.layout import Layout
from adapter.plan import traffic
from adapter.plan.hardware import Profile
from adapter.plan.memory import ours_chunk, peft_fp32_inputs, unfused_ops, vision_load, whole_layer_graphs

COMPONENTS = ("compute", "tp_comm", "dp_comm", "cp_comm", "optimizer", "host")
LOCAL_ATTENTION = 15 / 509  # Megatron's unfused attention ran at 15 TFLOP/s where SDPA reached 349-414
#                             (docs/BENCHMARKS.md, 2026-11-30, "context parallelism and the SDPA core attention")
OPT_BYTES_PER_PARAM = 56    # fp32 grad copy (6), AdamW r/w of param, m, v + grad read (28), 16-bit write-back (6),
#                             grad norm and clip (16): what one optimizer step streams per local parameter
FLAT_OPT_BYTES_PER_PARAM = 30  # flat AdamW: 16-bit grad read for the norm (2) and the update (2), master, m, v
#                               read and written (24), 16-bit weight written (2); streamed at the device copy rate
#                               (1B, one H200: the step's share fell from ~29 to ~9 ms; docs/BENCHMARKS.md,
#                               2026-12-01, third session)
FLAT_BF16_OPT_BYTES_PER_PARAM = 16  # optimizer.state_dtype: bf16: the gradient read twice (4), the bf16 weight, m and
#                                     v read and written (12), no master
FP8_MLP_SPEEDUP = 1.25        # precision fp8: the MLP GEMMs' fwd+bwd time, casts included, over bf16's; fitted to
#                               one H200's 1B run (+8.3% end to end; the kernel bench gave 1.19× fc1, 1.01× fc2)
COMPILED_HIDDEN = 0.6       # compiled layers fuse each residual add with the next norm: 12 of the 20 bytes/element
COMPILE_BREAKS = 1.2        # ...but at tp > 1 (a graph break at every Megatron linear), cp > 1 or selective recompute
#                             nothing fuses and each break costs host time: -8% measured at tp=2 (1B, session 4)
PEFT_FP32_BYTES = 24         # PEFT's fp32 adapters over a 16-bit base, per element of each adapted linear's input:
#                             the cast 2+4, A's forward read 4, its weight gradient's read 4, the input gradient's fp32
#                             write and its cast-and-add into the 16-bit one 4+2+4. One H200, Llama-3.1-8B, r 16 on
#                             all linears: 10,071 tokens/s with Liger where plan said 12,263 without this (−18%)
UNFUSED_ROPE = 5            # unfused RoPE (mul/cat/neg/add per q and k) moves ~5× the fused kernel's bytes (~12 ms
#                             per step on the 1B shape, BENCHMARKS session 2)


@dataclass(frozen=True)
class StepTime:
    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    breakdown: dict[str, float]        # COMPONENTS, seconds per step; they add up to step_time_s
    compute_detail: dict[str, float]   # gemm, attention, memory_bound, recompute: the compute term's parts
    bottleneck: str
    profile: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- compute ------------------------------------------------------------------------------------------------------

def gemm_seconds(shapes: list[tuple[int, int, int]], prof: Profile) -> float:
    """Forward time; backward is two GEMMs of the same three dimensions each (dgrad, wgrad), so fwd+bwd = 3×."""
    return sum(2 * m * n * k / prof.gemm.rate(m, n, k) for m, n, k in shapes)


# Bytes the memory-bound kernels of soft-capped attention move per score (S×S per head), fwd+bwd. Compiled: read
# the scores and write the probabilities forward, read the probabilities, their gradient and the scores and write
# the scores' gradient backward (4 + 8). Eager, op by op (adapter/kernels/varlen.math_attention): scale, tanh,
# scale, mask, fp32 softmax and its cast forward (29), each one's backward (35).
SOFTCAP_BYTES = {True: 12, False: 64}


def attention_seconds(arch: ModelArch, *, micro: int, seq: int, cp: int, tp: int, prof: Profile,
                      doc_len: int | None = None, kind: str = "sdpa", window: int | None = None,
                      compiled: bool = True) -> float:
    """Forward+backward of one layer's core attention on one rank: its FLOPs (adapter/models/counts.py,
    `attention_flops`: half the s² score matrix, or inside each packed document of `doc_len` tokens, or a sliding
    `window`) at the profile's attention rate; cp ranks split the work evenly (load-balanced chunks).

    Soft-capped scores (Gemma 2; cp = 1) are materialised: the whole S×S scores of every head as batched GEMMs at
    the GEMM rate (a causal mask or a window skips none of them) and their elementwise passes (SOFTCAP_BYTES) at the
    elementwise rate. Counted as flash attention they were 22% fast on one H200 (Gemma-2-9B shape cut to 8 layers:
    29,057 tokens/s measured, 35,408 predicted; docs/BENCHMARKS.md, 2026-12-06)."""
    span = min(doc_len or seq, seq)
    if arch.attn_softcap is not None and kind == "sdpa":
        heads, d = micro * (seq // span) * arch.num_heads // tp, arch.head_dim
        scores = heads * span * span
        return 3 * gemm_seconds([(span, span, d), (span, d, span)], prof) * heads + \
            SOFTCAP_BYTES[compiled] * scores / prof.elementwise_bytes_per_s
    flops = attention_flops(arch, seq_len=seq, sequences=micro, doc_len=doc_len, heads=arch.num_heads // tp,
                            windows=[window]) / cp
    rate = prof.attention.rate(span / cp if doc_len is None else span)
    if kind == "local":
        rate *= LOCAL_ATTENTION
    return flops / rate


def layer_memory_bytes(arch: ModelArch, *, tokens: int, tp: int, sp: bool, fused: bool,
                       compiled: bool = False, hf_norms: bool = False, fused_act: bool = True) -> float:
    """Bytes one layer's memory-bound kernels move, fwd+bwd (backward ≈ 2× forward): two RMSNorms (r+w) and two
    residual adds (2r+w) on the hidden states, sharded over tp by sequence parallelism; the post-norms and q/k norms
    of the families that have them; RoPE on q and k; the gated MLP's activation.

    Eager Gemma (`norm_offset`: normed and scaled in fp32, adapter/modeling/gpt.RMSNorm) runs each norm as four
    kernels through fp32 copies, and its GeGLU unfused (gelu 2+2, product 4+2: 10 bytes an element of the FFN
    against the fused SwiGLU's 6); compiled layers fuse both. The norms' weight is fitted, not counted: one H200
    (Gemma-3-4B shape, seq 4096, micro-batch 2) took 515 ms a step eager against 408 compiled (docs/BENCHMARKS.md,
    2026-12-05, "plan against the measured one-GPU runs"), which 16 bytes an element per norm reproduces (+1%) at
    the profile's fitted elementwise rate; the four kernels' raw traffic (upcast 2+4, rms_norm 4+4, scale 4+4, cast
    back 4+2 = 28) over-predicts by 18%, the fp32 kernels running nearer the copy rate than the mixed ones the rate
    was fitted on. `hf_norms` (transformers' own eager RMSNorms: upcast, square, mean, rsqrt, scale, cast back,
    weight) and an unfused activation (`fused_act` false: transformers' act_fn(gate) * up) are counted alike: the
    transformers engine without Liger's kernels ran 19,464 tokens/s on the Llama-3.2-3B shape where plan said
    23,579 without them (docs/BENCHMARKS.md, 2026-12-04 11:42)."""
    h, f = arch.hidden_size, arch.routed_ffn
    qd, kvd = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shard = tp if sp else 1
    norm = 16 if (arch.norm_offset or hf_norms) and not compiled else 4
    hidden = (2 * norm + 2 * 6) * tokens * h / shard * (COMPILED_HIDDEN if compiled else 1)
    hidden += 2 * norm * tokens * h / shard if arch.post_norms else 0
    hidden += norm * tokens * (qd + kvd) / tp if arch.qk_norm else 0
    rope = 4 * tokens * (qd + kvd) / tp * (1 if fused else UNFUSED_ROPE)
    act = (6 if compiled or (fused and fused_act and arch.activation == "silu") else 10) * tokens * f / tp
    return 3 * (hidden + rope + act)


def head_memory_bytes(arch: ModelArch, *, tokens: int, tp: int, sp: bool, fused: bool, vocab: int,
                      local_params: int) -> float:
    """Per micro-batch, outside the layers: cross-entropy over the vocab-parallel logits (fused: bf16 logits read
    twice forward, once backward, gradient written; Megatron's: fp32 copies, ~4× that), the embedding's lookup and
    gradient, the final norm, and the copy of every gradient into ZeRO's contiguous buffer."""
    h, v = arch.hidden_size, vocab // tp
    ce = (8 if fused else 16) * tokens * v
    emb = 2 * v * h + 8 * tokens * h
    norm = 12 * tokens * h / (tp if sp else 1)
    return ce + emb + norm + 4 * local_params


def lora_gemms(spec: lora.LoraSpec, *, tokens: int, tp: int, sp: bool) -> list[tuple[int, int, int]]:
    """The adapters' forward GEMMs on one rank, all layers: x·Aᵀ (this rank's tokens under SP for column-parallel
    linears) and z·Bᵀ (adapter/modeling/lora.py's order)."""
    out = []
    for t in spec.targets:
        (ra, ia), (ob, rb) = t.a_shape(spec.r, tp), t.b_shape(spec.r, tp)
        col = t.linear.tp_axis == 0
        out += [(tokens // (tp if sp and col else 1), ra, ia), (tokens // (1 if col or not sp else tp), ob, rb)]
    return out


def lora_memory_bytes(spec: lora.LoraSpec, *, tokens: int, tp: int, sp: bool) -> float:
    """Bytes the adapters' elementwise work moves: in backward, each fused linear's input gradient from the
    adapters added to the base's (read, read, write; 2-byte elements). The output side runs inside the GEMMs (the
    adapters' z·Bᵀ accumulates into the base output: adapter/modeling/lora.py), timed with `lora_gemms`."""
    fused = {(t.layer, t.linear.fused): t for t in spec.targets}
    return sum(6 * tokens // (tp if sp and t.linear.tp_axis == 0 else 1) * t.a_shape(spec.r, tp)[1]
               for t in fused.values())


# ---- communication ------------------------------------------------------------------------------------------------

def link(layout: Layout, group: str, prof: Profile) -> tuple[float, float]:
    """(bus bandwidth, latency) of a group's ring. Inside a node: NVLink. Across nodes each node's members of the
    group push the ring's boundary traffic through their own NICs, so the ring runs at min(NVLink, members per node
    × NIC bandwidth): a dp_replicate group with one member per node gets one NIC, a 16-rank group over two 8-GPU
    nodes gets eight."""
    if not layout.crosses_nodes(group):
        return prof.intra_node.busbw, prof.intra_node.latency_s
    return min(prof.intra_node.busbw, members_per_node(layout, group) * prof.inter_node.busbw_per_gpu), \
        prof.inter_node.latency_s


@lru_cache(maxsize=4096)
def members_per_node(layout: Layout, group: str) -> int:
    """The fewest members any node holds of one group (the ring's narrowest crossing)."""
    per_node: dict[int, int] = {}
    for r in layout.groups(group)[0]:
        per_node[layout.node(r)] = per_node.get(layout.node(r), 0) + 1
    return min(per_node.values())


def collective_seconds(nbytes: float, calls: float, bw_lat: tuple[float, float]) -> float:
    """`nbytes` each rank sends in total (traffic.py's ring volumes) over `calls` collectives."""
    bw, lat = bw_lat
    return nbytes / bw + calls * lat if nbytes > 0 else 0.0


# ---- the step -----------------------------------------------------------------------------------------------------

def predict(run: ResolvedRun, prof: Profile, *, stage: int,
            rows: list[traffic.GroupTraffic] | None = None, doc_len: int | None = None) -> StepTime:
    """The step time of `run` (on its layout) with ZeRO `stage` (deepspeed_config.zero_stage's answer). `doc_len`: the
    packed documents' mean length when attention stays inside documents (varlen); plan does not know the data, so
    it passes None and full causal sequences are counted (an upper bound for `data.document_mask`)."""
    cfg, arch, layout = run.cfg, run.arch, run.layout
    p, ds, hw = cfg.parallelism, cfg.deepspeed, prof.host
    tp, cp, L, ga, b = layout.tp, layout.cp, arch.num_layers, cfg.grad_accum, cfg.batch.micro_batch_size
    sp = cfg.use_sequence_parallel and tp > 1
    fused = cfg.model.fused_kernels is not False
    tokens = b * cfg.seq_len // cp
    lp = local_params(arch, tp, cfg.model.vocab_divisible_by)
    P, trained = held_and_trained(run, tp)
    spec = run.lora
    vocab = tp if arch.score_head else padded_vocab_size(arch.vocab_size, tp, cfg.model.vocab_divisible_by)
    full, selective = cfg.recompute == "full", cfg.recompute == "selective"
    compiled = whole_layer_graphs(cfg)
    broken = cfg.model.compile and not compiled
    rows = traffic.estimate(run) if rows is None else rows
    vol = {r.group: r.bytes_per_step for r in rows}

    # GPU compute per micro-batch
    shapes = layer_gemms(arch, tokens, tp)
    g_fwd = L * gemm_seconds(shapes, prof)
    if cfg.precision == "fp8":  # the MLP's two GEMMs (the last two shapes) in fp8, casts included
        g_fwd -= L * gemm_seconds(shapes[2:], prof) * (1 - 1 / FP8_MLP_SPEEDUP)
    # one rank's output rows as its engine holds them: the transformers engine's stay unaligned where the
    # checkpoint's are (Olmo-3's 100,278: the GEMMs at 0.36 of the rate, hardware.Gemm)
    head_rows = arch.score_labels if arch.score_head else output_rows(arch, tp, cfg.model.vocab_divisible_by)
    chunk = tokens
    if cfg.model.fused_linear_ce:  # ours, in token chunks (either engine)
        # the chunks' smaller GEMMs only: one H200, 1B shape, 8,192 tokens (bench/linear_ce_bench.py), they account
        # for 0.9 of the +2.4 ms measured at 1,024-token chunks (0.4 of 1.1 at 2,048); the rest, ~0.2 ms a chunk, is
        # not modelled (1% of that step), since a per-chunk constant would swamp small models. Its logits' row stride
        # where the kernel pads an unaligned slice's rows (counts.linear_ce_row_stride)
        chunk = ours_chunk(cfg, vocab_rows=head_rows, tokens=tokens)
        head_rows = linear_ce_row_stride(head_rows)
    elif not arch.native and not arch.score_head and "fused_linear_cross_entropy" in cfg.model.liger:  # Liger's
        chunk = liger_linear_ce_chunk(tokens, head_rows, arch.hidden_size)
    g_head = gemm_seconds([(chunk, head_rows, arch.hidden_size)] * (tokens // chunk)
                          + [(tokens % chunk, head_rows, arch.hidden_size)] * bool(tokens % chunk), prof)
    if spec is None:
        gemm = 3 * (g_fwd + g_head)
    else:  # frozen weights: forward and input gradient only; the adapters (and a trained LM head) all three
        g_adapters = gemm_seconds(lora_gemms(spec, tokens=tokens, tp=tp, sp=sp), prof)
        gemm = 2 * g_fwd + (3 if "lm_head" in spec.modules_to_save else 2) * g_head + 3 * g_adapters
        g_fwd += g_adapters  # what full recompute runs again
    v_gemm, v_attn, v_mem, v_host = vision_seconds(run, prof)
    gemm += v_gemm
    attn = v_attn + sum(attention_seconds(arch, micro=b, seq=cfg.seq_len, cp=cp, tp=tp, prof=prof, doc_len=doc_len,
                                 kind=cfg.model.attention, window=arch.window(i), compiled=compiled)
               for i in range(L))
    hf_norms, fused_act = unfused_ops(cfg, arch)
    layer_bytes = L * layer_memory_bytes(arch, tokens=tokens, tp=tp, sp=sp, fused=fused, compiled=compiled,
                                         hf_norms=hf_norms, fused_act=fused_act)
    if spec is not None:
        layer_bytes += lora_memory_bytes(spec, tokens=tokens, tp=tp, sp=sp)
    layer_bytes += PEFT_FP32_BYTES * tokens * peft_fp32_inputs(run)  # PEFT's fp32 adapters (plan/memory.py)
    Q, q_bytes, _ = quantized_base(run, tp)  # a 4/8-bit base: each linear dequantised in forward and backward
    layer_bytes += 2 * Q * (q_bytes + (2 if cfg.param_precision in ("bf16", "fp16") else 4))
    # the flat AdamW reads autograd's own gradients (adapter/train/optim.py): no copy into a contiguous buffer
    copied = 0 if flat_at_stage(cfg, stage) else trained
    mem = v_mem + (layer_bytes + head_memory_bytes(arch, tokens=tokens, tp=tp, sp=sp, fused=fused, vocab=vocab,
                                           local_params=copied)) / prof.elementwise_bytes_per_s
    recompute = (g_fwd + attn / ATTN_FWD_BWD + layer_bytes / 3 / prof.elementwise_bytes_per_s) if full else \
        attn / ATTN_FWD_BWD if selective else 0.0
    compute_mb = gemm + attn + mem + recompute

    # TP and CP collectives: on the critical path
    rc = 1.5 if full else 1.0
    tp_calls = ((8 * L + 4) if sp else (4 * L + 2)) * rc + (2 * L + 1 if sp else 0) + \
        (2 * L if arch.qk_norm and tp > 1 else 0)
    tp_mb = collective_seconds(vol.get("tp", 0) / ga, tp_calls if tp > 1 else 0, link(layout, "tp", prof))
    cp_calls = L * (2 if p.cp_comm_type == "all_gather" else 3 * (cp - 1)) * rc
    cp_mb = collective_seconds(vol.get("cp", 0) / ga, cp_calls if cp > 1 else 0, link(layout, "cp", prof))
    # MoE token all-to-all (expert parallelism): dispatch and combine, forward and backward, on the critical path
    ep_mb = collective_seconds(vol.get("ep", 0) / ga, 4 * L * rc if layout.ep > 1 else 0, link(layout, "ep", prof))
    eg = "expt_dp_shard" if "expt_dp_shard" in vol else "expt_dp"  # exact HSDP: the experts' group inside a replica
    expt = collective_seconds(vol.get(eg, 0) / ga, 3 * L if layout.ep > 1 else 0, link(layout, eg, prof))

    # ZeRO: side-stream traffic, exposed only where compute cannot hide it
    hsdp = ds.replicate_mode == "hsdp" or layout.dp_replicate == 1
    zgroup = "dp_shard_cp" if hsdp else "dp_cp"
    z = layout.size(zgroup)
    edge_params = lp.embedding + lp.output
    dp_mb = dp_step = 0.0
    units = (L + 1) if ds.gather_granularity == "layer" else (L * param_tensors(arch, layout.ep)[0] + 2)
    if stage == 3 and z > 1:
        t = collective_seconds(vol.get(zgroup, 0) / ga, 3 * units if hsdp else 2 * units, link(layout, zgroup, prof))
        if not hsdp:   # hpZ: the secondary (intra-group) all-gather in backward
            t += collective_seconds(vol.get("dp_shard_cp", 0) / ga, units, link(layout, "dp_shard_cp", prof))
        edge = t * (2 * edge_params + lp.layer) / (3 * P)      # first gather, last reduce: nothing to hide behind
        dp_mb = edge + max(0.0, t + expt - edge - compute_mb)
    elif stage == 2 and z > 1:
        one = vol.get(zgroup, 0) / (ga + 1)                    # one pass over the trained grads or params
        bw_lat = link(layout, zgroup, prof)
        last = collective_seconds(2 * one * min(ds.reduce_bucket_size, trained) / trained, 1, bw_lat)
        grads = collective_seconds(one, ceil(trained / ds.reduce_bucket_size), bw_lat)
        dp_mb = last + max(0.0, grads + expt - last - compute_mb * 2 / 3)  # bucket by bucket during backward
        dp_step += collective_seconds(one, ceil(trained / ds.prefetch_bucket_size), bw_lat)  # after the step
    if stage == 3 and hsdp and layout.dp_replicate > 1:       # after the whole backward, before the step
        dp_step += collective_seconds(vol.get("dp_replicate", 0), 1, link(layout, "dp_replicate", prof))

    # the host issuing it all
    # grouped experts under the flat AdamW hand autograd one gradient per expert linear (adapter/modeling/moe.py)
    grouped_grads = arch.moe and cfg.model.moe_grouped_gemm and cfg.param_precision == "bf16" and \
        flat_at_stage(cfg, stage)
    tensors = param_tensors(arch, layout.ep, grouped_grads)[1]
    layer_host = hw.compiled_layer_s if compiled and arch.native else hw.layer_s * (COMPILE_BREAKS if broken else 1.0)
    if arch.moe:  # its MoE half stays eager (adapter/modeling/compile.py): the attention half's share, then the rest
        layer_host = layer_host / 2 + hw.moe_layer_s - hw.layer_s / 2
    host_mb = L * layer_host * rc + v_host + tensors * hw.param_s + \
        (tp_calls * hw.tp_collective_s if tp > 1 else 0.0)
    stall_mb = 2 * units * hw.zero3_unit_s * rc if stage == 3 else 0.0   # hooks run even over a group of one
    gpu_mb = compute_mb + tp_mb + cp_mb + ep_mb + dp_mb
    mb_time = max(gpu_mb, host_mb) + stall_mb

    shard = -(-trained // z) if stage >= 2 else trained
    # m and v read and written: 1 byte (8-bit) or half of one (4-bit), not 4
    moments_saved = {"adamw_8bit": 12, "adamw_4bit": 14}.get(cfg.optimizer.name, 0)
    if flat_at_stage(cfg, stage):  # adapter/train/optim.py: one fused pass over the states at the copy rate
        per = FLAT_BF16_OPT_BYTES_PER_PARAM if cfg.optimizer.state_dtype == "bf16" else FLAT_OPT_BYTES_PER_PARAM
        optimizer = (per - moments_saved) * trained / prof.hbm_bytes_per_s
        host_step = 0.0
    else:
        optimizer = (OPT_BYTES_PER_PARAM - moments_saved) * shard / prof.optimizer_bytes_per_s
        host_step = max(0.0, hw.step_s + tensors * hw.step_per_tensor_s - optimizer - dp_step)
    scan = {"fp16": {}} if cfg.precision == "fp16" else {"bf16": ds.overrides.get("bf16", {})}
    host_step += tensors * hw.overflow_scan_per_tensor_s if skips_nonfinite_steps(scan) else 0.0

    step = ga * mb_time + dp_step + optimizer + host_step
    breakdown = {"compute": ga * compute_mb, "tp_comm": ga * tp_mb, "dp_comm": ga * dp_mb + dp_step,
                 "cp_comm": ga * cp_mb, "ep_comm": ga * ep_mb, "optimizer": optimizer,
                 "host": ga * (mb_time - gpu_mb) + host_step}
    detail = {"gemm": ga * gemm, "attention": ga * attn, "memory_bound": ga * mem, "recompute": ga * recompute}
    tok = cfg.global_batch * cfg.seq_len / layout.world / step
    flops = flops_per_token(arch, cfg.seq_len) if spec is None else lora.flops_per_token(spec, arch, cfg.seq_len)
    return StepTime(step_time_s=step, tokens_per_s_per_gpu=tok, mfu=tok * flops / prof.peak_flops,
                    breakdown=breakdown,
                    compute_detail=detail, bottleneck=bottleneck(breakdown, detail, layout),
                    profile=prof.source_path or prof.name)


def vision_seconds(run: ResolvedRun, prof: Profile) -> tuple[float, float, float, float]:
    """(GEMM, attention, elementwise and host seconds) of an image-text run's vision tower per micro-batch: each
    image through every layer, forward, and backward where the tower trains (a frozen tower: the forward's third
    of the GEMMs and the elementwise bytes, 1/ATTN_FWD_BWD of the attention); a trained tower under full recompute
    runs its forward twice (transformers checkpoints its layers too). Its layers are transformers' own, each a layer
    of host time like a text layer's (Host.layer_s, or compiled_layer_s). One H100, gemma-3-4b-it's tower at 896
    pixels, full fine-tune, 8 images a step: the forward was host-bound (the GPU idle 267 of its 420 ms, profiled)
    and the backward GPU-bound (docs/BENCHMARKS.md, 2026-12-07). Zeros for text runs. The processor's time is not
    counted: on a GPU a worker renders the micro-batches ahead (data.num_workers)."""
    images, patches, trains = vision_load(run)
    v = run.arch.vision
    if not patches or v is None:
        return 0.0, 0.0, 0.0, 0.0
    layers, pb = v[0], 2 if run.cfg.param_precision in ("bf16", "fp16") else 4
    gemm = images * layers * gemm_seconds(vision_gemms(v, patches), prof)
    attn = images * layers * vision_attention_flops(v, patches) / prof.attention.rate(patches)
    mem = images * layers * vision_memory_bytes(v, patches, pb) / prof.elementwise_bytes_per_s
    # compiled layers (model.compile: true) compile the tower's too (a checkpoint's _no_split_modules); their fused
    # elementwise kernels are not counted (not measured), the eager bytes are. transformers' compiled layers spend
    # the host time of eager ones (one H100, this tower's row: ~1.9 ms a layer forward, ~2.4 backward, either way:
    # docs/BENCHMARKS.md, 2026-12-07 05:10), so a layer of host time is layer_s here, compiled or not
    host = layers * prof.host.layer_s
    if not trains:
        return gemm, attn / ATTN_FWD_BWD, mem / 3, host
    if run.cfg.recompute == "full":
        return 4 * gemm, attn * (1 + 1 / ATTN_FWD_BWD), mem * 4 / 3, 1.5 * host
    return 3 * gemm, attn, mem, host


def bottleneck(breakdown: dict[str, float], detail: dict[str, float], layout: Layout) -> str:
    """The largest share of the step, in words, with what would move it."""
    step = sum(breakdown.values())
    share = {k: v / step for k, v in breakdown.items()}
    top = max(share, key=share.__getitem__)
    pct = f"{100 * share[top]:.0f}% of the step"
    if top == "compute":
        part = max(detail, key=detail.__getitem__)
        words = {"gemm": "compute-bound: matmuls", "attention": "compute-bound: attention kernels (long sequences)",
                 "memory_bound": "memory-bound kernels (norms, RoPE, SwiGLU, cross-entropy)",
                 "recompute": "activation recompute"}[part]
        text = f"{words}, {100 * detail[part] / step:.0f}% of the step (compute {pct})"
    elif top == "host":
        text = (f"host-bound: the GPU waits {pct} for Python, kernel launches and DeepSpeed's hooks (larger "
                "micro-batches, fewer collectives or compiled layers help)")
    elif top == "optimizer":
        text = f"optimizer step, {pct} (few tokens per step for the parameters each GPU updates)"
    else:
        name = {"tp_comm": "TP collectives on the critical path", "dp_comm": "exposed data-parallel communication",
                "cp_comm": "CP K/V exchange", "ep_comm": "MoE token all-to-all (expert parallelism)"}[top]
        group = {"tp_comm": "tp", "cp_comm": "cp", "dp_comm": "dp_cp", "ep_comm": "ep"}[top]
        over = " (its groups cross nodes)" if layout.crosses_nodes(group) else ""
        text = f"{name}{over}, {pct}"
    return text
