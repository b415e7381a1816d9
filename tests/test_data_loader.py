"""build_dataset (mock, raw text, Megatron prefix) and the `lpbench data` sub-commands."""

import argparse
import json

import numpy as np
import pytest
import torch

from lpbench.data import build_dataset
from lpbench.data.indexed import IndexedDataset, write_indexed_dataset
from lpbench.data.prepare import add_parser, read_metadata
from lpbench.data.tokenizer import load_tokenizer
from lpbench.errors import UsageError

TEXTS = [
    f"Document number {i}: " + " ".join(["lorem", "ipsum", "dolor", "sit"][: 1 + i % 4]) * (1 + i % 5)
    for i in range(60)
]


@pytest.fixture
def corpus(tmp_path):
    f = tmp_path / "corpus.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return f


def _cli(argv):
    parser = argparse.ArgumentParser(prog="lpbench")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_mock_dataset():
    d = build_dataset("mock", seq_len=8, seed=3, vocab_size=64)
    a, b = d.train_loader(2), d.train_loader(2)
    assert torch.equal(next(a)[0], next(b)[0])
    x, y = next(a)
    assert x.shape == (2, 8) and int(x.max()) < 64
    vx, _ = next(d.valid_batches(2))
    assert not torch.equal(vx, next(build_dataset("mock", seq_len=8, seed=3, vocab_size=64).train_loader(2))[0])
    assert "mock" in d.describe()
    with pytest.raises(UsageError, match="vocab_size"):
        build_dataset("mock", seq_len=8)


def test_validation_never_overlaps_training_and_shards_cover(tmp_path):
    # unique token ids make every stream position identifiable
    docs = np.array_split(np.arange(3000), 50)
    write_indexed_dataset(tmp_path / "uniq", docs, np.uint16)
    d = build_dataset(str(tmp_path / "uniq"), seq_len=16, seed=0, val_sequences=10)
    assert len(d.valid) >= 10 and "inferred" in d.describe()
    world, mbs = 2, 3
    loaders = [d.train_loader(mbs, rank=r, world_size=world) for r in range(world)]
    per_epoch = len(d.train) // (mbs * world)
    train_labels, train_inputs = [], []
    for loader in loaders:
        for _ in range(per_epoch):
            x, y = next(loader)
            train_inputs += x.reshape(-1).tolist()
            train_labels += y.reshape(-1).tolist()
    assert len(set(train_labels)) == len(train_labels)  # disjoint ranks, no repeats
    assert len(train_labels) == per_epoch * mbs * world * 16
    valid_tokens = set()
    for x, y in d.valid_batches(4):
        valid_tokens |= set(x.reshape(-1).tolist()) | set(y.reshape(-1).tolist())
    assert valid_tokens.isdisjoint(train_labels) and valid_tokens.isdisjoint(train_inputs)
    assert min(valid_tokens) in {int(doc[0]) for doc in docs}  # starts at a document


def test_raw_text_byte_tokenizer(corpus):
    d = build_dataset(str(corpus), seq_len=32, seed=0, val_fraction=0.1)
    assert d.vocab_size == 257 and d.eos_id == 256
    stream = []
    for t in TEXTS:
        stream += list(t.encode()) + [256]
    assert len(d.train.tokens) + len(d.valid.tokens) == len(stream)
    assert d.train.tokens.tolist() + d.valid.tokens.tolist() == stream
    assert "byte-level" in d.describe() and "validation" in d.describe()
    n = (len(stream) - 1) // 32
    assert len(d.valid) >= int(np.ceil(0.1 * n))


def test_raw_trained_tokenizer_with_cache(corpus, tmp_path):
    cache = tmp_path / "cache"
    d1 = build_dataset(str(corpus), seq_len=16, seed=1, train_vocab_size=300, cache_dir=cache)
    assert list(cache.glob("*.bin")) and list(cache.glob("*.tokenizer.json"))
    d2 = build_dataset(str(corpus), seq_len=16, seed=1, train_vocab_size=300, cache_dir=cache)
    assert "cached" in d2.tokenizer.description
    assert np.array_equal(d1.train.tokens, d2.train.tokens)
    assert d1.tokenizer.decode(d1.train[0].tolist()).startswith("Document number 0")
    nocache = build_dataset(str(corpus), seq_len=16, seed=1, tokenizer=d1.tokenizer)
    assert np.array_equal(nocache.train.tokens, d1.train.tokens)


def test_bad_specs(tmp_path):
    with pytest.raises(UsageError, match="not 'mock'"):
        build_dataset(str(tmp_path / "missing"), seq_len=8)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("hi")
    with pytest.raises(UsageError):
        build_dataset(str(tiny), seq_len=8)


def test_cli_prepare_and_tokenizer(corpus, tmp_path, capsys):
    prefix = tmp_path / "out" / "corpus_text_document"
    assert _cli(["data", "prepare", "--input", str(corpus), "--output-prefix", str(prefix)]) == 0
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16 and ds.num_documents == len(TEXTS)
    assert ds.document(5).tolist() == list(TEXTS[5].encode()) + [256]
    assert read_metadata(prefix)["eos_id"] == 256
    assert "wrote" in capsys.readouterr().out

    tok_path = tmp_path / "tok.json"
    assert _cli(["data", "tokenizer", "--input", str(corpus), "--vocab-size", "320", "--output", str(tok_path)]) == 0
    tok = load_tokenizer(tok_path)
    p2 = tmp_path / "bpe"
    _cli(["data", "prepare", "--input", str(corpus), "--output-prefix", str(p2), "--tokenizer", str(tok_path)])
    ds2 = IndexedDataset(p2)
    assert ds2.document(7).tolist() == tok.encode(TEXTS[7]) + [tok.eos_id]
    d = build_dataset(str(p2), seq_len=16, seed=0)
    assert d.vocab_size == tok.vocab_size and d.eos_id == tok.eos_id
    assert build_dataset(str(p2) + ".idx", seq_len=16, tokenizer=str(tok_path)).eos_id == tok.eos_id


def test_cli_errors(corpus, tmp_path):
    with pytest.raises(UsageError, match="--output-prefix"):
        _cli(["data", "prepare", "--input", str(corpus)])
    with pytest.raises(UsageError, match="--vocab-size"):
        _cli(["data", "tokenizer", "--input", str(corpus), "--vocab-size", "0"])
    with pytest.raises(UsageError, match="no such file"):
        _cli(["data", "prepare", "--input", str(tmp_path / "no.jsonl"), "--output-prefix", "x"])
    with pytest.raises(UsageError, match="choose a command"):
        _cli(["data"])
    with pytest.raises(UsageError, match="no 'body' field"):
        _cli(["data", "prepare", "--input", str(corpus), "--output-prefix", str(tmp_path / "b"), "--text-key", "body"])
    assert not (tmp_path / "b.bin").exists()
