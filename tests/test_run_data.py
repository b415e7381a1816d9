"""`lpbench run --data PREFIX` on a dataset `data prepare` wrote: the model's vocabulary follows the data's."""

import json

import numpy as np

from lpbench.cli import main
from lpbench.data.indexed import write_indexed_dataset

RUN = [
    "run",
    "--model",
    "tiny",
    "--seq-len",
    "32",
    "--mbs",
    "2",
    "--gbs",
    "2",
    "--steps",
    "3",
    "--warmup-steps",
    "1",
    "--precision",
    "bf16",
]


def _prepared(tmp_path, vocab=4096):
    """A prepared dataset whose tokenizer is larger than tiny's 2048-token vocabulary."""
    prefix = tmp_path / "docs_text_document"
    rng = np.random.default_rng(0)
    write_indexed_dataset(
        prefix, [rng.integers(0, vocab - 1, 200) for _ in range(20)] + [np.array([vocab - 1])], dtype=np.uint16
    )
    (tmp_path / "docs_text_document.lpbench.json").write_text(
        json.dumps({"tokenizer": "test BPE", "vocab_size": vocab, "eos_id": vocab - 1})
    )
    return prefix


def test_run_resizes_the_default_models_vocabulary_to_the_prepared_data(tmp_path, capsys):
    prefix = _prepared(tmp_path)
    assert (
        main([*RUN, "--data", str(prefix), "--results", str(tmp_path / "r"), "--json", str(tmp_path / "s.json")]) == 0
    )
    err = capsys.readouterr().err
    assert "model tiny's vocabulary of 2048 resized to the data's 4096" in err
    (row,) = json.loads((tmp_path / "s.json").read_text())
    assert row["status"] == "ok"


def test_mock_data_keeps_the_models_vocabulary(tmp_path, capsys):
    assert main([*RUN, "--results", str(tmp_path / "r")]) == 0
    assert "resized" not in capsys.readouterr().err


def test_converge_on_too_little_text_says_how_much_it_needs(tmp_path, capsys):
    text = tmp_path / "small.txt"
    text.write_text("A short paragraph of documentation.\n\n" * 80)  # ~3 KB: a few sequences of 256 bytes
    argv = [
        "converge",
        "--data",
        str(text),
        "--tokenizer",
        "byte",
        "--model",
        "tiny",
        "--precision",
        "bf16",
        "--tokens",
        "4096",
        "--results",
        str(tmp_path / "r"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "tokens of data are needed" in err and "--eval-every 0" in err and len(err.strip().splitlines()) == 1
    needed = int(err.split("about ")[1].split(" tokens")[0].replace(",", ""))
    text.write_text("A short paragraph of documentation.\n\n" * (needed // 36 + 10))  # 36 tokens a paragraph
    assert main(argv) == 0  # that much text is enough


def test_ticker_prints_at_most_every_interval(monkeypatch):
    import io

    from lpbench.console import Ticker

    out, now = io.StringIO(), [0.0]
    tick = Ticker("lpbench data prepare", every=5.0, stream=out)
    tick.clock, tick.t0, tick.last = (lambda: now[0]), 0.0, 0.0
    assert not tick(documents=10)
    now[0] = 6.0
    assert tick(documents=1200, tokens=345678)
    now[0] = 7.0
    assert not tick(documents=1300)
    assert out.getvalue() == "lpbench data prepare: 1,200 documents, 345,678 tokens (0:06 elapsed)\n"


def test_prepare_shows_progress(tmp_path, monkeypatch, capsys):
    from lpbench.console import Ticker

    monkeypatch.setattr(Ticker.__init__, "__defaults__", (0.0, None))  # a line at every document
    text = tmp_path / "t.txt"
    text.write_text("one paragraph\n\nanother paragraph\n")
    assert main(["data", "prepare", "--input", str(text), "--output-prefix", str(tmp_path / "p")]) == 0
    assert "lpbench data prepare: 2 documents" in capsys.readouterr().err
