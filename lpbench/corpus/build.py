"""``lpbench data corpus``: an English corpus from the documentation installed on this machine.

Sources (each a :class:`CorpusSource`; ``--sources`` picks, ``--root NAME=DIR`` re-points):

- ``man``: manual pages (``man1``–``man9`` of ``/usr/share/man``, gzipped roff, English
  sections only); the roff (man and mdoc macros, escapes, tables) is stripped to text
  (:mod:`lpbench.corpus.roff`).
- ``info``: GNU info manuals (``/usr/share/info``), one document per node, menus dropped.
- ``doc``: README/NEWS/``.txt``/``.md``/``.rst`` files of ``/usr/share/doc`` (gzipped or not;
  changelogs, copyright files and HTML left out); HTML comments and tags stripped.
- ``licenses``: ``/usr/share/common-licenses``.
- ``python``: the docstrings of every module under the Python library folders of this
  interpreter (read with :mod:`ast`, nothing imported), one document per module, and the
  long descriptions (READMEs) of the installed distributions' ``METADATA``.

Files are read in sorted order, paragraphs hard-wrapped at a fixed width are re-flowed into
one line, and documents are deduplicated at paragraph level: a paragraph of at least
``DEDUP_MIN_WORDS`` words that was already seen (whitespace and case ignored) is dropped, and
a document left with fewer than ``min_words`` words is dropped, so exact and near-exact
duplicates (the same README in many packages, flag lists repeated in every page of a CLI)
go. Documents with more than 10% non-ASCII characters (not English) or with under 5% common
English function words ("the", "of", "and", ...: tables, lists of names, character maps) are
left out. The kept documents are shuffled with a fixed seed, so a held-out tail of the corpus samples every
source, and written as JSON lines ``{"text", "source", "path"}`` with a stats file.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import os
import random
import re
import sys
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from lpbench.console import Ticker
from lpbench.corpus.roff import strip_roff
from lpbench.errors import UsageError
from lpbench.paths import check_dir, check_file, write_file

DEDUP_MIN_WORDS = 6
MAX_NON_ASCII = 0.10
MIN_STOPWORDS = 0.05  # share of common English function words below which a text is not prose
STOPWORDS = frozenset(
    "the of and to a in is that for it as with be on by this are or not an if from at which can you when will".split()
)
MAX_FILE_BYTES = 4_000_000


# ----------------------------------------------------------------------------- text helpers
_LIST_OR_CODE = re.compile(r"\s*([-*+\u2022]\s|\d+[.)]\s|[|#>]|```|\.\. |\S+\s*::$|[-=~^*_]{3,}\s*$)")


def reflow(text: str) -> str:
    """Join the lines of each hard-wrapped prose paragraph; leave lists, tables, code as they are."""
    out = []
    for para in re.split(r"\n[ \t]*\n", text):
        lines = [ln.rstrip() for ln in para.split("\n") if ln.strip()]
        if not lines:
            continue
        prose = all(len(ln) - len(ln.lstrip()) <= 3 and not _LIST_OR_CODE.match(ln) for ln in lines)
        out.append(" ".join(ln.strip() for ln in lines) if prose and len(lines) > 1 else "\n".join(lines))
    return "\n\n".join(out)


def _read(path: Path) -> str:
    """The text of ``path``, gunzipped if it ends in .gz; a file that cannot be read or decompressed (a
    corrupt .gz) is skipped as empty, one line on stderr saying so: one bad page does not stop a corpus."""
    try:
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        print(
            f"lpbench data corpus: {path}: not readable ({' '.join(str(exc).split())[:120]}); skipped", file=sys.stderr
        )
        return ""
    return data.decode("utf-8", errors="replace")


def _files(root: Path, keep: Callable[[Path], bool]) -> Iterator[Path]:
    """Regular files (no symlinks) under ``root`` passing ``keep``, in sorted order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if not p.is_symlink() and p.is_file() and p.stat().st_size <= MAX_FILE_BYTES and keep(p):
                yield p


# ----------------------------------------------------------------------------- sources
def man_documents(root: Path) -> Iterator[tuple[Path, str]]:
    """One document per page of the English sections (``manN`` directly under ``root``)."""
    sections = sorted(p for p in root.iterdir() if p.is_dir() and re.fullmatch(r"man[1-9]\w*", p.name))
    for section in sections:
        for path in _files(section, lambda p: re.search(r"\.\d\w*(\.gz)?$", p.name) is not None):
            src = _read(path)
            if re.match(r"\s*\.so\s", src) and src.count("\n") < 3:  # a redirect to another page
                continue
            yield path, strip_roff(src)


def info_documents(root: Path) -> Iterator[tuple[Path, str]]:
    """One document per node of every info manual; node headers, menus and underlines dropped."""
    for path in _files(root, lambda p: re.search(r"\.info(-\d+)?(\.gz)?$", p.name) is not None):
        for node in _read(path).split("\x1f")[1:]:
            keep, in_menu = [], False
            for line in node.split("\n"):
                if line.startswith(("File: ", "Tag Table:", "End Tag Table", "Indirect:")):
                    continue
                if line.startswith("* Menu:"):
                    in_menu = True
                    continue
                if in_menu and (line.startswith("* ") or line.startswith(" " * 10) or not line.strip()):
                    continue
                in_menu = False
                if re.fullmatch(r"[*=\-.]{3,}", line.strip()):
                    continue
                keep.append(line)
            yield path, reflow("\n".join(keep))


_DOC_NAME = re.compile(r"(readme|news|faq|todo|authors|thanks|howto|usage|intro|notes|guide)", re.I)
_DOC_SUFFIX = (".txt", ".md", ".rst", ".text", ".markdown")


def _is_doc(path: Path) -> bool:
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    low = name.lower()
    if low.startswith(("changelog", "copyright", "license", "licence", "copying")) or "changelog" in low:
        return False
    return low.endswith(_DOC_SUFFIX) or (_DOC_NAME.match(low) is not None and "." not in low.strip("."))


def doc_documents(root: Path) -> Iterator[tuple[Path, str]]:
    """README/NEWS/text/markdown/reST files (gzipped or not), HTML comments and tags stripped."""
    for path in _files(root, _is_doc):
        text = re.sub(r"<!--.*?-->", "", _read(path), flags=re.S)
        text = re.sub(r"</?[A-Za-z][^<>\n]*>", "", text)
        yield path, reflow(text)


def license_documents(root: Path) -> Iterator[tuple[Path, str]]:
    for path in _files(root, lambda p: True):
        yield path, reflow(_read(path))


def _docstrings(tree: ast.Module) -> Iterator[str]:
    """Module, class and function docstrings in source order."""
    defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop(0)
        if doc := ast.get_docstring(node, clean=True):
            yield doc
        todo[:0] = [n for n in ast.iter_child_nodes(node) if isinstance(n, defs)]


def python_documents(root: Path) -> Iterator[tuple[Path, str]]:
    """Per ``.py`` module its docstrings (3+ words each); per ``*.dist-info/METADATA`` its README."""
    own = Path(__file__).resolve().parents[1]
    for path in _files(
        root, lambda p: p.suffix == ".py" or (p.name == "METADATA" and p.parent.name.endswith(".dist-info"))
    ):
        if own in path.resolve().parents:
            continue
        if path.name == "METADATA":
            head, _, body = _read(path).partition("\n\n")
            if "Description-Content-Type: text/html" not in head:
                yield path, reflow(re.sub(r"<[^<>\n]*>", "", body))
            continue
        try:
            tree = ast.parse(_read(path))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        docs = [reflow(d) for d in _docstrings(tree) if len(d.split()) >= 3]
        yield path, "\n\n".join(docs)


def _python_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = [paths["stdlib"], paths["purelib"], paths["platlib"]]
    return tuple(dict.fromkeys(os.path.realpath(r) for r in roots))


@dataclass(frozen=True)
class CorpusSource:
    name: str
    description: str
    licence: str
    roots: tuple[str, ...]
    documents: Callable[[Path], Iterator[tuple[Path, str]]]


SOURCES: dict[str, CorpusSource] = {
    s.name: s
    for s in (
        CorpusSource(
            "man",
            "manual pages (English sections man1-man9, roff stripped)",
            "each page under its package's licence (/usr/share/doc/PKG/copyright)",
            ("/usr/share/man",),
            man_documents,
        ),
        CorpusSource(
            "info",
            "GNU info manuals, one document per node",
            "GNU Free Documentation License or the package's licence",
            ("/usr/share/info",),
            info_documents,
        ),
        CorpusSource(
            "doc",
            "README/NEWS/text/markdown files of installed packages",
            "each file under its package's licence (/usr/share/doc/PKG/copyright)",
            ("/usr/share/doc",),
            doc_documents,
        ),
        CorpusSource(
            "licenses",
            "licence texts",
            "the licence texts themselves (verbatim copying permitted)",
            ("/usr/share/common-licenses",),
            license_documents,
        ),
        CorpusSource(
            "python",
            "docstrings of the Python standard library and installed packages, and their READMEs",
            "each module under its distribution's licence (PSF for the standard library; "
            "*.dist-info/LICENSE* or METADATA License fields)",
            _python_roots(),
            python_documents,
        ),
    )
}
DEFAULT_SOURCES = ("man", "info", "doc", "licenses", "python")


# ----------------------------------------------------------------------------- assembly
def _non_ascii(text: str) -> float:
    return sum(ord(c) > 127 for c in text) / max(1, len(text))


def _stopword_share(words: list[str]) -> float:
    return sum(w in STOPWORDS for w in words) / max(1, len(words))


class Deduplicator:
    """Drops paragraphs of DEDUP_MIN_WORDS+ words seen before (whitespace and case ignored)."""

    def __init__(self):
        self.seen: set[bytes] = set()
        self.dropped = 0

    def __call__(self, text: str) -> str:
        kept = []
        for para in text.split("\n\n"):
            words = para.lower().split()
            if len(words) >= DEDUP_MIN_WORDS:
                h = hashlib.blake2b(" ".join(words).encode(), digest_size=10).digest()
                if h in self.seen:
                    self.dropped += 1
                    continue
                self.seen.add(h)
            kept.append(para)
        return "\n\n".join(kept)


def first_words(text: str, n: int) -> str:
    """The first ``n`` words of ``text``, keeping its paragraphs (the last one may be cut)."""
    kept, left = [], n
    for para in text.split("\n\n"):
        words = para.split()
        if left <= 0 or not words:
            continue
        kept.append(para if len(words) <= left else " ".join(words[:left]))
        left -= min(len(words), left)
    return "\n\n".join(kept)


def assemble(
    out_dir: str | os.PathLike,
    sources: list[str] | None = None,
    roots: dict[str, list[str]] | None = None,
    *,
    min_words: int = 20,
    max_words: int | None = None,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict:
    """Write ``out_dir/corpus.jsonl`` and ``out_dir/corpus.stats.json``; return the stats.

    ``roots`` re-points sources (``{"man": ["/tmp/man"]}``); ``max_words`` bounds the words kept
    (sources in the order given; the document that reaches the bound is cut to it).
    """
    names = list(sources or DEFAULT_SOURCES)
    for n in names:
        if n not in SOURCES:
            raise UsageError(f"unknown corpus source {n!r}; valid: {', '.join(SOURCES)}")
    for n in roots or {}:
        if n not in names:
            raise UsageError(f"--root {n}=...: {n!r} is not among the sources ({', '.join(names)})")
    if min_words < 1:
        raise UsageError(f"--min-words must be >= 1, got {min_words}")
    if max_words is not None and max_words < min_words:
        raise UsageError(f"--max-words ({max_words}) must be at least --min-words ({min_words})")
    check_dir(out_dir, "--out")
    for name in ("corpus.jsonl", "corpus.stats.json"):
        check_file(Path(out_dir) / name, "--out")
    dedup = Deduplicator()
    records: list[str] = []
    stats: dict = {"sources": {}, "seed": seed, "min_words": min_words, "dedup_min_words": DEDUP_MIN_WORDS}
    total_words = 0
    tick = Ticker("lpbench data corpus")
    for name in names:
        src = SOURCES[name]
        dirs = (roots or {}).get(name) or list(src.roots)
        s = {"description": src.description, "licence": src.licence, "roots": dirs}
        counts = ("files", "documents", "words", "bytes", "dropped_short_or_duplicate", "dropped_not_english_prose")
        s.update(dict.fromkeys(counts, 0))
        for d in dirs:
            root = Path(d)
            if not root.is_dir():
                if (roots or {}).get(name):
                    raise UsageError(f"--root {name}={d}: no such directory")
                log(f"lpbench data corpus: {name}: {d} not present here, skipped")
                continue
            for path, text in src.documents(root):
                s["files"] += 1
                tick(**{f"{name} files read": s["files"], "documents kept": len(records), "words": total_words})
                if _non_ascii(text) > MAX_NON_ASCII or _stopword_share(text.lower().split()) < MIN_STOPWORDS:
                    s["dropped_not_english_prose"] += 1
                    continue
                text = dedup(text).strip()
                n = len(text.split())
                if max_words and total_words + n > max_words:  # a bound: the last document is cut to fit
                    text = first_words(text, max_words - total_words)
                    n = len(text.split())
                if n < min_words:
                    s["dropped_short_or_duplicate"] += 1
                    continue
                records.append(json.dumps({"text": text, "source": name, "path": str(path)}, ensure_ascii=False))
                s["documents"] += 1
                s["words"] += n
                s["bytes"] += len(text.encode())
                total_words += n
                if max_words and total_words >= max_words:
                    break
            if max_words and total_words + min_words > max_words:  # no further document would fit
                break
        stats["sources"][name] = s
        log(
            f"lpbench data corpus: {name}: {s['documents']:,} documents, {s['words']:,} words, "
            f"{s['bytes'] / 1e6:.1f} MB from {s['files']:,} files"
        )
        if max_words and total_words + min_words > max_words:
            break
    if not records:
        raise UsageError("no documents found in the chosen sources")
    random.Random(seed).shuffle(records)
    out = Path(out_dir)
    path = out / "corpus.jsonl"
    write_file(path, "".join(r + "\n" for r in records))
    stats.update(
        documents=len(records),
        words=total_words,
        bytes=sum(s["bytes"] for s in stats["sources"].values()),
        paragraphs_dropped_as_duplicates=dedup.dropped,
        output=str(path),
    )
    write_file(out / "corpus.stats.json", json.dumps(stats, indent=1))
    return stats


# ----------------------------------------------------------------------------- CLI
def _root(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected SOURCE=DIR, got {text!r}")
    return name, path


def add_corpus_parser(sub) -> None:
    """``lpbench data corpus`` on the ``data`` sub-command parsers."""
    p = sub.add_parser(
        "corpus",
        help="assemble an English corpus (JSONL) from documentation installed here",
        description="Assemble man pages, info manuals, package docs and Python docstrings "
        "installed on this machine into one deduplicated, shuffled JSONL corpus.",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="write DIR/corpus.jsonl and DIR/corpus.stats.json")
    p.add_argument(
        "--sources",
        default=",".join(DEFAULT_SOURCES),
        metavar="A,B",
        help=f"comma-separated, from {', '.join(SOURCES)} (default: all)",
    )
    p.add_argument(
        "--root",
        action="append",
        type=_root,
        default=[],
        metavar="SOURCE=DIR",
        help="read SOURCE from DIR instead of its default folders (repeatable)",
    )
    p.add_argument(
        "--min-words",
        type=int,
        default=20,
        metavar="N",
        help="drop documents with fewer words after deduplication (default 20)",
    )
    p.add_argument(
        "--max-words",
        type=int,
        default=None,
        metavar="N",
        help="keep at most N words: the document that reaches N is cut to it (default: everything)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the document shuffle (default 0)")
    p.set_defaults(func=_cmd_corpus)


def _cmd_corpus(args) -> int:
    roots: dict[str, list[str]] = {}
    for name, path in args.root:
        roots.setdefault(name, []).append(path)
    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    stats = assemble(
        args.out,
        sources,
        roots,
        min_words=args.min_words,
        max_words=args.max_words,
        seed=args.seed,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(
        f"wrote {stats['output']}: {stats['documents']:,} documents, {stats['words']:,} words, "
        f"{stats['bytes'] / 1e6:.1f} MB ({stats['paragraphs_dropped_as_duplicates']:,} duplicate paragraphs "
        f"dropped); stats in {Path(args.out) / 'corpus.stats.json'}"
    )
    return 0
