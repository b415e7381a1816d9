import sqlite3

import pytest

from lpbench.bench.store import ResultsStore
from lpbench.errors import UsageError


def _add(store, **kw):
    args = dict(config={"model": "tiny", "precision": "bf16", "seq_len": 64, "mbs": 2, "gbs": 4},
                status="ok", error=None, metrics={"tokens_per_sec_per_gpu": 123.0, "final_loss": 1.5, "path": "native"},
                steps=[{"step": 1, "loss": 2.0, "step_time_s": 0.5}, {"step": 2, "loss": 1.5, "step_time_s": 0.4}],
                env={"gpu": None, "torch": "x"}, run_key="k1", group_id="g")
    args.update(kw)
    return store.add_run(**args)


def test_round_trip(tmp_path):
    store = ResultsStore(tmp_path)
    run_id = _add(store)
    store.close()
    again = ResultsStore(tmp_path, create=False)
    (run,) = again.runs()
    assert run["id"] == run_id and run["model"] == "tiny" and run["tokens_per_sec_per_gpu"] == 123.0
    assert run["config"]["gbs"] == 4 and run["env"]["torch"] == "x" and run["metrics"]["path"] == "native"
    assert [s["loss"] for s in again.steps(run_id)] == [2.0, 1.5]


def test_failed_insert_leaves_no_half_row(tmp_path):
    store = ResultsStore(tmp_path)
    with pytest.raises(sqlite3.IntegrityError):  # duplicate step number violates the primary key
        _add(store, steps=[{"step": 1, "loss": 1.0}, {"step": 1, "loss": 1.0}])
    assert store.runs() == []
    assert store.conn.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == 0


def test_nan_metrics_stored_as_null(tmp_path):
    store = ResultsStore(tmp_path)
    _add(store, status="diverged", metrics={"final_loss": float("nan")}, steps=[{"step": 1, "loss": float("inf")}])
    (run,) = store.runs()
    assert run["final_loss"] is None and store.steps(run["id"])[0]["loss"] is None


def test_missing_and_corrupt_databases_are_refused(tmp_path):
    with pytest.raises(UsageError, match="no results database"):
        ResultsStore(tmp_path / "nowhere", create=False)
    (tmp_path / "results.db").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(UsageError, match="not a readable lpbench results database"):
        ResultsStore(tmp_path)
