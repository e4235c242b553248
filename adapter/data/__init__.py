"""Training data. Pretraining text: local files -> documents (`documents.py`) -> a token cache on disk
(`token_cache.py`) -> fixed-length samples (`pretraining.py`); SFT datasets: `sft/`; synthetic tokens
(`synthetic.py`); then one resumable micro-batch stream per data-parallel rank (`sampler.py`).

The launcher's torch-free preflight (adapter/train/preflight.py) reads this package to check the data before any
process starts, so torch, transformers, datasets and pyarrow are imported by the functions that use them.
"""
from adapter.data.documents import JSONL_SUFFIXES, PARQUET_SUFFIXES, TEXT_SUFFIXES, expand_files, iter_documents
from adapter.data.pretraining import PackedDataset, open_dataset
from adapter.data.sampler import DPSampler, build_batches, collate
from adapter.data.synthetic import SyntheticData
from adapter.data.token_cache import CACHE_VERSION, TOKENIZER_FILES, TokenCache, build_token_cache, cache_key

__all__ = ["JSONL_SUFFIXES", "PARQUET_SUFFIXES", "TEXT_SUFFIXES", "expand_files", "iter_documents", "PackedDataset",
           "open_dataset", "DPSampler", "build_batches", "collate", "SyntheticData", "CACHE_VERSION", "TOKENIZER_FILES",
           "TokenCache", "build_token_cache", "cache_key"]
