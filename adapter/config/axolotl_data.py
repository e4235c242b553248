"""Axolotl's data keys mapped onto `data:`: the top-level dataset keys, each `datasets:` / `test_datasets:` entry
(checked key by key: one nd-adapter does not support is refused, never dropped) and continued pretraining from
local `pretraining_dataset` files."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from adapter.config.schema import set_dotted
from adapter.config.schema_data import DatasetEntry
from adapter.errors import bad

# Axolotl's dataset keys: top-level key -> data.<key>; `datasets:` entries are checked key by key.
DATA_KEYS = {
    "datasets": "datasets", "train_on_inputs": "train_on_inputs", "sample_packing": "sample_packing",
    "eval_sample_packing": "eval_sample_packing", "pad_to_sequence_len": "pad_to_sequence_len",
    "excess_length_strategy": "excess_length_strategy", "dataset_prepared_path": "prepared_path",
    "val_set_size": "val_set_size", "shuffle_merged_datasets": "shuffle_merged_datasets",
    "chat_template": "chat_template", "chat_template_jinja": "chat_template_jinja", "eot_tokens": "eot_tokens",
    "special_tokens": "special_tokens", "dataset_processes": "num_proc", "dataset_num_proc": "num_proc",
    "resize_token_embeddings_to_32x": "resize_vocab_to_32x", "tokens": "tokens",
    "test_datasets": "test_datasets", "min_sample_len": "min_sample_len", "dataset_exact_deduplication": "deduplicate",
    "curriculum_sampling": "curriculum", "sample_packing_sequentially": "pack_in_order",
    "tokenizer_use_mistral_common": "mistral_common", "processor_type": "processor_type", "image_size": "image_size",
    "image_resize_algorithm": "image_resize_algorithm", "processor_kwargs": "processor_kwargs",
    "dataloader_num_workers": "num_workers", "dataloader_prefetch_factor": "prefetch_factor",
    "dataloader_pin_memory": "pin_memory",
}
ENTRY_KEYS = set(DatasetEntry.model_fields)
ENTRY_ALIASES = {"message_field_role": "role", "message_field_content": "content"}  # Axolotl's deprecated spellings
# a message's reasoning: Axolotl maps message_property_mappings[template_thinking_key] = field_thinking (both default
# reasoning_content, the key chat templates such as qwen3 render inside <think>), after the entry's own mappings
THINKING = {"field_thinking": "reasoning_content", "template_thinking_key": "reasoning_content"}

PRETRAIN_USED = {"path", "type", "text_column", "field", "split", "name", "data_files", "skip", "trust_remote_code"}


def map_pretraining(value: Any, out: dict[str, Any], notes: list[str], *, has_sft: bool) -> None:
    """Axolotl's continued pretraining (`pretraining_dataset`, streamed from the hub there) from local files onto
    nd-adapter's pretraining data (data.files): documents tokenised once into a cache, joined with EOS and cut into
    sequence_len samples, every token trained. Axolotl reads only the first entry; hub names are refused."""
    if value is None:
        return
    entries = [value] if isinstance(value, str) else value
    if not isinstance(entries, list) or not entries:
        raise bad("pretraining_dataset", value, "must be a list of datasets (or one path)",
                  "write `- path: data/corpus.jsonl` below it")
    if has_sft:
        raise bad("pretraining_dataset", value, "given with datasets: Axolotl then pretrains and drops the SFT "
                  "datasets", "give one of pretraining_dataset or datasets")
    entry = entries[0] if isinstance(entries[0], dict) else {"path": entries[0]}
    unknown = sorted(set(entry) - PRETRAIN_USED)
    if unknown:
        raise bad(f"pretraining_dataset[0].{unknown[0]}", entry[unknown[0]], "a key nd-adapter does not support",
                  f"use {', '.join(sorted(PRETRAIN_USED))}")
    path = entry.get("path")
    if not isinstance(path, str) or not path:
        raise bad("pretraining_dataset[0].path", path, "missing", "give the local file or directory of the corpus")
    if entry.get("type", "pretrain") not in ("pretrain", "completion"):
        raise bad("pretraining_dataset[0].type", entry["type"], "pretraining reads raw text",
                  "use type: pretrain (or completion)")
    if entry.get("skip"):
        raise bad("pretraining_dataset[0].skip", entry["skip"], "skipping rows of the corpus is not supported",
                  "remove it (drop the rows from the files instead)")
    root = Path(path)
    if not root.exists():
        raise bad("pretraining_dataset[0].path", path, "not a local file or directory: nd-adapter does not stream "
                  "hub datasets (clusters are often offline)", f"download it (`hf download {path} --repo-type "
                  "dataset`) and point path at its jsonl/txt/parquet files")
    files = entry.get("data_files")
    files = [str(root / f) for f in ([files] if isinstance(files, str) else files)] if files else [str(root)]
    set_dotted(out, "data.files", files)
    set_dotted(out, "data.text_key", entry.get("text_column") or entry.get("field") or "text")
    notes.append(f"pretraining_dataset: {path} -> data.files (documents joined with EOS and cut into sequence_len "
                 "samples, every token trained; Axolotl truncates each document to sequence_len instead)"
                 + ("; only the first entry is read, as in Axolotl" if len(entries) > 1 else ""))


def _entry(i: int, entry: Any, key: str = "datasets") -> dict[str, Any]:
    where = f"{key}[{i}]"
    if not isinstance(entry, dict):
        raise bad(where, entry, "must be a mapping", "write each entry as `- path: ...` with `type: ...` below it")
    out: dict[str, Any] = {}
    legacy: dict[str, Any] = {}
    thinking = {k: entry.get(k, default) for k, default in THINKING.items()}
    for key, value in entry.items():
        if key in THINKING:
            continue
        if key in ENTRY_ALIASES:
            legacy[ENTRY_ALIASES[key]] = value
        elif key not in ENTRY_KEYS:
            raise bad(f"{where}.{key}", value, "a dataset key nd-adapter does not support",
                      "remove it; the supported keys are listed in docs/config.md (SFT datasets)")
        elif key == "type" and isinstance(value, dict):
            raise bad(f"{where}.type", value, "user-defined prompt formats are not supported",
                      "use type: input_output (segments with labels) or pre-tokenised rows")
        elif value is not None:
            out[key] = value
    if legacy:
        out["message_property_mappings"] = {**legacy, **(out.get("message_property_mappings") or {})}
    field, tkey = thinking["field_thinking"], thinking["template_thinking_key"]
    if field and tkey and (field, tkey) != ("reasoning_content", "reasoning_content"):  # the default passes as is
        if not (isinstance(field, str) and isinstance(tkey, str)):
            raise bad(f"{where}.field_thinking", field, "must name a message field", "e.g. field_thinking: thinking")
        out["message_property_mappings"] = {**(out.get("message_property_mappings") or {}), tkey: field}
    return out


def map_data(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    names = (raw.get(k) for k in ("base_model", "base_model_config", "tokenizer_config"))
    if raw.get("tokenizer_use_mistral_common") is None and any("magistral" in str(n or "").lower() for n in names):
        raw = {**raw, "tokenizer_use_mistral_common": True}  # Axolotl's schema (check_tokenizer_use_mistral_common)
        notes.append("tokenizer_use_mistral_common: true (Axolotl turns it on for a Magistral model)")
    if raw.get("tokenizer_use_mistral_common"):
        notes.append("tokenizer_use_mistral_common -> data.mistral_common: chats encoded by mistral-common from the "
                     "checkpoint's tekken.json, each trained turn found over token ids as Axolotl's MistralStrategy "
                     "finds it (the EOS ends a turn)")
        clash = next((k for k in ("pretraining_dataset", "tokens", "special_tokens", "resize_token_embeddings_to_32x")
                      if raw.get(k)), None)
        if clash is not None:
            raise bad("tokenizer_use_mistral_common", True, f"mistral-common encodes conversations with the "
                      f"checkpoint's own vocabulary; {clash} needs the HF tokenizer" + (
                          " (pretraining text)" if clash == "pretraining_dataset" else " (tokens added to it)"),
                      f"set tokenizer_use_mistral_common: false, or remove {clash}")
    if raw.get("tokenizer_use_mistral_common") and (raw.get("chat_template") or raw.get("chat_template_jinja")):
        notes.append("chat_template: not used with tokenizer_use_mistral_common (mistral-common encodes the chats; "
                     "Axolotl passes no template then either)")
        raw = {k: v for k, v in raw.items() if k not in ("chat_template", "chat_template_jinja")}
    if raw.get("test_datasets") and raw.get("val_set_size"):
        raise bad("val_set_size", raw["val_set_size"], "Axolotl takes test_datasets or val_set_size, not both",
                  "drop val_set_size (the test datasets are the eval set)")
    for key, target in DATA_KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        if key == "tokens" and not (isinstance(value, list) and all(isinstance(t, str) and t for t in value)):
            raise bad(key, value, "must be a list of the tokens to add (Axolotl's schema: a list of strings)",
                      "write `tokens: [\"<|im_start|>\"]`; bos_token, eos_token, pad_token, ... go under "
                      "special_tokens")
        if key in ("datasets", "test_datasets"):
            if not isinstance(value, list):
                raise bad(key, value, "must be a list", f"write `{key}:` with `- path: ...` entries below it")
            value = [_entry(i, e, key) for i, e in enumerate(value)]
        set_dotted(out, f"data.{target}", value)
    if raw.get("seed") is not None:
        set_dotted(out, "data.seed", raw["seed"])  # Axolotl's seed also shuffles and splits the data

