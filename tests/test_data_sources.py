"""Document readers: plain text (paragraphs or files), JSONL, parquet, directories."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lpbench.data.sources import describe_source, iter_documents, list_files
from lpbench.errors import UsageError


def test_text_paragraphs_and_files(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("first line\nsecond line\n\n\n  \nnext para\n\nlast")
    assert list(iter_documents(f)) == ["first line\nsecond line", "next para", "last"]
    assert list(iter_documents(f, text_unit="file")) == [f.read_text()]
    with pytest.raises(UsageError, match="text_unit"):
        list(iter_documents(f, text_unit="line"))


def test_jsonl(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(
        "\n".join(
            json.dumps(r)
            for r in [{"text": "one"}, {"text": ""}, {"text": "two", "id": 2}, {"body": "x", "text": None}]
        )
        + "\n\n"
    )
    assert list(iter_documents(f)) == ["one", "two"]
    g = tmp_path / "e.jsonl"
    g.write_text(json.dumps({"body": "x"}) + "\n")
    assert list(iter_documents(g, text_key="body")) == ["x"]
    with pytest.raises(UsageError, match=r"e\.jsonl:1: no 'text' field"):
        list(iter_documents(g))
    h = tmp_path / "h.jsonl"
    h.write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(UsageError, match=r"h\.jsonl:2"):
        list(iter_documents(h))


def test_parquet(tmp_path):
    f = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": ["alpha", None, "beta"], "n": [1, 2, 3]}), f)
    assert list(iter_documents(f)) == ["alpha", "beta"]
    with pytest.raises(UsageError, match="no column 'content'"):
        list(iter_documents(f, text_key="content"))


def test_directory_order_and_filtering(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("B")
    (tmp_path / "sub" / "a.jsonl").write_text('{"text": "A"}\n')
    (tmp_path / "notes.csv").write_text("ignored")
    (tmp_path / ".hidden.txt").write_text("hidden")
    pq.write_table(pa.table({"text": ["P"]}), tmp_path / "c.parquet")
    assert [f.name for f in list_files(tmp_path)] == ["b.txt", "c.parquet", "a.jsonl"]
    assert list(iter_documents(tmp_path)) == ["B", "P", "A"]
    assert "3 files" in describe_source(tmp_path)


def test_errors(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        list_files(tmp_path / "nope.txt")
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(UsageError, match="unknown data format"):
        list_files(tmp_path / "x.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no .txt"):
        list_files(tmp_path / "empty")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(UsageError, match="parquet"):
        list(iter_documents(tmp_path / "bad.parquet"))
