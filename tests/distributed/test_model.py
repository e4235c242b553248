"""GPTModel built by adapter.modeling.gpt reproduces HF models: random tiny HF checkpoints, copied with the mapping of
docs/internals.md.

The copy helper is deliberately local (the real tables live in adapter/convert), so this test pins the model
builder, not the converter. Each distributed case runs in fresh gloo processes (tests/helpers/dist.py).
"""
from __future__ import annotations

import torch

from tests.helpers.dist import run_workers
from tests.helpers.gpt import VOCAB, hf_config, init_megatron

SEQ = 32
TOL = 1e-5


def hf_model(family: str, **over):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(family, **over), dtype=torch.float32).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomise so the mapping is really checked
        for n, p in model.named_parameters():
            if "norm" in n or "bias" in n:
                p.normal_(1.0 if "norm" in n else 0.0, 0.1)
    return model


def copy_hf_to_megatron(hf, model, arch, tp: int, rank: int) -> None:
    """The HF->GPTModel mapping of docs/internals.md, sliced for TP rank `rank` (local helper; adapter/convert owns
    the real one)."""
    sd = hf.state_dict()
    d, ng = arch.head_dim, arch.num_kv_heads
    hpg = arch.num_heads // ng
    padded = model.vocab_size

    def rows(t):  # vocab-padded and split over TP
        full = torch.zeros(padded, *t.shape[1:])
        full[:t.size(0)] = t
        return full.chunk(tp)[rank]

    def qkv(p, suffix):
        q, k, v = (sd[f"{p}.self_attn.{x}_proj.{suffix}"] for x in "qkv")
        tail = q.shape[1:]
        fused = torch.cat([q.view(ng, hpg * d, *tail), k.view(ng, d, *tail), v.view(ng, d, *tail)], 1)
        return fused.reshape(-1, *tail).chunk(tp)[rank]

    out = {"embedding.word_embeddings.weight": rows(sd["model.embed_tokens.weight"]),
           "decoder.final_layernorm.weight": sd["model.norm.weight"]}
    if not arch.tie_embeddings:
        out["output_layer.weight"] = rows(sd["lm_head.weight"])
    for i in range(arch.num_layers):
        p, m = f"model.layers.{i}", f"decoder.layers.{i}"
        gate, up = (sd[f"{p}.mlp.{x}_proj.weight"].chunk(tp)[rank] for x in ("gate", "up"))
        out.update({
            f"{m}.input_layernorm.weight": sd[f"{p}.input_layernorm.weight"],
            f"{m}.self_attention.linear_qkv.weight": qkv(p, "weight"),
            f"{m}.self_attention.linear_proj.weight": sd[f"{p}.self_attn.o_proj.weight"].chunk(tp, 1)[rank],
            f"{m}.pre_mlp_layernorm.weight": sd[f"{p}.post_attention_layernorm.weight"],
            f"{m}.mlp.linear_fc1.weight": torch.cat([gate, up]),
            f"{m}.mlp.linear_fc2.weight": sd[f"{p}.mlp.down_proj.weight"].chunk(tp, 1)[rank],
        })
        if arch.qkv_bias:
            out[f"{m}.self_attention.linear_qkv.bias"] = qkv(p, "bias")
        if arch.qk_norm:
            out[f"{m}.self_attention.q_layernorm.weight"] = sd[f"{p}.self_attn.q_norm.weight"]
            out[f"{m}.self_attention.k_layernorm.weight"] = sd[f"{p}.self_attn.k_norm.weight"]
    missing, unexpected = model.load_state_dict(out, strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith("_extra_state")], (missing, unexpected)


def max_logit_diff(family: str, tp: int, rank: int, **build) -> float:
    from adapter.modeling.gpt import build_gpt_model, forward_logits
    from adapter.models.arch import arch_from_hf_dict

    hf = hf_model(family)
    arch = arch_from_hf_dict(hf.config.to_dict())
    model = build_gpt_model(arch, tp=tp, **build).eval()
    copy_hf_to_megatron(hf, model, arch, tp, rank)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        got = forward_logits(model, ids, vocab_size=VOCAB)
    return (ref - got).abs().max().item()


def sdpa_vs_local() -> float:
    """Our core attention against Megatron's local DotProductAttention on the same GQA inputs."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from adapter.kernels.attention import SDPAttention
    from adapter.modeling.gpt import transformer_config
    from adapter.models.arch import arch_from_hf_dict

    cfg = transformer_config(arch_from_hf_dict(hf_config("llama").to_dict()))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(SEQ, 2, n, 16, generator=g) for n in (4, 2, 2))
    outs = [cls(cfg, 1, AttnMaskType.causal, "self")(q, k, v, None) for cls in (SDPAttention, DotProductAttention)]
    assert outs[0].shape == (SEQ, 2, 64)
    return (outs[0] - outs[1]).abs().max().item()


def packed_diff() -> float:
    """Packed documents equal the HF model run on each document separately: Megatron's THD PackedSeqParams (two
    documents in one row), and our packed batches (adapter.kernels.thd: two samples, five documents)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from adapter.kernels.thd import pack_batch
    from adapter.modeling.gpt import build_gpt_model
    from adapter.models.arch import arch_from_hf_dict

    hf = hf_model("qwen3")
    arch = arch_from_hf_dict(hf.config.to_dict())
    model = build_gpt_model(arch).eval()
    copy_hf_to_megatron(hf, model, arch, 1, 0)
    a, b = torch.randint(0, VOCAB, (1, 10)), torch.randint(0, VOCAB, (1, 22))
    cu = torch.tensor([0, 10, 32], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=22, max_seqlen_kv=22)
    docs = ([3, 10, 19], [5, 27])
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    seg = torch.tensor([[i for i, n in enumerate(d) for _ in range(n)] for d in docs])
    stream, params = pack_batch({"tokens": ids, "labels": ids, "loss_mask": torch.ones(2, SEQ), "segment_ids": seg})
    with torch.no_grad():
        got = model(torch.cat([a, b], 1), None, None, packed_seq_params=packed)[..., :VOCAB]
        ref = torch.cat([hf(a).logits, hf(b).logits], 1)
        got2 = model(stream["tokens"], stream["position_ids"], None, packed_seq_params=params)[..., :VOCAB]
        ref2 = torch.cat([hf(ids[i:i + 1, sum(d[:j]):sum(d[:j + 1])]).logits
                          for i, d in enumerate(docs) for j in range(len(d))], 1)
    return max((got - ref).abs().max().item(), (got2 - ref2).abs().max().item())


def tp_grad_diff(rank: int) -> float:
    """tp=2 with SP and Qwen3 q/k norms: after summing `tp_grad_sum_params` grads over TP, every replicated norm
    weight has HF's gradient (the training loop's duty, docs/internals.md)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state

    from adapter.modeling.gpt import build_gpt_model, tp_grad_sum_params
    from adapter.models.arch import arch_from_hf_dict

    hf = hf_model("qwen3")
    arch = arch_from_hf_dict(hf.config.to_dict())
    model = build_gpt_model(arch, tp=2, sequence_parallel=True, padded_vocab=VOCAB)  # no padding rows: HF's softmax
    copy_hf_to_megatron(hf, model, arch, 2, rank)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    model(ids, None, None, labels=labels).sum().backward()
    summed = tp_grad_sum_params(model)
    for p in summed:
        dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())
    F.cross_entropy(hf(ids).logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    names = {"input_layernorm": "input_layernorm", "pre_mlp_layernorm": "post_attention_layernorm",
             "self_attention.q_layernorm": "self_attn.q_norm", "self_attention.k_layernorm": "self_attn.k_norm"}
    diffs = [(dict(model.named_parameters())["decoder.final_layernorm.weight"].grad - hf_grads["model.norm.weight"])]
    for i in range(arch.num_layers):
        for m, h in names.items():
            diffs.append(dict(model.named_parameters())[f"decoder.layers.{i}.{m}.weight"].grad
                         - hf_grads[f"model.layers.{i}.{h}.weight"])
    assert len(summed) == len(diffs), (len(summed), len(diffs))
    return max(d.abs().max().item() for d in diffs)


def _worker(rank, world):
    """tp=1 (each rank its own families: the world is data parallel), then tp=2 with and without SP."""
    init_megatron(tp=1)
    diffs = {"llama": max_logit_diff("llama", 1, 0), "llama_local": max_logit_diff("llama", 1, 0, attention="local"),
             "sdpa_vs_local": sdpa_vs_local()} if rank == 0 else \
        {"qwen2": max_logit_diff("qwen2", 1, 0), "qwen3": max_logit_diff("qwen3", 1, 0),
         "qwen3_packed": packed_diff()}
    init_megatron(tp=2)
    diffs.update({"tp2_llama": max_logit_diff("llama", 2, rank),
                  "tp2_llama_sp": max_logit_diff("llama", 2, rank, sequence_parallel=True),
                  "tp2_qwen3_sp": max_logit_diff("qwen3", 2, rank, sequence_parallel=True),
                  "tp2_qwen3_sp_norm_grads": tp_grad_diff(rank)})
    return diffs


def test_matches_hf_at_tp1_tp2_and_sequence_parallel():
    results = run_workers(_worker, 2, timeout=180)
    want = {"llama", "llama_local", "qwen2", "qwen3", "qwen3_packed", "sdpa_vs_local"}
    assert want <= results[0].keys() | results[1].keys()
    for diffs in results:
        assert all(v <= TOL for v in diffs.values()), diffs


def _fused_worker(rank, world):
    """Fused kernels (adapter/kernels/fusions.py eager on CPU; Megatron's SwiGLU via torch.compile): fp32 logits match
    HF; bf16 agrees with the unfused model to bf16 rounding; the cross-entropy equals Megatron's at tp=2."""
    from megatron.core import parallel_state, tensor_parallel

    from adapter.kernels.fusions import vocab_parallel_cross_entropy
    from adapter.modeling.gpt import FusedLossGPTModel, build_gpt_model
    from adapter.models.arch import arch_from_hf_dict

    init_megatron(tp=1)
    out = {"fp32_vs_hf": max_logit_diff("llama", 1, 0, fused_kernels=True)}
    arch = arch_from_hf_dict(hf_config("llama").to_dict())
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    losses, grads, flags = [], [], []
    for fused in (False, True):
        torch.manual_seed(0)
        model = build_gpt_model(arch, params_dtype=torch.bfloat16, fused_kernels=fused)
        flags.append((model.config.bias_activation_fusion, model.config.apply_rope_fusion,
                      isinstance(model, FusedLossGPTModel), model.rope_tables))
        loss = model(ids[:, :-1], None, None, labels=ids[:, 1:]).float().mean()
        loss.backward()
        losses.append(loss.item())
        grads.append(model.output_layer.weight.grad.float())
    out["flags"] = flags
    out["bf16_loss_rel"] = abs(losses[0] - losses[1]) / losses[0]
    out["bf16_grad_rel"] = ((grads[0] - grads[1]).abs().max() / grads[0].abs().max()).item()

    init_megatron(tp=2)  # vocab-parallel: each rank holds half the vocabulary
    g = torch.Generator().manual_seed(5)
    full = torch.randn(16, 3, 2 * 50, generator=g) * 4
    target = torch.randint(0, 100, (16, 3), generator=g)
    dloss = torch.rand(16, 3, generator=g)
    res = []
    for fn in (lambda x: vocab_parallel_cross_entropy(x, target, parallel_state.get_tensor_model_parallel_group()),
               lambda x: tensor_parallel.vocab_parallel_cross_entropy(x, target)):
        x = full.chunk(2, -1)[rank].clone().requires_grad_()
        loss = fn(x)
        (loss * dloss).sum().backward()
        res.append((loss.detach(), x.grad))
    out["tp2_ce_loss"] = (res[0][0] - res[1][0]).abs().max().item()
    out["tp2_ce_grad"] = (res[0][1] - res[1][1]).abs().max().item()
    return out


def test_fused_kernels_match_unfused():
    for r in run_workers(_fused_worker, 2, timeout=300):
        assert r["flags"] == [(False, False, False, False), (True, True, True, True)], r
        assert r["fp32_vs_hf"] <= TOL and r["tp2_ce_loss"] <= TOL and r["tp2_ce_grad"] <= TOL, r
        assert r["bf16_loss_rel"] <= 2e-3 and r["bf16_grad_rel"] <= 3e-2, r  # bf16 eps is 7.8e-3


def _compile_worker(rank, world):
    """`model.compile`: at tp=1 every layer is one graph (no breaks) shared by all layers, and loss and gradients
    match eager; at tp=2 the graph breaks at Megatron's linears but the math is unchanged."""
    import functools

    import torch._dynamo
    from torch._dynamo.utils import counters

    # Dynamo's capture, AOTAutograd's decompositions and its min-cut partitioner (the memory budget) without
    # inductor's C++ code generation, which no user runs (CUDA's Triton path: tests/gpu/test_packed.py) and which
    # cost this test 40 s of CI; this worker process only
    torch.compile = functools.partial(torch.compile, backend="aot_eager_decomp_partition")

    from adapter.kernels.thd import pack_batch
    from adapter.modeling.compile import compile_layers
    from adapter.modeling.gpt import build_gpt_model
    from adapter.models.arch import arch_from_hf_dict

    out = {}
    arch = arch_from_hf_dict(hf_config("llama", num_hidden_layers=4).to_dict())
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))

    def packed(docs):  # documents as the loop packs them (PackedDocs.to marks cu_seqlens dynamic)
        seg = torch.tensor([[i for i, n in enumerate(d) for _ in range(n)] for d in docs])
        stream, params = pack_batch({"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(2, SEQ),
                                     "segment_ids": seg})
        return stream, params.to("cpu")

    for tp in (1, 2):
        init_megatron(tp=tp)
        runs = []
        for compiled in (False, True):
            torch.manual_seed(0)
            model = build_gpt_model(arch, tp=tp)
            if compiled:
                torch._dynamo.reset()
                counters.clear()
                assert compile_layers(model) == 4
            loss = model(ids[:, :-1], None, None, labels=ids[:, 1:]).float().mean()
            loss.backward()
            runs.append([(loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})])
            if tp == 1:  # packed documents: the varlen op stays inside the graph; new document counts reuse it
                if compiled:
                    out["graph_breaks"] = sum(counters["graph_break"].values())
                    out["graphs"] = counters["stats"]["unique_graphs"]
                for docs in (([3, 10, 19], [5, 27]), ([2] * 16, [1, 31])):
                    if compiled:
                        out["packed_graphs_before_second"] = counters["stats"]["unique_graphs"]
                    model.zero_grad()
                    stream, params = packed(docs)
                    loss = model(stream["tokens"], stream["position_ids"], None, labels=stream["labels"],
                                 packed_seq_params=params).float().mean()
                    loss.backward()
                    runs[-1].append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
                if compiled:
                    out["packed_graph_breaks"] = sum(counters["graph_break"].values()) - out["graph_breaks"]
                    out["packed_graphs_second"] = counters["stats"]["unique_graphs"] - out.pop(
                        "packed_graphs_before_second")
        for i, ((l0, g0), (l1, g1)) in enumerate(zip(*runs)):
            name = f"tp{tp}_packed{i}" if i else f"tp{tp}"
            out[f"{name}_loss"] = abs(l0 - l1)
            out[f"{name}_grad"] = max((g0[n] - g1[n]).abs().max().item() for n in g0)
        if tp == 1:  # model.compile_memory_budget: the partitioner recomputes instead of saving; same maths
            saved = {}
            for budget in (None, 0.3):
                torch.manual_seed(0)
                model = build_gpt_model(arch, tp=1)
                torch._dynamo.reset()
                compile_layers(model, memory_budget=budget)
                nbytes = []
                with torch.autograd.graph.saved_tensors_hooks(
                        lambda t, nbytes=nbytes: (nbytes.append(t.numel() * t.element_size()), t)[1], lambda t: t):
                    loss = model(ids[:, :-1], None, None, labels=ids[:, 1:]).float().mean()
                loss.backward()
                saved[budget] = sum(nbytes)
            torch._functorch.config.activation_memory_budget = 1.0
            (l0, g0) = runs[0][0]
            out["tp1_budget_loss"] = abs(loss.item() - l0)
            out["tp1_budget_grad"] = max((g0[n] - p.grad).abs().max().item() for n, p in model.named_parameters())
            out["saved_bytes"] = saved
    return out


def test_compiled_layers_match_eager():
    for r in run_workers(_compile_worker, 2, timeout=600):
        assert all(v <= TOL for k, v in r.items() if k.endswith(("_loss", "_grad"))), r
        assert {"tp1_loss", "tp2_grad", "tp1_packed1_grad", "tp1_packed2_grad", "tp1_budget_grad"} <= r.keys(), r
        assert r["saved_bytes"][0.3] < r["saved_bytes"][None], r   # the budget made the layers keep less
        assert r["graph_breaks"] == 0, r  # e.g. Megatron's tp_group=None warning (adapter/patches/mcore.py) would
        assert r["graphs"] == 1, r        # four layers, one compiled graph
        # packed documents: no graph break, and a new document count needs no new graph (cu_seqlens are dynamic)
        assert r["packed_graph_breaks"] == 0 and r["packed_graphs_second"] == 0, r


def _linear_ce_worker(rank, world):
    """The fused linear + cross-entropy (tokens in chunks, gradients in the forward) against GPTModel's own output
    layer + cross-entropy: the masked loss sum and every parameter's gradient, fp32, at tp 1 and 2 (with and without
    sequence parallelism), tied and untied, with an uneven 0/1 loss mask and chunks that do not divide the tokens;
    and at tp 2 with Gemma 2's final soft-capping (a cap small enough to bend these logits)."""
    import dataclasses
    from unittest import mock

    from adapter.kernels import fusions
    from adapter.modeling.gpt import build_gpt_model
    from adapter.models.arch import arch_from_hf_dict

    out = {}
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    mask = (torch.rand(2, SEQ, generator=g) > 0.4).float()
    for tp, sp, tie, cap in ((1, False, False, None), (1, False, True, None), (2, False, False, None),
                             (2, True, True, None), (2, False, False, 0.05)):
        if tp > world:
            continue
        init_megatron(tp=tp)
        arch = dataclasses.replace(arch_from_hf_dict(hf_config("llama", tie_word_embeddings=tie).to_dict()),
                                   final_softcap=cap)
        res = []
        for linear_ce in (False, True):
            torch.manual_seed(0)
            model = build_gpt_model(arch, tp=tp, sequence_parallel=sp, fused_kernels=True, linear_ce=linear_ce)
            with mock.patch.object(fusions, "linear_ce_chunk", lambda rows: 7):  # 7 tokens a chunk
                out_ = model(ids[:, :-1], None, None, labels=ids[:, 1:], loss_mask=mask)
            total = out_ if out_.dim() == 0 else (out_.float() * mask).sum()
            total.backward()
            res.append((total.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (l0, g0), (l1, g1) = res
        key = f"tp{tp}{'_sp' if sp else ''}{'_tied' if tie else ''}{'_softcap' if cap else ''}"
        out[key] = (abs(l0 - l1).item() / abs(l0).item(), max((g0[n] - g1[n]).abs().max().item() for n in g0),
                    res[1][0].dim())
    return out


def test_fused_linear_cross_entropy_matches_unfused():
    for r in run_workers(_linear_ce_worker, 2, timeout=300):
        assert set(r) == {"tp1", "tp1_tied", "tp2", "tp2_sp_tied", "tp2_softcap"}, r
        for key, (loss_rel, grad_diff, ndim) in r.items():
            assert ndim == 0 and loss_rel <= TOL and grad_diff <= TOL, (key, r[key])


def _padded_vocab_worker(rank, world):
    """The vocabulary is padded to a multiple of 128·tp (200 → 256 rows here, all padding on the last rank's tail):
    the padding rows' logits must never enter the softmax, or the loss and every gradient differ from HF's. Masked
    loss sum and the final norm's gradient against HF, for Megatron's cross-entropy, ours, and the fused linear CE."""
    import torch.nn.functional as F

    from adapter.modeling.gpt import build_gpt_model
    from adapter.models.arch import arch_from_hf_dict

    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    mask = (torch.rand(2, SEQ, generator=g) > 0.3).float()
    out = {}
    for tie in (False, True):
        hf = hf_model("llama", tie_word_embeddings=tie)
        logits = hf(ids[:, :-1]).logits
        ref = (F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none") * mask.flatten()).sum()
        ref.backward()
        ref_grad = hf.model.norm.weight.grad
        arch = arch_from_hf_dict(hf.config.to_dict())
        for tp in (1, 2):
            init_megatron(tp=tp)
            for name, build in (("megatron_ce", {}), ("fused_ce", {"fused_kernels": True}),
                                ("linear_ce", {"fused_kernels": True, "linear_ce": True})):
                model = build_gpt_model(arch, tp=tp, **build)
                assert model.vocab_size == 256
                copy_hf_to_megatron(hf, model, arch, tp, rank % tp)
                got = model(ids[:, :-1], None, None, labels=ids[:, 1:], loss_mask=mask)
                got = got if got.dim() == 0 else (got.float() * mask).sum()
                got.backward()
                grad = model.decoder.final_layernorm.weight.grad
                out[f"tp{tp}_{name}{'_tied' if tie else ''}"] = (abs(got.item() - ref.item()) / ref.item(),
                                                                  (grad - ref_grad).abs().max().item())
    # a rank holding only padding (vocab 40 in 2 × 50 columns: rank 1 has none): the kernels on their own
    from megatron.core import parallel_state

    from adapter.kernels.fusions import linear_cross_entropy, vocab_parallel_cross_entropy

    group = parallel_state.get_tensor_model_parallel_group()
    hidden = torch.randn(12, 8, generator=g)
    weight = torch.randn(100, 8, generator=g)
    target = torch.randint(0, 40, (12,), generator=g)
    full = (hidden @ weight[:40].t()).requires_grad_()
    ref = F.cross_entropy(full, target, reduction="none")
    ref.sum().backward()
    real = 40 if rank == 0 else 0
    x = (hidden @ weight.chunk(2)[rank].t()).requires_grad_()
    loss = vocab_parallel_cross_entropy(x, target, group, real=real)
    loss.sum().backward()
    cols = slice(0, 40) if rank == 0 else slice(0, 0)
    out["only_padding_ce"] = ((loss - ref).abs().max().item(),
                              max((x.grad[:, cols] - full.grad[:, cols]).abs().max().item() if rank == 0 else 0.0,
                                  x.grad[:, real:].abs().max().item() if real < 50 else 0.0))
    h = hidden.clone().requires_grad_()
    wl = weight.chunk(2)[rank].clone().requires_grad_()
    total = linear_cross_entropy(h, wl, target, torch.ones(12), group, chunk=5, real=real)
    total.backward()
    out["only_padding_linear_ce"] = (abs(total.item() - ref.sum().item()) / ref.sum().item(),
                                     wl.grad[real:].abs().max().item())
    return out


def test_padded_vocab_rows_never_enter_the_loss():
    for r in run_workers(_padded_vocab_worker, 2, timeout=300):
        assert len(r) == 14, r
        assert all(loss <= TOL and grad <= TOL for loss, grad in r.values()), r
