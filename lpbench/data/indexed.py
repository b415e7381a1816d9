"""Megatron-LM indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``): writer and memmap reader.

Byte-compatible with Megatron-Core's ``IndexedDataset`` (``megatron/core/datasets/
indexed_dataset.py``; formerly ``MMapIndexedDataset``). ``.bin`` holds the token ids of every
sequence back to back in one dtype. ``.idx``, all little-endian::

    9 bytes  b"MMIDIDX\\x00\\x00"
    <Q       version, 1
    <B       dtype code (DTYPE_CODES)
    <Q       sequence count S
    <Q       document count D (entries of the document index, i.e. documents + 1)
    S x int32  sequence lengths (tokens)
    S x int64  sequence pointers (byte offset of each sequence in .bin)
    D x int64  document index: sequence indices where documents start, leading 0, ending at S

A document is one or more sequences (Megatron's ``--split-sentences`` makes one per sentence).
Multimodal datasets append an int8 mode per sequence; the reader ignores it.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from lpbench.errors import UsageError

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int | None) -> type:
    """Megatron's choice for token ids: uint16 when ``vocab_size < 65500``, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def bin_path(prefix: str | os.PathLike) -> str:
    return os.fspath(prefix) + ".bin"


def idx_path(prefix: str | os.PathLike) -> str:
    return os.fspath(prefix) + ".idx"


def exists(prefix: str | os.PathLike) -> bool:
    """Whether both ``prefix.bin`` and ``prefix.idx`` exist."""
    return os.path.isfile(bin_path(prefix)) and os.path.isfile(idx_path(prefix))


class IndexedDatasetWriter:
    """Streams sequences to ``prefix.bin``; ``finalize()`` writes ``prefix.idx``.

    Files are written under temporary names and renamed at ``finalize``, so an interrupted
    write never leaves a readable half dataset. Use as a context manager or call ``finalize``.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: type = np.int32):
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise UsageError(f"dtype {self.dtype} has no Megatron dtype code")
        folder = Path(self.prefix).absolute().parent
        self._made = [p for p in (folder, *folder.parents) if not p.exists()]  # removed again by abort()
        folder.mkdir(parents=True, exist_ok=True)
        self._tmp = f".tmp{os.getpid()}"  # per process: ranks may build one cache at once
        self._bin = open(bin_path(self.prefix) + self._tmp, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]
        self.num_tokens = 0

    def add_item(self, tokens) -> None:
        """Append one sequence (call ``end_document`` after a document's last sequence)."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError("a sequence must be a 1-D array of token ids")
        if arr.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise UsageError(f"token ids {lo}..{hi} do not fit {self.dtype}")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self.sequence_lengths.append(int(arr.size))
        self.num_tokens += int(arr.size)

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens) -> None:
        """Append a document stored as a single sequence."""
        self.add_item(tokens)
        self.end_document()

    def finalize(self) -> None:
        """Close ``.bin`` and write ``.idx`` in Megatron's layout."""
        self._bin.close()
        if self.document_indices[-1] != len(self.sequence_lengths):
            self.end_document()  # close a document left open by add_item
        lengths = np.asarray(self.sequence_lengths, dtype=np.int64)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            pointers[1:] = np.cumsum(lengths[:-1] * self.dtype.itemsize)
        tmp_idx = idx_path(self.prefix) + self._tmp
        with open(tmp_idx, "wb") as f:
            f.write(INDEX_HEADER)
            f.write(struct.pack("<Q", INDEX_VERSION))
            f.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(self.document_indices)))
            f.write(lengths.astype("<i4").tobytes(order="C"))
            f.write(pointers.astype("<i8").tobytes(order="C"))
            f.write(np.asarray(self.document_indices, dtype="<i8").tobytes(order="C"))
        os.replace(bin_path(self.prefix) + self._tmp, bin_path(self.prefix))
        os.replace(tmp_idx, idx_path(self.prefix))

    def abort(self) -> None:
        """Close and delete the temporary files."""
        self._bin.close()
        for p in (bin_path(self.prefix) + self._tmp, idx_path(self.prefix) + self._tmp):
            if os.path.exists(p):
                os.remove(p)
        for folder in self._made:  # deepest first; a folder something else wrote into stays
            try:
                folder.rmdir()
            except OSError:
                break

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Reads a Megatron ``.bin``/``.idx`` pair through numpy memmap (no copy of the tokens)."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = os.fspath(prefix)
        if not exists(self.prefix):
            raise UsageError(f"{self.prefix}: no Megatron dataset (.bin and .idx both needed)")
        ipath = idx_path(self.prefix)
        with open(ipath, "rb") as f:
            head = f.read(34)
        if len(head) < 34 or head[:9] != INDEX_HEADER:
            raise UsageError(f"{ipath}: not a Megatron index (bad header)")
        (version,) = struct.unpack("<Q", head[9:17])
        (code,) = struct.unpack("<B", head[17:18])
        n_seq, n_doc = struct.unpack("<QQ", head[18:34])
        if version != INDEX_VERSION:
            raise UsageError(f"{ipath}: index version {version}, expected {INDEX_VERSION}")
        if code not in DTYPE_CODES:
            raise UsageError(f"{ipath}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        if self.dtype.kind == "f":
            raise UsageError(f"{ipath}: token ids stored as {self.dtype} (dtype code {code}); token ids are integers")
        need = 34 + n_seq * (4 + 8) + n_doc * 8
        if os.path.getsize(ipath) < need:
            raise UsageError(f"{ipath}: truncated ({os.path.getsize(ipath)} < {need} bytes)")
        idx = np.memmap(ipath, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(idx, "<i4", n_seq, 34)
        self.sequence_pointers = np.frombuffer(idx, "<i8", n_seq, 34 + 4 * n_seq)
        self.document_indices = np.frombuffer(idx, "<i8", n_doc, 34 + 12 * n_seq)
        if n_doc == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != n_seq:
            raise UsageError(f"{ipath}: document index does not span the {n_seq} sequences")
        if n_seq and (int(self.sequence_lengths.min()) < 0 or int(self.sequence_pointers.min()) < 0):
            raise UsageError(f"{ipath}: a negative sequence length or pointer: not a Megatron index")
        if n_doc > 1 and bool((np.diff(self.document_indices) < 0).any()):
            raise UsageError(f"{ipath}: document index is not in order: not a Megatron index")
        nbytes = os.path.getsize(bin_path(self.prefix))
        end = (int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize) if n_seq else 0
        if nbytes < end:
            raise UsageError(f"{bin_path(self.prefix)}: truncated ({nbytes} < {end} bytes)")
        self._bin = np.memmap(bin_path(self.prefix), mode="r", dtype=self.dtype) if nbytes else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        """Number of sequences."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def __getitem__(self, i: int) -> np.ndarray:
        """Tokens of sequence ``i`` (a read-only view in the file's dtype)."""
        i = range(len(self))[i]  # bounds + negative indices
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return self._bin[start : start + int(self.sequence_lengths[i])]

    def document(self, d: int) -> np.ndarray:
        """Tokens of document ``d`` (its sequences concatenated)."""
        d = range(self.num_documents)[d]
        lo, hi = int(self.document_indices[d]), int(self.document_indices[d + 1])
        parts = [self[i] for i in range(lo, hi)]
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)

    def tokens(self) -> np.ndarray:
        """Every token in sequence order, as one memmap view (sequences must be contiguous).

        True of files written by Megatron's builder and by this module.
        """
        if len(self) == 0:
            return self._bin[:0]
        expected = np.zeros(len(self), dtype=np.int64)
        expected[1:] = np.cumsum(self.sequence_lengths[:-1], dtype=np.int64) * self.dtype.itemsize
        if not np.array_equal(expected, self.sequence_pointers):
            raise UsageError(f"{self.prefix}: sequences are not stored back to back")
        return self._bin[: self.num_tokens]

    def document_starts(self) -> np.ndarray:
        """Token offset at which each document starts, for ``tokens()``."""
        seq_starts = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, dtype=np.int64, out=seq_starts[1:])
        return seq_starts[self.document_indices[:-1]]

    def describe(self) -> str:
        return (
            f"Megatron indexed dataset {self.prefix} ({self.num_documents} documents, "
            f"{len(self)} sequences, {self.num_tokens:,} tokens, {self.dtype})"
        )


def write_indexed_dataset(prefix: str | os.PathLike, documents, dtype: type = np.int32) -> None:
    """Write each item of ``documents`` (token id arrays) as one single-sequence document."""
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in documents:
            w.add_document(doc)
