"""A family is its record and its weight table, nothing else: a Llama-shaped family registered here, with Meta's
original checkpoint names (attention.wq ... feed_forward.w2, attention_norm, tok_embeddings, output) and one norm
option Llama lacks (q/k norms), is counted, planned, given LoRA targets, PEFT names and a quantised base, shrunk for
the rehearsal and converted, with no other code knowing it (docs/adding-a-model.md). Its layer is Qwen3's, so
transformers' Qwen3 model is the reference for its parameter count and its Megatron checkpoint."""
from __future__ import annotations

import json

import pytest
import torch

from adapter.errors import UserError
from adapter.models import counts, families, lora
from adapter.models.arch import arch_from_hf_dict
from adapter.models.families import Family
from adapter.models.mapping import LAYER, Ctx, copy, fused_qkv, gated_mlp, untied, vocab

A, F = "layers.{i}.attention.", "layers.{i}.feed_forward."
META_TABLE = (
    vocab("embedding.word_embeddings.weight", "tok_embeddings.weight"),
    copy(LAYER + "self_attention.linear_qkv.layer_norm_weight", "layers.{i}.attention_norm.weight", "h"),
    fused_qkv(LAYER + "self_attention.linear_qkv.weight", A + "wq.weight", A + "wk.weight", A + "wv.weight"),
    copy(LAYER + "self_attention.linear_proj.weight", A + "wo.weight", "h q", tp_axis=1),
    copy(LAYER + "self_attention.q_layernorm.weight", A + "q_norm.weight", "d"),
    copy(LAYER + "self_attention.k_layernorm.weight", A + "k_norm.weight", "d"),
    copy(LAYER + "mlp.linear_fc1.layer_norm_weight", "layers.{i}.ffn_norm.weight", "h"),
    gated_mlp(LAYER + "mlp.linear_fc1.weight", F + "w1.weight", F + "w3.weight"),
    copy(LAYER + "mlp.linear_fc2.weight", F + "w2.weight", "h f", tp_axis=1),
    copy("decoder.final_layernorm.weight", "norm.weight", "h"),
    vocab("output_layer.weight", "output.weight", when=untied),
)
META = Family("metallama", ("MetaLlamaForCausalLM",), ("metallama",), META_TABLE, qkv_bias=False, qk_norm=True)
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 300, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
NAMES = ["wq", "wk", "wv", "wo", "w1", "w3", "w2"]


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    """The record added to the families, as a new entry in FAMILIES would be."""
    monkeypatch.setattr(families, "FAMILIES", families.FAMILIES + (META,))
    monkeypatch.setitem(families._BY_NAME, META.name, META)


def arch(**kw):
    return arch_from_hf_dict({"architectures": ["MetaLlamaForCausalLM"], **SHAPE, **kw})


def qwen3(**kw):
    return arch_from_hf_dict({"architectures": ["Qwen3ForCausalLM"], **SHAPE, **kw})


def test_its_linears_and_counts_come_from_its_table():
    a, ref = arch(), qwen3()
    assert (a.family, a.qk_norm) == ("metallama", True)
    lins = counts.linears(a)
    assert [lin.name for lin in lins] == NAMES
    assert [lin.hf_module for lin in lins[:1] + lins[-1:]] == ["layers.{i}.attention.wq", "layers.{i}.feed_forward.w2"]
    assert [(lin.fused, lin.tp_axis) for lin in lins] == [(lin.fused, lin.tp_axis) for lin in counts.linears(ref)]
    # the same layer as Qwen3's under other names: every count is Qwen3's
    assert counts.num_params(a) == counts.num_params(ref)
    assert counts.layer_norm_params(a) == 2 * 128 + 2 * 32  # two RMSNorms and the q/k norms, from its table
    assert counts.param_tensors(a) == counts.param_tensors(ref) == (8, 2 * 8 + 3)
    assert counts.layer_gemms(a, 64, 2) == counts.layer_gemms(ref, 64, 2)
    assert counts.flops_per_token(a, 256) == counts.flops_per_token(ref, 256)


def test_its_parameter_count_is_transformers_qwen3_s():
    from transformers import AutoModelForCausalLM, Qwen3Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**SHAPE))
    assert counts.num_params(arch()) == sum(p.numel() for p in model.parameters())


def test_lora_targets_placement_and_peft_names():
    a = arch()
    spec = lora.resolve(a, r=4, alpha=8, target_linear=True, modules_to_save=["output"])
    assert [t.linear.name for t in spec.targets if t.layer == 0] == NAMES
    assert spec.targets[0].hf_module == "layers.0.attention.wq" and spec.modules_to_save == ("lm_head",)
    assert lora.peft_key(spec.targets[0], "A") == "base_model.model.layers.0.attention.wq.lora_A.weight"
    assert lora.saved_key(a, "lm_head") == "base_model.model.output.weight"
    assert lora.peft_config(spec, None)["target_modules"] == NAMES
    assert lora.nn_linears(a) == counts.linears(a)  # all of them nn.Linear: all quantised by a 4-bit base
    assert lora.resolve(a, r=4, alpha=8, target_modules=["wq", "wv"]).target_names == ("wq", "wv")
    with pytest.raises(UserError, match="PEFT has no default target modules for metallama.*list some of wq, wk"):
        lora.resolve(a, r=4, alpha=8)
    with pytest.raises(UserError, match="q_proj.*matches no linear of this metallama model's layers"):
        lora.resolve(a, r=4, alpha=8, target_modules=["q_proj"])
    # each adapter's rows in Megatron's fused outputs are where the converter puts that HF linear's rows
    for fused in ("linear_qkv", "linear_fc1"):
        rule = families.linear_rule(a, fused)
        hf = {lin.name: torch.arange(lin.out * 128, dtype=torch.float32).view(lin.out, 128) + 1e5 * j
              for j, lin in enumerate(counts.linears(a)) if lin.fused == fused}
        for tp in (1, 2):
            whole = rule.to_megatron(list(hf.values()), Ctx(a, 512, tp))
            p = lora.placement(a, fused, tp)
            assert {name for name, _, _ in p.pieces} == set(hf)
            for rank in range(tp):
                local = torch.cat([c.chunk(tp)[rank] for c in whole.chunk(rule.parts)]).view(p.groups, p.width, 128)
                for name, t in hf.items():
                    start, size = p.piece(name)
                    assert torch.equal(local[:, start:start + size].reshape(-1, 128), t.chunk(tp)[rank]), name


def test_plan_freeze_and_the_rehearsal_s_tiny_model(tmp_path):
    import contextlib
    import io

    from adapter.cli import main
    from adapter.models import freeze
    from adapter.train.rehearse import tiny_arch

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"architectures": ["MetaLlamaForCausalLM"], **SHAPE}))
    (tmp_path / "run.yaml").write_text(f"model:\n  path: {tmp_path / 'm'}\ndata:\n  synthetic: true\nseq_len: 256\n"
                                       "parallelism:\n  dp_shard_size: 2\n  tp_size: 2\nlora:\n  r: 8\n"
                                       "  target_linear: true\n  quantize_base: nf4\nhardware:\n  gpus_per_node: 4\n")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", str(tmp_path / "run.yaml")]) == 0
    assert "on wq, wk, wv, wo, w1, w3, w2 of all 2 layers" in out.getvalue() and "NF4" in out.getvalue()
    tensors = freeze.resolve(arch(), ["^layers.1.attention.w[qkv]", "^layers.1.attention_norm"])
    assert {t.name for t in tensors if t.trained} == {"decoder.layers.1.self_attention.linear_qkv.weight",
                                                     "decoder.layers.1.input_layernorm.weight"}
    tiny = tiny_arch(arch(), 2, None)
    assert tiny.family == "metallama" and tiny.qk_norm and [lin.name for lin in counts.linears(tiny)] == NAMES
    assert counts.num_params(tiny) == counts.num_params(tiny_arch(qwen3(), 2, None))


def test_it_converts_as_the_qwen3_layer_it_renames(tmp_path):
    """Qwen3's tensors under this family's names convert to the Megatron checkpoint Qwen3's own do, and back to the
    same tensors under this family's names, bit for bit."""
    from safetensors.torch import save_file

    from adapter.convert import megatron_io as mio
    from adapter.convert.to_hf import megatron_to_hf
    from adapter.convert.to_megatron import hf_to_megatron
    from tests.helpers.hf import TINY, make_hf, tensors

    src = make_hf("qwen3", tmp_path / "qwen3")
    shape = {**TINY, "head_dim": 32, "tie_word_embeddings": False}
    a = arch_from_hf_dict({"architectures": ["MetaLlamaForCausalLM"], **shape})
    theirs = {r.megatron: r for r in families.table_for(qwen3(**shape))}
    rename = {}
    for rule in families.table_for(a):
        for i in range(a.num_layers) if rule.per_layer else (None,):
            rename.update(zip(theirs[rule.megatron].hf_names(i), rule.hf_names(i)))
    meta = tmp_path / "meta"
    meta.mkdir()
    source = tensors(src)
    save_file({rename[k]: v.contiguous() for k, v in source.items()}, meta / "model.safetensors",
              metadata={"format": "pt"})
    (meta / "config.json").write_text(json.dumps({"architectures": ["MetaLlamaForCausalLM"], **shape}))
    (meta / "tokenizer.json").write_text('{"version": "1.0", "model": {}}')
    ours, ref = (mio.DistCheckpointReader(mio.resolve_ckpt_dir(hf_to_megatron(d, tmp_path / f"{d.name}-meg", tp=2,
                                                                              progress=False)))
                 for d in (meta, src))
    assert set(ours.keys()) == set(ref.keys())
    for key in ref.keys():
        if not key.endswith("_extra_state"):
            assert torch.equal(ours.read(key), ref.read(key)), key
    back = tensors(megatron_to_hf(tmp_path / "meta-meg", tmp_path / "back", progress=False))
    assert back.keys() == {rename[k] for k in source}
    assert all(torch.equal(back[rename[k]], v) for k, v in source.items())


def test_every_family_s_table_holds_the_norms_its_record_builds():
    """Counts read a layer's norms off the table and the model builds them from the record's flags: the two agree
    for every family."""
    for fam in families.FAMILIES:
        keys = {r.megatron for r in fam.table}
        assert (LAYER + "self_attention.q_layernorm.weight" in keys) == (LAYER + "self_attention.k_layernorm.weight"
                                                                          in keys) == fam.qk_norm, fam.name
        assert (LAYER + "self_attention.linear_proj.post_norm.weight" in keys) == fam.post_norms, fam.name
        assert (LAYER + "mlp.linear_fc2.post_norm.weight" in keys) == fam.post_norms, fam.name
