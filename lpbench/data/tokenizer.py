"""Tokenizers: a local HF ``tokenizer.json``, a byte-level BPE trained on the corpus, or bytes.

All expose ``encode(str) -> list[int]``, ``encode_batch``, ``decode``, ``eos_id``,
``vocab_size`` and ``description`` (which tokenizer is in use, for logs and results).
Encoding adds no BOS/EOS: packing (:mod:`lpbench.data.packing`) puts one EOS after each document.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Iterable, Protocol

from lpbench.errors import UsageError
from lpbench.paths import write_file

DEFAULT_EOS = "<|endoftext|>"
# Tried in order when a tokenizer.json is loaded without an explicit EOS token
# (GPT-2/Qwen, Llama 3, Llama 2/Mistral, Gemma, generic).
EOS_CANDIDATES = (DEFAULT_EOS, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")


class Tokenizer(Protocol):
    eos_id: int
    vocab_size: int
    description: str

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """Dependency-free fallback: token = UTF-8 byte (0-255), EOS = 256, vocab 257."""

    eos_id = 256
    vocab_size = 257
    description = "byte-level (UTF-8 bytes 0-255 + EOS 256, vocab 257, no merges)"
    fingerprint = "byte-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with a known EOS token."""

    def __init__(self, tok, eos_token: str | None = None, source: str = "tokenizer.json"):
        self.tok = tok
        candidates = (eos_token,) if eos_token else EOS_CANDIDATES
        for name in candidates:
            tid = tok.token_to_id(name)
            if tid is not None:
                self.eos_token, self.eos_id = name, tid
                break
        else:
            raise UsageError(
                f"{source}: no EOS token ({', '.join(candidates)}) in the vocabulary; name it with --eos-token"
            )
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.description = (
            f"HF tokenizers from {source} (vocab {self.vocab_size}, EOS {self.eos_token!r} = {self.eos_id})"
        )

    @property
    def fingerprint(self) -> str:
        """A hash of the full tokenizer definition, for cache keys."""
        return hashlib.sha256(self.tok.to_str().encode()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        write_file(path, self.tok.to_str(pretty=True))
        return path


def _tokenizers():
    try:
        import tokenizers
    except ModuleNotFoundError:
        raise UsageError(
            "tokenizer.json files need HF tokenizers: pip install tokenizers (or use the byte-level tokenizer)"
        ) from None
    return tokenizers


def load_tokenizer(path: str | os.PathLike, eos_token: str | None = None) -> HFTokenizer:
    """Load a local ``tokenizer.json`` (or a directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise UsageError(f"{p}: no such tokenizer file")
    try:
        tok = _tokenizers().Tokenizer.from_file(str(p))
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"{p}: not a HF tokenizer.json: {exc}") from None
    return HFTokenizer(tok, eos_token, source=str(p))


def check_vocab_size(vocab_size: int) -> None:
    """UsageError unless a byte-level BPE of ``vocab_size`` tokens can be trained."""
    if vocab_size > 1 << 24:  # the BPE trainer takes a 32-bit size; no tokenizer is larger
        raise UsageError(f"--vocab-size must be <= {1 << 24:,}, got {vocab_size}")
    if vocab_size < 258:
        raise UsageError(f"--vocab-size must be >= 258 (256 bytes + EOS + merges), got {vocab_size}")


def train_tokenizer(
    docs: Iterable[str],
    vocab_size: int,
    eos_token: str = DEFAULT_EOS,
    min_frequency: int = 2,
    output: str | os.PathLike | None = None,
) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 style) on ``docs``; save it as ``output`` when given.

    The vocabulary holds the 256 byte symbols, ``eos_token`` and up to ``vocab_size - 257``
    merges; a small corpus may yield fewer (``vocab_size`` of the result is the real size).
    """
    check_vocab_size(vocab_size)
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[eos_token],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),
    )
    tok.train_from_iterator(docs, trainer)
    out = HFTokenizer(tok, eos_token, source="corpus")
    out.description = (
        f"byte-level BPE trained on the corpus (vocab {out.vocab_size}, "
        f"requested {vocab_size}, EOS {eos_token!r} = {out.eos_id})"
    )
    if output is not None:
        out.save(output)
        out.description += f", saved to {output}"
    return out


def get_tokenizer(spec: "Tokenizer | str | os.PathLike | None", eos_token: str | None = None) -> Tokenizer:
    """A tokenizer object from ``None``/``"byte"`` (bytes), a tokenizer.json path, or as is."""
    if spec is None or (isinstance(spec, str) and spec == "byte"):
        return ByteTokenizer()
    if isinstance(spec, (str, os.PathLike)):
        return load_tokenizer(spec, eos_token)
    return spec


def fingerprint(tokenizer: Tokenizer) -> str:
    """A stable identifier of a tokenizer's behaviour (for caches)."""
    fp = getattr(tokenizer, "fingerprint", None)
    return fp if isinstance(fp, str) else hashlib.sha256(tokenizer.description.encode()).hexdigest()[:16]
