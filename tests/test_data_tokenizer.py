"""Tokenizers: byte-level fallback, BPE training, tokenizer.json save/load round trip."""

import json

import pytest

from lpbench.data.tokenizer import ByteTokenizer, get_tokenizer, load_tokenizer, train_tokenizer
from lpbench.errors import UsageError

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Packing documents into sequences keeps every token exactly once.",
    "Low precision training: FP8, MXFP8 and NVFP4 against BF16.",
    "def main():\n    return 0  # naïve café, ünïcode ✓",
] * 20


def test_byte_tokenizer():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids == list("héllo".encode()) and max(ids) < 256
    assert tok.decode(ids + [tok.eos_id]) == "héllo"
    assert tok.vocab_size == 257 and tok.eos_id == 256 and "byte" in tok.description


def test_train_save_load_round_trip(tmp_path):
    path = tmp_path / "tok" / "tokenizer.json"
    tok = train_tokenizer(CORPUS, 400, output=path)
    assert path.is_file()
    assert 257 < tok.vocab_size <= 400
    assert tok.decode([tok.eos_id]) == "<|endoftext|>"
    text = CORPUS[3] + "\n" + CORPUS[0]
    ids = tok.encode(text)
    assert len(ids) < len(text.encode())  # merges were learned
    assert tok.decode(ids) == text  # lossless byte-level BPE
    assert tok.eos_id not in ids  # no special tokens added on encode
    loaded = load_tokenizer(path)
    assert loaded.encode(text) == ids and loaded.eos_id == tok.eos_id
    assert loaded.vocab_size == tok.vocab_size
    assert load_tokenizer(path.parent).encode(text) == ids  # a directory works too
    assert get_tokenizer(str(path)).encode(text) == ids
    assert str(path) in loaded.description and "trained" in tok.description
    assert tok.encode_batch([text, "fox"]) == [ids, tok.encode("fox")]
    saved = json.loads(path.read_text())
    assert saved["model"]["type"] == "BPE" and saved["pre_tokenizer"]["type"] == "ByteLevel"


def test_eos_detection_and_errors(tmp_path):
    path = tmp_path / "t.json"
    train_tokenizer(CORPUS, 300, eos_token="</s>", output=path)
    assert load_tokenizer(path).eos_token == "</s>"
    with pytest.raises(UsageError, match="no EOS"):
        load_tokenizer(path, eos_token="<nope>")
    with pytest.raises(UsageError, match="no such tokenizer"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UsageError, match="not a HF tokenizer"):
        load_tokenizer(tmp_path / "bad.json")
    with pytest.raises(UsageError, match="vocab-size"):
        train_tokenizer(CORPUS, 100)
    assert isinstance(get_tokenizer(None), ByteTokenizer)
    assert isinstance(get_tokenizer("byte"), ByteTokenizer)
