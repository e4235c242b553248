"""adapter/patches/hf_masks.py: a sliding window as long as the sequence is the causal mask itself, which SDPA runs
as is_causal (flash); the model's outputs are unchanged, and longer sequences keep their window."""
from __future__ import annotations

import torch


def _olmo3(window: int):
    from transformers import Olmo3Config, Olmo3ForCausalLM

    cfg = Olmo3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, sliding_window=window, layer_types=["sliding_attention", "full_attention"],
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return Olmo3ForCausalLM(cfg).eval()


def test_window_as_long_as_the_sequence_is_causal():
    import transformers.masking_utils as mu
    from transformers.models.olmo3 import modeling_olmo3 as olmo3

    from adapter.patches.hf_masks import documents, prepare

    model = _olmo3(window=8)
    ids = torch.randint(0, 64, (2, 8))
    before = model(input_ids=ids).logits
    original, causal = olmo3.create_sliding_window_causal_mask, olmo3.create_causal_mask
    prepare(model)
    try:
        wrapped = olmo3.create_sliding_window_causal_mask
        assert wrapped is not original
        embeds = torch.zeros(2, 8, 32)
        # seq = window: transformers materialises it; the wrapper hands SDPA is_causal (None), the same pairs
        assert original(model.config, embeds, None, None) is not None
        assert wrapped(model.config, embeds, None, None) is None
        for pos, pad in ((None, torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])),
                         (torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2), None)):  # left padding; packed documents
            assert torch.equal(*(b(model.config, embeds, pad, None, position_ids=pos, allow_is_causal_skip=False)
                                 for b in (original, wrapped)))
        with documents(torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2)):  # positions filled in, then causal in them
            assert torch.equal(wrapped(model.config, embeds, None, None, allow_is_causal_skip=False),
                               mu.create_causal_mask(model.config, embeds, None, None, allow_is_causal_skip=False,
                                                     position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2)))
        assert torch.allclose(model(input_ids=ids).logits, before, atol=1e-6)
        # a longer sequence keeps its window
        long = torch.zeros(2, 12, 32)
        assert torch.equal(wrapped(model.config, long, None, None), original(model.config, long, None, None))
        assert not wrapped(model.config, long, None, None)[0, 0, 11, 0]
    finally:
        olmo3.create_sliding_window_causal_mask, olmo3.create_causal_mask = original, causal
