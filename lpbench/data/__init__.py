"""Data: mock tokens, local text/JSONL/parquet, Megatron .bin/.idx, tokenizers, packing, sampling.

Entry point: :func:`build_dataset` (``--data mock | PATH | MEGATRON_PREFIX``).
"""

from lpbench.data.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype
from lpbench.data.loader import DataSplits, build_dataset
from lpbench.data.mock import MockDataset, MockLoader
from lpbench.data.packing import PackedSequences, pack_documents
from lpbench.data.sampler import MicroBatchLoader, MicroBatchSampler
from lpbench.data.tokenizer import ByteTokenizer, get_tokenizer, load_tokenizer, train_tokenizer

__all__ = [
    "build_dataset",
    "DataSplits",
    "MockDataset",
    "MockLoader",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "optimal_dtype",
    "PackedSequences",
    "pack_documents",
    "MicroBatchSampler",
    "MicroBatchLoader",
    "ByteTokenizer",
    "get_tokenizer",
    "load_tokenizer",
    "train_tokenizer",
]
