"""``build_dataset``: one entry point from a ``--data`` spec to train / validation sources.

Specs:

- ``mock`` / ``mock-uniform``: seeded random tokens (:mod:`lpbench.data.mock`): a learnable random
  walk / NeMo's uniform tokens; the default for throughput runs.
- a Megatron prefix (``PATH`` with ``PATH.bin`` and ``PATH.idx``; a ``.bin``/``.idx`` path also
  works): read through memmap, packed as a single token stream in stored order.
- a raw text / JSONL / parquet file or directory (:mod:`lpbench.data.sources`): tokenized when
  built (with ``cache_dir``, written once as a Megatron dataset there and memmapped later).

The packed stream (:mod:`lpbench.data.packing`) is split into training sequences and a
held-out validation tail that shares no token with training; the training order comes from
:class:`lpbench.data.sampler.MicroBatchSampler` (seeded, sharded, resumable).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from lpbench.data import indexed, sources
from lpbench.data.mock import MockDataset
from lpbench.data.packing import PackedSequences, concat_documents, split_train_valid
from lpbench.data.prepare import METADATA_SUFFIX, read_metadata, tokenize_documents, write_documents
from lpbench.data.sampler import Splits
from lpbench.data.tokenizer import (
    DEFAULT_EOS,
    ByteTokenizer,
    Tokenizer,
    fingerprint,
    get_tokenizer,
    load_tokenizer,
    train_tokenizer,
)
from lpbench.errors import UsageError

MOCK_VALID_SEQUENCES = 16


@dataclass
class DataSplits(Splits):
    """Train and validation sources (``src[i]`` -> ``seq_len + 1`` int64 tokens) and their story."""

    train: PackedSequences | MockDataset
    valid: PackedSequences | MockDataset
    num_documents: int | None = None
    num_tokens: int | None = None
    prefix: str | None = None  # the Megatron dataset read (for raw text: its tokenized cache), if any

    @property
    def is_mock(self) -> bool:
        return isinstance(self.train, MockDataset)

    def describe(self) -> str:
        """Several lines: where the data comes from, tokenizer, corpus, split sizes, order, what was dropped."""
        docs = f" in {self.num_documents:,} documents" if self.num_documents else ""
        corpus = []
        if self.num_tokens is not None:
            corpus.append(f"corpus: {self.num_tokens:,} tokens{docs}, vocab {self.vocab_size}, EOS id {self.eos_id}")
        if self.is_mock:
            order = f"order: sample index = position (seed {self.seed})"
        else:
            order = f"order: seeded shuffle (seed {self.seed}), sharded over data-parallel ranks"
        return super().describe(tuple(corpus), (order,))


VAL_FRACTION = 0.01  # of a real dataset's sequences held out for validation, rounded up


def build_dataset(
    spec: str,
    tokenizer: "Tokenizer | str | None" = None,
    *,
    seq_len: int,
    seed: int = 0,
    vocab_size: int | None = None,
    val_fraction: float = VAL_FRACTION,
    val_sequences: int | None = None,
    text_key: str = "text",
    text_unit: str = "paragraph",
    train_vocab_size: int | None = None,
    eos_token: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> DataSplits:
    """Resolve ``spec`` (see module doc) into :class:`DataSplits`.

    ``tokenizer``: a tokenizer object, a tokenizer.json path or ``"byte"``. For raw text without
    one, a byte-level BPE of ``train_vocab_size`` is trained on the whole input (validation tail
    included) when that is given, else the byte-level tokenizer is used. ``vocab_size`` is
    required for mock data (the model's); elsewhere it comes from the tokenizer, the dataset's
    ``.lpbench.json`` note, or the largest token id + 1. Validation: ``val_sequences`` if given,
    else ``ceil(val_fraction * sequences)`` (0 disables it); mock uses a separate random stream.
    """
    if seq_len < 1:
        raise UsageError(f"seq_len must be >= 1, got {seq_len}")
    if not 0 <= val_fraction < 1:
        raise UsageError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if spec in MOCK_KINDS:
        return _build_mock(tokenizer, seq_len, seed, vocab_size, val_sequences, eos_token, MOCK_KINDS[spec])
    split = _Split(seq_len, seed, val_fraction, val_sequences)
    prefix = spec[:-4] if spec.endswith((".bin", ".idx")) else spec
    if indexed.exists(prefix):
        return _build_indexed(prefix, tokenizer, vocab_size, eos_token, split)
    if not os.path.exists(spec):
        raise UsageError(
            f"--data {spec}: not 'mock', 'mock-uniform', an existing file or directory, "
            f"or a Megatron prefix with {spec}.bin and {spec}.idx"
        )
    return _build_raw(spec, tokenizer, vocab_size, eos_token, split, text_key, text_unit, train_vocab_size, cache_dir)


MOCK_KINDS = {"mock": "walk", "mock-uniform": "uniform"}


def data_vocab(spec: str) -> tuple[int, str] | None:
    """(vocabulary size, where it was read) of a Megatron dataset that ``data prepare`` wrote, from its
    ``PREFIX.lpbench.json`` note; None for mock data, raw text or a dataset without the note."""
    if spec in MOCK_KINDS:
        return None
    prefix = spec[:-4] if spec.endswith((".bin", ".idx")) else spec
    meta = _note(prefix, indexed.IndexedDataset(prefix).tokens()) if indexed.exists(prefix) else None
    return (int(meta["vocab_size"]), prefix + METADATA_SUFFIX) if meta else None


def _note(prefix, tokens) -> dict | None:
    """The ``PREFIX.lpbench.json`` note of a dataset whose token ids are ``tokens`` (None without one);
    UsageError when its vocabulary does not hold them."""
    meta = read_metadata(prefix)
    if meta and len(tokens) and int(tokens.max()) >= int(meta["vocab_size"]):
        raise UsageError(
            f"{prefix}{METADATA_SUFFIX}: vocabulary of {meta['vocab_size']}, but the data holds token "
            f"id {int(tokens.max())}: the note does not belong to this data"
        )
    return meta


def _build_mock(tokenizer, seq_len, seed, vocab_size, val_sequences, eos_token, kind) -> DataSplits:
    tok = get_tokenizer(tokenizer, eos_token) if tokenizer is not None else None
    vocab = vocab_size or (tok.vocab_size if tok is not None else None)
    if not vocab:
        raise UsageError("mock data needs a vocab_size (the model's)")
    n_val = MOCK_VALID_SEQUENCES if val_sequences is None else val_sequences
    return DataSplits(
        train=MockDataset(vocab, seq_len, seed, stream=0, kind=kind),
        valid=MockDataset(vocab, seq_len, seed, stream=1, num_samples=n_val, kind=kind),
        seq_len=seq_len,
        vocab_size=vocab,
        eos_id=None,
        seed=seed,
        source=f"mock ({'uniform random' if kind == 'uniform' else 'random-walk'} tokens of a "
        f"{vocab}-token vocabulary, seed {seed})",
        tokenizer=None,
    )


class _Split(NamedTuple):
    """How a token stream becomes :class:`DataSplits` (``build_dataset``'s arguments of that name)."""

    seq_len: int
    seed: int
    val_fraction: float
    val_sequences: int | None


def _splits(tokens, doc_starts, vocab, eos_id, source, tok, n_docs, notes, split: _Split) -> DataSplits:
    top = int(tokens.max()) if len(tokens) else -1
    if len(tokens) and tokens.dtype.kind == "i" and int(tokens.min()) < 0:
        raise UsageError(f"{source}: negative token id {int(tokens.min())}: not a token dataset")
    if top >= vocab:
        what = tok.description if tok is not None else f"vocab_size {vocab}"
        raise UsageError(
            f"{source}: token id {top} >= vocab size {vocab}: the data was tokenized with another tokenizer than {what}"
        )
    n_val = split.val_sequences
    if n_val is None:
        total = max(0, (len(tokens) - 1) // split.seq_len)
        n_val = math.ceil(split.val_fraction * total) if split.val_fraction > 0 else 0
    train, valid = split_train_valid(tokens, split.seq_len, n_val, doc_starts)
    return DataSplits(
        train=train,
        valid=valid,
        seq_len=split.seq_len,
        vocab_size=vocab,
        eos_id=eos_id,
        seed=split.seed,
        source=source,
        tokenizer=tok,
        num_documents=n_docs,
        num_tokens=len(tokens),
        notes=notes,
    )


def _build_indexed(prefix, tokenizer, vocab_size, eos_token, split: _Split, source=None, notes=None) -> DataSplits:
    ds = indexed.IndexedDataset(prefix)
    tokens = ds.tokens()
    meta = _note(prefix, tokens) or {}
    notes = list(notes or [])
    tok = get_tokenizer(tokenizer, eos_token) if tokenizer is not None else None
    if tok is not None:
        vocab, eos_id = tok.vocab_size, tok.eos_id
        if meta.get("tokenizer_fingerprint") not in (None, fingerprint(tok)):
            notes.append(f"note: {prefix} was prepared with another tokenizer ({meta.get('tokenizer')})")
    elif meta:
        vocab, eos_id = int(meta["vocab_size"]), meta.get("eos_id")
        notes.append(f"tokenizer (from {prefix}{METADATA_SUFFIX}): {meta.get('tokenizer')}")
    else:
        vocab = int(tokens.max()) + 1 if len(tokens) else 1
        eos_id = None
        notes.append(
            f"note: no tokenizer given; vocab size {vocab} inferred from the largest "
            f"token id, EOS unknown (documents are used as stored)"
        )
    source = source or ds.describe()
    splits = _splits(
        tokens, ds.document_starts(), vocab_size or vocab, eos_id, source, tok, ds.num_documents, notes, split
    )
    splits.prefix = os.fspath(prefix)
    return splits


def _build_raw(
    path, tokenizer, vocab_size, eos_token, split: _Split, text_key, text_unit, train_vocab_size, cache_dir
) -> DataSplits:
    files = sources.list_files(path)
    source = sources.describe_source(path)
    key = None
    if cache_dir is not None:
        stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
        what = {"v": 1, "key": text_key, "unit": text_unit, "train": train_vocab_size, "eos": eos_token, "files": stats}
        h = hashlib.sha256(json.dumps(what).encode())
        key = Path(cache_dir) / f"{Path(path).stem or 'data'}-{h.hexdigest()[:16]}"

    def docs():
        return sources.iter_documents(path, text_key=text_key, text_unit=text_unit)

    if tokenizer is not None:
        tok = get_tokenizer(tokenizer, eos_token)
    elif train_vocab_size:
        saved = Path(f"{key}.tokenizer.json") if key is not None else None
        if saved is not None and saved.is_file():
            tok = load_tokenizer(saved, eos_token)
            tok.description = (
                f"byte-level BPE trained on the corpus (vocab {tok.vocab_size}, "
                f"EOS {tok.eos_token!r} = {tok.eos_id}, cached at {saved})"
            )
        else:
            tok = train_tokenizer(docs(), train_vocab_size, output=saved, eos_token=eos_token or DEFAULT_EOS)
    else:
        tok = ByteTokenizer()
    notes = []
    if key is not None:
        prefix = f"{key}-{fingerprint(tok)}"
        if not indexed.exists(prefix):
            write_documents(docs(), tok, prefix, source=source)
        notes.append(f"cache: tokenized corpus at {prefix}.bin/.idx")
        return _build_indexed(prefix, tok, vocab_size, eos_token, split, source=source, notes=notes)
    dtype = indexed.optimal_dtype(tok.vocab_size)
    stream, starts = concat_documents(tokenize_documents(docs(), tok), tok.eos_id, dtype)
    if len(starts) == 0:
        raise UsageError(f"{path}: no non-empty documents found")
    return _splits(stream, starts, vocab_size or tok.vocab_size, tok.eos_id, source, tok, len(starts), notes, split)
