"""GPU host only (`pytest -m gpu`, 2 GPUs): both context-parallel schemes through the CUDA kernels match cp = 1."""
from __future__ import annotations

import pytest
import torch

from adapter.errors import UserError
from tests.helpers.attention import cp_diffs, qkv_dout, sdpa_reference
from tests.helpers.dist import run_workers


def _cuda_worker(rank, world):
    """NCCL, one GPU per rank: both CP schemes through the CUDA kernels (SDPA lower-right causal; flash ring)."""
    import time

    import torch.distributed as dist

    from adapter.kernels.attention import context_parallel_attention

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    res = {}
    # (full seq, batch, q heads, kv heads, head dim): a small GQA case, then 16k and 32k tokens (8k/16k per rank,
    # where the efficient-attention ring used to crash), Llama-3.2-1B heads.
    for shape in (dict(s=1024, b=2, np_=8, ng=2, d=128), dict(s=16384, b=1, np_=32, ng=8, d=64),
                  dict(s=32768, b=1, np_=32, ng=8, d=64)):
        full = [t.cuda() for t in qkv_dout(**shape)]
        ref = sdpa_reference(*full)  # fp32; bf16 is judged against the error of plain bf16 SDPA at cp=1
        bf16_cp1 = sdpa_reference(*(t.bfloat16() for t in full))
        bf16_tol = 2 * max((a.float() - b).abs().max().item() for a, b in zip(bf16_cp1, ref))
        del full, ref, bf16_cp1
        cases = [("all_gather", torch.float32, 1e-4)] if shape["s"] == 1024 else []
        cases += [("all_gather", torch.bfloat16, bf16_tol), ("p2p", torch.bfloat16, bf16_tol)]
        for comm, dtype, tol in cases:
            diff, wrong = cp_diffs(rank, world, comm, dist.group.WORLD, dtype, "cuda", **shape)
            res[f"{comm}_{shape['s']}_{str(dtype)[6:]}"] = (diff, tol, wrong)
    q, k, v = (torch.randn(8192, 1, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for n in (32, 8, 8))
    with pytest.raises(UserError, match="bf16"):  # the flash ring takes half precision only
        context_parallel_attention(*(t.float() for t in (q, k, v)), scale=0.125, group=dist.group.WORLD, comm="p2p")
    for comm in ("all_gather", "p2p"):  # timing, informational: 16k tokens over cp=2, 32 q / 8 kv heads, fwd+bwd
        for i in range(4):
            if i == 1:
                torch.cuda.synchronize()
                t = time.perf_counter()
            context_parallel_attention(q, k, v, scale=0.125, group=dist.group.WORLD, comm=comm).sum().backward()
        torch.cuda.synchronize()
        res[f"ms_{comm}"] = (time.perf_counter() - t) / 3 * 1e3
    dist.destroy_process_group()
    return res



@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_cp2_both_schemes_on_cuda_match_cp1():
    for r in run_workers(_cuda_worker, 2, timeout=300):
        print(r)
        for k, v in r.items():
            if not k.startswith("ms_"):  # (error, bf16 tolerance, error of a wrong chunk order): meets the tolerance,
                assert v[0] <= v[1] and v[2] > 10 * v[0], (k, v)  # and is far from what a layout bug gives


def test_transformers_engine_own_attention_follows_its_sdpa_on_cuda():
    """An Olmo-3 model (sliding-window and full layers, window 64 < seq 256), bf16 on CUDA: its attention on
    nd-adapter's kernels at cp = 1 (hf_cp: flash's windowed varlen; checks.own_attention) against transformers' own
    sdpa path (a materialised window mask), same weights and tokens: the loss and every gradient within bf16
    rounding of each other."""
    import copy

    from transformers import AutoModelForCausalLM

    from adapter.modeling import hf_cp
    from tests.helpers.archs import tiny_config

    class One:  # cp = 1: the attention function reads only the group's size
        def size(self):
            return 1

    cfg = tiny_config("olmo3")
    cfg.sliding_window, cfg.head_dim = 64, 64
    cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads = 256, 4, 2
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to("cuda", torch.bfloat16)
    ours = copy.deepcopy(theirs)
    hf_cp.install(ours, dtype=torch.bfloat16, gpu=True, comm="all_gather")
    ids = torch.randint(0, cfg.vocab_size, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    loss_theirs = theirs(input_ids=ids, labels=ids, use_cache=False).loss
    with hf_cp.forward(One(), "all_gather") as state:
        loss_ours = ours(input_ids=ids, labels=ids, use_cache=False).loss
    assert state.calls == cfg.num_hidden_layers
    loss_theirs.backward()
    loss_ours.backward()
    assert abs(loss_ours.item() - loss_theirs.item()) < 2e-2 * abs(loss_theirs.item())
    for (name, a), b in zip(theirs.named_parameters(), ours.parameters()):
        scale = a.grad.float().abs().max().item() + 1e-6
        assert (a.grad.float() - b.grad.float()).abs().max().item() < 0.05 * scale, name
