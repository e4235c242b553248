"""Training data: local files -> documents (`documents.py`) -> a token cache on disk (`token_cache.py`) -> packed
samples (`packing.py`) -> one resumable micro-batch stream per data-parallel rank (`sampler.py`)."""
from adapter.data.documents import JSONL_SUFFIXES, PARQUET_SUFFIXES, TEXT_SUFFIXES, expand_files, iter_documents
from adapter.data.packing import PackedDataset, cu_seqlens, document_attention_mask, open_dataset
from adapter.data.sampler import DPSampler, build_batches
from adapter.data.synthetic import SyntheticData
from adapter.data.token_cache import CACHE_VERSION, TOKENIZER_FILES, TokenCache, build_token_cache, cache_key

__all__ = ["JSONL_SUFFIXES", "PARQUET_SUFFIXES", "TEXT_SUFFIXES", "expand_files", "iter_documents", "PackedDataset",
           "cu_seqlens", "document_attention_mask", "open_dataset", "DPSampler", "build_batches", "SyntheticData",
           "CACHE_VERSION",
           "TOKENIZER_FILES", "TokenCache", "build_token_cache", "cache_key"]
