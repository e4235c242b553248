"""Image-text conversations as Axolotl 067b021's multimodal path feeds them (`processor_type` with
`skip_prepare_dataset`): rows read as they are, turned into a batch by the checkpoint's processor at each
micro-batch, labels masked by the chat format's role markers.

Nothing is tokenised ahead (Axolotl prepares nothing either): each micro-batch's rows are normalised as Axolotl's
ProcessingStrategy does (a `field_messages` / `messages` column, ShareGPT `conversations` mapped to roles, text
content made a content list; the first image of an `images` / `image` column loaded, resized when `image_size` is
set, and put at the bare image placeholder of the last message that has one, else appended to the first user turn),
then `processor.apply_chat_template(..., padding=True)` renders, tokenises and pads them and builds the image
tensors. Labels are the input ids, less padding, the model's media tokens and, where the format has role markers,
every token outside a trained role's turn (Axolotl's `_compute_role_keep_mask`: `roles_to_train`, `train_on_eos`,
`train_on_inputs`). No sequence is cut: Axolotl's collator ignores sequence_len here.

The formats (role markers and media tokens) are records in adapter/data/sft/multimodal_formats.py.
"""
from __future__ import annotations

from copy import deepcopy

import numpy as np

from adapter.data.sft.multimodal_formats import STRATEGIES, boundaries, media_ids, role_keep, strategy_name
from adapter.errors import bad
from adapter.models.image_text import CROSS_ATTENTION

RESAMPLE = {"bilinear": "BILINEAR", "bicubic": "BICUBIC", "lanczos": "LANCZOS"}
IMAGE_COLUMNS = ("images", "image")  # a row's image column, the first of these it has (Axolotl's)


def _image_column(names) -> str | None:
    return next((k for k in IMAGE_COLUMNS if k in names), None)


def _content(message: dict) -> dict | None:
    c = message["content"]
    if isinstance(c, str):
        return {"role": message["role"], "content": [{"type": "text", "text": c}]}
    return {"role": message["role"], "content": c} if isinstance(c, list) else None  # other types: dropped


def _without_none(x):
    if isinstance(x, dict):
        return {k: _without_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_without_none(v) for v in x]
    return x


def normalise(row: dict, *, fields: tuple[str, ...], image_size, resample: str, load: bool = True) -> dict:
    """One row as Axolotl's ProcessingStrategy.__call__ leaves it: {"messages": [...]} with the column image placed
    (`load` False: its path or URL placed unread, for rendering the chat template's text alone)."""
    from PIL import Image, ImageOps
    from transformers.image_utils import load_image

    row = dict(row)
    field = next((f for f in (*fields, "messages") if row.get(f) is not None), None)
    if field is not None and field not in ("messages", "conversations"):
        msgs = row.pop(field)
        legacy = bool(msgs) and isinstance(msgs[0], dict) and "from" in msgs[0] and "value" in msgs[0]
        row["conversations" if legacy else "messages"] = msgs
        if legacy:
            row.pop("messages", None)
    if row.get("messages") is not None:
        row = deepcopy(row)
    elif row.get("conversations") is not None:
        names = {"human": "user", "gpt": "assistant"}
        row = {**deepcopy({k: v for k, v in row.items() if k != "conversations"}),
               "messages": [{"role": names.get(c["from"], c["from"]), "content": c["value"]}
                            for c in row["conversations"]]}
    else:
        raise bad("datasets", sorted(row), "a row without `messages` (or `conversations`, or the entry's "
                  "field_messages)", "give each row its conversation under messages")
    row["messages"] = [m for m in (_content(m) for m in row["messages"]) if m is not None]
    key = _image_column(row)
    if key is not None and row[key] is not None:
        value = row[key]
        if not isinstance(value, (list, tuple)) or not value:
            raise bad("datasets", key, f"the `{key}` column must hold a list of images", f"write {key}: [path]")
        try:
            img = load_image(value[0]) if load else value[0]
        except (OSError, ValueError) as e:  # a missing file, an offline URL, bytes PIL cannot read
            raise bad("datasets", str(value[0])[:120], f"an image that does not load ({str(e).splitlines()[0][:120]})",
                      "give a readable file (a relative path is read from the working directory, as Axolotl reads "
                      "it), or embed the image in the dataset") from None
        img = ImageOps.exif_transpose(img).convert("RGB") if isinstance(img, Image.Image) else img
        if image_size is not None:
            method = getattr(Image.Resampling, resample)
            img = (img.resize(tuple(image_size), method) if isinstance(image_size, (list, tuple)) else
                   ImageOps.pad(img, (image_size, image_size), method=method, color=(0, 0, 0)))
        at, first_user = None, None
        for i, m in enumerate(row["messages"]):
            if first_user is None and m["role"] == "user":
                first_user = i
            for k, c in enumerate(m["content"]):  # the first bare placeholder of the last message that has one
                if c.get("type") == "image" and not ({"image", "url", "path", "base64"} & set(c)):
                    at = (i, k)
                    break
        if at is not None:
            row["messages"][at[0]]["content"][at[1]]["image"] = img
        else:
            row["messages"][first_user or 0]["content"].append({"type": "image", "image": img})
    return _without_none(row)


class MultimodalRows:
    """A run's image-text rows, indexable like the prepared SFT sets: item i is {"row": [i], "loss_mask": [1]}
    (the trainer's eval zeroes "loss_mask" for its filler copies), and `collate` builds a micro-batch's tensors:
    tokens, next-token labels and loss_mask [b, s], and every tensor the processor returns under `mm_<name>`
    (attention_mask, pixel_values, image_grid_thw, token_type_ids, ...), which the model takes as they are."""

    def __init__(self, rows, processor, strategy: str, *, chat_template: str | None, fields: tuple[str, ...],
                 image_size=None, resample: str = "BILINEAR", train_on_inputs: bool = False,
                 roles: tuple[str, ...] = ("assistant",), train_on_eos: str = "turn", blank_filler: bool = False):
        self.blank_filler = blank_filler  # a micro-batch without an image gets a blank one (`filler`)
        self.rows, self.processor, self.strategy = rows, processor, STRATEGIES[strategy]
        self.chat_template, self.fields, self.image_size, self.resample = chat_template, fields, image_size, resample
        self.train_on_inputs, self.roles, self.train_on_eos = train_on_inputs, set(roles), train_on_eos
        self.bounds = boundaries(self.strategy, processor.tokenizer)
        self.media = media_ids(self.strategy, processor)

    def __len__(self) -> int:
        return len(self.rows)

    def strategy_label(self) -> str:
        """The format's name and what it trains, for the run's data line."""
        name = next(k for k, v in STRATEGIES.items() if v is self.strategy)
        trained = ("every token" if self.train_on_inputs else f"the {', '.join(sorted(self.roles))} turns" if
                   self.bounds else "every token but padding and media (no role markers, as Axolotl's base format)")
        return f"{name}: {trained} trained"

    def __getitem__(self, i: int) -> dict:
        return {"row": np.array([i], dtype=np.int64), "loss_mask": np.ones(1, dtype=np.float32)}

    def _render(self, conversations: list) -> dict:
        """One micro-batch as the processor renders it (Axolotl's collator: the chat template, padding=True)."""
        return dict(self.processor.apply_chat_template(conversations, add_generation_prompt=False, tokenize=True,
                                                       return_tensors="pt", return_dict=True,
                                                       chat_template=self.chat_template,
                                                       processor_kwargs={"padding": True}))

    def filler(self) -> dict:
        """The row a micro-batch without an image gets under ZeRO-3 or data parallelism: a user turn holding one
        black image of `image_size` (224 pixels where unset), nothing of it trained. ZeRO-3 gathers the vision
        tower's weights collectively at each call of the tower, and ZeRO-1/2 reduce the gradients in buckets that
        every rank fills alike: a rank whose micro-batch had no image would skip the tower while its peers wait in
        its gathers, or reduce a bucket of other parameters than theirs (DeepSpeed fails in its all-reduce). With
        the filler every rank calls the tower in every forward (and its backward), in the model's own order. It is
        rendered apart and joined below the rows as `_with_filler` says, so the rows' tokens, positions and losses
        are the ones they have without it; its own tokens are not trained, so the tower's gradient is the rows'."""
        from PIL import Image

        size = self.image_size or 224
        img = Image.new("RGB", tuple(size) if isinstance(size, (list, tuple)) else (size, size))
        return {"messages": [{"role": "user", "content": [{"type": "image", "image": img}]}]}

    def labels(self, ids) -> np.ndarray:
        """Axolotl's process_labels: [b, s] input ids with untrained tokens -100 (no shift)."""
        ids = np.asarray(ids)
        keep = np.ones(ids.shape, dtype=bool)
        if not self.train_on_inputs and self.bounds:
            keep = np.array([role_keep(r.tolist(), self.bounds, self.roles, self.train_on_eos) for r in ids])
        pad = getattr(self.processor.tokenizer, "pad_token_id", None)
        for t in ([pad] if pad is not None else []) + self.media:
            keep &= ids != t
        return np.where(keep, ids, -100)

    def check_template(self, at: list[int] | None = None) -> None:
        """Render the chat template's text for rows `at` (every row where None), images unread: a row the template
        refuses (Llama 3.2 Vision's raises on a system turn beside an image) is one line naming it, before training
        (`preprocess`) or at the micro-batch that holds it, not a template's traceback."""
        from jinja2.exceptions import TemplateError

        for i in range(len(self.rows)) if at is None else at:
            conv = normalise(self.rows[i], fields=self.fields, image_size=None, resample=self.resample, load=False)
            try:
                self.processor.apply_chat_template([conv["messages"]], tokenize=False, add_generation_prompt=False,
                                                   chat_template=self.chat_template)
            except TemplateError as e:
                raise bad("datasets", _first_text(conv["messages"]), "the chat template refuses the row whose text "
                          f"starts so: {str(e)[:160].rstrip('.')}", "fix or drop the row (e.g. its system turn), or "
                          "set a chat_template that renders it") from None

    def collate(self, items: list[dict]) -> dict:
        import torch
        from jinja2.exceptions import TemplateError

        rows = [normalise(self.rows[int(it["row"][0])], fields=self.fields, image_size=self.image_size,
                          resample=self.resample) for it in items]
        flags = [float(it["loss_mask"][0]) for it in items]
        try:
            batch = self._render([r["messages"] for r in rows])
        except TemplateError:
            self.check_template([int(it["row"][0]) for it in items])  # names the row
            raise
        except ValueError as e:  # the processor refusing the batch (transformers 5.17's Mllama: no mix of rows with
            # and without images), said in one line as Axolotl's collator would meet it
            raise bad("datasets", _first_text(rows[0]["messages"]), f"{type(self.processor).__name__} refuses "
                      f"the micro-batch holding the row whose text starts so: {str(e).splitlines()[0][:160]}",
                      "change the rows as it asks (e.g. give every row an image), or use a transformers version "
                      "whose processor takes them") from None
        if self.blank_filler and not any(map(_has_image, rows)):
            batch = _with_filler(batch, self._render([self.filler()["messages"]]),
                                 getattr(self.processor.tokenizer, "pad_token_id", None) or 0)
            flags.append(0.0)
        ids = batch.pop("input_ids")
        target = torch.from_numpy(self.labels(ids.numpy()))
        flags = torch.tensor(flags)
        labels = torch.zeros_like(ids)
        labels[:, :-1] = ids[:, 1:]
        mask = torch.zeros(ids.shape, dtype=torch.float32)
        mask[:, :-1] = (target[:, 1:] != -100).float() * flags[:, None]
        return {"tokens": ids, "labels": labels, "loss_mask": mask, **{f"mm_{k}": v for k, v in batch.items()}}


def load(cfg, model_dir, tokenizer_dir, vocab_size: int, *, filler: bool = False
         ) -> tuple[MultimodalRows, MultimodalRows | None, str | None]:
    """(training rows, held-out rows or None, the chat template) of a processor_type run: the checkpoint's processor
    (AutoProcessor or the named class, `processor_kwargs` to its from_pretrained) with the run's tokenizer in it (its
    special tokens and tokens added), the datasets' rows merged in order, `val_set_size`'s share held out as for
    preference rows. The template: `chat_template` by name or jinja, else the tokenizer's, else the processor's.
    `image_size` unset takes the checkpoint's vision_config.image_size, as Axolotl fills it in. `filler`: a
    micro-batch without an image gets a blank one in an untrained row (MultimodalRows.filler: under ZeRO-3 or data
    parallelism a rank that skipped the vision tower would stall its peers)."""
    import json
    import tempfile
    from pathlib import Path

    import datasets
    import transformers

    from adapter.config import spell
    from adapter.data.sft import sources, templates
    from adapter.data.sft.preference import split
    from adapter.data.sft.prepare import top_prefix
    from adapter.data.sft.tokenizer import load_tokenizer

    d = cfg.data
    name = d.processor_type or "AutoProcessor"
    cls = getattr(transformers, name, None)
    if cls is None or not hasattr(cls, "from_pretrained") or not name.endswith("Processor"):
        raise bad(spell(cfg, "data.processor_type"), name, "not a processor class of transformers",
                  "use AutoProcessor")
    try:
        processor = cls.from_pretrained(str(model_dir), trust_remote_code=cfg.model.trust_remote_code,
                                        **(d.processor_kwargs or {}))
    except ImportError as e:  # transformers' requires_backends: e.g. Qwen2-VL's video processor needs torchvision
        said = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        package = "torchvision" if "torchvision" in str(e).lower() else "the package it names"
        raise bad(spell(cfg, "data.processor_type"), name, f"the checkpoint's processor needs a package this "
                  f"environment lacks: {said[:160]}", f"install {package} (the build that matches your torch), "
                  "as Axolotl's environment has it") from None
    except (OSError, ValueError, TypeError) as e:
        raise bad(spell(cfg, "data.processor_type"), name, f"the checkpoint's processor does not load from "
                  f"{model_dir}: {str(e).splitlines()[0][:160]}", "point base_model at a directory with the "
                  "processor's files (preprocessor_config.json / processor_config.json)") from None
    processor.tokenizer = load_tokenizer(cfg, tokenizer_dir, vocab_size)
    choice = d.chat_template if d.chat_template != "tokenizer_default" else None
    template = (templates.resolve_template(choice, d.chat_template_jinja, processor.tokenizer, top_prefix(cfg))
                if choice or d.chat_template_jinja else getattr(processor.tokenizer, "chat_template", None))
    strategy = strategy_name(choice, processor)
    size = d.image_size
    conf = json.loads((Path(model_dir) / "config.json").read_text())
    if size is None:
        vision = conf.get("vision_config") or {}
        size = vision.get("image_size")
        size = tuple(size) if isinstance(size, list) else size
    keep = tempfile.TemporaryDirectory(prefix="nd-mm-")  # datasets' arrow files of local jsonl, this process's
    parts, first = [], d.datasets[0] if d.datasets else None
    for entries, test in ((d.datasets, False), (d.test_datasets, True)):
        loaded = [sources.load(sources.resolve(e, f"{'test_' if test else ''}datasets[{i}]"), e, Path(keep.name))
                  for i, e in enumerate(entries)]
        parts.append(datasets.concatenate_datasets(loaded) if len(loaded) > 1 else (loaded[0] if loaded else None))
    for p in parts:  # image paths that do not exist: said now, not at the step that reaches them
        missing = _missing_files(p) if p is not None else []
        if missing:
            raise bad("datasets", missing[0], f"{len(missing)} image path(s) of the `images` column are not files",
                      "fix the paths (a relative one is read from the working directory, as Axolotl reads it)")
    fields = tuple(dict.fromkeys(e.field_messages for e in d.datasets if e.field_messages))
    roles = tuple(first.roles_to_train) if first is not None and first.roles_to_train is not None else ("assistant",)
    eos = (first.train_on_eos if first is not None else None) or "turn"
    resample = RESAMPLE[d.image_resize_algorithm]

    if filler and conf.get("model_type") in CROSS_ATTENTION:
        _every_row_has_an_image(parts, fields, resample)

    def rows(ds):
        out = MultimodalRows(ds, processor, strategy, chat_template=template, fields=fields, image_size=size,
                             resample=resample, train_on_inputs=d.train_on_inputs, roles=roles, train_on_eos=eos,
                             blank_filler=filler)
        out.keep = keep  # the arrow files live as long as the rows
        return out

    train, test = parts
    if test is not None:
        return rows(train), rows(test), template
    tr, held = split(cfg, len(train))
    return rows(train.select(tr)), (rows(train.select(held)) if len(held) else None), template


def _with_filler(batch: dict, filler: dict, pad: int) -> dict:
    """The rows' batch with the filler's below it. Both are padded on the right to the longer length (the rows
    keep the processor's own padding, left or right, and only gain padding after their last token, which a causal
    model's tokens never attend to); [rows, length] tensors (ids, attention mask, token types) are joined row-wise,
    the filler's media tensors (pixel values, image grids: the rows have none) taken as they are."""
    import torch
    import torch.nn.functional as F

    ids = batch["input_ids"]
    length = max(ids.shape[1], filler["input_ids"].shape[1])

    def widen(t, fill):
        return F.pad(t, (0, length - t.shape[1]), value=fill)

    out = {}
    for k in dict.fromkeys([*batch, *filler]):
        a, b = batch.get(k), filler.get(k)
        if a is None or b is None:
            out[k] = b if a is None else a
        elif a.dim() == 2 and a.shape[0] == ids.shape[0] and a.shape[1] == ids.shape[1]:
            fill = pad if k == "input_ids" else 0
            out[k] = torch.cat([widen(a, fill), widen(b, fill)])
        else:
            out[k] = torch.cat([a, b])
    return out


def _first_text(messages: list[dict]) -> str:
    """A normalised conversation's first text, cut to 60 characters: how a one-line error names its row."""
    return next((c.get("text") for m in messages for c in m["content"] if c.get("text")), "")[:60]


def _has_image(row: dict) -> bool:
    """Whether a normalised row carries an image (placed from its column, or given in its messages' content)."""
    return any(c.get("type") == "image" and ({"image", "url", "path", "base64"} & set(c))
               for m in row["messages"] for c in m["content"])


def debug_lines(rows: MultimodalRows, samples: int) -> list[str]:
    """`preprocess --debug`: the first rows as the processor renders them, the trained tokens in ⟦ ⟧."""
    tok, out = rows.processor.tokenizer, []
    for i in range(min(samples, len(rows))):
        b = rows.collate([rows[i]])
        ids, mask = b["tokens"][0].tolist(), [0.0] + b["loss_mask"][0].tolist()[:-1]  # token k trained: mask[k-1]
        text, open_ = "", False
        for t, m in zip(ids, mask):
            if bool(m) != open_:
                text += "⟦" if m else "⟧"
                open_ = bool(m)
            text += tok.decode([t])
        extra = ", ".join(f"{k[3:]} {tuple(v.shape)}" for k, v in b.items() if k.startswith("mm_"))
        out.append(f"row {i}: {len(ids)} tokens, {int(sum(mask))} trained; {extra}\n{text + ('⟧' if open_ else '')}")
    return out


def _every_row_has_an_image(parts, fields: tuple[str, ...], resample: str) -> None:
    """Llama 3.2 Vision (Mllama) reads the image through cross-attention layers inside the language model, which it
    runs only in micro-batches holding an image. Under ZeRO-3 or data parallelism every rank must run them in every
    micro-batch (MultimodalRows.filler), but a blank image would change the text rows' results there (a row without
    an image still attends to the batch's vision states in those layers), so rows without one are refused."""
    for p in parts:
        if p is None:
            continue
        for row in p:
            if not _has_image(normalise(row, fields=fields, image_size=None, resample=resample, load=False)):
                raise bad("datasets", sorted(row)[:6], "a row without an image: Llama 3.2 Vision runs its cross-"
                          "attention layers only in micro-batches with one, and under ZeRO-3 or data parallelism "
                          "every rank must run them (a blank image would change the text rows' results)",
                          "give every row an image, or train on one data-parallel rank without ZeRO-3")


def _missing_files(ds) -> list[str]:
    """The `images` / `image` column's string entries that are neither a file, a URL nor inline data (read from the
    arrow table; embedded images are not strings)."""
    import os

    key = _image_column(ds.column_names)
    if key is None:
        return []
    out = []
    for value in ds.data.column(key).to_pylist():
        for v in (value if isinstance(value, list) else [value])[:1]:  # (the first image is the one used)
            if isinstance(v, str) and not v.startswith(("http://", "https://", "data:")) and len(v) < 4096 \
                    and not os.path.isfile(v):
                out.append(v)
    return out


__all__ = ["RESAMPLE", "normalise", "MultimodalRows", "load", "debug_lines"]
