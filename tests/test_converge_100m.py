"""benchmarks/converge_100m.py: ``export`` rebuilds, from a run's results database, the JSON record that
``run`` writes (for a run whose wrapper was stopped after training), and refuses a run that left none."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLAGS = [
    "--data",
    "mock",
    "--model",
    "tiny",
    "--tokens",
    "2048",
    "--seq-len",
    "64",
    "--mbs",
    "4",
    "--gbs",
    "4",
    "--eval-every",
    "4",
    "--device",
    "cpu",
]


@pytest.fixture(scope="module")
def study(benchmark_script):
    return benchmark_script("converge_100m")


def test_export_writes_the_record_run_wrote(study, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    work = tmp_path / "work"
    assert study.main(["run", "bf16", "--out", str(tmp_path / "run"), "--work", str(work), *FLAGS]) == 0
    assert study.main(["export", "bf16", "--out", str(tmp_path / "export"), "--work", str(work), *FLAGS]) == 0
    ran = json.loads((tmp_path / "run" / "bf16.json").read_text())
    exported = json.loads((tmp_path / "export" / "bf16.json").read_text())
    assert ran["wall_s"] > 0 and exported["wall_s"] is None
    assert ran["val_losses"] and len(ran["train"]) == 8
    for key in ("date_utc", "wall_s"):
        ran.pop(key), exported.pop(key)
    assert exported == ran


def test_export_of_a_run_that_left_no_database_fails(study, tmp_path, capsys):
    assert (
        study.main(["export", "nvfp4", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), *FLAGS]) == 2
    )
    assert "nvfp4: no result" in capsys.readouterr().err
    assert not (tmp_path / "work" / "nvfp4").exists() and not (tmp_path / "out").exists()


def test_export_without_the_corpus_exits_with_one_line(study, tmp_path):
    flags = [tmp_path / "no-such-corpus" if f == "mock" else f for f in FLAGS]
    with pytest.raises(SystemExit, match="no prepared corpus"):
        study.main(["export", "bf16", "--out", str(tmp_path / "out"), *map(str, flags)])
