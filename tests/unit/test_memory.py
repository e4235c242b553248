"""The memory and traffic formulas against values computed by hand for a tiny model (see comments)."""
from __future__ import annotations

import pytest

from adapter import config
from adapter.models import counts
from adapter.models.arch import arch_from_hf_dict, padded_vocab_size
from adapter.parallel.layout import Layout
from adapter.plan import memory, traffic
from tests.helpers.runs import planned

# hidden 64, 4 heads × 16, 2 KV heads, ffn 128, 2 layers, vocab 1000, untied
TINY = arch_from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 2,
                          "vocab_size": 1000, "tie_word_embeddings": False})


def cfg(**over):
    raw = {"model": {"path": "unused"}, "parallelism": {"dp_shard_size": 2, "tp_size": 2},
           "batch": {"micro_batch_size": 2}, "seq_len": 32}
    for k, v in over.items():
        config.set_dotted(raw, k, v)
    return config.build(raw, env={})


def test_padded_vocab_and_local_params():
    assert padded_vocab_size(1000, 2, 128) == 1024          # multiple of 128·2
    assert padded_vocab_size(128256, 8, 128) == 129024
    lp = counts.local_params(TINY, tp=2)
    # linear per layer: 64·(64+2·32) + 64·64 + 3·64·128 = 36864 -> /tp = 18432, + 2 norms of 64 = 18560
    assert lp.layer == 18560
    assert lp.embedding == lp.output == 1024 * 64 // 2 == 32768
    assert lp.total(2) == 2 * 18560 + 2 * 32768 + 64 == 102720


def test_model_states_and_activations_by_hand():
    est = memory.estimate(planned(cfg(**{"model.fused_linear_ce": False}), TINY), partition_size=2, gpu_capacity=10**9)
    shard = 102720 // 2
    assert (est.weights, est.gradients, est.optimizer) == (2 * shard, 2 * shard, 12 * shard)
    # one layer, s=32 b=2 h=64 tp=2 with sequence parallel, bf16:
    #   norms/linear inputs 2·32·2·64·4/2 = 16384; q 4096, k+v 4096, attn out 4096, lse 4·32·2·4/2 = 512;
    #   mlp 2·32·2·3·128/2 = 24576  -> 53760
    assert memory.layer_activations(TINY, seq=32, micro=2, tp=2, cp=1, sp=True, attention="sdpa") == 53760
    assert est.activations_no_recompute == 2 * 53760 + 3 * 4096 == 119808
    assert est.activations_full_recompute == 2 * 4096 + 53760 + 3 * 4096 == 74240
    assert est.logits == 32 * 2 * 512 * (2 + 2) == 131072               # fused CE: bf16 logits and their grad
    # fused linear + CE (the default, auto): the hidden states' grad (32·2 tokens × 64), bf16, plus one chunk of
    # bf16 logits, their gradient written over them: all 64 tokens (< 256) × 512; the output weight's grad (512 rows
    # per tp rank × 64, bf16) is a buffer of its own beside ZeRO's gradients, computed in the forward
    chunked = memory.estimate(planned(cfg(), TINY), partition_size=2, gpu_capacity=1)
    assert chunked.logits == 2 * 32 * 2 * 64 + 64 * 512 * 2 == 73728
    assert chunked.peak - est.peak == chunked.logits + 2 * 512 * 64 - est.logits
    small = memory.estimate(planned(cfg(**{"model.fused_linear_ce": True, "model.fused_linear_ce_chunk": 16}), TINY),
                            partition_size=2, gpu_capacity=1)
    assert small.logits == 2 * 32 * 2 * 64 + 16 * 512 * 2   # the chunk asked for
    unfused = memory.estimate(planned(cfg(**{"model.fused_kernels": False, "model.fused_linear_ce": False}), TINY),
                              partition_size=2, gpu_capacity=1)
    assert unfused.logits == 32 * 2 * 512 * (2 + 4 + 4) == 327680      # Megatron's CE: + fp32 copy + saved exp
    assert est.activations == est.activations_no_recompute
    assert memory.estimate(planned(cfg(recompute="full"), TINY), partition_size=2, gpu_capacity=1).activations == 74240


def test_8bit_adamw_keeps_two_bytes_of_moments_per_parameter():
    shard = 102720 // 2
    est = memory.estimate(planned(cfg(**{"optimizer.name": "adamw_8bit"}), TINY), partition_size=2,
                          gpu_capacity=10**9)
    assert est.optimizer == int((4 + 2 + 2 * 4 / 256) * shard)  # fp32 master + uint8 m, v + an fp32 absmax per 256
    fp32 = memory.estimate(planned(cfg(**{"optimizer.name": "adamw_8bit", "precision": "fp32"}), TINY),
                           partition_size=2, gpu_capacity=10**9)
    assert fp32.optimizer == int((2 + 2 * 4 / 256) * shard)     # fp32 weights are their own master
    four = memory.estimate(planned(cfg(**{"optimizer.name": "adamw_4bit"}), TINY), partition_size=2,
                           gpu_capacity=10**9)
    assert four.optimizer == int((4 + 1 + 2 * 4 / 256) * shard)  # 4-bit m, v (two a byte) + an fp32 scale per 256


def test_bf16_states_keep_four_bytes_per_parameter_on_the_flat_adamw_and_zero3_six_on_zero12():
    """optimizer.state_dtype: bf16 (no fp32 master, bf16 m and v): 4 bytes a trained parameter on the flat AdamW
    (tp alone) and under ZeRO-3 (DeepSpeed's bf16 master partition is the weights' own), 6 under ZeRO-1/2 (a bf16
    copy of them); the DeepSpeed config says so; refused beside fp32 weights and 8-bit moments, in one line."""
    import pytest

    from adapter.errors import UserError
    from adapter.parallel import deepspeed_config

    one, bf = {"parallelism.dp_shard_size": 1}, {"optimizer.state_dtype": "bf16"}
    local = 102720  # one TP rank's parameters (test_padded_vocab_and_local_params)
    est = memory.estimate(planned(cfg(**one, **bf), TINY), partition_size=1, gpu_capacity=10**9, stage=1)
    fp32 = memory.estimate(planned(cfg(**one), TINY), partition_size=1, gpu_capacity=10**9, stage=1)
    assert fp32.optimizer == 12 * local and est.optimizer == 4 * local  # master + m + v, or bf16 m + v
    assert deepspeed_config.zero_stage(cfg(**one, **bf), Layout(1, 1, 1, 2)) == 1
    for stage, per in ((3, 4), (2, 6)):
        run = planned(cfg(**bf, **{"deepspeed.zero_stage": stage}), TINY)
        est = memory.estimate(run, partition_size=2, gpu_capacity=10**9, stage=stage)
        assert est.optimizer == per * -(-local // 2), (stage, est.optimizer)
        conf = deepspeed_config.build(run.cfg, Layout(1, 2, 1, 2))["bf16"]
        assert conf["bf16_master_weights_and_grads"] and conf["bf16_optimizer_states"], conf
    with pytest.raises(UserError, match=r"optimizer.state_dtype: bf16 applies to bf16 weights, and precision is fp32"):
        cfg(**{"optimizer.state_dtype": "bf16", "precision": "fp32"})
    with pytest.raises(UserError, match=r"optimizer.name: adamw_8bit 8-bit ones: choose one"):
        cfg(**{"optimizer.state_dtype": "bf16", "optimizer.name": "adamw_8bit"})


def test_local_attention_adds_the_score_matrix():
    sdpa = memory.layer_activations(TINY, seq=32, micro=2, tp=2, cp=1, sp=True, attention="sdpa")
    local = memory.layer_activations(TINY, seq=32, micro=2, tp=2, cp=1, sp=True, attention="local")
    assert local - sdpa == 2 * 2 * 32 * 32 * 2 * 4 // 2     # scores + softmax, bf16, 4 heads / tp


@pytest.mark.parametrize("eager", [True, False])
def test_soft_capped_attention_counts_what_autograd_keeps(eager):
    """Gemma 2's soft-capped scores run through math_attention: the bytes it saves for backward beyond q, k, v
    (measured with saved-tensor hooks, deduplicated by storage) are what plan adds, plus the shared bool mask; op
    by op (eager) and as a compiled layer runs it (inductor's partitioner keeps the 16-bit scores and
    probabilities, not the fp32 softmax)."""
    import torch

    from adapter.kernels.varlen import math_attention, window_mask

    hf = {"architectures": ["Gemma2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 1000}
    capped, plain = (arch_from_hf_dict({**hf, "attn_logit_softcapping": c}) for c in (50.0, None))
    kw = dict(seq=32, micro=2, tp=1, cp=1, sp=False, attention="sdpa", eager=eager)
    added = memory.layer_activations(capped, **kw) - memory.layer_activations(plain, **kw)
    q = torch.randn(2, 4, 32, 16, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, 32, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    allowed = window_mask(32, 32, 8, q.device)
    saved = {}

    def keep(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    attend = math_attention if eager else torch.compile(math_attention, fullgraph=True)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        attend(q, k, v, 0.25, allowed, 50.0)
    inputs = sum(saved.pop(t.untyped_storage().data_ptr(), 0) for t in (q, k, v))
    assert inputs == q.untyped_storage().nbytes()   # K and V are saved only as their repeated copies
    kept = sum(saved.values())
    if not eager:  # the row max and sum of the softmax (fp32, one per query and head), besides the S×S tensors
        kept -= 2 * 4 * 2 * 4 * 32
    assert kept == added + 2 * 2 * 2 * 32 * 16 * 2 + allowed.numel()  # + K, V as counted already


def test_zero3_traffic_by_hand():
    c = cfg()
    rows = {r.group: r for r in traffic.estimate(planned(c, TINY, Layout(1, 2, 1, 2)))}
    # ZeRO-3 over 2 ranks: 3 × (2 bytes × 102720 params × 1/2)
    assert rows["dp_shard_cp"].bytes_per_step == 3 * 102720
    # TP: (4·2 + 2) collectives × 2 × (2·32·2·64 bytes) × 1/2
    assert rows["tp"].bytes_per_step == 10 * 2 * 8192 // 2


def test_zero_stage_only_when_there_is_something_to_shard():
    from adapter.parallel import deepspeed_config

    tp_only = cfg(**{"parallelism.dp_shard_size": 1})
    assert deepspeed_config.build(tp_only, Layout(1, 1, 1, 2))["zero_optimization"] == {"stage": 0}  # flat AdamW
    ds = cfg(**{"parallelism.dp_shard_size": 1, "optimizer.impl": "deepspeed"})
    assert deepspeed_config.build(ds, Layout(1, 1, 1, 2))["zero_optimization"] == {"stage": 1}
    assert deepspeed_config.build(cfg(), Layout(1, 2, 1, 2))["zero_optimization"]["stage"] == 3


def test_optimizer_step_transients_by_stage():
    """ZeRO-1/2 step: flat 16-bit partition copy + fp32 copy of the whole partition (2 + 4 bytes/param on top of the
    16 of model states); ZeRO-3: one fp32 sub_group. The Mistral-7B shape on one H200 (docs/BENCHMARKS.md,
    2026-12-01, "the one-GPU memory check") peaks there and ran out of memory at every micro-batch size under
    DeepSpeed's step; plan must say so. The flat AdamW (the default with nothing to shard) has no step transient."""
    from pathlib import Path

    from adapter.models.arch import load_arch

    mistral = load_arch(Path(__file__).resolve().parents[2] / "configs/models/mistral-7b")
    one = cfg(**{"parallelism.dp_shard_size": 1, "parallelism.tp_size": 1, "seq_len": 4096, "recompute": "full",
                 "optimizer.impl": "deepspeed"})
    P = counts.local_params(mistral, 1).total(mistral.num_layers)
    flat = cfg(**{"parallelism.dp_shard_size": 1, "parallelism.tp_size": 1, "seq_len": 4096, "recompute": "full"})
    est = memory.estimate(planned(flat, mistral), partition_size=1, gpu_capacity=memory.GPUS["h200"][0], stage=1)
    assert est.comm_buffers == 0 and est.peak_phase == "forward_backward" and est.fits  # the flat AdamW: in place
    est = memory.estimate(planned(one, mistral), partition_size=1, gpu_capacity=memory.GPUS["h200"][0], stage=1)
    assert est.comm_buffers == (2 + 4) * P and est.peak == 22 * P and est.peak_phase == "optimizer_step"
    assert not est.fits and 22 * P / memory.GIB > 148
    z3 = memory.estimate(planned(cfg(), TINY), partition_size=2, gpu_capacity=10**9, stage=3)
    assert z3.comm_buffers - 2 * 2 * min(500_000_000, 102720) == 4 * (102720 // 2)   # buckets + fp32 shard
    big = memory.estimate(planned(one, mistral), partition_size=2, gpu_capacity=10**13, stage=3)
    # ZeRO-3 steps one sub_group of 1e9 at a time (not the 3.6e9-element shard), beside 2 overlapped 5e8 buckets
    assert big.comm_buffers == 4 * memory.SUB_GROUP + 2 * 2 * 500_000_000
    room = int(22 * P * (1 + memory.MARGIN)) + memory.RUNTIME_RESERVE  # peak + the model's margin + the runtime
    assert memory.estimate(planned(one, mistral), partition_size=1, gpu_capacity=room + 1, stage=1).fits
    assert not memory.estimate(planned(one, mistral), partition_size=1, gpu_capacity=room - 2**20, stage=1).fits


def test_packed_documents_by_hand():
    """Packed documents (data.document_mask): no s×s term, key prefixes under all-gather CP, one RoPE row per token."""
    kw = dict(micro=2, tp=2, sp=True, attention="sdpa")
    dense = memory.layer_activations(TINY, seq=32, cp=1, **kw)
    assert memory.layer_activations(TINY, seq=32, cp=1, packed=True, **kw) == dense == 53760  # same per-token terms
    assert memory.layer_activations(TINY, seq=64, cp=1, packed=True, **kw) == 2 * dense     # linear in seq
    # cp=2 all-gather, s = 16 per rank: q 2·16·2·64/2 = 2048, attn out 2048, lse 4·16·2·4/2 = 256, norms 8192,
    # mlp 12288; K,V: the gathered sequence (32) for dense, the key prefixes 32·5/4 = 40 for packed, ×2·2·32/2
    ag = dict(seq=32, cp=2, cp_comm="all_gather", **kw)
    assert memory.layer_activations(TINY, **ag) == 2048 + 2048 + 256 + 8192 + 12288 + 2 * 32 * 2 * 2 * 32 // 2
    assert memory.layer_activations(TINY, packed=True, **ag) - memory.layer_activations(TINY, **ag) == \
        2 * (40 - 32) * 2 * 2 * 32 // 2
    est = memory.estimate(planned(cfg(**{"data.document_mask": True}), TINY), partition_size=2, gpu_capacity=10**9)
    assert est.activations_no_recompute == 2 * 53760 + 3 * 4096 + 4 * 32 * 2 * 16  # + fp32 RoPE angles [s·b, d]


def test_attention_flops_by_hand():
    # 2 layers, 4 heads × 16, s=32, b=2: forward 4·(32·32/2)·4·16·2·2 = 524,288; × 3.5 fwd+bwd; / (tp·cp)
    assert memory.attention_flops(TINY, seq=32, micro=2, tp=1, cp=1) == 3.5 * 524288
    assert memory.attention_flops(TINY, seq=32, micro=2, tp=2, cp=2) == 3.5 * 524288 / 4
    assert memory.attention_flops(TINY, seq=32, micro=2, tp=1, cp=1, doc_len=8) == 3.5 * 524288 / 4  # s·ℓ, not s²
    assert memory.attention_flops(TINY, seq=32, micro=2, tp=1, cp=1, doc_len=64) == 3.5 * 524288    # ℓ ≤ s


def test_cp_traffic_by_hand():
    # kv = 2 bytes · s=16 · b=2 · 2 · 16 head_dim · (2 kv heads / tp 1) = 4096 per layer; 2 layers
    for comm, per_layer in (("all_gather", 2 * 1 * 4096),              # all-gather + reduce-scatter, (cp−1)·kv each
                            ("p2p", 2 * 1 * 4096 + 2 * 4096 * 4 // 2)):  # block hops fwd+bwd; cp fp32 gradient hops
        for mask in (False, True):  # the same volume with packed documents: 1/cp of every document per rank
            c = cfg(**{"parallelism.cp_size": 2, "parallelism.tp_size": 1, "parallelism.cp_comm_type": comm,
                       "data.document_mask": mask})
            rows = {r.group: r for r in traffic.estimate(planned(c, TINY, Layout(1, 2, 2, 1)))}
            assert rows["cp"].bytes_per_step == 2 * per_layer, (comm, mask)
            assert ("packed documents" in rows["cp"].what) == mask


def test_plan_attention_cost():
    from adapter.plan.build import attention_cost

    dense = attention_cost(cfg(), TINY)
    assert not dense.packed_documents and dense.doc_len == 32 and dense.kernel == "SDPA causal"
    assert dense.flops_per_gpu_step == memory.attention_flops(TINY, seq=32, micro=2, tp=2, cp=1)
    syn = attention_cost(cfg(**{"data.document_mask": True, "data.synthetic": True, "data.synthetic_doc_len": 8}),
                         TINY)
    assert syn.packed_documents and syn.doc_len == 8 and syn.flops_per_gpu_step == dense.flops_per_gpu_step / 4
    real = attention_cost(cfg(**{"data.document_mask": True, "parallelism.cp_size": 2}), TINY)
    assert real.doc_len == 32 and "upper bound" in real.doc_len_source and "split over cp=2" in real.kernel


def test_compiled_fp8_layers_keep_less():
    """precision fp8 in compiled layers: each fp8 MLP linear's bf16 input is not kept (fitted to H200 peaks: 2 bytes
    × tokens × (hidden for fc1 + FFN for fc2) per layer); eager fp8 is not modelled."""
    one_gpu = {"parallelism.tp_size": 1, "parallelism.dp_shard_size": 1}
    base = memory.estimate(planned(cfg(**one_gpu, **{"model.compile": True}), TINY), partition_size=1, gpu_capacity=1)
    fp8 = memory.estimate(planned(cfg(**one_gpu, **{"model.compile": True, "precision": "fp8"}), TINY),
                          partition_size=1, gpu_capacity=1)
    fc1 = memory.estimate(planned(cfg(**one_gpu, **{"model.compile": True, "precision": "fp8",
                                                    "model.fp8_linears": ["fc1"]}), TINY),
                          partition_size=1, gpu_capacity=1)
    eager = memory.estimate(planned(cfg(**one_gpu, **{"model.compile": False, "precision": "fp8"}), TINY),
                            partition_size=1, gpu_capacity=1)
    tokens = 32 * 2
    assert base.activations - fp8.activations == 2 * 2 * tokens * (64 + 128)    # 2 layers
    assert base.activations - fc1.activations == 2 * 2 * tokens * 64
    assert base.activations_full_recompute - fp8.activations_full_recompute == 2 * tokens * (64 + 128)  # one layer
    assert eager.activations == base.activations


def test_eager_gemma_layers_count_what_autograd_keeps():
    """Without `model.compile` Gemma's norms (scaled by 1 + w, computed in fp32: adapter/modeling/gpt.RMSNorm) keep
    8 bytes an element (measured here with saved-tensor hooks, deduplicated by storage: the fp32 input copy and the
    fp32 normed output), not the 16-bit input a compiled layer keeps; its unfused GeGLU keeps the activation's output
    too. The plan adds exactly that for the eager layers (2 pre-norms, 2 post-norms, q/k norms, one FFN-wide tensor);
    against the GPU's measured peaks: tests/unit/test_timing.py."""
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    from adapter.modeling.gpt import RMSNorm

    conf = SimpleNamespace(use_cpu_initialization=True, params_dtype=torch.bfloat16, sequence_parallel=False,
                           layernorm_zero_centered_gamma=True)
    norm, x = RMSNorm(conf, 64, eps=1e-6), torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = {}

    def keep(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        norm(x)
    per_element = sum(n for n in saved.values() if n >= x.numel()) / x.numel()
    assert per_element == 8

    from adapter.models.arch import load_arch

    root = Path(__file__).resolve().parents[2]

    gemma = load_arch(root / "configs/models/gemma-3-4b-shape")
    assert gemma.norm_offset and gemma.post_norms and gemma.qk_norm and gemma.activation == "gelu_tanh"
    kw = dict(seq=64, micro=2, tp=1, cp=1, sp=False, attention="sdpa")
    tokens, h, f = 128, gemma.hidden_size, gemma.routed_ffn
    qk = (gemma.num_heads + gemma.num_kv_heads) * gemma.head_dim
    added = memory.layer_activations(gemma, eager=True, **kw) - memory.layer_activations(gemma, **kw)
    assert added == (per_element - 2) * tokens * (2 * h + 2 * h + qk) + 2 * tokens * f


def test_peft_fp32_adapters_keep_an_fp32_copy_of_each_adapted_input():
    """What plan counts of PEFT's LoRA on the transformers engine (memory.peft_activations): get_peft_model keeps
    the adapters in fp32 over a bf16 base, and each adapted linear keeps an fp32 copy of its input (q, k and v each
    their own): measured here on transformers' Llama with saved-tensor hooks, against Σ in_features of the adapted
    linears as the plan counts them on the meta-device model (generic_run._peft_counts)."""
    import json

    import peft
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from adapter.models.generic_run import _peft_counts

    conf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 160,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128}
    kw = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear", "task_type": "CAUSAL_LM"}
    inputs = _peft_counts(json.dumps(conf, sort_keys=True), False, None, json.dumps(kw, sort_keys=True))[-1]
    assert inputs == 2 * (5 * 64 + 64 + 160)  # per layer: q, k, v, gate, up (hidden), o (heads × dim), down (FFN)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in conf.items() if k != "architectures"}))
    model = peft.get_peft_model(model.to(torch.bfloat16), peft.LoraConfig(**kw))
    tokens, saved = 16, {}

    def keep(t):
        saved[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(input_ids=torch.randint(0, 128, (1, tokens)))
    copies = [t for t in saved.values() if t.dtype == torch.float32 and t.dim() == 2 and t.shape[0] == tokens
              and t.shape[1] in (64, 160)]  # (the fp32 norms keep [1, tokens, hidden] copies of their own)
    assert sum(t.numel() for t in copies) * 4 == 4 * tokens * inputs


def test_attention_saves_no_view_of_the_fused_qkv_output():
    """V split from the fused QKV projection's output is a view: saved for backward as it is, it kept the whole
    buffer alive in every layer (the 1B shape's peak: +0.63 GiB over transformers + Liger, which projects V apart).
    SDPAttention saves its own copy; q and k are new tensors after RoPE, as here."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    from adapter.kernels.attention import SDPAttention
    from adapter.modeling.gpt import transformer_config

    arch = arch_from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 1,
                              "vocab_size": 1000})
    attn = SDPAttention(transformer_config(arch), 1, AttnMaskType.causal, "self",
                        pg_collection=type("P", (), {"tp": None, "cp": None})())
    qkv = torch.randn(32, 2, 2, 4 * 16, requires_grad=True)  # [s, b, groups, (2 q heads + k + v) · d], as Megatron's
    q, k, v = torch.split(qkv, [32, 16, 16], dim=-1)
    q, k = q.reshape(32, 2, 4, 16) * 1.0, k * 1.0  # RoPE's outputs: new tensors
    saved = set()

    def keep(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = attn(q, k, v, None)
    assert qkv.untyped_storage().data_ptr() not in saved
    out.sum().backward()
    assert qkv.grad[..., 48:].abs().sum() > 0  # V's gradient still reaches the projection
