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
    sdpa = mu.AttentionMaskInterface._global_mapping["sdpa"]
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
        mu.AttentionMaskInterface._global_mapping["sdpa"] = sdpa


def test_model_mask_functions_by_broadcasting_where_checked_equal():
    """A model's own mask functions (Gemma 3's image tokens seen both ways) are evaluated by broadcasting once the
    first mask of their structure equalled transformers' vmap; one that indexes an axis at a time keeps the vmap."""
    import transformers.masking_utils as mu
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3 import modeling_gemma3 as g3

    from adapter.patches import hf_masks

    cfg = Gemma3TextConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                           num_hidden_layers=2, intermediate_size=32, vocab_size=50, sliding_window=6)
    cfg._attn_implementation = "sdpa"
    emb = torch.zeros(2, 12, 32)

    def masks(tt, pad=None):
        block = g3.get_block_sequence_ids_for_mask(tt)
        return g3.create_masks_for_vision_model(config=cfg, inputs_embeds=emb, attention_mask=pad, cache=None,
                                               position_ids=None, block_sequence_ids=block)

    cases = []
    for lo, hi in ((2, 6), (0, 9), (7, 12)):  # the image's tokens at other places, then left padding
        tt = torch.zeros(2, 12, dtype=torch.long)
        tt[0, lo:hi] = 1
        cases += [(tt, None), (tt, torch.tensor([[0, 0] + [1] * 10, [1] * 12]))]
    want = [masks(*c) for c in cases]

    def one_axis(batch_idx, head_idx, q_idx, kv_idx):  # right under vmap, not under broadcasting
        return cases[0][0][batch_idx][q_idx] == 1

    odd_want = mu.create_causal_mask(cfg, emb, None, None, or_mask_function=one_axis)
    original = mu.AttentionMaskInterface._global_mapping["sdpa"]
    hf_masks._BROADCAST.clear()
    try:
        hf_masks.prepare(torch.nn.Linear(1, 1))
        assert mu.AttentionMaskInterface._global_mapping["sdpa"].nd_adapter_broadcast
        got = [masks(*c) for c in cases]
        assert all(torch.equal(a[k], b[k]) for a, b in zip(got, want) for k in a)
        assert True in hf_masks._BROADCAST.values() and False not in hf_masks._BROADCAST.values()
        assert torch.equal(mu.create_causal_mask(cfg, emb, None, None, or_mask_function=one_axis), odd_want)
        assert False in hf_masks._BROADCAST.values()  # the one-axis function stays on the vmap
    finally:
        mu.AttentionMaskInterface._global_mapping["sdpa"] = original
        hf_masks._BROADCAST.clear()
