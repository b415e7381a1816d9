"""Read documents (strings) from local plain text, JSONL, parquet, or directories of those.

Formats by file extension:

- plain text (``.txt .text .md .rst``): UTF-8 (undecodable bytes replaced). With
  ``text_unit="paragraph"`` (default) each block of lines separated by one or more blank lines
  is a document, read as a stream so large files need little memory; with ``text_unit="file"``
  the whole file is one document.
- JSON lines (``.jsonl .ndjson .json``, one JSON object per line, as Megatron's "loose JSON"):
  the document is the string under ``text_key`` (default ``"text"``); blank lines are skipped.
- parquet (``.parquet .pq``, read with pyarrow in record batches): the ``text_key`` column.

A directory is read recursively in sorted path order, taking files with these extensions and
skipping hidden ones. Empty documents are skipped. Problems raise :class:`UsageError`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from lpbench.errors import UsageError
from lpbench.parsing import parse_json

TEXT_EXTENSIONS = (".txt", ".text", ".md", ".rst")
JSONL_EXTENSIONS = (".jsonl", ".ndjson", ".json")
PARQUET_EXTENSIONS = (".parquet", ".pq")
KNOWN_EXTENSIONS = TEXT_EXTENSIONS + JSONL_EXTENSIONS + PARQUET_EXTENSIONS
TEXT_UNITS = ("paragraph", "file")

PathLike = str | os.PathLike


def detect_format(path: PathLike) -> str:
    """``"text"``, ``"jsonl"`` or ``"parquet"`` from the file's extension."""
    ext = Path(path).suffix.lower()
    for fmt, exts in (("text", TEXT_EXTENSIONS), ("jsonl", JSONL_EXTENSIONS), ("parquet", PARQUET_EXTENSIONS)):
        if ext in exts:
            return fmt
    known = " ".join(KNOWN_EXTENSIONS)
    raise UsageError(f"{path}: unknown data format {ext or '(no extension)'!r}; known: {known}")


def list_files(paths: PathLike | Sequence[PathLike]) -> list[Path]:
    """The data files named by ``paths`` (files and/or directories), in a stable order."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            hidden = lambda f: any(part.startswith(".") for part in f.relative_to(p).parts)
            found = sorted(
                f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in KNOWN_EXTENSIONS and not hidden(f)
            )
            if not found:
                raise UsageError(f"{p}: directory holds no .txt/.jsonl/.parquet data files")
            files.extend(found)
        elif p.is_file():
            detect_format(p)
            files.append(p)
        else:
            raise UsageError(f"{p}: no such file or directory")
    return files


def iter_documents(
    paths: PathLike | Sequence[PathLike], text_key: str = "text", text_unit: str = "paragraph"
) -> Iterator[str]:
    """Every non-empty document of every file under ``paths``, in order."""
    if text_unit not in TEXT_UNITS:
        raise UsageError(f"text_unit must be one of {TEXT_UNITS}, got {text_unit!r}")
    for f in list_files(paths):
        fmt = detect_format(f)
        if fmt == "text":
            yield from read_text(f, text_unit)
        elif fmt == "jsonl":
            yield from read_jsonl(f, text_key)
        else:
            yield from read_parquet(f, text_key)


def read_text(path: PathLike, text_unit: str = "paragraph") -> Iterator[str]:
    """Documents of a plain-text file: blank-line-separated blocks, or the whole file."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        if text_unit == "file":
            text = fh.read().strip("\n")
            if text.strip():
                yield text
            return
        block: list[str] = []
        for line in fh:
            if line.strip():
                block.append(line)
            elif block:
                yield "".join(block).rstrip("\n")
                block = []
        if block:
            yield "".join(block).rstrip("\n")


def jsonl_records(path: PathLike) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON value) of each non-blank line; a UsageError names a bad line."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                value = parse_json(line, f"{path}:{lineno}")
            except UsageError as exc:
                hint = (
                    " (a JSON array? use one object per line)" if lineno == 1 and line.lstrip().startswith("[") else ""
                )
                raise UsageError(f"{exc}{hint}") from None
            yield lineno, value


def read_jsonl(path: PathLike, text_key: str = "text") -> Iterator[str]:
    """The ``text_key`` string of each JSON object, one object per line."""
    for lineno, record in jsonl_records(path):
        if not isinstance(record, dict) or text_key not in record:
            raise UsageError(f"{path}:{lineno}: no {text_key!r} field (choose the field with --text-key)")
        text = record[text_key]
        if text is None:
            continue
        if not isinstance(text, str):
            raise UsageError(f"{path}:{lineno}: field {text_key!r} is {type(text).__name__}, not a string")
        if text:
            yield text


def open_parquet(path: PathLike):
    """A ``pyarrow.parquet.ParquetFile``, or a UsageError naming the file or the missing extra."""
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError:
        raise UsageError("reading parquet needs pyarrow: pip install pyarrow") from None
    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise UsageError(f"{path}: not a readable parquet file: {exc}") from None


def read_parquet(path: PathLike, text_key: str = "text", batch_size: int = 1024) -> Iterator[str]:
    """The non-null strings of column ``text_key``, read in record batches."""
    pf = open_parquet(path)
    names = pf.schema_arrow.names
    if text_key not in names:
        raise UsageError(f"{path}: no column {text_key!r} (columns: {', '.join(names)}; choose one with --text-key)")
    for batch in pf.iter_batches(batch_size=batch_size, columns=[text_key]):
        for text in batch.column(0).to_pylist():
            if text is None:
                continue
            if not isinstance(text, str):
                raise UsageError(f"{path}: column {text_key!r} holds {type(text).__name__}, not strings")
            if text:
                yield text


def describe_source(paths: PathLike | Sequence[PathLike]) -> str:
    """``"path (jsonl)"`` or ``"dir/ (12 files: 10 text, 2 jsonl)"``."""
    files = list_files(paths)
    label = paths if isinstance(paths, (str, os.PathLike)) else ", ".join(map(str, paths))
    fmts = [detect_format(f) for f in files]
    if len(files) == 1 and str(files[0]) == str(label):
        return f"{label} ({fmts[0]})"
    counts = ", ".join(f"{fmts.count(k)} {k}" for k in ("text", "jsonl", "parquet") if k in fmts)
    return f"{label} ({len(files)} files: {counts})"


def batched(items: Iterable, size: int) -> Iterator[list]:
    """Consecutive lists of up to ``size`` items."""
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
