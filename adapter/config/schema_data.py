"""The `data:` section of the run config (schema.py's `RunConfig.data`): where the training tokens come from, Axolotl's
dataset entries and the keys that shape examples into samples and their order. Kept apart from schema.py, which
holds every other section, for its size.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from adapter.config.schema_rl import PreferenceFields
from adapter.config.values import Float, Int, Jinja, PathStr, Strict

TRAIN_ON_EOS = Literal["turn", "all", "last", "none"]


class DatasetEntry(PreferenceFields, Strict):
    """One SFT dataset, Axolotl's `datasets:` entry keys (adapter/data/sft reads them; docs/config.md lists them).
    `type` stays a string here so that a wrong one is refused by the data code in one line naming the entry."""

    path: PathStr = Field(description="local file or directory, a save_to_disk directory, or a hub id in the "
                                      "local cache")
    type: str | None = Field(None, description="completion, alpaca, chat_template, input_output; none = tokenised")
    split: str = "train"
    data_files: PathStr | list[PathStr] | None = None
    name: str | None = Field(None, description="the dataset's configuration name")
    ds_type: str | None = Field(None, description="loader for files: json, parquet, arrow, csv, text")
    field: str | None = Field(None, description="completion: the text column (default text)")
    field_messages: str = "messages"
    field_system: str = "system"
    field_tools: str = "tools"
    message_property_mappings: dict[str, str] | None = None
    roles: dict[str, list[str]] | None = None
    roles_to_train: list[str] | None = None
    train_on_eos: TRAIN_ON_EOS | None = None
    train_on_eot: TRAIN_ON_EOS | None = None
    chat_template: str | None = None
    chat_template_jinja: Jinja | None = None
    drop_system_message: bool = False
    # stepwise_supervised rows (a process reward model's: prompt, completions, labels), Axolotl's entry keys
    step_separator: str = Field("\n", description="stepwise_supervised: the text after each step, its last token "
                                "the one labelled")
    max_completion_length: Int | None = Field(None, ge=1, description="stepwise_supervised: the steps' tokens cut "
                                              "to this many")
    train_on_last_step_only: bool = Field(False, description="stepwise_supervised: only the last step's label "
                                          "trained")


class SpecialTokens(Strict):
    """Axolotl's `special_tokens`; one the vocabulary lacks gets a new id and rows, as `tokens:` (models/vocab.py)."""

    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    sep_token: str | None = None
    cls_token: str | None = None
    mask_token: str | None = None
    additional_special_tokens: list[str] | None = None


class DataSection(Strict):
    files: list[PathStr] = Field(default_factory=list)
    synthetic: bool = Field(False, description="random tokens instead of files (benchmarks, rehearsals)")
    synthetic_doc_len: Int | None = Field(
        None, ge=1, description="synthetic data in documents of about this many tokens (default: one per sample)")
    document_mask: bool = Field(False, description="attention stays inside each packed document (varlen, any cp)")
    text_key: str = "text"
    cache_dir: PathStr | None = None
    seed: Int = 1234
    # SFT: Axolotl's dataset keys; `datasets` replaces `files` (adapter/data/sft).
    datasets: list[DatasetEntry] = Field(default_factory=list)
    train_on_inputs: bool = False
    sample_packing: bool = False
    eval_sample_packing: bool | None = Field(None, description="default: sample_packing")
    pad_to_sequence_len: bool | None = None
    excess_length_strategy: Literal["drop", "truncate", "raise"] = "drop"
    prepared_path: PathStr | None = Field(None, description="SFT cache root (Axolotl's dataset_prepared_path)")
    val_set_size: Float = Field(0.0, ge=0)
    shuffle_merged_datasets: bool = True
    curriculum: bool = Field(False, description="the samples trained in their prepared order every epoch, one "
                             "dataset's rows unshuffled (Axolotl's curriculum_sampling)")
    pack_in_order: bool = Field(False, description="packing fills one sample at a time in the examples' order (next "
                                "fit: Axolotl's sample_packing_sequentially); default: best fit")
    chat_template: str | None = None
    chat_template_jinja: Jinja | None = None
    eot_tokens: list[str] | None = Field(
        None, description="tokens that end a turn, trained per train_on_eot (Axolotl's eot_tokens); unset: the EOS")
    special_tokens: SpecialTokens = SpecialTokens()
    mistral_common: bool = Field(False, description="tokenise and encode chats with mistral-common (the checkpoint's "
                                 "tekken.json, transformers' MistralCommonBackend in finetuning mode), not the HF "
                                 "tokenizer and a chat template (Axolotl's tokenizer_use_mistral_common)")
    tokens: list[str] = Field(default_factory=list, description="Axolotl's tokens (adapter/models/vocab.py)")
    resize_vocab_to_32x: bool = Field(False, description="Axolotl's resize_token_embeddings_to_32x: an embedding "
                                      "with fewer rows than the tokenizer rounded up to 32 grows (data.tokens' rule)")
    num_proc: Int | None = Field(None, ge=1, description="processes for tokenising; default: by data size")
    test_datasets: list[DatasetEntry] = Field(
        default_factory=list, description="evaluated instead of a held-out part of datasets (Axolotl's test_datasets)")
    min_sample_len: Int | None = Field(
        None, ge=1, description="examples with fewer tokens are dropped, counted (Axolotl's min_sample_len)")
    deduplicate: bool = Field(False, description="identical examples kept once, train and test each on its own "
                                                 "(Axolotl's dataset_exact_deduplication)")
    # image-text conversations through the checkpoint's processor (adapter/data/sft/multimodal.py)
    processor_type: str | None = Field(None, description="AutoProcessor or a transformers processor class: rows of "
                                       "messages and images, batched by the processor (Axolotl's processor_type)")
    image_size: Int | tuple[Int, Int] | None = Field(
        None, description="the column image letterboxed to a square of this side, or resized to (width, height)")
    image_resize_algorithm: Literal["bilinear", "bicubic", "lanczos"] = "bilinear"
    processor_kwargs: dict[str, Any] | None = Field(None, description="passed to the processor's from_pretrained")
    num_workers: Int | None = Field(
        None, ge=0, description="worker processes per rank rendering micro-batches ahead (Axolotl's "
        "dataloader_num_workers); unset: 1 for image-text rows (their processor) on a GPU, else 0")
    prefetch_factor: Int = Field(2, ge=1, description="micro-batches each worker renders ahead (Axolotl's "
                                 "dataloader_prefetch_factor)")
    pin_memory: bool = Field(True, description="workers' batches in page-locked memory on CUDA (Axolotl's "
                             "dataloader_pin_memory)")

    @model_validator(mode="after")
    def _one_source(self) -> DataSection:
        if self.datasets and (self.files or self.synthetic):
            raise ValueError("data.datasets (SFT) cannot be combined with data.files or data.synthetic: give one")
        if self.test_datasets and not self.datasets:
            raise ValueError("data.test_datasets needs data.datasets to train on: list the training data too")
        if self.mistral_common and self.files:
            raise ValueError("data.mistral_common encodes conversations (datasets of type chat_template); "
                             "pretraining files are tokenised by the HF tokenizer: set it to false")
        if self.mistral_common and (self.tokens or self.resize_vocab_to_32x
                                    or self.special_tokens.model_dump(exclude_none=True)):
            raise ValueError("data.mistral_common encodes with the checkpoint's own mistral-common vocabulary, to "
                             "which no token can be added: remove tokens / special_tokens / resize_vocab_to_32x")
        if self.test_datasets and self.val_set_size:
            raise ValueError("data.test_datasets and data.val_set_size both choose the eval set: give one "
                             "(Axolotl refuses both too)")
        return self
