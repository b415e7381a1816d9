"""Megatron .bin/.idx: round trip and byte layout (megatron/core/datasets/indexed_dataset.py)."""

import struct

import numpy as np
import pytest

from lpbench.data.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype, write_indexed_dataset
from lpbench.errors import UsageError


def _parse_idx(path):
    """An independent parse of the .idx bytes, per Megatron's _IndexWriter."""
    raw = open(path, "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", raw, 9)
    (code,) = struct.unpack_from("<B", raw, 17)
    n_seq, n_doc = struct.unpack_from("<QQ", raw, 18)
    off = 34
    lengths = struct.unpack_from(f"<{n_seq}i", raw, off)
    off += 4 * n_seq
    pointers = struct.unpack_from(f"<{n_seq}q", raw, off)
    off += 8 * n_seq
    docs = struct.unpack_from(f"<{n_doc}q", raw, off)
    off += 8 * n_doc
    return dict(
        version=version,
        code=code,
        lengths=list(lengths),
        pointers=list(pointers),
        docs=list(docs),
        size=len(raw),
        end=off,
    )


@pytest.mark.parametrize(
    "dtype,code,itemsize", [(np.uint16, 8, 2), (np.int32, 4, 4), (np.int64, 5, 8), (np.uint8, 1, 1)]
)
def test_layout_matches_megatron(tmp_path, dtype, code, itemsize):
    docs = [[5, 6, 7], [1], [9, 9, 2, 3, 0]]
    prefix = tmp_path / "ds"
    write_indexed_dataset(prefix, docs, dtype)
    idx = _parse_idx(f"{prefix}.idx")
    assert idx["version"] == 1 and idx["code"] == code
    assert idx["lengths"] == [3, 1, 5]
    assert idx["pointers"] == [0, 3 * itemsize, 4 * itemsize]
    assert idx["docs"] == [0, 1, 2, 3]  # leading 0, one sequence per document
    assert idx["end"] == idx["size"]  # nothing after the document index
    raw_bin = open(f"{prefix}.bin", "rb").read()
    assert raw_bin == np.asarray(sum(docs, []), dtype=np.dtype(dtype).newbyteorder("<")).tobytes()


def test_multi_sequence_documents_and_read_back(tmp_path):
    prefix = tmp_path / "sent"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for doc in ([[1, 2], [3]], [[4, 5, 6]], [[7], [8, 9], [10]]):  # documents of sentences
            for sentence in doc:
                w.add_item(sentence)
            w.end_document()
    idx = _parse_idx(f"{prefix}.idx")
    assert idx["lengths"] == [2, 1, 3, 1, 2, 1]
    assert idx["pointers"] == [0, 4, 6, 12, 14, 18]
    assert idx["docs"] == [0, 2, 3, 6]
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16 and len(ds) == 6 and ds.num_documents == 3
    assert [ds[i].tolist() for i in range(6)] == [[1, 2], [3], [4, 5, 6], [7], [8, 9], [10]]
    assert ds[-1].tolist() == [10]
    assert ds.document(0).tolist() == [1, 2, 3] and ds.document(2).tolist() == [7, 8, 9, 10]
    assert ds.tokens().tolist() == list(range(1, 11))
    assert ds.document_starts().tolist() == [0, 3, 6]


def test_random_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 70000, rng.integers(1, 50)) for _ in range(200)]
    prefix = tmp_path / "big"
    write_indexed_dataset(prefix, docs, optimal_dtype(70000))
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.int32
    assert all(np.array_equal(ds.document(i), d) for i, d in enumerate(docs))
    assert ds.num_tokens == sum(len(d) for d in docs)


def test_optimal_dtype_threshold():
    assert optimal_dtype(65499) is np.uint16
    assert optimal_dtype(65500) is np.int32
    assert optimal_dtype(None) is np.int32


def test_errors(tmp_path):
    with pytest.raises(UsageError, match="no Megatron dataset"):
        IndexedDataset(tmp_path / "missing")
    with pytest.raises(UsageError, match="do not fit"):
        write_indexed_dataset(tmp_path / "x", [[70000]], np.uint16)
    assert not (tmp_path / "x.bin").exists()  # aborted write leaves nothing readable
    write_indexed_dataset(tmp_path / "ok", [[1, 2, 3]], np.uint16)
    raw = bytearray(open(tmp_path / "ok.idx", "rb").read())
    raw[0:1] = b"X"
    (tmp_path / "ok.idx").write_bytes(bytes(raw))
    with pytest.raises(UsageError, match="bad header"):
        IndexedDataset(tmp_path / "ok")


def test_truncated_bin_detected(tmp_path):
    write_indexed_dataset(tmp_path / "t", [[1, 2, 3, 4]], np.int32)
    (tmp_path / "t.bin").write_bytes(open(tmp_path / "t.bin", "rb").read()[:8])
    with pytest.raises(UsageError, match="truncated"):
        IndexedDataset(tmp_path / "t")
