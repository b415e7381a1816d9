"""Pack documents into fixed-length training sequences, as Megatron's GPTDataset does.

Documents are concatenated into one token stream with one EOS after each document. Sequence
``i`` is the window ``stream[i*S : i*S + S + 1]`` (``S = seq_len``): inputs are its first ``S``
tokens, labels its last ``S``. Consecutive windows share one token (the last label of ``i`` is
the first input of ``i + 1``), so every token of the used stream is an input exactly once and
every token after the first is a label exactly once: nothing is lost or duplicated, and
sequences cross document boundaries (the EOS separates them). ``n = (len(stream) - 1) // S``
sequences are made; the tail of fewer than ``S`` tokens after the last window is dropped
(``dropped_tokens``), never padded.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from lpbench.errors import UsageError


def concat_documents(
    docs: Iterable[Sequence[int]], eos_id: int | None, dtype: type = np.int64
) -> tuple[np.ndarray, np.ndarray]:
    """The stream ``doc0 EOS doc1 EOS ...`` (no EOS if ``eos_id`` is None), and doc starts."""
    parts, starts, pos = [], [], 0
    eos = None if eos_id is None else np.asarray([eos_id], dtype=dtype)
    for doc in docs:
        arr = np.asarray(doc, dtype=dtype)
        if arr.size == 0:
            continue
        starts.append(pos)
        parts.append(arr)
        pos += arr.size
        if eos is not None:
            parts.append(eos)
            pos += 1
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    return stream, np.asarray(starts, dtype=np.int64)


class PackedSequences:
    """``seq_len + 1`` windows over a token stream (ndarray or memmap; see module doc)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, name: str = "packed"):
        if seq_len < 1:
            raise UsageError(f"seq_len must be >= 1, got {seq_len}")
        self.tokens, self.seq_len, self.name = tokens, int(seq_len), name
        self.num_samples = max(0, (len(tokens) - 1) // self.seq_len)

    def __len__(self) -> int:
        return self.num_samples

    @property
    def used_tokens(self) -> int:
        """Stream tokens covered by the windows (``n*S + 1``, or 0 when there are none)."""
        return self.num_samples * self.seq_len + 1 if self.num_samples else 0

    @property
    def dropped_tokens(self) -> int:
        """Tail tokens that are in no window."""
        return len(self.tokens) - self.used_tokens

    def __getitem__(self, i: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of sequence ``i``, int64."""
        i = range(self.num_samples)[i]
        lo = i * self.seq_len
        return np.asarray(self.tokens[lo : lo + self.seq_len + 1], dtype=np.int64)

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """``(input, label)`` of sequence ``i``."""
        w = self[i]
        return w[:-1], w[1:]

    def describe(self) -> str:
        return (
            f"{self.name}: {self.num_samples} sequences of {self.seq_len} "
            f"({self.used_tokens:,} tokens used, {self.dropped_tokens} tail tokens dropped)"
        )


def pack_documents(docs: Iterable[Sequence[int]], eos_id: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """All ``(inputs, labels)`` as two int64 arrays ``[n, seq_len]`` (small data, tests)."""
    stream, _ = concat_documents(docs, eos_id)
    packed = PackedSequences(stream, seq_len)
    n, s = packed.num_samples, seq_len
    inputs = stream[: n * s].reshape(n, s)
    labels = stream[1 : n * s + 1].reshape(n, s)
    return inputs, labels


def split_train_valid(
    tokens: np.ndarray, seq_len: int, num_valid: int, doc_starts: np.ndarray | None = None
) -> tuple[PackedSequences, PackedSequences]:
    """Hold out the end of the stream as validation: no token is in both splits.

    The validation stream is the last ``num_valid * S + 1`` tokens, moved back to the start of
    the document it cuts (when ``doc_starts`` is given and that costs at most another
    ``num_valid * S`` tokens), so validation text is unseen in training. Like Megatron's
    ``--split``, this is a contiguous range: shuffle the corpus beforehand if it is sorted.
    """
    total = max(0, (len(tokens) - 1) // seq_len)
    if num_valid < 0 or (num_valid and num_valid >= total):
        raise UsageError(
            f"cannot hold out {num_valid} of {total} sequences of {seq_len} tokens "
            f"({len(tokens):,} tokens): use a smaller seq_len or validation split, "
            f"or more data"
        )
    cut = len(tokens) - (num_valid * seq_len + 1) if num_valid else len(tokens)
    if num_valid and doc_starts is not None and len(doc_starts):
        k = int(np.searchsorted(doc_starts, cut, side="right")) - 1
        if k >= 0:
            snapped = int(doc_starts[k])
            if cut - snapped <= num_valid * seq_len and (snapped - 1) // seq_len >= 1:
                cut = snapped
    train = PackedSequences(tokens[:cut], seq_len, "train")
    valid = PackedSequences(tokens[cut:], seq_len, "validation")
    if len(train) == 0:
        raise UsageError(
            f"{len(tokens):,} tokens leave no training sequence of {seq_len} tokens: give more text "
            "or a smaller --seq-len"
        )
    return train, valid
