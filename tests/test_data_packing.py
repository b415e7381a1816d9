"""Packing: EOS separators, Megatron-style overlapping windows, nothing lost or duplicated."""

import numpy as np
import pytest

from lpbench.data.packing import PackedSequences, concat_documents, pack_documents, split_train_valid
from lpbench.errors import UsageError

EOS = 99


def _docs(seed=0, n=40):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, 90, rng.integers(1, 30))) for _ in range(n)]


def test_stream_has_one_eos_after_each_document():
    stream, starts = concat_documents([[1, 2], [], [3]], EOS)
    assert stream.tolist() == [1, 2, EOS, 3, EOS]
    assert starts.tolist() == [0, 3]


@pytest.mark.parametrize("seq_len", [1, 7, 16, 64])
def test_no_token_lost_or_duplicated(seq_len):
    docs = _docs()
    stream, _ = concat_documents(docs, EOS)
    inputs, labels = pack_documents(docs, EOS, seq_len)
    n = (len(stream) - 1) // seq_len
    assert inputs.shape == labels.shape == (n, seq_len)
    # every used stream position is an input exactly once, and a label exactly once
    assert inputs.reshape(-1).tolist() == stream[: n * seq_len].tolist()
    assert labels.reshape(-1).tolist() == stream[1 : n * seq_len + 1].tolist()
    packed = PackedSequences(stream, seq_len)
    assert packed.dropped_tokens == len(stream) - (n * seq_len + 1) < seq_len
    assert packed.dropped_tokens >= 0
    assert np.count_nonzero(inputs == EOS) + np.count_nonzero(stream[n * seq_len :] == EOS) == len(docs)
    for i in range(n):
        x, y = packed.pair(i)
        assert np.array_equal(x, inputs[i]) and np.array_equal(y, labels[i])


def test_window_index_bounds():
    packed = PackedSequences(np.arange(10), 4)  # (10-1)//4 = 2 windows
    assert len(packed) == 2 and packed[1].tolist() == [4, 5, 6, 7, 8]
    assert packed.dropped_tokens == 1
    with pytest.raises(IndexError):
        packed[2]


def test_split_shares_no_token_and_starts_validation_at_a_document():
    docs = _docs(1, 200)
    stream, starts = concat_documents(docs, EOS)
    train, valid = split_train_valid(stream, 16, 5, starts)
    assert len(valid) >= 5 and len(train) > 0
    cut = len(train.tokens)
    assert cut in set(starts.tolist())  # a document boundary
    assert train.used_tokens <= cut  # train windows stay before the cut
    assert valid[0].tolist() == stream[cut : cut + 17].tolist()
    assert len(train.tokens) + len(valid.tokens) == len(stream)
    with pytest.raises(UsageError):
        split_train_valid(stream, 16, len(stream), starts)


def test_split_without_validation():
    train, valid = split_train_valid(np.arange(100), 10, 0)
    assert len(train) == 9 and len(valid) == 0
