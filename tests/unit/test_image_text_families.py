"""Image-text families beyond Gemma 3 and Qwen2.5-VL (tests/distributed/test_image_text.py): LLaVA 1.5 (the base
format) and Llama 3.2 Vision (Mllama, whose language model reads the image through cross-attention layers, tiles and
aspect-ratio ids). One micro-batch each through nd-adapter's rows and loss against transformers' own model on the
processor's batch, labelled by the format's rule (tests/helpers/image_text.FAMILIES), fp32 on CPU; and what Llama 3.2
Vision's chat template and layers refuse."""
from __future__ import annotations

import pytest

from tests.helpers.image_text import batch, mllama_vlm, rows
from tests.helpers.sft_data import write_jsonl


def _raw(model, data, **over) -> dict:
    return {"base_model": str(model), "processor_type": "AutoProcessor", "skip_prepare_dataset": True,
            "remove_unused_columns": False, "sample_packing": False, "chat_template": "llama3_2_vision",
            "datasets": [{"path": str(data), "type": "chat_template"}], "sequence_len": 256, "micro_batch_size": 2,
            "output_dir": str(data.parent / "out"), "learning_rate": 1e-4, **over}


def _losses(train, model, processor, idx: list[int], family: str):
    """nd-adapter's mean loss of the micro-batch of rows `idx` (through load()'s collate) and transformers' on the
    processor's batch labelled by the family's rule, beside our batch and the reference's labels."""
    import torch.nn.functional as F

    from adapter.modeling.hf_build import CausalLMLosses

    b = train.collate([train[i] for i in idx])
    media = {k: v for k, v in b.items() if k.startswith("mm_")}
    per_token = CausalLMLosses(model)(b["tokens"], None, labels=b["labels"], loss_mask=b["loss_mask"], **media)
    got = (per_token * b["loss_mask"]).sum() / b["loss_mask"].sum()
    ref, labels = batch(processor, [train.rows[i] for i in idx], family=family)
    logits = model(**ref).logits.float()
    want = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    return got, want, b, labels


def _no_system(rs: list[dict]) -> list[dict]:  # Llama 3.2 Vision's template refuses a system turn beside an image
    return [{**r, "messages": [m for m in r["messages"] if m["role"] != "system"]} for r in rs]


@pytest.fixture(scope="module")
def mllama(tmp_path_factory):
    root = tmp_path_factory.mktemp("mllama")
    return root, mllama_vlm(root)


def test_mllama_rows_and_loss_match_transformers(mllama):
    import torch
    from transformers import AutoProcessor, MllamaForConditionalGeneration

    from adapter import config
    from adapter.data.sft.multimodal import load

    root, model_dir = mllama
    data = _no_system(rows(root, 8, images_every=2))  # rows 0, 2, ... with an image
    cfg = config.build(_raw(model_dir, write_jsonl(root / "m.jsonl", data)), env={}, world_size=1)
    train, _, _ = load(cfg, model_dir, model_dir, 10 ** 6)
    processor = AutoProcessor.from_pretrained(str(model_dir))
    model = MllamaForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    for idx in ([0, 2], [0, 1], [1, 3]):  # images alone, an image beside a text row, text alone
        got, want, b, labels = _losses(train, model, processor, idx, "mllama")
        assert ("mm_cross_attention_mask" in b) == (0 in idx), sorted(k for k in b if k.startswith("mm_"))
        assert torch.allclose(got, want, rtol=1e-5, atol=0), (idx, float(got), float(want))
        assert (b["loss_mask"][:, :-1] > 0).sum() == (labels[:, 1:] != -100).sum()


def test_what_mllama_refuses_is_one_line(mllama):
    """A row its chat template refuses (a system turn beside an image), named before training by `preprocess` and
    at the micro-batch that holds it; rows without an image where every rank must run the cross-attention layers
    (data parallelism or ZeRO-3: the blank filler would change the text rows' results)."""
    from adapter import config
    from adapter.data.sft.multimodal import load
    from adapter.errors import UserError
    from tests.helpers.cli import run_cli

    root, model_dir = mllama
    with_system = write_jsonl(root / "sys.jsonl", rows(root, 4))  # row 0: a system turn and an image
    path = root / "sys.yaml"
    import yaml

    path.write_text(yaml.safe_dump(_raw(model_dir, with_system)))
    code, out, err = run_cli("preprocess", "--config", str(path))
    said = [ln for ln in err.splitlines() if ln.startswith("nd-adapter: error:")]
    assert code == 2 and len(said) == 1 and "Traceback" not in err, (out[-2000:], err)
    assert "the chat template refuses the row whose text starts so: Prompting with images is incompatible with " \
        "system messages. Fix:" in err, err
    train, _, _ = load(config.build(_raw(model_dir, with_system), env={}, world_size=1), model_dir, model_dir, 10 ** 6)
    with pytest.raises(UserError, match="datasets='image': the chat template refuses the row whose text starts so"):
        train.collate([train[0]])

    mixed = write_jsonl(root / "mixed.jsonl", _no_system(rows(root, 4, images_every=2)))
    cfg = config.build(_raw(model_dir, mixed), env={}, world_size=1)
    load(cfg, model_dir, model_dir, 10 ** 6)  # one rank: text rows skip the layers, as transformers does
    with pytest.raises(UserError, match="a row without an image: Llama 3.2 Vision runs its cross-attention"):
        load(cfg, model_dir, model_dir, 10 ** 6, filler=True)


def test_a_processor_refusing_a_micro_batch_is_one_line(mllama):
    """transformers 5.17's MllamaProcessor refuses a batch mixing rows with and without images (5.25's takes it;
    the GPU host has 5.17): its ValueError is one line naming the micro-batch's first row, not a traceback."""
    from adapter import config
    from adapter.data.sft.multimodal import load
    from adapter.errors import UserError

    root, model_dir = mllama
    data = write_jsonl(root / "mix.jsonl", _no_system(rows(root, 4, images_every=2)))
    train, _, _ = load(config.build(_raw(model_dir, data), env={}, world_size=1), model_dir, model_dir, 10 ** 6)

    def refuses(*_a, **_k):
        raise ValueError("If a batch of text is provided, there should be either no images or at least one image "
                         "per sample")

    train.processor.apply_chat_template = refuses
    with pytest.raises(UserError, match=r"MllamaProcessor refuses the micro-batch holding the row whose text starts "
                                        r"so: If a batch of text is provided"):
        train.collate([train[0], train[1]])


def test_llava_rows_and_loss_match_transformers(tmp_path):
    """LLaVA 1.5 (chat_template llava: Axolotl's base format, every token trained but padding and the image tokens)
    through load(): one micro-batch each of images alone, an image beside a text row, and text alone, as transformers'
    loss on the processor's batch."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from adapter import config
    from adapter.data.sft.multimodal import load
    from tests.helpers.image_text import llava_vlm

    model_dir = llava_vlm(tmp_path)
    data = write_jsonl(tmp_path / "l.jsonl", rows(tmp_path, 8, images_every=2))
    cfg = config.build(_raw(model_dir, data, chat_template="llava"), env={}, world_size=1)
    train, _, _ = load(cfg, model_dir, model_dir, 10 ** 6)
    assert train.strategy_label().startswith("base:"), train.strategy_label()
    processor = AutoProcessor.from_pretrained(str(model_dir))
    model = LlavaForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).train()
    for idx in ([0, 2], [0, 1], [1, 3]):
        got, want, _, _ = _losses(train, model, processor, idx, "llava")
        assert torch.allclose(got, want, rtol=1e-5, atol=0), (idx, float(got), float(want))
