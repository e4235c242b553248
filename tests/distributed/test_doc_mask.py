"""Packed documents with `data.document_mask`: a document's logits do not depend on the documents packed before it."""
from __future__ import annotations

from tests.helpers.dist import run_workers


def _worker(rank, world):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from adapter.kernels.thd import document_attention_mask
    from adapter.modeling.gpt import build_gpt_model
    from adapter.models.arch import arch_from_hf_dict

    dist.init_process_group("gloo", rank=rank, world_size=world)
    ps.initialize_model_parallel()
    arch = arch_from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 2,
                              "vocab_size": 256, "max_position_embeddings": 128})
    torch.manual_seed(0)
    model = build_gpt_model(arch, padded_vocab=256).eval()
    a, b = torch.randint(0, 256, (1, 10)), torch.randint(0, 256, (1, 14))
    packed = torch.cat([a, b], 1)
    segments = torch.tensor([[0] * 10 + [1] * 14])
    pos = torch.arange(24)[None]
    with torch.no_grad():
        masked = model(packed, pos, document_attention_mask(segments))[:, 10:]
        unmasked = model(packed, pos, None)[:, 10:]
        alone = model(b, torch.arange(14)[None], None)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    # RoPE is relative, so document b attends exactly as it would alone, whatever its offset in the pack
    return float((masked - alone).abs().max()), float((unmasked - alone).abs().max())


def test_document_mask_isolates_documents():
    masked, unmasked = run_workers(_worker, 1)[0]
    assert masked < 1e-5, masked
    assert unmasked > 1e-3, unmasked  # negative control: without the mask, document a leaks into b
