"""A tiny Gemma 3 image-text checkpoint (Gemma3ForConditionalGeneration, its SigLIP tower and projector) with its
processor (Gemma3Processor over PIL, a BPE tokenizer with Gemma's turn and image tokens, Axolotl's gemma3 chat
template), and image-text rows of Axolotl's multimodal format: `messages` with a bare image placeholder and an
`images` column of PNG paths."""
from __future__ import annotations

from pathlib import Path

ANSWERS = ["the cat sat", "on the mat", "hello world", "the mat sat on the cat"]


def gemma3_vlm(root: Path, seed: int = 0) -> Path:
    """root/model: config, random weights, tokenizer and processor files."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
        PreTrainedTokenizerFast,
    )

    from adapter.data.sft.templates import BUILTIN

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                "<end_of_image>", "<image_soft_token>"]
    tok.train_from_iterator([" ".join(ANSWERS) + " user model system describe image what is this"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    ft = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>",
                                 unk_token="<unk>", extra_special_tokens={
                                     "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                     "image_token": "<image_soft_token>"})
    ft.chat_template = BUILTIN["gemma3"]
    out = root / "model"
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}),
                                tokenizer=ft, chat_template=BUILTIN["gemma3"], image_seq_length=4)
    processor.save_pretrained(out)
    ids = ft.convert_tokens_to_ids
    cfg = Gemma3Config(
        text_config=dict(vocab_size=len(ft), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                         pad_token_id=ids("<pad>"), bos_token_id=ids("<bos>"), eos_token_id=ids("<eos>")),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=7),
        mm_tokens_per_image=4, boi_token_index=ids("<start_of_image>"), eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"), architectures=["Gemma3ForConditionalGeneration"])
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():  # spread the weights (HF's 0.02 init leaves every loss near log V)
        for p in model.parameters():
            p.mul_(3.0) if p.dim() > 1 else None
    model.save_pretrained(out)
    return out


def rows(root: Path, n: int, text_only: bool = False) -> list[dict]:
    """n rows, each with an image (a PNG of its own size under root/img, a bare placeholder in the user turn), but
    every other one without (`text_only`); a system turn on every third."""
    import numpy as np
    from PIL import Image

    (root / "img").mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        user: list[dict] = [{"type": "text", "text": "what is this" if i % 2 else "describe"}]
        row: dict = {"messages": []}
        if i % 3 == 0:
            row["messages"].append({"role": "system", "content": "image"})
        if not (text_only and i % 2):
            path = root / "img" / f"{i}.png"
            Image.fromarray((np.random.RandomState(i).rand(20 + 4 * i, 36, 3) * 255).astype("uint8")).save(path)
            user = [{"type": "image"}, *user]
            row["images"] = [str(path)]
        row["messages"] += [{"role": "user", "content": user},
                            {"role": "assistant", "content": ANSWERS[i % len(ANSWERS)]}]
        out.append(row)
    return out


__all__ = ["ANSWERS", "gemma3_vlm", "rows"]
