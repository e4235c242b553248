"""Per-GPU memory model for a run: model states under ZeRO-3, activations, buffers; all in bytes.

The formulas are deliberately explicit (one line per tensor family) so they can be unit-tested against hand
calculations and calibrated against measured `torch.cuda.max_memory_allocated` peaks (docs/BENCHMARKS.md).
Activation terms follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
adapted to RMSNorm + SwiGLU + GQA and to our SDPA attention, which keeps no S×S score matrix; packed documents
(`data.document_mask`) run varlen attention, which keeps no S×S mask either (`attention_flops` has their FLOPs).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from adapter.config import RunConfig
from adapter.models import counts, lora
from adapter.models.arch import ModelArch
from adapter.models.counts import expert_params, linear_ce_chunk, local_params, output_rows
from adapter.models.footprint import held_and_trained, optimizer_bytes, quantized_base
from adapter.models.resolved import ResolvedRun
from adapter.parallel import deepspeed_config

GIB = 2**30
SUB_GROUP = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size default (ZeRO-3 steps that many at a time)

# name -> (device memory as torch reports it (`mem_get_info` total), dense bf16 peak FLOP/s). H200: measured on the
# GPU host (139.80 GiB); the others from the same driver's reserve (~0.6 GiB under the nominal size).
GPUS: dict[str, tuple[int, float]] = {
    "h100-80gb": (int(79.1 * GIB), 989e12),
    "h200": (int(139.8 * GIB), 989e12),
    "a100-80gb": (int(79.1 * GIB), 312e12),
    "a100-40gb": (int(39.4 * GIB), 312e12),
    "l40s": (int(44.4 * GIB), 362e12),
}
# Held outside PyTorch's allocator for the whole run: CUDA context, NCCL and cuBLAS workspaces. Measured 1.3 GiB on
# one H200 (torch 2.11, NCCL 2.27, DeepSpeed ZeRO-1); counted against the capacity, not as a tensor.
RUNTIME_RESERVE = int(1.5 * GIB)
# The model's own error near capacity: on one H200 the 3B shape at micro-batch 8 peaked 1.3% above the prediction
# (ran, 92% of capacity) and at micro-batch 9 ran out of memory where the bare prediction said 99%. "Fits" keeps
# this much headroom rather than promise a run that dies at its first step.
MARGIN = 0.03


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int             # this rank's ZeRO-3 shard of the (bf16) weights
    gradients: int           # its shard of the gradients
    optimizer: int           # fp32 master weights + Adam moments, sharded
    gathered_params: int     # ZeRO-3 working set: the layers gathered for compute (current + prefetched)
    comm_buffers: int        # reduce bucket(s) and the optimizer step's transient gradient copies
    activations: int         # with the run's recompute setting
    activations_no_recompute: int
    activations_full_recompute: int
    logits: int              # output logits + vocab-parallel cross-entropy workspace
    peak: int
    capacity: int
    partition_size: int      # ranks a ZeRO-3 shard set spans
    runtime_reserve: int = RUNTIME_RESERVE  # CUDA context, NCCL, cuBLAS: outside the allocator's peak
    peak_phase: str = "forward_backward"    # or "optimizer_step": where the peak is reached

    @property
    def fits(self) -> bool:
        return self.peak * (1 + MARGIN) + self.runtime_reserve <= self.capacity

    def to_dict(self) -> dict[str, int | bool | str]:
        return {**asdict(self), "fits": self.fits}


def lora_activations(spec: lora.LoraSpec, arch: ModelArch, *, seq: int, micro: int, tp: int, sp: bool,
                     bytes_per: int) -> list[int]:
    """Bytes each layer's adapters keep for backward (adapter/modeling/lora.py): the r-wide z of every adapter
    (column-parallel: over the whole sequence after SP's gather; row-parallel: this rank's tokens) and, with
    dropout, each adapter's dropped input and its mask. Their inputs themselves are the layer's own activations."""
    out = [0] * arch.num_layers
    sp_div = tp if sp else 1
    for t in spec.targets:
        lin, col = t.linear, t.linear.tp_axis == 0
        keep = bytes_per * seq * micro * spec.r // (1 if col else sp_div)
        if spec.dropout:
            tokens_in = seq * micro // (sp_div if col else 1)
            keep += (bytes_per + 1) * tokens_in * (lin.inp if col else lin.inp // tp)
        out[t.layer] += keep
    return out


def layer_activations(arch: ModelArch, *, seq: int, micro: int, tp: int, cp: int, sp: bool, attention: str,
                      cp_comm: str = "all_gather", bytes_per: int = 2, packed: bool = False, eager: bool = False,
                      fused_mlp: bool = True, hf_norms: bool = False) -> int:
    """Bytes one layer keeps for backward, for one micro-batch on one rank.

    `packed`: packed documents (adapter/kernels/varlen.py): the same per-token terms, no s×s mask; under all-gather
    CP the saved K,V are every local query chunk's causal key prefix, (2·cp+1)/(2·cp) of the sequence. The
    per-document CP padding (< 2·cp tokens per document) is not counted.

    `eager` (no `model.compile`): what autograd keeps op by op where a compiled layer's partitioner recomputes it
    instead. Gemma's norms (`norm_offset`: normed and scaled in fp32, adapter/modeling/gpt.RMSNorm) keep an fp32
    copy of their input and their fp32 normed output, 8 bytes an element against the 16-bit input a compiled layer
    keeps (measured with saved-tensor hooks: tests/unit/test_memory.py); on one H200 the Gemma-3-4B shape's eager
    peak was 123.2 GiB where this model without it said 90.4 (docs/BENCHMARKS.md, 2026-12-05, "plan against the
    measured one-GPU runs"). A gated MLP whose activation is not fused (GeGLU always: Megatron fuses SwiGLU only;
    SwiGLU with `fused_mlp` false) keeps the activation's output beside its product: 4 FFN-wide tensors, not 3.
    `hf_norms`: transformers' own eager RMSNorms (the transformers engine without Liger's): upcast to fp32, normed,
    cast back and scaled, keeping the fp32 copy and the 16-bit normed values, 6 bytes an element (measured with
    saved-tensor hooks on LlamaRMSNorm; its ops are the same on CPU and CUDA)."""
    s, b, h = seq // cp, micro, arch.hidden_size
    qd, kvd, f = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.routed_ffn
    shard = tp if sp else 1
    norm_side = bytes_per * s * b * h * 4 // shard                   # 2 norm inputs + qkv and fc1 inputs
    # every norm keeps its input: the 2 pre-norms (above), GLM-4's and Gemma's 2 post-norms, the q/k norms
    norm_bytes = 8 if eager and arch.norm_offset else 6 if eager and hf_norms and bytes_per == 2 else bytes_per
    norm_side += (norm_bytes - bytes_per) * s * b * h * 2 // shard
    norm_side += norm_bytes * s * b * h * 2 // tp if arch.post_norms else 0  # on linear_proj / fc2's reduced output
    norm_side += norm_bytes * s * b * (qd + kvd) // tp if arch.qk_norm else 0
    kv_len = seq if (cp > 1 and cp_comm == "all_gather") else s         # all-gather CP keeps the gathered K,V
    if packed and cp > 1 and cp_comm == "all_gather":
        kv_len = seq * (2 * cp + 1) // (2 * cp)                          # the key prefixes of both local chunks
    attn = bytes_per * s * b * qd // tp + bytes_per * kv_len * b * 2 * kvd // tp   # q and k, v for attention bwd
    attn += bytes_per * s * b * qd // tp                                 # attention output (= linear_proj input)
    attn += 4 * s * b * arch.num_heads // tp                             # fp32 log-sum-exp of the fused kernel
    if attention == "local":                                             # unfused: scores + softmax, S×S
        attn += 2 * bytes_per * s * kv_len * b * arch.num_heads // tp
    if arch.attn_softcap is not None:  # soft-capped scores are materialised (kernels/varlen.math_attention, cp = 1):
        # eager: tanh's output, the fp32 softmax and its 16-bit copy, S×S per head; a compiled layer keeps two 16-bit
        # S×S tensors (the scores and the probabilities; saved-tensor hooks, tests/unit/test_memory.py; on one H200
        # the Gemma-2-9B shape cut to 8 layers peaked at 43.3 GiB where the eager count said 58.0). A window masks
        # them, it does not shrink them; packed, the worst case: one document the length of the sequence. And K, V
        # repeated to every head.
        attn += (2 * bytes_per + (4 if eager else 0)) * s * kv_len * b * arch.num_heads // tp
        attn += 2 * bytes_per * kv_len * b * (qd - kvd) // tp
    mlp = bytes_per * s * b * 3 * f // tp                                # fc1 out (gate, up) + swiglu out
    if eager and (arch.activation != "silu" or not fused_mlp):
        mlp += bytes_per * s * b * f // tp                               # + the activation's output
    if arch.moe:  # each token's k copies sent to its experts (fc1's input) and their outputs before the weighting
        mlp += 2 * bytes_per * s * b * arch.experts_per_token * h // (tp if sp else 1)
    return norm_side + attn + mlp


def unfused_ops(cfg: RunConfig, arch: ModelArch) -> tuple[bool, bool]:
    """(transformers' own RMSNorms run: the transformers engine without Liger's, whether the gated activation runs
    fused: the native engine's, or Liger's SwiGLU), read by the memory and the time model alike."""
    return not arch.native and "rms_norm" not in cfg.model.liger, arch.native or "glu_activation" in cfg.model.liger


def ours_chunk(cfg: RunConfig, *, vocab_rows: int, tokens: int) -> int:
    """Tokens per chunk of nd-adapter's fused linear CE in this run (the chunk `auto` resolved or the one asked;
    else the kernel's default), at most the micro-batch's tokens; read by the memory and the time model alike."""
    return min(tokens, cfg.model.fused_linear_ce_chunk or linear_ce_chunk(vocab_rows))


def head_trains(run: ResolvedRun) -> bool:
    """Whether the output layer (or the tied embedding it reads) gets a gradient: not under adapters that leave it
    frozen (lm_head / embed_tokens outside modules_to_save), whose fused linear CE then computes no weight gradient.
    `unfrozen_parameters` is counted as training it (its row ranges still make whole-weight gradients)."""
    if run.lora is not None:
        return bool(run.lora.modules_to_save)
    if run.peft is not None:
        return bool(run.peft.modules_to_save)
    return True


def peft_fp32_inputs(run: ResolvedRun) -> int:
    """Σ in_features of the linears whose PEFT adapters run in fp32 over a 16-bit base (the transformers engine's
    LoRA: get_peft_model's autocast_adapter_dtype, as Axolotl loads them); 0 where there are none."""
    peft = run.peft
    return peft.adapter_inputs if peft is not None and run.cfg.param_precision in ("bf16", "fp16") else 0


def peft_activations(run: ResolvedRun, *, tokens: int) -> int:
    """What PEFT's adapters on the transformers engine keep beyond the layer's own activations. PEFT keeps them in
    fp32 over a 16-bit base (get_peft_model's autocast_adapter_dtype, as Axolotl loads them): each adapted linear
    casts its input to fp32 and keeps that copy for the adapter's weight gradient (measured with saved-tensor hooks:
    one copy per adapted linear, q, k and v each their own), while a frozen base linear keeps nothing of its input.
    With every linear adapted (`all-linear`) the layer's 16-bit inputs of q/k/v, gate/up and down are then kept by
    nothing else (the attention's output still is, by the attention). One H200, Llama-3.1-8B shape, r 16 on all
    linears: 46.36 GiB measured with Liger, 57.4 without, where the native layer's count said 33.8 / 45.1
    (docs/BENCHMARKS.md, 2026-12-04 and 2026-12-05)."""
    inputs, arch, peft = peft_fp32_inputs(run), run.arch, run.peft
    if peft is None:
        return 0
    # quantised experts (quantize_experts): each layer's whole dequantised expert weights are kept for its backward (the
    # input's gradient multiplies by them; bitsandbytes' parametrisation dequantises outside autograd)
    experts = (2 if run.cfg.param_precision in ("bf16", "fp16") else 4) * sum(peft.experts or ())
    if not inputs:
        return experts
    keep = 4 * tokens * inputs
    if peft.target_modules == "all-linear" and not arch.moe:  # (a mixture's experts are not all nn.Linear)
        keep -= 2 * tokens * (2 * arch.hidden_size + arch.routed_ffn) * arch.num_layers
    return max(0, keep) + experts


def vision_load(run: ResolvedRun) -> tuple[int, int, bool]:
    """(images per micro-batch, patches the vision tower sees per image, whether it trains) of an image-text run:
    one image a row, as Axolotl's multimodal path takes each row's first (the blank filler of ZeRO-3 or dp > 1, one
    more where a micro-batch has none, is not counted); the tower trains in a full fine-tune without freeze_mm_modules
    (adapters and unfrozen_parameters leave it frozen: its forward only, nothing kept). Read by the memory and the
    time model alike; (0, 0, False) for text runs and towers config.json does not describe."""
    cfg, v = run.cfg, run.arch.vision
    if v is None or not cfg.data.processor_type:
        return 0, 0, False
    trained = run.peft is None and run.lora is None and run.unfrozen is None and not cfg.model.freeze_mm_modules
    return cfg.batch.micro_batch_size, counts.vision_patches(v, cfg.data.image_size), trained


def whole_layer_graphs(cfg: RunConfig) -> bool:
    """`model.compile` gives one whole graph per layer only at tp = cp = 1 without selective recompute (elsewhere the
    graph breaks at Megatron's linears, the CP attention or the recompute boundary: adapter/modeling/compile.py)."""
    p = cfg.parallelism
    return bool(cfg.model.compile) and p.tp_size == 1 and p.cp_size == 1 and cfg.recompute != "selective"


def fp8_freed(cfg: RunConfig, arch: ModelArch, *, tokens: int) -> int:
    """Bytes per layer that compiled layers with `precision: fp8` do not keep: the bf16 input of each fp8 MLP linear
    (fc1: the norm's output, fc2: the SwiGLU output), measured, not derived. One H200, compiled, tp = 1
    (docs/BENCHMARKS.md, 2026-12-01, third and fifth sessions):
    the peak fell by 2.5 GiB on the 1B shape (rowwise and tensorwise) and by ~4.8 GiB on 3B (tensorwise, against
    bf16 with linear CE's share taken out), i.e. 2·tokens·(hidden + FFN) per layer both times. The fp8 copies the
    matmuls keep do not show in those peaks; why is not pinned down (no memory snapshot was taken). Not modelled:
    eager fp8, and fp8 attention projections (not measured)."""
    if cfg.precision != "fp8" or not whole_layer_graphs(cfg):
        return 0
    linears = set(cfg.model.fp8_linears)
    return 2 * tokens * ((arch.hidden_size if "fc1" in linears else 0) + (arch.routed_ffn if "fc2" in linears
                                                                          else 0))


def attention_flops(arch: ModelArch, *, seq: int, micro: int, tp: int, cp: int, doc_len: int | None = None) -> float:
    """Attention-matmul FLOPs one GPU does per micro-batch, forward + backward (adapter/models/counts.py,
    `attention_flops`), split over tp × cp. Causal: a sequence of s tokens costs 4·(s²/2)·heads·head_dim forward;
    packed documents of ℓ tokens (`doc_len`) cost s/ℓ · 4·(ℓ²/2)·heads·head_dim per sequence: s·ℓ instead of s²."""
    return counts.attention_flops(arch, seq_len=seq, sequences=micro, doc_len=doc_len) / (tp * cp)


def estimate(run: ResolvedRun, *, partition_size: int, gpu_capacity: int, stage: int = 3) -> MemoryEstimate:
    """`stage` 3 shards the 16-bit weights over the partition; 1 and 2 keep them whole (nothing is gathered)."""
    cfg, arch = run.cfg, run.arch
    p = cfg.parallelism
    tp, cp, L = run.layout.tp, run.layout.cp, arch.num_layers
    half = cfg.param_precision in ("bf16", "fp16")
    pb = 2 if half else 4
    lp = local_params(arch, tp, cfg.model.vocab_divisible_by)
    # gradients and optimizer states only for the trained parameters (LoRA's adapters, unfrozen_parameters)
    P, trained = held_and_trained(run, tp)
    # a 4/8-bit base (Q parameters): left out of ZeRO's 16-bit shard; whole on every rank, except the transformers
    # engine's NF4 codes under ZeRO-3, which it partitions like any parameter (q_held below)
    Q, q_bytes, q_one = quantized_base(run, tp)
    Z = partition_size
    shard = -(-(P - Q) // Z)
    trained_shard = -(-trained // Z)
    grads = pb * trained_shard
    zero12 = stage in (1, 2) and not deepspeed_config.flat_at_stage(cfg, stage)
    optim = int(optimizer_bytes(cfg, zero12) * trained_shard)  # master + moments
    ds = cfg.deepspeed
    # expert parallelism: a rank holds its experts only (each partitioned over the ranks holding the same experts,
    # Z/ep of them: the same shard of the model states as without ep), so whole weights and a layer's gather shrink
    ep = p.ep_size
    P_whole = P - expert_params(arch, tp) + expert_params(arch, tp, ep)
    if ep > 1:
        lp = local_params(arch, tp, cfg.model.vocab_divisible_by, ep)
    q_held = int(q_bytes * Q)
    if Q and stage == 3 and Z > 1 and run.peft is not None and run.peft.quantize_base == "nf4":
        # the transformers engine: ZeRO-3 partitions bitsandbytes' NF4 codes (parameters there) and gathers a
        # layer's; LLM.int8() keeps its own reference to the whole int8 codes, so those stay whole
        q_held = int(q_bytes * (-(-Q // Z) + Q // arch.num_layers))
    weights = pb * (shard if stage == 3 else P_whole - Q) + q_held
    layer = lp.layer - Q // arch.num_layers  # what ZeRO-3 gathers of a layer
    prefetched = layer if ds.gather_granularity == "layer" else min(ds.prefetch_bucket_size, layer)
    gathered = pb * (max(layer, lp.embedding) + prefetched) if Z > 1 and stage == 3 else 0
    gathered += pb * q_one  # one linear's weight dequantised for its GEMM (forward and backward)
    # The optimizer step's transients on top of the model states (DeepSpeed 0.19.8). ZeRO-3 turns its 16-bit gradient
    # partition into fp32 one sub_group (1e9 elements) at a time. ZeRO-1/2 turn the whole partition at once
    # (stage_1_and_2.step, `flat_grad_partition.to(fp32)`) and, from the second step on, also hold a flat 16-bit
    # copy of it: measured on one H200 with a Mistral-7B shape, 16.0 bytes/param resident before the fp32 copy at
    # step 1 and 18.0 at step 2, then the 27 GiB fp32 copy that the run died allocating (docs/BENCHMARKS.md,
    # 2026-12-01, "the one-GPU memory check"). Neither outlives the step (a 1B run peaked 2.3 GiB below what they
    # would add to forward/backward).
    # nd-adapter's flat AdamW (nothing to shard) updates everything in place, one parameter at a time: nothing.
    if deepspeed_config.flat_at_stage(cfg, stage):
        step_transient = 0
    elif stage == 3:
        step_transient = 4 * min(trained_shard, SUB_GROUP) if half else 0
    else:
        step_transient = pb * trained_shard + (4 * trained_shard if half else 0)
    # ZeRO-3's reduce buckets count at the peak; ZeRO-2's did not (measured: the same peak at bucket sizes 5e7-5e8)
    buckets = pb * min(ds.reduce_bucket_size, trained) * (2 if ds.overlap_comm else 1) if Z > 1 and stage == 3 else 0

    sp = cfg.use_sequence_parallel and tp > 1
    packed = cfg.document_attention
    hf_norms, fused_act = unfused_ops(cfg, arch)
    one = layer_activations(arch, seq=cfg.seq_len, micro=cfg.batch.micro_batch_size, tp=tp, cp=cp, sp=sp,
                            attention=cfg.model.attention, cp_comm=p.cp_comm_type, bytes_per=pb, packed=packed,
                            eager=not cfg.model.compile, hf_norms=hf_norms,
                            fused_mlp=cfg.model.fused_kernels is not False and fused_act)
    s, b, h = cfg.seq_len // cp, cfg.batch.micro_batch_size, arch.hidden_size
    one -= fp8_freed(cfg, arch, tokens=s * b)
    spec = run.lora
    adapters = [0] * L if spec is None else lora_activations(spec, arch, seq=s, micro=b, tp=tp, sp=sp, bytes_per=pb)
    layer_input = pb * s * b * h // (tp if sp else 1)
    rope = 4 * s * b * arch.head_dim if packed else 0                    # packed: one fp32 RoPE angle row per token
    peft = peft_activations(run, tokens=s * b)
    no_rc = L * one + sum(adapters) + peft + 3 * layer_input + rope      # + embedding out, final norm in/out
    full_rc = L * layer_input + one + max(adapters) + peft // L + 3 * layer_input + rope  # inputs kept, one layer
    images, patches, tower_trains = vision_load(run)
    v = arch.vision
    if tower_trains and patches and v is not None:  # a trained vision tower's layers (transformers checkpoints them
        # too: their inputs alone)
        kept = counts.vision_activation_bytes(v, patches, pb) * images
        no_rc += kept
        full_rc += images * patches * pb * v[1] * v[0] + kept // v[0]
    acts = full_rc if cfg.recompute == "full" else no_rc
    rows = output_rows(arch, tp, cfg.model.vocab_divisible_by)        # one rank's, as its engine holds them
    fused = cfg.model.fused_kernels is not False                        # unset: on (plan assumes GPUs)
    liger_ce = not arch.native and "fused_linear_cross_entropy" in cfg.model.liger
    linear_ce = bool(cfg.model.fused_linear_ce) or liger_ce
    # the output weight's gradient (or the tied embedding's): the first one backward makes, unless adapters freeze it
    head_grad = pb * (lp.output or lp.embedding) if head_trains(run) else 0
    if arch.score_head:  # a reward model: one fp32 score per position (a process reward model: a class's each)
        logits = 4 * s * b * arch.score_labels
    elif linear_ce:
        # linear + CE in token chunks: the output weight's gradient (counted as head_grad) and the hidden states'
        # gradient, computed in the forward, wait for backward; one chunk's logits exist at a time, ours with their
        # gradient written over them (adapter/kernels/fusions.py), Liger's with an fp32 working copy (its chunk:
        # tokens·hidden / vocab rows, rounded up to a power of two: counts.liger_linear_ce_chunk)
        chunk = counts.liger_linear_ce_chunk(s * b, rows, h) if liger_ce else \
            ours_chunk(cfg, vocab_rows=rows, tokens=s * b)
        logits = pb * s * b * h + chunk * rows * (pb + 4 if liger_ce else pb)
    elif not fused or not arch.native:  # Megatron's CE, or transformers' logits: an fp32 copy + the saved exp
        logits = s * b * rows * (pb + 4 + 4)
    else:                                                               # adapter.kernels.fusions: logits + their grad
        logits = s * b * rows * 2 * pb

    during_step = weights + grads + optim + step_transient
    if deepspeed_config.flat_at_stage(cfg, stage):
        # the flat AdamW leaves the gradients autograd's own, freed after each step (adapter/train/optim.py): they
        # grow as backward frees the activations, so the peak is the activations with the first gradients backward
        # makes (the output layer's, or the tied embedding's) or all the gradients, whichever is larger. One H200,
        # Qwen3-MoE shape, bf16 states: 41.9 GiB measured, where the gradients beside the activations said 48.6
        # (docs/BENCHMARKS.md, 2026-12-05, "plan against the measured one-GPU runs")
        # With gradient accumulation the later micro-batches run their forward beside the earlier ones' gradients,
        # all of them: one H100, an image-text full fine-tune at grad-accum 4, 14.07 GiB measured where the first
        # micro-batch's peak said 12.16 (docs/BENCHMARKS.md, 2026-12-07)
        early = grads if cfg.grad_accum > 1 else min(grads, head_grad)
        during_fwd_bwd = weights + optim + gathered + buckets + max(acts + logits + early, grads)
    else:  # the gradients are held whole; the fused kernel's output-weight gradient is a buffer beside them
        during_fwd_bwd = weights + grads + optim + gathered + buckets + acts + logits + (head_grad if linear_ce else 0)
    return MemoryEstimate(weights=weights, gradients=grads, optimizer=optim, gathered_params=gathered,
                          comm_buffers=buckets + step_transient, activations=acts,
                          activations_no_recompute=no_rc, activations_full_recompute=full_rc, logits=logits,
                          peak=max(during_step, during_fwd_bwd), capacity=gpu_capacity, partition_size=Z,
                          peak_phase="optimizer_step" if during_step > during_fwd_bwd else "forward_backward")
