"""A tiny Gemma 3 image-text checkpoint (Gemma3ForConditionalGeneration, its SigLIP tower and projector) with its
processor (Gemma3Processor over PIL, a BPE tokenizer with Gemma's turn and image tokens, Axolotl's gemma3 chat
template), and image-text rows of Axolotl's multimodal format: `messages` with a bare image placeholder and an
`images` column of PNG paths."""
from __future__ import annotations

import json
from pathlib import Path

ANSWERS = ["the cat sat", "on the mat", "hello world", "the mat sat on the cat"]
SIZE = 28  # the tiny tower's vision_config.image_size


def gemma3_vlm(root: Path, seed: int = 0, *, text: dict | None = None, vision: dict | None = None,
               image_seq_length: int = 4, spread: float = 3.0) -> Path:
    """root/model: config, random weights, tokenizer and processor files. `text` / `vision` override the tiny
    shape's text_config / vision_config keys (bench/vision_plan_check.py builds gemma-3-4b-it's tower this way),
    `image_seq_length` the soft tokens per image (a square whose side divides the tower's patches per side)."""
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
    vision = {**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     image_size=SIZE, patch_size=7), **(vision or {})}
    side = vision["image_size"]
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": side, "width": side}),
                                tokenizer=ft, chat_template=BUILTIN["gemma3"], image_seq_length=image_seq_length)
    processor.save_pretrained(out)
    ids = ft.convert_tokens_to_ids
    cfg = Gemma3Config(
        text_config={**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, sliding_window=8), **(text or {}),
                     **dict(vocab_size=len(ft), pad_token_id=ids("<pad>"), bos_token_id=ids("<bos>"),
                            eos_token_id=ids("<eos>"))},
        vision_config=vision, mm_tokens_per_image=image_seq_length, boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"), image_token_index=ids("<image_soft_token>"),
        architectures=["Gemma3ForConditionalGeneration"])
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():  # spread the weights (HF's 0.02 init leaves every loss near log V)
        for p in model.parameters():
            p.mul_(spread) if p.dim() > 1 and spread != 1.0 else None
    model.save_pretrained(out)
    return out


def rows(root: Path, n: int, images_every: int = 1) -> list[dict]:
    """n rows, row i with an image where i % images_every == 0 (a PNG of its own size under root/img, a bare
    placeholder in the user turn), the others text alone; a system turn on every third."""
    import numpy as np
    from PIL import Image

    (root / "img").mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        user: list[dict] = [{"type": "text", "text": "what is this" if i % 2 else "describe"}]
        row: dict = {"messages": []}
        if i % 3 == 0:
            row["messages"].append({"role": "system", "content": "image"})
        if i % images_every == 0:
            path = root / "img" / f"{i}.png"
            Image.fromarray((np.random.RandomState(i).rand(20 + 4 * i, 36, 3) * 255).astype("uint8")).save(path)
            user = [{"type": "image"}, *user]
            row["images"] = [str(path)]
        row["messages"] += [{"role": "user", "content": user},
                            {"role": "assistant", "content": ANSWERS[i % len(ANSWERS)]}]
        out.append(row)
    return out


# each family's reference rule: its model class, the assistant turn's opening and closing markers (the answer and
# its closing marker trained), its media tokens (never trained), and the side its images are letterboxed to (None:
# left as they are, the processor resizes them)
FAMILIES = {
    "gemma3": dict(model="Gemma3ForConditionalGeneration", start="<start_of_turn>model\n", end="<end_of_turn>",
                   media=("<start_of_image>", "<image_soft_token>"), size=SIZE),
    "qwen2_5_vl": dict(model="Qwen2_5_VLForConditionalGeneration", start="<|im_start|>assistant\n", end="<|im_end|>",
                       media=("<|image_pad|>",), size=None),
    # LLaVA 1.5 (chat_template llava): Axolotl's base format, no role markers
    "llava": dict(model="LlavaForConditionalGeneration", start=None, end=None, media=("<image>",), size=SIZE),
    # Pixtral: the assistant's turn runs from [/INST] to the EOS (its format record's markers)
    "pixtral": dict(model="LlavaForConditionalGeneration", start="[/INST]", end="</s>", media=("[IMG]",), size=56),
    "mllama": dict(model="MllamaForConditionalGeneration", start="<|start_header_id|>assistant<|end_header_id|>\n\n",
                   end="<|eot_id|>", media=("<|image|>",), size=SIZE),
}


def batch(processor, rows: list[dict], size: int | None = SIZE, family: str = "gemma3"):
    """A micro-batch as the reference builds it: the image at the placeholder, the processor's rendering, labels
    by the format's rule (module docstring; FAMILIES)."""
    from PIL import Image, ImageOps

    fam = FAMILIES[family]
    convs = []
    for r in rows:
        msgs = json.loads(json.dumps(r["messages"]))
        for m in msgs:
            m["content"] = [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"]
            for c in m["content"]:
                if c.get("type") == "image":  # letterboxed to the tower's image_size, as Axolotl fills it in
                    img = Image.open(r["images"][0]).convert("RGB")
                    c["image"] = img if size is None else ImageOps.pad(
                        img, (size, size), method=Image.Resampling.BILINEAR, color=(0, 0, 0))
        convs.append(msgs)
    b = processor.apply_chat_template(convs, add_generation_prompt=False, tokenize=True, return_tensors="pt",
                                      return_dict=True, processor_kwargs={"padding": True})
    tok = processor.tokenizer
    if fam["start"] is None:  # Axolotl's base format (no role markers): every token trained but padding and media
        labels = b["input_ids"].clone()
    else:
        labels = _turn_labels(b["input_ids"], tok.encode(fam["start"], add_special_tokens=False),
                              tok.convert_tokens_to_ids(fam["end"]))
    media = {tok.convert_tokens_to_ids(t) for t in fam["media"]}
    for t in media | {tok.pad_token_id}:
        labels[b["input_ids"] == t] = -100
    return b, labels


def _turn_labels(input_ids, start: list[int], end: int):
    """Each turn that opens with `start` trained to its `end` token, that included; every other token -100."""
    import torch

    labels = torch.full_like(input_ids, -100)
    for i, ids in enumerate(input_ids.tolist()):
        j = 0
        while j < len(ids):
            if ids[j:j + len(start)] == start:
                k = j + len(start)
                while k < len(ids) and ids[k] != end:
                    labels[i, k] = ids[k]
                    k += 1
                if k < len(ids):
                    labels[i, k] = end
                j = k
            j += 1
    return labels


def reference(model_dir: Path, order, held, *, lr: float, freeze_towers: bool = False, lora: str | None = None,
              device: str = "cpu", family: str = "gemma3"):
    """transformers' model (PEFT's for LoRA on the modules the regex `lora` names; the towers and projector frozen
    with `freeze_towers`, as Axolotl's freeze_mm_modules) trained on `order` (per step: the micro-batches of every
    rank, each a list of rows) with AdamW (Axolotl's betas, no decay): losses per step, and the held-out loss (Σ over
    its tokens / their count) after the last, and the model."""
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import AutoProcessor

    fam = FAMILIES[family]
    try:
        processor = AutoProcessor.from_pretrained(str(model_dir))
    except (ImportError, AttributeError):  # Qwen's video processor without torchvision (CPU CI): the test's own
        if family != "qwen2_5_vl":
            raise
        processor = qwen_processor(model_dir)
    processor.tokenizer.chat_template = processor.chat_template
    cls = getattr(transformers, fam["model"])
    model = cls.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    if freeze_towers:  # Axolotl's freeze_mm_modules
        for n, p in model.named_parameters():
            if {"vision_tower", "multi_modal_projector"} & set(n.split(".")):
                p.requires_grad_(False)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(42)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=lora))
    model.train()  # as transformers' Trainer trains it
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    def sums(micro):
        b, labels = batch(processor, micro, fam["size"], family)
        b, labels = b.to(device), labels.to(device)
        logits = model(**b).logits.float()
        target = labels[:, 1:]
        ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
        return ce, int((target != -100).sum())

    losses = []
    for step in order:
        parts = [batch(processor, m, fam["size"], family)[1][:, 1:].ne(-100).sum().item() for m in step]
        count = sum(parts)
        total = 0.0
        for m in step:
            ce, _ = sums(m)
            (ce / count).backward()
            total += float(ce.detach()) / count
        opt.step()
        opt.zero_grad()
        losses.append(total)
    model.eval()
    with torch.no_grad():
        ce, n = sums(held)
    return losses, float(ce) / n, model


def _saved(cls, cfg, out: Path, seed: int) -> Path:
    """`cls(cfg)` from `seed`, its matrices spread (× 3: HF's 0.02 init leaves every loss near log V), saved to out."""
    import torch

    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0) if p.dim() > 1 else None
    model.save_pretrained(out)
    return out


def _tokenizer(specials: list[str], **kw):
    """A byte-level BPE tokenizer of 300 tokens over the rows' words, with the family's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(ANSWERS) + " user assistant system describe image what is this"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kw)


def qwen2_5_vlm(root: Path, seed: int = 0) -> Path:
    """root/qwen: a tiny Qwen2.5-VL checkpoint (two vision blocks, one of them windowed; M-RoPE text layers) with its
    tokenizer, image processor and chat template; `qwen_processor` builds its processor. Saved without the video
    processor, which transformers builds only with torchvision (not a dependency here)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from adapter.data.sft.templates import BUILTIN

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
    ft = _tokenizer(specials, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                    extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    out = root / "qwen"
    out.mkdir(parents=True, exist_ok=True)
    ft.save_pretrained(out)
    (out / "chat_template.jinja").write_text(BUILTIN["qwen2_vl"])
    # 28-pixel patches merged 2 × 2: a 56-pixel square is one merged token a side
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56 * 4, patch_size=14, merge_size=2,
                             temporal_patch_size=2).save_pretrained(out)
    ids = ft.convert_tokens_to_ids
    cfg = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(ft), pad_token_id=ids("<|endoftext|>"),
                         eos_token_id=ids("<|im_end|>"), bos_token_id=None,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[1], window_size=56),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        architectures=["Qwen2_5_VLForConditionalGeneration"])
    return _saved(Qwen2_5_VLForConditionalGeneration, cfg, out, seed)


def mllama_vlm(root: Path, seed: int = 0) -> Path:
    """root/mllama: a tiny Llama 3.2 Vision checkpoint (MllamaForConditionalGeneration: a tiled vision tower whose
    states the language model reads by a cross-attention layer) with its processor and chat template."""
    import torch
    from transformers import MllamaConfig, MllamaForConditionalGeneration, MllamaProcessor
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    from adapter.data.sft.templates import BUILTIN

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|image|>", "<|finetune_right_pad_id|>"]
    ft = _tokenizer(specials, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                    pad_token="<|finetune_right_pad_id|>")
    out = root / "mllama"
    MllamaProcessor(image_processor=MllamaImageProcessorPil(size={"height": SIZE, "width": SIZE}, max_image_tiles=2),
                    tokenizer=ft, chat_template=BUILTIN["llama3_2_vision"]).save_pretrained(out)
    ids = ft.convert_tokens_to_ids
    cfg = MllamaConfig(
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                           intermediate_size=64, vision_output_dim=96, image_size=SIZE, patch_size=14,
                           max_num_tiles=2, intermediate_layers_indices=[0, 1],
                           supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]]),
        text_config=dict(vocab_size=len(ft) + 8, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, cross_attention_layers=[1],
                         bos_token_id=ids("<|begin_of_text|>"), eos_token_id=ids("<|eot_id|>"),
                         pad_token_id=ids("<|finetune_right_pad_id|>")),
        image_token_index=ids("<|image|>"), architectures=["MllamaForConditionalGeneration"])
    torch.manual_seed(seed)
    model = MllamaForConditionalGeneration(cfg)
    with torch.no_grad():  # (the cross-attention gates start at 0 in transformers: spread, they let the image in)
        for n, p in model.named_parameters():
            p.mul_(3.0) if p.dim() > 1 else p.fill_(0.5) if "gate" in n else None
    model.save_pretrained(out)
    return out


def llava_vlm(root: Path, seed: int = 0) -> Path:
    """root/llava: a tiny LLaVA 1.5 checkpoint (a CLIP vision tower, Llama text layers) with its LlavaProcessor
    (CLIP's image processor over PIL: no torchvision needed) and the llava chat template."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from adapter.data.sft.templates import BUILTIN

    ft = _tokenizer(["<s>", "</s>", "<unk>", "<image>", "<pad>"], bos_token="<s>", eos_token="</s>",
                    unk_token="<unk>", pad_token="<pad>")
    out = root / "llava"
    LlavaProcessor(image_processor=CLIPImageProcessorPil(size={"shortest_edge": SIZE},
                                                         crop_size={"height": SIZE, "width": SIZE}),
                   tokenizer=ft, patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1,
                   chat_template=BUILTIN["llava"], image_token="<image>").save_pretrained(out)
    ids = ft.convert_tokens_to_ids
    cfg = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=SIZE, patch_size=14, projection_dim=32),
        text_config=dict(model_type="llama", vocab_size=len(ft), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, pad_token_id=ids("<pad>")),
        image_token_index=ids("<image>"), vision_feature_layer=-2, vision_feature_select_strategy="default",
        architectures=["LlavaForConditionalGeneration"])
    return _saved(LlavaForConditionalGeneration, cfg, out, seed)


def pixtral_vlm(root: Path, seed: int = 0) -> Path:
    """root/pixtral: a tiny Pixtral checkpoint (LlavaForConditionalGeneration over a Pixtral vision tower, Mistral
    text layers) with its PixtralProcessor (transformers builds it only with torchvision: the GPU host has it)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, PixtralProcessor
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from adapter.data.sft.templates import BUILTIN

    ft = _tokenizer(["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]", "<pad>"],
                    bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
    out = root / "pixtral"
    PixtralProcessor(image_processor=PixtralImageProcessorPil(size={"longest_edge": 56}, patch_size=14), tokenizer=ft,
                     patch_size=14, spatial_merge_size=1, chat_template=BUILTIN["pixtral"], image_token="[IMG]",
                     image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]").save_pretrained(out)
    ids = ft.convert_tokens_to_ids
    cfg = LlavaConfig(
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=56, patch_size=14, head_dim=16),
        text_config=dict(model_type="mistral", vocab_size=len(ft), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         pad_token_id=ids("<pad>")),
        image_token_index=ids("[IMG]"), vision_feature_layer=-1, vision_feature_select_strategy="full",
        projector_hidden_act="gelu", multimodal_projector_bias=True, architectures=["LlavaForConditionalGeneration"])
    return _saved(LlavaForConditionalGeneration, cfg, out, seed)


def save_qwen_processor(model_dir: Path) -> None:
    """Qwen2_5_VLProcessor saved whole into the checkpoint (its video processor too: needs torchvision, which the GPU
    host has), so that AutoProcessor loads it as it loads a real Qwen2.5-VL checkpoint's."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    Qwen2_5_VLProcessor(image_processor=AutoImageProcessor.from_pretrained(str(model_dir)),
                        tokenizer=AutoTokenizer.from_pretrained(str(model_dir)),
                        video_processor=Qwen2VLVideoProcessor(),
                        chat_template=(model_dir / "chat_template.jinja").read_text()).save_pretrained(str(model_dir))


def qwen_processor(model_dir: Path):
    """Qwen2_5_VLProcessor over the checkpoint's image processor and tokenizer, without its video processor
    (transformers' class check asks for one; nothing here renders video)."""
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = object.__new__(Qwen2_5_VLProcessor)
    proc.image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
    proc.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    proc.video_processor = None
    proc.chat_template = (model_dir / "chat_template.jinja").read_text()
    for k in ("image_token", "video_token"):
        setattr(proc, k, getattr(proc.tokenizer, k))
    proc.image_token_id = proc.tokenizer.convert_tokens_to_ids(proc.image_token)
    proc.video_token_id = proc.tokenizer.convert_tokens_to_ids(proc.video_token)
    return proc


__all__ = ["ANSWERS", "SIZE", "FAMILIES", "gemma3_vlm", "llava_vlm", "mllama_vlm", "pixtral_vlm", "qwen2_5_vlm",
           "qwen_processor", "save_qwen_processor", "rows", "batch", "reference"]
