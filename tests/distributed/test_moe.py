"""Mixtures of experts against transformers: Qwen3-MoE, Mixtral and OLMoE, tiny random models (4 experts,
top 2, each family's routing), fp32 on CPU.

Per family and layout: logits, transformers' load-balancing loss and the loss it trains on (mean cross-entropy +
router_aux_loss_coef · aux), and the routers' gradients of that loss, at tp 2 (with sequence parallelism, which
Megatron's MoE layer needs beside TP in training: the routers' statistics summed over TP) and cp 2 (summed over
CP). A negative control drops the auxiliary gradient: the routers' gradients then differ. The conversion round trip
at tp 2 is bit-exact. All of these run the experts as grouped GEMMs (GroupedExperts, CPU); the same model with
Megatron's per-expert loop gives the same loss and every gradient, and so does `model.compile` (each layer's
attention compiled, the experts eager). Where every expert is local, the sync-free dispatcher gives Megatron's
dispatcher's loss and gradients (bit for bit here: fp32, two picks per token, summed in the same order).
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_workers

pytestmark = pytest.mark.slow
TOL = 1e-5
FAMILIES = ("qwen3_moe", "mixtral", "olmoe")
S = 16


def _router(i: int) -> str:
    return f"model.layers.{i}.mlp.gate.weight"  # transformers 5's module (Mixtral's files say block_sparse_moe)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from adapter.convert.to_hf import megatron_to_hf
    from adapter.convert.to_megatron import hf_to_megatron
    from tests.helpers.hf import make_hf, tensors

    root = tmp_path_factory.mktemp("moe")
    ids = torch.randint(0, 300, (2, S + 1), generator=torch.Generator().manual_seed(1))
    out, exact = {}, {}
    for case in FAMILIES:
        hf_dir = make_hf(case, root / f"hf_{case}")
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        res = hf(ids[:, :-1])  # its training loss on these labels: mean CE + coef · aux, as its forward adds them
        loss = torch.nn.functional.cross_entropy(res.logits.flatten(0, 1), ids[:, 1:].flatten())
        loss = loss + hf.config.router_aux_loss_coef * res.aux_loss
        loss.backward()
        grads = torch.stack([hf.get_parameter(_router(i)).grad for i in range(2)])
        ref = {"logits": res.logits.detach(), "aux": res.aux_loss.item(), "loss": loss.item(), "router": grads}
        meg = hf_to_megatron(hf_dir, root / f"meg_{case}", tp=2, progress=False)
        a, b = tensors(hf_dir), tensors(megatron_to_hf(meg, root / f"back_{case}", progress=False))
        exact[case] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        out[case] = (str(meg), ref)
    return ids, out, exact


def _run(rank, ids, ckpt, ref, tp, cp, sp, aux_grad=True, ep=1):
    import json
    from pathlib import Path

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from adapter.convert.load import load_megatron_checkpoint
    from adapter.kernels.attention import split_for_cp
    from adapter.modeling.gpt import build_gpt_model, forward_logits, tp_grad_sum_params
    from adapter.models.arch import ModelArch

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 expert_model_parallel_size=ep)
    meta = json.loads((Path(ckpt) / "nd_adapter.json").read_text())
    arch = ModelArch(**meta["arch"])
    model = build_gpt_model(arch, tp=tp, cp=cp, sequence_parallel=sp, padded_vocab=meta["padded_vocab_size"])
    load_megatron_checkpoint(model, ckpt)
    r = ps.get_context_parallel_rank()
    if ep > 1 and ps.get_data_parallel_rank() % 2:  # data-parallel ranks read different data: rows swapped here
        ids, ref = ids.flip(0), {**ref, "logits": ref["logits"].flip(0)}
    x, labels = ids[:, :-1], ids[:, 1:]
    model.eval()
    with torch.no_grad():
        logits = forward_logits(model, split_for_cp(x, cp, r), vocab_size=arch.vocab_size)
    dlogits = (logits - split_for_cp(ref["logits"], cp, r)).abs().max().item()
    model.train()
    aux = model.moe_aux
    aux.scale = 1.0 if aux_grad else 0.0  # the loss below is mean CE + coef · aux, as transformers' training loss
    ce = model(split_for_cp(x, cp, r), None, None, labels=split_for_cp(labels, cp, r)).sum() / labels.numel()
    ce.backward()
    ce = ce.detach()
    if cp > 1:
        dist.all_reduce(ce, group=ps.get_context_parallel_group())
    for p in tp_grad_sum_params(model):
        dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    router = torch.stack([layer.mlp.router.weight.grad for layer in model.decoder.layers])
    if cp > 1:
        dist.all_reduce(router, group=ps.get_context_parallel_group())
    value = aux.value().item()
    return {"logits": dlogits, "aux": abs(value - ref["aux"]),
            "loss": abs(ce.item() + aux.coef * value - ref["loss"]),
            "router": (router - ref["router"]).abs().max().item()}


def _grouped_vs_loop(ids, ckpt):
    """The same tp 2 (+SP) model with grouped expert GEMMs and with Megatron's loop: the loss and every gradient."""
    import json
    from pathlib import Path

    from megatron.core import parallel_state as ps

    from adapter.convert.load import load_megatron_checkpoint
    from adapter.modeling import moe
    from adapter.modeling.compile import compile_layers
    from adapter.modeling.gpt import build_gpt_model
    from adapter.models.arch import ModelArch

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    meta = json.loads((Path(ckpt) / "nd_adapter.json").read_text())
    arch = ModelArch(**meta["arch"])
    calls, apply = [], moe._GroupedLinear.apply
    moe._GroupedLinear.apply = lambda *a: calls.append(1) or apply(*a)
    try:
        out = []
        for grouped, compiled in ((True, False), (False, False), (True, True)):
            model = build_gpt_model(arch, tp=2, sequence_parallel=True, padded_vocab=meta["padded_vocab_size"],
                                    moe_grouped_gemm=grouped)
            load_megatron_checkpoint(model, ckpt)
            if grouped and not compiled:  # a conversion gives each weight its own tensor; one buffer again after it
                model.to(torch.float64).to(torch.float32)
                fc1 = [e.linear_fc1.weight for e in model.decoder.layers[0].mlp.experts.local_experts]
                assert moe.as_batch(fc1).data_ptr() == fc1[0].data_ptr()
            if compiled:  # model.compile: a MoE layer's attention half compiled, its experts eager
                torch._dynamo.reset()
                assert compile_layers(model) == arch.num_layers
            loss = model(ids[:, :-1], None, None, labels=ids[:, 1:]).sum()
            loss.backward()
            out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    finally:
        moe._GroupedLinear.apply = apply
    (a, ga), (b, gb), (c, gc) = out
    assert len(calls) == 4 * arch.num_layers and ga.keys() == gb.keys()  # fc1 and fc2 of every layer, grouped
    return {"loss": (a - b).abs().item(), "grads": max((ga[n] - gb[n]).abs().max().item() for n in ga),
            "compiled_loss": ((a - c).abs() / a.abs()).item(),  # a sum over every token: relative
            # relative to the largest gradient: inductor's CPU code reorders the sums by the machine's vector width
            # (1.0e-5 absolute on one CI machine, under it on another)
            "compiled_grads": max((ga[n] - gc[n]).abs().max().item() for n in ga) /
            max(ga[n].abs().max().item() for n in ga)}


def _local_vs_megatron(ids, ckpt):
    """At tp = ep = 1 every expert is local: LocalTokenDispatcher against Megatron's allgather dispatcher on the same
    model, loss and every gradient, and its forward + backward reads nothing back to the host and sizes
    nothing from the data (the ops that would: masked_select, nonzero, .item()/.tolist(), a copy to the CPU)."""
    import json
    from pathlib import Path

    from megatron.core import parallel_state as ps
    from torch.utils._python_dispatch import TorchDispatchMode

    from adapter.convert.load import load_megatron_checkpoint
    from adapter.modeling.gpt import build_gpt_model
    from adapter.modeling.moe import LocalTokenDispatcher
    from adapter.models.arch import ModelArch

    class Spy(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1)
    meta = json.loads((Path(ckpt) / "nd_adapter.json").read_text())
    arch = ModelArch(**meta["arch"])
    out = []
    for local in (True, False):
        model = build_gpt_model(arch, padded_vocab=meta["padded_vocab_size"], moe_local_dispatch=local)
        load_megatron_checkpoint(model, ckpt)
        layer = model.decoder.layers[0].mlp
        assert isinstance(layer.token_dispatcher, LocalTokenDispatcher) == local
        spy = Spy()
        with spy:
            h = layer(torch.randn(S, 2, arch.hidden_size, generator=torch.Generator().manual_seed(3),
                                  requires_grad=True))[0]
            h.square().sum().backward()
        loss = model(ids[:, :-1], None, None, labels=ids[:, 1:]).sum()
        model.zero_grad()
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}, spy.ops))
    (a, ga, ops), (b, gb, megatron_ops) = out
    host = {"masked_select", "nonzero", "_local_scalar_dense"}
    return {"loss": (a - b).abs().item(), "grads": max((ga[n] - gb[n]).abs().max().item() for n in ga),
            "host_ops": float(len(ops & host)), "control": float(not megatron_ops & host)}


def _worker(rank, world, ids, cases):
    import torch.distributed as dist

    from adapter.patches.mcore import install_cpu_shims

    install_cpu_shims()
    dist.init_process_group("gloo")
    res = {}
    for case, (ckpt, ref) in cases.items():
        res[f"{case}_tp2"] = _run(rank, ids, ckpt, ref, 2, 1, True)
    ckpt, ref = cases["qwen3_moe"]
    res["qwen3_moe_cp2"] = _run(rank, ids, ckpt, ref, 1, 2, False)
    res["olmoe_cp2"] = _run(rank, ids, *cases["olmoe"], 1, 2, False)
    res["control_no_aux_grad"] = _run(rank, ids, ckpt, ref, 2, 1, True, aux_grad=False)
    res["grouped_vs_loop"] = _grouped_vs_loop(ids, ckpt)
    res["local_vs_megatron_dispatch"] = _local_vs_megatron(ids, ckpt)
    res["qwen3_moe_ep2"] = _run(rank, ids, ckpt, ref, 1, 1, False, ep=2)  # each rank 2 of the 4 experts
    res["olmoe_cp2_ep2"] = _run(rank, ids, *cases["olmoe"], 1, 2, False, ep=2)  # the experts over the CP pair
    return res


def test_moe_families_match_transformers_logits_aux_loss_and_router_grads(models):
    ids, cases, exact = models
    assert all(exact.values()), exact  # HF -> Megatron (tp 2) -> HF, bit for bit
    for res in run_workers(_worker, 2, ids, cases, timeout=600):
        control = res.pop("control_no_aux_grad")
        local = res.pop("local_vs_megatron_dispatch")
        assert local == {"loss": 0.0, "grads": 0.0, "host_ops": 0.0, "control": 0.0}, local  # bit for bit
        for name, d in res.items():
            assert max(d.values()) <= TOL, (name, d)
        assert control["router"] > 1e-3, control  # without the auxiliary gradient the routers' gradients differ


def _worker4(rank, world, ids, cases):
    import torch.distributed as dist

    from adapter.patches.mcore import install_cpu_shims

    install_cpu_shims()
    dist.init_process_group("gloo")
    res = {}
    for case in FAMILIES:  # one expert per rank (Megatron's single-local-expert path)
        res[f"{case}_ep4"] = _run(rank, ids, *cases[case], 1, 1, False, ep=4)
    res["mixtral_tp2_ep2"] = _run(rank, ids, *cases["mixtral"], 2, 1, True, ep=2)
    return res


def test_moe_expert_parallel_at_ep4_and_with_tp2(models):
    """Expert parallelism on 4 gloo processes: ep=4 (each rank one of the 4 experts) for the three families, and
    tp=2 × ep=2 (the experts TP-sharded too); the data-parallel ranks read different batches."""
    ids, cases, _ = models
    for res in run_workers(_worker4, 4, ids, cases, timeout=600):
        for name, d in res.items():
            assert max(d.values()) <= TOL, (name, d)
