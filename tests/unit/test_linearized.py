"""Axolotl's linearized Llama 4 experts (`llama4_linearized_experts`; adapter/models/linearized.py): a checkpoint
in that layout builds the model transformers builds from the same weights in its own layout -- the same logits and,
mapped back to the fused layout, the same gradients -- quantised per linear on a 4-bit base; plan's meta model
counts and targets the per-expert linears; a checkpoint read in the other layout, another model or tp > 1 is one
line. (Training and the export under ZeRO-3: tests/distributed/test_transformers_engine.py.)"""
from __future__ import annotations

import pytest

from adapter import config
from adapter.errors import UserError


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    from tests.helpers.archs import linearized, make_arch
    from tests.helpers.sft_data import tiny_model

    root = tmp_path_factory.mktemp("linearized")
    fused = make_arch("llama4_text", root / "fused", tiny_model(root / "tok"))
    return fused, linearized(fused, root / "linearized")


def test_linearized_checkpoint_computes_what_transformers_computes(llama4):
    import torch

    from adapter.modeling.hf_build import build_model
    from adapter.modeling.hf_linearized import fused_state
    from adapter.models.linearized import LLAMA4
    from tests.helpers.archs import reference_model

    fused, lin = llama4
    want = reference_model(fused)
    got = build_model(str(lin), weights=True, dtype=torch.float32, seed=0, trust_remote_code=False, linearized=True)
    assert type(got.model.layers[0].feed_forward.experts).__name__ == "LinearizedExperts"
    tokens = torch.randint(0, want.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    for m in (want, got):
        m(tokens, labels=tokens).loss.backward()
    assert torch.allclose(got(tokens).logits, want(tokens).logits, rtol=1e-5, atol=1e-6)
    grads = fused_state({n: p.grad for n, p in got.named_parameters()}, LLAMA4)
    ref = {n: p.grad for n, p in want.named_parameters()}
    assert grads.keys() == ref.keys()
    assert all(torch.allclose(grads[k], ref[k], rtol=1e-4, atol=1e-7) for k in ref)
    # one layout read as the other: one line naming Axolotl's key, in both directions
    for where, flag in ((lin, False), (fused, True)):
        with pytest.raises(UserError, match=f"llama4_linearized_experts: {str(not flag).lower()}"):
            build_model(str(where), weights=True, dtype=torch.float32, seed=0, trust_remote_code=False,
                        linearized=flag)


def test_a_4bit_base_quantises_every_expert_linear(llama4):
    pytest.importorskip("bitsandbytes")
    import torch

    from adapter.modeling.hf_build import build_model

    model = build_model(str(llama4[1]), weights=True, dtype=torch.float32, seed=0, trust_remote_code=False,
                        linearized=True, quantize="nf4")
    experts = model.model.layers[0].feed_forward.experts
    assert {type(m).__name__ for m in (*experts.gate_projs, *experts.up_projs, *experts.down_projs)} == {"Linear4bit"}


def _run(model_dir, **over):
    raw = {"model": {"path": str(model_dir), "linearized_experts": True}, "seq_len": 64,
           "batch": {"micro_batch_size": 1}, "optimizer": {"max_steps": 1}, **over}
    return config.build(raw, env={}, world_size=over.get("parallelism", {}).get("tp_size", 1))


def test_plan_counts_and_targets_the_per_expert_linears(llama4):
    from adapter.models import announce
    from adapter.models.resolved import resolve_run

    fused, lin = llama4
    lora = {"r": 4, "alpha": 8, "target_modules": ["gate_projs.0", "q_proj"], "quantize_base": "nf4"}
    run = resolve_run(_run(lin, lora=lora), gpu=False)
    plain = resolve_run(_run(lin, lora={**lora, "target_modules": ["q_proj"]}, model={"path": str(lin)}), gpu=False)
    assert run.arch.param_count == plain.arch.param_count  # the same weights, in another layout
    assert run.peft.matched == ("gate_projs.0", "q_proj"), run.peft.matched
    # a 4-bit base quantises the experts too (bitsandbytes quantises linears): more quantised weights than the
    # fused layout's linears alone
    assert run.peft.linears[0] > plain.peft.linears[0]
    said = announce.engine(run)
    assert "its experts as one linear per expert and projection (model.linearized_experts" in said, said
    assert "exported in transformers' fused layout" not in said  # a LoRA run exports its adapter


@pytest.mark.parametrize("over, said", [
    ({"parallelism": {"tp_size": 2}}, "tensor parallelism over linearized experts"),
])
def test_layouts_it_does_not_build_are_one_line(llama4, over, said):
    from adapter.models.resolved import resolve_run

    with pytest.raises(UserError, match=said):
        resolve_run(_run(llama4[1], **over), gpu=False)


def test_another_model_has_no_linearized_layout(tmp_path):
    from adapter.models.resolved import resolve_run
    from tests.helpers.sft_data import tiny_model

    with pytest.raises(UserError, match="has no linearized expert layout"):
        resolve_run(_run(tiny_model(tmp_path / "tok")), gpu=False)


def test_merge_lora_takes_the_adapter_on_the_linearized_base_and_writes_transformers_layout(llama4, tmp_path):
    """`nd-adapter merge-lora` of a linearized run: PEFT's merge on the base built in its layout (an adapter on one
    expert's projection included), written in transformers' fused layout, so that transformers' own Llama 4 loads
    it and computes what the adapted model computes; without the key the base is refused in one line (transformers
    would have started the fused experts random and merged into those)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from adapter.convert.peft import merge_transformers
    from adapter.modeling.hf_build import build_model

    lin = llama4[1]
    model = build_model(str(lin), weights=True, dtype=torch.float32, seed=0, trust_remote_code=False, linearized=True)
    torch.manual_seed(0)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "gate_projs.0"]))
    for name, p in adapted.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # PEFT starts B at zero: a merge of that would change nothing
    adapted.save_pretrained(str(tmp_path / "adapter"))
    tokens = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = adapted(tokens).logits
    out = merge_transformers(lin, tmp_path / "adapter", tmp_path / "merged", key="--adapter", linearized=True)
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(merged(tokens).logits, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(UserError, match="llama4_linearized_experts: true"):
        merge_transformers(lin, tmp_path / "adapter", tmp_path / "merged-2", key="--adapter")
    assert not (tmp_path / "merged-2").exists()
