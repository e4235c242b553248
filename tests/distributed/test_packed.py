"""Packed documents with context parallelism equal cp = 1: attention outputs and q/k/v gradients (both schemes, cp 2
and 4), and GPTModel's loss and gradients at (cp 2, tp 2) over several optimizer steps.

cp = 1 itself is checked against per-document SDPA and against transformers (tests/unit/test_packed.py,
tests/distributed/test_model.py)."""
from __future__ import annotations

import torch

from tests.helpers.attention import packed_batch
from tests.helpers.dist import run_workers

TOL = 1e-5
S, HQ, HK, D = 32, 4, 2, 8
# documents of very different lengths: shorter than 2·cp (1, 2, 3), odd, long; and one spanning a whole sample
DOCS = ([1, 3, 17, 2, 9], [32])


def _full_qkv(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, D, generator=g) for h in (HQ, HK, HK, HQ)]  # q, k, v, dout


def _attention_diffs(rank, cp, comm, group):
    """Max |Δ| of this rank's real rows (out, dq, dk, dv) against cp = 1; the padding's K/V gradients (nothing may
    attend to it); and a negative control (the dense CP scheme on the same stream ignores the documents)."""
    from adapter.kernels.attention import context_parallel_attention
    from adapter.kernels.thd import pack_batch
    from adapter.kernels.varlen import packed_attention

    full = packed_batch(DOCS)
    n = full["tokens"].numel()
    q, k, v, dout = _full_qkv(n)
    ref_stream, ref_p = pack_batch(full)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = packed_attention(*ref, ref_p, scale=D ** -0.5)
    ref_out.backward(dout)

    local, p = pack_batch(full, cp_size=cp, cp_rank=rank)
    idx = local["tokens"][0] - 1
    real = idx >= 0
    noise = _full_qkv(len(idx), seed=7 + rank)  # padding rows get arbitrary values: they must not matter
    ins = [torch.where(real[:, None, None], t[idx.clamp(min=0)], z).requires_grad_()
           for t, z in zip((q, k, v), noise)]
    out = packed_attention(*ins, p, scale=D ** -0.5, group=group, comm=comm)
    out.backward(torch.where(real[:, None, None], dout[idx.clamp(min=0)], 0.0))  # padding carries no loss
    diffs = [(out - ref_out[idx])[real].abs().max().item()]
    diffs += [(t.grad - r.grad[idx])[real].abs().max().item() for t, r in zip(ins, ref)]
    pad_grad = max(t.grad[~real].abs().max().item() for t in ins[1:]) if (~real).any() else 0.0
    dense = context_parallel_attention(*(t.detach().unsqueeze(1) for t in ins), scale=D ** -0.5, group=group,
                                       comm=comm)[0].transpose(0, 1)
    return {"max": max(diffs), "pad_kv_grad": pad_grad, "pads": int((~real).sum()),
            "wrong_order": (dense - ref_out[idx])[real].abs().max().item()}


def _gpt_steps(rank, cp, comm, steps=3, stream_rope=False, recompute=None):
    """GPTModel (tp=2, sequence parallel) trained `steps` SGD steps on packed batches: per-step loss and grads.
    `stream_rope`: rotate by stream position instead of in-document position (a deliberate bug)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from adapter.kernels.thd import local_multiple, pack_batch
    from adapter.modeling.gpt import build_gpt_model, tp_grad_sum_params
    from adapter.models.arch import arch_from_hf_dict

    arch = arch_from_hf_dict(dict(architectures=["Qwen3ForCausalLM"], hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  vocab_size=100, rope_theta=10000.0))
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=cp)
    torch.manual_seed(0)
    model = build_gpt_model(arch, tp=2, cp=cp, cp_comm_type=comm, sequence_parallel=True, recompute=recompute)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    r, cp_group = ps.get_context_parallel_rank(), ps.get_context_parallel_group()
    history = []
    for step in range(steps):
        full = packed_batch((DOCS, ([5, 27], [32]), ([2] * 16, [30, 2]))[step], seed=step)
        full["tokens"] = torch.randint(0, 100, (2, S), generator=torch.Generator().manual_seed(10 + step))
        full["labels"] = full["tokens"].roll(-1, 1)
        ntok = full["loss_mask"].sum()
        local, p = pack_batch(full, cp_size=cp, cp_rank=r, multiple=local_multiple(S, cp, 2))
        if stream_rope:
            p.positions = torch.arange(len(p.positions))
            p.rope_len = len(p.positions)
        per_token = model(local["tokens"], local["position_ids"], None, labels=local["labels"], packed_seq_params=p)
        loss = (per_token * local["loss_mask"]).sum() / ntok
        loss.backward()
        for prm in tp_grad_sum_params(model):  # partial over TP (the loop's hooks): SP norms see their tokens only
            dist.all_reduce(prm.grad, group=ps.get_tensor_model_parallel_group())
        if cp > 1:  # the loop's dp-cp gradient reduction, restricted to cp
            for prm in model.parameters():
                dist.all_reduce(prm.grad, group=cp_group)
            loss = loss.detach()
            dist.all_reduce(loss, group=cp_group)
        history.append((loss.item(), {n: prm.grad.clone() for n, prm in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return history


def _worker(rank, world):
    import torch.distributed as dist

    from adapter.patches.mcore import install_cpu_shims

    install_cpu_shims()
    dist.init_process_group("gloo")
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    res = {}
    for comm in ("all_gather", "p2p"):
        res[f"cp2_{comm}"] = _attention_diffs(rank % 2, 2, comm, pairs[rank // 2])
        res[f"cp4_{comm}"] = _attention_diffs(rank, 4, comm, dist.group.WORLD)
    ref = _gpt_steps(rank, 1, None)
    for name, comm, recompute in (("all_gather", "all_gather", None), ("p2p", "p2p", None),
                                  ("all_gather_selective", "all_gather", "selective"), ("p2p_full", "p2p", "full")):
        got = _gpt_steps(rank, 2, comm, recompute=recompute)
        res[f"gpt_{name}_loss"] = max(abs(a[0] - b[0]) / a[0] for a, b in zip(ref, got))
        res[f"gpt_{name}_grad"] = max((b[1][n] - g).abs().max().item() for a, b in zip(ref, got)
                                      for n, g in a[1].items())
    res["gpt_ref_losses"] = [h[0] for h in ref]
    res["gpt_wrong_rope"] = abs(_gpt_steps(rank, 2, "all_gather", steps=1, stream_rope=True)[0][0] - ref[0][0])
    return res


def test_packed_cp2_cp4_and_gpt_tp2_cp2_match_cp1():
    for r in run_workers(_worker, 4, timeout=300):
        for name in ("cp2_all_gather", "cp2_p2p", "cp4_all_gather", "cp4_p2p"):
            d = r[name]
            assert d["max"] <= TOL and d["pad_kv_grad"] == 0.0, (name, d)
            assert d["wrong_order"] > 100 * TOL, (name, d)  # the comparison can fail
        assert r["cp4_p2p"]["pads"] > 0, r  # documents shorter than 2·cp were padded
        for name in ("all_gather", "p2p", "all_gather_selective", "p2p_full"):  # + activation recompute
            assert r[f"gpt_{name}_loss"] <= TOL and r[f"gpt_{name}_grad"] <= TOL, (name, r)
        assert r["gpt_wrong_rope"] > 100 * TOL, r  # the chunks' RoPE positions matter, and are checked
        losses = r["gpt_ref_losses"]
        assert losses[0] != losses[1] != losses[2], losses  # the steps really trained on different batches
