"""Context parallelism equals cp=1 in outputs and q/k/v gradients, and end to end in GPTModel loss and grads; the
ring with its blocks staged through host memory (the shared-GPU mode's, adapter/parallel/shared_gpu.py) too."""
from __future__ import annotations

import pytest
import torch

from adapter.errors import UserError
from tests.helpers.attention import cp_diffs
from tests.helpers.dist import run_workers

TOL = 1e-5


def _worker(rank, world):
    """World of 4: attention at cp=2 (two groups) and cp=4, both schemes; then GPTModel tp=2 × cp=2."""
    import torch.distributed as dist

    from adapter.patches.mcore import install_cpu_shims

    install_cpu_shims()
    dist.init_process_group("gloo")
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    result = {}
    for comm in ("all_gather", "p2p"):
        result[f"cp2_{comm}"], result[f"cp2_{comm}_wrong_order"] = cp_diffs(rank % 2, 2, comm, pairs[rank // 2])
        result[f"cp4_{comm}"], result[f"cp4_{comm}_wrong_order"] = cp_diffs(rank, 4, comm, dist.group.WORLD)
    from adapter.kernels import ring  # the shared-GPU mode's ring: every block staged through host copies

    plain, ring.staged = ring.staged, lambda tensor, group: True
    try:
        result["cp4_p2p_staged"], _ = cp_diffs(rank, 4, "p2p", dist.group.WORLD)
    finally:
        ring.staged = plain
    result.update(_gpt_cp_vs_no_cp(rank))
    return result


def _gpt_cp_vs_no_cp(rank):
    """GPTModel loss and gradients at (tp=2, cp=2) equal (tp=2, cp=1), for both CP schemes."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from adapter.kernels.attention import split_for_cp
    from adapter.modeling.gpt import build_gpt_model
    from adapter.models.arch import arch_from_hf_dict

    arch = arch_from_hf_dict(dict(architectures=["Qwen3ForCausalLM"], hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  vocab_size=100, rope_theta=10000.0))
    ids = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(3))
    ids, labels = ids[:, :-1], ids[:, 1:]

    def run(cp, comm=None, weights=None, split=split_for_cp):
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=cp)
        torch.manual_seed(0)
        model = build_gpt_model(arch, tp=2, cp=cp, cp_comm_type=comm)
        if weights is not None:
            model.load_state_dict(weights)
        r = ps.get_context_parallel_rank()
        loss = model(split(ids, cp, r), None, None, labels=split(labels, cp, r)).sum()
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        if cp > 1:  # the training loop's dp-cp gradient all-reduce, restricted to cp here
            dist.all_reduce(loss.detach(), group=ps.get_context_parallel_group())
            for g in grads.values():
                dist.all_reduce(g, group=ps.get_context_parallel_group())
        return model.state_dict(), loss.item(), grads

    weights, ref_loss, ref_grads = run(1)
    out = {}
    for comm in ("all_gather", "p2p"):
        _, loss, grads = run(2, comm, weights)
        out[f"gpt_{comm}_loss"] = abs(loss - ref_loss) / abs(ref_loss)
        out[f"gpt_{comm}_grad"] = max((grads[n] - g).abs().max().item() for n, g in ref_grads.items())
    _, loss, _ = run(2, "all_gather", weights, split=lambda t, cp, r: t.chunk(cp, 1)[r])  # contiguous: wrong
    out["gpt_wrong_order"] = abs(loss - ref_loss) / abs(ref_loss)
    return out


def _check(results):
    for r in results:
        bad = {k: v for k, v in r.items() if not k.endswith("wrong_order") and not v <= TOL}  # NaN fails
        assert not bad, r
        assert all(v > 10 * TOL for k, v in r.items() if k.endswith("wrong_order")), r  # the check can fail


def test_cp2_cp4_and_gpt_tp2_cp2_match_cp1():
    _check(run_workers(_worker, 4, timeout=240))


def test_split_for_cp_is_megatrons_chunk_order():
    from adapter.kernels.attention import split_for_cp

    x = torch.arange(16).view(1, 16)
    assert split_for_cp(x, 2, 0).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert split_for_cp(x, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    with pytest.raises(UserError, match="seq_length=16"):
        split_for_cp(x, 3, 0)


@pytest.mark.parametrize("name,want", [("allgather", "all_gather"), ("alltoall", "p2p"), ("p2p", "p2p"),
                                       (None, "all_gather")])
def test_cp_comm_type_names(name, want):
    from adapter.kernels.attention import normalize_cp_comm_type

    assert normalize_cp_comm_type(name) == want


def test_cp_comm_type_refuses_ulysses():
    from adapter.kernels.attention import normalize_cp_comm_type

    with pytest.raises(UserError, match="cp_comm_type='a2a'"):
        normalize_cp_comm_type("a2a")


