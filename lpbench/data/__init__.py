"""Data: mock tokens, local text/JSONL/parquet, Megatron .bin/.idx, tokenizers, packing, sampling.

Entry point: :func:`build_dataset` (``--data mock | PATH | MEGATRON_PREFIX``).
"""

from lpbench.data.loader import DataSplits, build_dataset

__all__ = ["build_dataset", "DataSplits"]
