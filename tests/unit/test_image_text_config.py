"""`processor_type` as Axolotl's vision examples write it: gemma3/gemma-3-4b-vision-qlora.yml plans unchanged on the
transformers engine (the checkpoint's shape, no weights); what image-text runs do not build is refused in one line
naming the key and the fix; the role-marker scan equals Axolotl's rule on hand-made rows. Training against
transformers (+ PEFT): tests/distributed/test_image_text.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from adapter import config
from adapter.data.sft.multimodal_formats import role_keep
from tests.helpers.cli import run_cli

FIXTURES = Path(__file__).parents[1] / "fixtures" / "axolotl"
EXAMPLE = FIXTURES / "gemma-3-4b-vision-qlora.yml"
SHAPE = Path(__file__).parents[2] / "configs" / "models" / "gemma-3-4b-it" / "config.json"


def _model() -> dict:
    """The checkpoint's config.json with its text config's vocabulary written out (transformers' default)."""
    import json

    conf = json.loads(SHAPE.read_text())
    conf["text_config"].setdefault("vocab_size", 262208)
    return conf


def test_axolotl_vision_example_plans_on_the_transformers_engine(tmp_path):
    from tests.helpers.axolotl_home import with_local_model

    cfg = config.build(yaml.safe_load(EXAMPLE.read_text()), env={}, world_size=1)
    assert cfg.data.processor_type == "AutoProcessor" and not cfg.data.sample_packing
    said = [n for n in cfg.notes if n.startswith("processor_type: AutoProcessor")]
    assert said and "skip_prepare_dataset, remove_unused_columns: implied" in said[0], cfg.notes
    assert not any("ignored" in n and "skip_prepare_dataset" in n for n in cfg.notes), cfg.notes
    path = with_local_model(EXAMPLE, tmp_path, _model(), drop=())
    code, out, err = run_cli("plan", str(path), "--gpus-per-node", "1")
    flat = " ".join(out.split())
    assert code == 0 and "engine: transformers' own Gemma3ForConditionalGeneration" in flat, (out[-3000:], err)
    assert "an image-text run" in flat and "the adapters trained" in flat, flat[-3000:]


@pytest.mark.parametrize("over, says", [
    ({"tensor_parallel_size": 2, "_gpus": 2}, "processor_type='AutoProcessor': tensor, context or expert parallelism"),
    ({"role_boundaries": [{"role": "assistant", "start": "<x>"}]}, "role_boundaries="),
    ({"lora_target_linear": True}, "lora_target_linear beside image-text rows"),
    ({"sample_packing": True}, "image-text rows are batched by the processor, not packed"),
    ({"rl": "dpo"}, "dpo on image-text rows is not built"),
    ({"chat_template": "gemma3n"}, "chat_template='gemma3n': the gemma3n image-text format"),
])
def test_what_image_text_runs_do_not_build_is_one_line(tmp_path, over, says):
    from tests.helpers.axolotl_home import with_local_model

    gpus = str(over.pop("_gpus", 1))
    path = with_local_model(EXAMPLE, tmp_path, _model(), drop=(), **over)
    code, out, err = run_cli("plan", str(path), "--gpus-per-node", gpus)
    assert code == 2 and err.count("\n") == 1 and says in err and "Fix:" in err, err


def test_role_markers_scan_as_axolotl():
    """Axolotl's _compute_role_keep_mask on ids: [S u U E] user turn, [S a A E] assistant turn (S start, E end)."""
    S, U, A, E, X = 1, 2, 3, 9, 7
    bounds = [("user", [S, U], [E], False, True), ("assistant", [S, A], [E], False, True)]
    ids = [X, S, U, 5, E, S, A, 6, 6, E, X, S, A, 8]  # the last turn has no end: it runs to the sequence's end
    keep = lambda eos, roles=("assistant",): [i for i, k in enumerate(role_keep(ids, bounds, set(roles), eos)) if k]  # noqa: E731
    assert keep("turn") == [7, 8, 9, 13]
    assert keep("none") == [7, 8, 13]
    assert keep("last") == [7, 8, 9, 13]  # the last trained turn with an end marker is the first one
    assert keep("all") == [4, 7, 8, 9, 13]  # the user turn's end marker too
    assert keep("turn", ("user", "assistant")) == [3, 4, 7, 8, 9, 13]
    inc = [("user", [S, U], [S, A], False, False), ("assistant", [S, A], [E], True, True)]  # a shared marker
    assert [i for i, k in enumerate(role_keep([S, U, 5, S, A, 6, E], inc, {"assistant"}, "turn")) if k] == \
        [3, 4, 5, 6]


def test_formats_are_picked_as_axolotl_picks_them():
    """The chat template's name, else the processor's class (PaddleOCR-VL's first), else the base format; each
    record's markers resolved on a tokenizer ("<eos>": its EOS id; a marker that does not encode is dropped)."""
    from types import SimpleNamespace

    from adapter.data.sft.multimodal_formats import STRATEGIES, boundaries, media_ids, strategy_name

    def proc(name, **attrs):
        return type(name, (), attrs)()

    assert strategy_name("qwen2_vl", proc("Qwen2VLProcessor")) == "qwen2_vl"
    assert strategy_name("llava", proc("LlavaProcessor")) == "base"
    assert strategy_name(None, proc("Glm46VProcessor")) == "glm4v"
    assert strategy_name("qwen2_vl", proc("PaddleOCRVLProcessor")) == "paddleocr_vl"
    assert strategy_name(None, proc("SmolVLMProcessor")) == "smolvlm2"
    assert strategy_name("gemma4_unified", proc("Gemma4Processor")) == "gemma4"
    vocab = {"[INST]": 5, "[/INST]": 6, "[IMG]": 7}
    tok = SimpleNamespace(eos_token_id=2, unk_token_id=0, encode=lambda s, add_special_tokens: [vocab[s]] if s in
                          vocab else [], convert_tokens_to_ids=lambda t: vocab.get(t, 0))
    assert boundaries(STRATEGIES["pixtral"], tok) == [("user", [5], [6], False, False),
                                                      ("assistant", [6], [2], False, True)]
    assert boundaries(STRATEGIES["mistral_v7_tekken"], tok) == boundaries(STRATEGIES["pixtral"], tok)  # no system
    assert media_ids(STRATEGIES["pixtral"], SimpleNamespace(tokenizer=tok, image_token="[IMG]")) == [7]
    assert media_ids(STRATEGIES["internvl"], SimpleNamespace(tokenizer=tok, image_ids=[11, 12])) == [11, 12]
    tok.image_token_id, tok.audio_token_id = 13, 0  # (0: the unknown token's id, as a missing one resolves)
    assert media_ids(STRATEGIES["gemma4"], SimpleNamespace(tokenizer=tok, image_token="[IMG]", boi_token="[INST]",
                                                           video_token_id=14)) == [7, 13, 5, 14]


def test_plan_counts_the_vision_towers_images(tmp_path):
    """plan counts one image a row through the vision tower (Gemma 3's SigLIP: 27 layers, 896 px / 14 = 4,096
    patches an image): a full fine-tune keeps the tower's activations for backward (8·hidden + 2·ffn elements a
    patch and layer) and runs its backward; freeze_mm_modules runs its forward alone and keeps nothing."""
    import json

    from tests.helpers.axolotl_home import with_local_model

    def planned(name, **keys):
        path = with_local_model(EXAMPLE, tmp_path / name, _model(), micro_batch_size=2, **keys, drop=(
            "adapter", "load_in_4bit", "lora_model_dir", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"))
        code, out, err = run_cli("plan", str(path), "--gpus-per-node", "1", "--format", "json")
        assert code == 0, err
        return json.loads(out)

    full, frozen = planned("full", gradient_checkpointing=False), planned("frozen", freeze_mm_modules=True,
                                                                          gradient_checkpointing=False)
    kept = 2 * 27 * 4096 * 2 * (8 * 1152 + 2 * 4304)  # two images in bf16
    assert full["memory"]["activations"] - frozen["memory"]["activations"] == kept
    # the example's gradient_checkpointing: transformers recomputes the tower's layers too, keeping their inputs
    rc, rc_frozen = planned("rc"), planned("rc frozen", freeze_mm_modules=True)
    assert rc["memory"]["activations"] - rc_frozen["memory"]["activations"] == 2 * 4096 * 2 * 1152 * 27 + kept // 27
    assert full["predicted"]["step_time_s"] > frozen["predicted"]["step_time_s"]
    # the tower's attention: bidirectional over 4,096 patches at the profile's flash rate for that span (a trained
    # tower's forward and backward, a frozen one's forward alone), 8 images a step (micro-batch 2 × grad-accum 4)
    from adapter.plan.hardware import read

    tower = 8 * 27 * 3.5 * 4 * 4096 ** 2 * 1152 / read(full["predicted"]["profile"]).attention.rate(4096)
    text = full["predicted"]["compute_detail"]["attention"] - tower
    assert text > 0  # the language model's own
    assert abs(frozen["predicted"]["compute_detail"]["attention"] - (text + tower / 3.5)) < 1e-9
    # grad-accum 4 on the flat AdamW: micro-batches 2-4 run their forward beside all the gradients
    m = full["memory"]
    assert m["peak"] >= m["weights"] + m["optimizer"] + m["gradients"] + m["activations"] + m["logits"]
    assert "896 pixels: 4096 patches through the 27-layer vision tower" in json.dumps(full)


def test_gated_vision_mlps_count_three_linears():
    """Qwen2.5-VL's (and Pixtral's, Gemma 4's, GLM-4V's) vision blocks have a gated MLP: plan counts gate, up and
    down and the four FFN-wide tensors their backward keeps; SigLIP's and Qwen2-VL's fc1 / fc2 two linears."""
    from adapter.models.counts import vision_activation_bytes, vision_gemms
    from adapter.models.vision import vision_tower

    qwen25 = vision_tower({"vision_config": {"model_type": "qwen2_5_vl_vision", "depth": 32, "hidden_size": 1280,
                                             "intermediate_size": 3420, "patch_size": 14, "out_hidden_size": 3584}})
    qwen2 = vision_tower({"vision_config": {"model_type": "qwen2_vl", "depth": 32, "embed_dim": 1280, "mlp_ratio": 4,
                                            "hidden_size": 3584, "patch_size": 14}})
    assert qwen25 == (32, 1280, 3420, 0, 14, 2) and qwen2 == (32, 1280, 5120, 0, 14, 1)
    assert vision_gemms(qwen25, 100).count((100, 3420, 1280)) == 2 and vision_gemms(qwen2, 100).count(
        (100, 5120, 1280)) == 1
    assert vision_activation_bytes(qwen25, 10, 2) == 32 * 10 * 2 * (8 * 1280 + 4 * 3420)
    assert vision_activation_bytes(qwen2, 10, 2) == 32 * 10 * 2 * (8 * 1280 + 2 * 5120)


def test_a_processor_needing_an_absent_package_is_one_line(tmp_path, monkeypatch):
    """transformers raises ImportError where a processor's part needs a missing backend (Qwen2-VL's video processor
    and torchvision): said in one line naming the package, not a traceback."""
    import transformers

    from adapter.data.sft.multimodal import load
    from adapter.errors import UserError

    def lacking(*_a, **_k):
        raise ImportError("\nQwen2VLVideoProcessor requires the Torchvision library but it was not found in your "
                          "environment. Check out the instructions on the\ninstallation page: ...")

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", lacking)
    raw = {**yaml.safe_load(EXAMPLE.read_text()), "datasets": [{"path": str(tmp_path / "x.jsonl"),
                                                               "type": "chat_template"}]}
    with pytest.raises(UserError) as e:
        load(config.build(raw, env={}, world_size=1), tmp_path, tmp_path, 100)
    line = str(e.value)
    assert "\n" not in line and "Qwen2VLVideoProcessor requires the Torchvision library" in line, line
    assert "install torchvision" in line, line
