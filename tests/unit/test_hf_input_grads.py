"""adapter/modeling/hf_build.drop_frozen_input_grads: with gradient checkpointing on, transformers hooks every
sub-model's input embeddings for an input gradient, the vision tower's too; a frozen tower then is back-propagated
for nothing. Without that hook the trained parameters' gradients are the same and the tower builds no graph."""
from __future__ import annotations

REGEX = r"model.language_model.layers.[\d]+.(mlp|self_attn).(up|down|gate|q|k|v|o)_proj"


def test_frozen_tower_gets_no_input_gradient(tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    from adapter.modeling.hf_build import drop_frozen_input_grads, recompute_layers
    from tests.helpers.image_text import batch, gemma3_vlm, rows

    model_dir = gemma3_vlm(tmp_path)
    b, labels = batch(AutoProcessor.from_pretrained(model_dir), rows(tmp_path, 2))

    def run(drop: bool):
        m = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
        recompute_layers(m)  # Axolotl's gradient_checkpointing: transformers' own, hooks included
        torch.manual_seed(0)  # the same adapters' initial values
        m = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=REGEX))
        m.train()
        dropped = drop_frozen_input_grads(m) if drop else []
        seen = []
        m.get_base_model().model.vision_tower.register_forward_hook(
            lambda mod, args, out: seen.append(out.last_hidden_state.requires_grad))
        m(**b, labels=labels).loss.backward()
        return dropped, seen, {n: p.grad for n, p in m.named_parameters() if p.requires_grad}

    _, tower_graph, want = run(False)
    assert tower_graph == [True]  # transformers' hook: the frozen tower is back-propagated
    dropped, tower_graph, got = run(True)
    assert dropped == ["SiglipVisionModel"] and tower_graph == [False]
    assert got.keys() == want.keys() and len(got) > 0
    assert all(torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-7) for k in want)
    assert all(g.abs().sum() > 0 for k, g in got.items() if "lora_B" in k)  # the adapters did get gradients
