"""GPTModel forward, backward (plain and full recompute) and a torch_dist checkpoint round trip on CPU, through
the CPU shims (adapter/patches/mcore.py)."""
from __future__ import annotations

import torch

from adapter.patches import mcore
from tests.helpers.dist import run_workers

TINY = dict(architectures=["LlamaForCausalLM"], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)


def _gpt_worker(rank, world, ckpt_dir):
    """Forward, backward (plain and full recompute) and a torch_dist checkpoint round trip of GPTModel on CPU."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    from adapter.modeling.gpt import build_gpt_model
    from adapter.models.arch import arch_from_hf_dict

    assert not torch.cuda.is_available()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel()
    arch = arch_from_hf_dict(TINY)
    ids = torch.randint(0, 100, (2, 16))
    losses = []
    for recompute in (None, "full"):
        torch.manual_seed(0)
        model = build_gpt_model(arch, recompute=recompute)
        assert mcore.install_cpu_shims() is True  # idempotent, and active without CUDA
        loss = model(ids, None, None, labels=ids).mean()
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        losses.append(loss.item())
    assert losses[0] == losses[1]

    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    torch.manual_seed(1)
    fresh = build_gpt_model(arch)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), ckpt_dir))
    return all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values())
               if isinstance(a, torch.Tensor))



def test_gpt_forward_backward_recompute_and_checkpoint_on_cpu(tmp_path):
    assert run_workers(_gpt_worker, 1, str(tmp_path), timeout=120) == [True]
