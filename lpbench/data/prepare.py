"""``lpbench data prepare`` (text/JSONL/parquet -> Megatron .bin/.idx), ``lpbench data tokenizer``.

``prepare`` writes each document as one sequence followed by EOS (Megatron's ``--append-eod``),
with token dtype chosen as Megatron does (uint16 below 65500 ids, else int32), plus a small
``PREFIX.lpbench.json`` note of the tokenizer, EOS id and vocabulary size (Megatron ignores it;
lpbench reads it back so a prepared dataset knows its vocabulary).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterable, Iterator

import numpy as np

from lpbench.console import Parser, Ticker
from lpbench.data import indexed, sources
from lpbench.data.tokenizer import DEFAULT_EOS, Tokenizer, check_vocab_size, fingerprint, get_tokenizer, train_tokenizer
from lpbench.errors import UsageError
from lpbench.parsing import parse_json
from lpbench.paths import check_file, write_file

METADATA_SUFFIX = ".lpbench.json"
MAX_VOCAB = 1 << 24  # no tokenizer has more token ids; a note saying so is not lpbench's


def tokenize_documents(docs: Iterable[str], tokenizer: Tokenizer, batch_size: int = 256) -> Iterator[list[int]]:
    """Token ids of each document (batched through ``encode_batch``), in order."""
    for batch in sources.batched(docs, batch_size):
        yield from tokenizer.encode_batch(batch)


def write_documents(
    docs: Iterable[str],
    tokenizer: Tokenizer,
    output_prefix: str | os.PathLike,
    append_eos: bool = True,
    source: str = "",
) -> dict:
    """Tokenize ``docs`` into ``output_prefix.bin/.idx``; return the summary saved beside it."""
    dtype = indexed.optimal_dtype(tokenizer.vocab_size)
    n_docs = 0
    tick = Ticker("lpbench data prepare")
    with indexed.IndexedDatasetWriter(output_prefix, dtype) as w:
        for ids in tokenize_documents(docs, tokenizer):
            if not ids:
                continue
            if append_eos:
                ids = ids + [tokenizer.eos_id]
            w.add_document(np.asarray(ids, dtype=np.int64))
            n_docs += 1
            tick(documents=n_docs, tokens=w.num_tokens)
        n_tokens = w.num_tokens
    meta = {
        "format": "megatron-indexed",
        "prefix": os.fspath(output_prefix),
        "source": source,
        "documents": n_docs,
        "tokens": n_tokens,
        "dtype": np.dtype(dtype).name,
        "dtype_code": indexed.CODE_OF_DTYPE[np.dtype(dtype)],
        "append_eos": append_eos,
        "tokenizer": tokenizer.description,
        "tokenizer_fingerprint": fingerprint(tokenizer),
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
    }
    write_file(os.fspath(output_prefix) + METADATA_SUFFIX, json.dumps(meta, indent=1))
    return meta


def read_metadata(prefix: str | os.PathLike) -> dict | None:
    """The ``PREFIX.lpbench.json`` note, or None (e.g. a dataset made by Megatron itself)."""
    path = os.fspath(prefix) + METADATA_SUFFIX
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            meta = parse_json(f.read(), path)
    except OSError as exc:
        raise UsageError(f"{path}: not readable JSON ({exc})") from None
    vocab = meta.get("vocab_size") if isinstance(meta, dict) else None
    if not isinstance(vocab, int) or isinstance(vocab, bool) or not 1 <= vocab <= MAX_VOCAB:
        raise UsageError(
            f"{path}: not lpbench's dataset note (vocab_size must be an integer from 1 to {MAX_VOCAB:,}, got {vocab!r})"
        )
    return meta


def prepare_dataset(
    input: str | os.PathLike,
    output_prefix: str | os.PathLike,
    tokenizer: "Tokenizer | str | None" = None,
    *,
    text_key: str = "text",
    text_unit: str = "paragraph",
    append_eos: bool = True,
    eos_token: str | None = None,
) -> dict:
    """Write a Megatron dataset from text/JSONL/parquet (``tokenizer``: tokenizer.json path,
    ``"byte"``/None for the byte-level tokenizer, or a tokenizer object)."""
    out = os.fspath(output_prefix)
    if out.endswith((".bin", ".idx")):
        raise UsageError(f"--output-prefix {out}: give the prefix, without .bin/.idx")
    for suffix in (".bin", ".idx", METADATA_SUFFIX):
        check_file(out + suffix, "--output-prefix")
    tok = get_tokenizer(tokenizer, eos_token)
    source = sources.describe_source(input)
    docs = sources.iter_documents(input, text_key=text_key, text_unit=text_unit)
    meta = write_documents(docs, tok, out, append_eos=append_eos, source=source)
    if meta["documents"] == 0:
        raise UsageError(f"{input}: no non-empty documents found")
    return meta


def build_tokenizer(
    input: str | os.PathLike,
    vocab_size: int,
    output: str | os.PathLike,
    *,
    text_key: str = "text",
    text_unit: str = "paragraph",
    eos_token: str = DEFAULT_EOS,
    min_frequency: int = 2,
):
    """Train a byte-level BPE on the documents under ``input`` and save it as ``output``."""
    sources.list_files(input)  # fail fast on a bad path
    check_file(output, "--output")
    check_vocab_size(vocab_size)
    docs = sources.iter_documents(input, text_key=text_key, text_unit=text_unit)
    tick = Ticker("lpbench data tokenizer: reading")

    def counted(docs):
        for n, doc in enumerate(docs, 1):
            tick(documents=n)
            yield doc

    print(
        "lpbench data tokenizer: reading the documents and training a byte-level BPE on them",
        file=sys.stderr,
        flush=True,
    )
    return train_tokenizer(counted(docs), vocab_size, eos_token=eos_token, min_frequency=min_frequency, output=output)


# --------------------------------------------------------------------------------------- CLI


class _UsageParser(Parser):
    """Argument errors become UsageError (the CLI prints one line and exits 2)."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_text_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input",
        required=True,
        metavar="PATH",
        help="a .txt/.md/.rst, .jsonl/.json, .parquet file, or a directory of them",
    )
    p.add_argument(
        "--text-key",
        default="text",
        metavar="KEY",
        help="JSONL field / parquet column holding the text (default: text)",
    )
    p.add_argument(
        "--text-unit",
        default="paragraph",
        choices=sources.TEXT_UNITS,
        help="plain text: one document per blank-line-separated block (paragraph, default) or per file",
    )


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``data corpus``, ``data prepare`` and ``data tokenizer`` on the CLI's sub-command parsers."""
    data = subparsers.add_parser(
        "data",
        help="prepare datasets and tokenizers",
        description="Prepare Megatron .bin/.idx datasets and tokenizers from local text.",
    )
    data.set_defaults(func=_missing_command)
    sub = data.add_subparsers(dest="data_command", metavar="{corpus,prepare,tokenizer}", parser_class=_UsageParser)
    from lpbench.corpus.build import add_corpus_parser

    add_corpus_parser(sub)

    p = sub.add_parser(
        "prepare",
        help="tokenize text/JSONL/parquet into a Megatron dataset",
        description="Tokenize documents into PREFIX.bin/PREFIX.idx "
        "(Megatron-LM indexed dataset), one EOS after each document.",
    )
    _add_text_flags(p)
    p.add_argument(
        "--output-prefix", required=True, metavar="PREFIX", help="write PREFIX.bin, PREFIX.idx and PREFIX.lpbench.json"
    )
    p.add_argument(
        "--tokenizer",
        default="byte",
        metavar="PATH",
        help="a tokenizer.json (or its directory); 'byte' for the byte-level tokenizer (default)",
    )
    p.add_argument(
        "--eos-token",
        default=None,
        metavar="TOKEN",
        help="EOS token of --tokenizer (default: found among common names)",
    )
    p.add_argument("--no-eos", dest="append_eos", action="store_false", help="do not append EOS after each document")
    p.set_defaults(func=_cmd_prepare)

    t = sub.add_parser(
        "tokenizer",
        help="train a byte-level BPE tokenizer on a corpus",
        description="Train a byte-level BPE (GPT-2 style) and save tokenizer.json.",
    )
    _add_text_flags(t)
    t.add_argument(
        "--vocab-size",
        required=True,
        type=_positive_int,
        metavar="V",
        help="vocabulary size, including the 256 byte symbols and EOS",
    )
    t.add_argument(
        "--output",
        default="tokenizer.json",
        metavar="PATH",
        help="where to save the tokenizer (default: tokenizer.json)",
    )
    t.add_argument(
        "--eos-token", default=DEFAULT_EOS, metavar="TOKEN", help=f"the EOS special token (default: {DEFAULT_EOS})"
    )
    t.add_argument(
        "--min-frequency",
        default=2,
        type=_positive_int,
        metavar="N",
        help="minimum pair count for a merge (default: 2)",
    )
    t.set_defaults(func=_cmd_tokenizer)
    return data


def _missing_command(args) -> int:
    raise UsageError("lpbench data: choose a command: corpus, prepare or tokenizer")


def _cmd_prepare(args) -> int:
    meta = prepare_dataset(
        args.input,
        args.output_prefix,
        args.tokenizer,
        text_key=args.text_key,
        text_unit=args.text_unit,
        append_eos=args.append_eos,
        eos_token=args.eos_token,
    )
    print(
        f"wrote {meta['prefix']}.bin/.idx: {meta['documents']:,} documents, "
        f"{meta['tokens']:,} tokens, {meta['dtype']} (Megatron dtype code {meta['dtype_code']}) "
        f"from {meta['source']}; tokenizer: {meta['tokenizer']}"
    )
    return 0


def _cmd_tokenizer(args) -> int:
    tok = build_tokenizer(
        args.input,
        args.vocab_size,
        args.output,
        text_key=args.text_key,
        text_unit=args.text_unit,
        eos_token=args.eos_token,
        min_frequency=args.min_frequency,
    )
    print(f"wrote {args.output}: {tok.description}")
    return 0
