"""The rehearsal's tiny model keeps every rule its real model meets: Axolotl's QLoRA examples whose models have
widths that a head_dim of 8 does not keep in NF4's blocks of 64 (Qwen2-7B's 28 heads: 224; Gemma 3's 4 heads: 32;
the same example on Qwen2.5-0.5B's 14 and SmolLM2-135M's 9 heads), at tp 1 and 2, and the expert-parallel and
mixture-of-experts examples (experts per ep rank). Each example is read as written (tests/fixtures/axolotl) with
its hub model's config.json in a local directory, and without its datasets (the shape does not depend on them)
and Gemma 3's unfrozen_parameters (refused beside an adapter)."""
from __future__ import annotations

from pathlib import Path

import pytest

from adapter.errors import UserError
from adapter.models import lora, source
from adapter.models.resolved import resolve_run
from adapter.train import rehearse
from tests.helpers.axolotl_home import MODELS, with_local_model

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests/fixtures/axolotl"
# SmolLM2-135M's published shape (HuggingFaceTB/SmolLM2-135M config.json): 9 heads of 64
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
           "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "bfloat16"}
CASES = {  # id: (example, base model config (None: the example's own), keys changed, world size)
    "qwen2-7b": ("qwen2-qlora-fsdp.yaml", None, {}, 1),
    "qwen2-7b-tp2": ("qwen2-qlora-fsdp.yaml", None, {"tensor_parallel_size": 2}, 2),
    "qwen2.5-0.5b": ("qwen2-qlora-fsdp.yaml", MODELS["Qwen/Qwen2.5-0.5B"], {}, 1),
    "smollm2-135m": ("qwen2-qlora-fsdp.yaml", SMOLLM2, {}, 1),
    "gemma-3-1b": ("gemma-3-1b-qlora.yml", None, {}, 1),
    "gemma-3-270m": ("gemma-3-270m-qlora.yml", None, {}, 1),
    "mixtral-qlora": ("mixtral-qlora-fsdp.yml", None, {"tensor_parallel_size": 2}, 4),
    "qwen3-30b-a3b-ep4": ("qwen3_30ba3b_ep_lora_4gpu.yaml", None, {}, 4),
}


def example_run(tmp_path: Path, name: str, model: dict | None, keys: dict, world: int):
    path = with_local_model(FIXTURES / name, tmp_path, model, ("datasets", "unfrozen_parameters"), **keys)
    return resolve_run(source.load_config(path, world_size=world))


def widths(arch, tp: int) -> dict[str, tuple[int, int]]:
    """Each quantisable linear's (rows, cols) on one TP rank."""
    return {lin.name: (lin.out // (tp if lin.tp_axis == 0 else 1), lin.inp // (tp if lin.tp_axis == 1 else 1))
            for lin in lora.nn_linears(arch)}


@pytest.mark.parametrize("case", list(CASES))
def test_the_tiny_model_keeps_the_real_model_s_rules(tmp_path, case):
    run = example_run(tmp_path, *CASES[case])
    tiny = rehearse.rehearsal(run, 2, None, str(tmp_path / "work")).arch  # before: tp_size blamed for NF4's blocks
    p = run.cfg.parallelism
    tp, ep = p.tp_size, p.ep_size
    if run.lora is not None and run.lora.quantize_base == "nf4":
        for name, (rows, cols) in widths(run.arch, tp).items():
            assert cols % lora.NF4_BLOCK == 0 and rows * cols % lora.NF4_BLOCK == 0, (name, rows, cols)
        for name, (rows, cols) in widths(tiny, tp).items():
            assert cols % lora.NF4_BLOCK == 0 and rows * cols % lora.NF4_BLOCK == 0, (name, rows, cols)
    assert (tiny.num_heads, tiny.num_kv_heads) == (run.arch.num_heads, run.arch.num_kv_heads)
    assert tiny.num_heads % tp == 0 and (tiny.num_kv_heads % tp == 0 or tp % tiny.num_kv_heads == 0)
    assert tiny.experts_per_token == run.arch.experts_per_token
    if run.arch.moe:  # whole experts on every ep rank, at least top-k of them, no more than needed
        assert tiny.num_experts % ep == 0 and tiny.expert_ffn_hidden_size % tp == 0
        assert tiny.experts_per_token <= tiny.num_experts <= max(run.arch.num_experts, rehearse.TINY_EXPERTS + ep)
    assert tiny.hidden_size <= 1024 and tiny.num_layers == rehearse.TINY_LAYERS  # still tiny


def test_a_rule_the_tiny_model_breaks_is_said_as_the_rehearsal_s(tmp_path, monkeypatch):
    """Not as the user's key (the message named tp_size, which was already 1)."""
    run = example_run(tmp_path, *CASES["qwen2-7b"])
    monkeypatch.setattr(rehearse, "tiny_head_dim", lambda heads, tp, block: rehearse.TINY_HEAD_DIM)
    with pytest.raises(UserError, match=r"^the rehearsal's tiny model \(28 heads of 8, hidden 224\) fails a check the "
                                        r"model itself passes, an nd-adapter bug"):
        rehearse.rehearsal(run, 2, None, str(tmp_path / "work"))


def test_unfrozen_patterns_past_the_tiny_model_s_layers_are_left_out_and_said(tmp_path):
    """Axolotl's Mixtral 8x22B examples unfreeze layers 44-55: the tiny copy has two, so those patterns match nothing
    there. The rehearsal leaves them out (said in its first lines) and rehearses the rest of the freezing, instead of
    calling the user's run an nd-adapter bug; a config whose every pattern is lost that way is one line saying so."""
    from adapter import config

    model = str(ROOT / "configs/models/llama-3.2-1b")  # 16 layers, tied embeddings
    patterns = ["^model.embed_tokens.weight$", "model.layers.1[2-5].mlp.down_proj"]
    raw = {"model": {"path": model, "unfrozen_parameters": patterns}, "seq_len": 64}
    run = resolve_run(config.build(raw, env={}, world_size=1))
    tiny = rehearse.rehearsal(run, 2, None, str(tmp_path / "work"))
    assert tiny.cfg.model.unfrozen_parameters == patterns[:1]
    assert any("rehearsal: model.unfrozen_parameters patterns that match nothing in the 2-layer tiny model are "
               f"left out here (the run itself matches them): {patterns[1]}" in n for n in tiny.cfg.notes)
    raw["model"]["unfrozen_parameters"] = patterns[1:]
    run = resolve_run(config.build(raw, env={}, world_size=1))
    with pytest.raises(UserError, match=r"^rehearse='model.unfrozen_parameters': the rehearsal's 2-layer tiny model "
                                        r"has none of the parameters model.unfrozen_parameters names"):
        rehearse.rehearsal(run, 2, None, str(tmp_path / "work2"))
