import gzip
import json
import textwrap

import pytest

from lpbench.cli import main
from lpbench.corpus.build import assemble, python_documents, reflow
from lpbench.corpus.roff import strip_roff

SHARED = (
    "Every command of this suite reads its configuration from the same file and honours the same "
    "environment variables, described in the overview page."
)

MAN_PAGE = (
    textwrap.dedent(r"""
    .\" Copyright notice: this comment must not reach the corpus.
    .de Vb
    .ft CW
    .nf
    ..
    .TH FROB 1 "2024" "frob 1.0"
    .SH NAME
    frob \- turn widgets into gadgets
    .SH DESCRIPTION
    \fBfrob\fR reads a widget from the standard input and writes
    the matching gadget to the standard output\(em quickly and \fIquietly\fP.
    .PP
    .ie n .IP "frob \-\-fast" 4
    .el .IP "frob \-\-slow" 4
    Use the fast path when the widget is small enough.
    .TP
    .BR \-v ", " \-\-verbose
    Print what is being done and why it is being done.
    .PP
    %s
    .SH EXAMPLE
    .nf
    $ frob < widget.txt
      > gadget
    .fi
    """)
    % SHARED
)


def write_tree(root):
    """A fake machine: man pages (one a copy, one a .so redirect, one in French), info, doc, Python."""
    man1 = root / "man" / "man1"
    man1.mkdir(parents=True)
    (man1 / "frob.1.gz").write_bytes(gzip.compress(MAN_PAGE.encode()))
    (man1 / "frob2.1.gz").write_bytes(gzip.compress(MAN_PAGE.encode()))  # exact duplicate
    (man1 / "frobnicate.1.gz").write_bytes(gzip.compress(b".so man1/frob.1\n"))
    other = MAN_PAGE.replace("frob", "grok").replace("widget", "sprocket").replace("gadget", "cog")
    (man1 / "grok.1").write_text(other)  # shares only SHARED with frob.1
    (root / "man" / "fr" / "man1").mkdir(parents=True)
    (root / "man" / "fr" / "man1" / "frob.1").write_text(".SH NOM\nfrob \\- transformer les widgets\n")
    info = root / "info"
    info.mkdir()
    (info / "frob.info").write_text(
        "This is frob.info, produced by makeinfo.\n\x1f\nFile: frob.info,  Node: Top,  Next: Usage\n\n"
        "frob\n****\n\n* Menu:\n\n* Usage::     How to use it.\n\n\x1f\nFile: frob.info,  Node: Usage\n\n"
        "1 Usage\n*******\n\nThe frob program is used in a pipeline and it turns every widget that it\n"
        "reads into a gadget, which is then written to the standard output of the process.\n"
    )
    doc = root / "doc" / "frob"
    doc.mkdir(parents=True)
    (doc / "README.md").write_text(
        "# frob\n\n<!-- badge -->The frob tool turns widgets into gadgets and is "
        "the reference implementation of the widget format for the project.\n"
    )
    (doc / "changelog.Debian.gz").write_bytes(
        gzip.compress(
            b"frob (1.0) unstable; urgency=low\n\n"
            b"  * Initial release of the package to the archive "
            b"with all of the changes.\n"
        )
    )
    (doc / "table.txt").write_text("U+0020 space 100% (1/1)\nU+0021 exclam 100% (1/1)\n" * 20)
    py = root / "py" / "frobpkg"
    py.mkdir(parents=True)
    (py / "__init__.py").write_text(
        textwrap.dedent('''
        """Frobnication helpers: turn widgets into gadgets, one at a time, with care."""

        SECRET_CODE = "x = 1  # code must not reach the corpus"


        class Frobber:
            """A frobber keeps the state of a frobnication between calls
            and can be reused for many widgets."""

            def run(self, widget):
                """Frob ``widget`` and return the gadget that it turns into."""
                return widget
        ''')
    )
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = write_tree(tmp_path_factory.mktemp("machine"))
    out = root / "out"
    roots = {
        "man": [str(root / "man")],
        "info": [str(root / "info")],
        "doc": [str(root / "doc")],
        "python": [str(root / "py")],
    }
    stats = assemble(out, ["man", "info", "doc", "python"], roots, min_words=8, log=lambda line: None)
    docs = [json.loads(line) for line in (out / "corpus.jsonl").read_text().splitlines()]
    return root, out, stats, docs, roots


def test_strip_roff_leaves_text_without_markup():
    text = strip_roff(MAN_PAGE)
    assert "frob - turn widgets into gadgets" in text
    assert (
        "frob reads a widget from the standard input and writes the matching gadget to the standard "
        "output\u2014 quickly and quietly."
    ) in text  # fonts gone, lines joined, \(em resolved
    assert "frob --fast" in text and "--slow" not in text  # the nroff branch of .ie
    assert "-v, --verbose\n\nPrint what is being done" in text  # .TP tag, alternating fonts joined
    assert "$ frob < widget.txt\n  > gadget" in text  # no-fill block keeps its lines and indent
    for markup in ("\\f", ".SH", ".TH", ".PP", "Copyright notice", ".ft", "\\-", "\\("):
        assert markup not in text


def test_strip_roff_reads_mdoc():
    text = strip_roff(
        ".Dd May 1 2024\n.Dt FROB 1\n.Sh NAME\n.Nm frob\n.Nd turn widgets into gadgets\n"
        ".Sh SYNOPSIS\n.Nm\n.Op Fl v\n.Ar file\n.Sh SEE ALSO\n.Xr grok 1 ,\n.Xr cat 1\n"
    )
    assert "frob \u2014 turn widgets into gadgets" in text
    assert "frob -v file" in text and "grok(1), cat(1)" in text


def test_reflow_joins_prose_but_not_lists_or_code():
    text = "A paragraph that was\nwrapped by hand.\n\n- item one\n- item two\n\n    code()\n    more()"
    assert reflow(text) == "A paragraph that was wrapped by hand.\n\n- item one\n- item two\n\n    code()\n    more()"


def test_python_docstrings_only(tmp_path):
    root = write_tree(tmp_path)
    [(path, text)] = list(python_documents(root / "py"))
    assert path.name == "__init__.py"
    assert text.split("\n\n") == [
        "Frobnication helpers: turn widgets into gadgets, one at a time, with care.",
        "A frobber keeps the state of a frobnication between calls and can be reused for many widgets.",
        "Frob ``widget`` and return the gadget that it turns into.",
    ]


def test_corpus_is_deduplicated_stripped_and_counted(corpus):
    root, out, stats, docs, _ = corpus
    by_path = {d["path"].split("/")[-1]: d for d in docs}
    # the copy of frob.1, the .so redirect, the French page, the changelog and the table are gone
    assert set(by_path) == {"frob.1.gz", "grok.1", "frob.info", "README.md", "__init__.py"}
    assert {d["source"] for d in docs} == {"man", "info", "doc", "python"}
    assert sum(d["text"].count(SHARED) for d in docs) == 1  # a paragraph shared by two pages is kept once
    info = by_path["frob.info"]["text"]
    assert info.startswith("1 Usage") and "Menu" not in info and "File:" not in info and "****" not in info
    assert "<!--" not in by_path["README.md"]["text"]
    for d in docs:
        assert "\\f" not in d["text"] and "\n.SH" not in d["text"]
    s = stats["sources"]
    assert s["man"]["files"] == 3 and s["man"]["documents"] == 2 and s["man"]["dropped_short_or_duplicate"] == 1
    assert s["doc"]["dropped_not_english_prose"] == 1  # table.txt
    assert stats["documents"] == len(docs)
    assert stats["words"] == sum(len(d["text"].split()) for d in docs)
    assert stats["bytes"] == sum(len(d["text"].encode()) for d in docs)
    assert json.loads((out / "corpus.stats.json").read_text())["documents"] == len(docs)


def test_corpus_is_reproducible(corpus, tmp_path):
    _, out, _, _, roots = corpus
    assemble(tmp_path, ["man", "info", "doc", "python"], roots, min_words=8, log=lambda line: None)
    assert (tmp_path / "corpus.jsonl").read_bytes() == (out / "corpus.jsonl").read_bytes()


def test_corpus_cli(corpus, tmp_path, capsys):
    root = corpus[0]
    assert (
        main(
            [
                "data",
                "corpus",
                "--out",
                str(tmp_path),
                "--sources",
                "man",
                "--root",
                f"man={root / 'man'}",
                "--min-words",
                "8",
            ]
        )
        == 0
    )
    assert "2 documents" in capsys.readouterr().out
    assert len((tmp_path / "corpus.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--sources", "man,novels"], "unknown corpus source 'novels'"),
        (["--sources", "man", "--root", "info=/tmp"], "'info' is not among the sources"),
        (["--sources", "man", "--root", "man=/no/such/dir"], "no such directory"),
        (["--root", "man"], "expected SOURCE=DIR, got 'man'"),
    ],
)
def test_corpus_cli_rejects_bad_input_in_one_line(argv, message, tmp_path, capsys):
    assert main(["data", "corpus", "--out", str(tmp_path)] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("bound", [10, 25, 40])
def test_max_words_is_a_bound(corpus, tmp_path, bound):
    _, _, full, _, roots = corpus
    assert full["words"] > bound  # the whole corpus would overshoot every bound here
    stats = assemble(
        tmp_path, ["man", "info", "doc", "python"], roots, min_words=8, max_words=bound, log=lambda line: None
    )
    words = sum(len(json.loads(line)["text"].split()) for line in (tmp_path / "corpus.jsonl").read_text().splitlines())
    assert words == stats["words"] and bound - 8 < words <= bound


def test_max_words_below_min_words_is_refused(tmp_path, capsys):
    assert main(["data", "corpus", "--out", str(tmp_path), "--min-words", "20", "--max-words", "5"]) == 2
    assert "--max-words (5) must be at least --min-words (20)" in capsys.readouterr().err
