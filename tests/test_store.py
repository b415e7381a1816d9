import json
import os
import sqlite3

import pytest

from lpbench.bench.store import ResultsStore, RunRecord
from lpbench.config import RunConfig, run_key
from lpbench.errors import UsageError


def _add(store, **kw):
    args = dict(
        config={"model": "tiny", "precision": "bf16", "seq_len": 64, "mbs": 2, "gbs": 4},
        status="ok",
        error=None,
        metrics={"tokens_per_sec_per_gpu": 123.0, "final_loss": 1.5, "path": "native"},
        steps=[{"step": 1, "loss": 2.0, "step_time_s": 0.5}, {"step": 2, "loss": 1.5, "step_time_s": 0.4}],
        env={"gpu": None, "torch": "x"},
        run_key="k1",
        group_id="g",
    )
    args.update(kw)
    return store.add_run(RunRecord(**args))


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


def test_a_sweep_run_is_recorded_once(tmp_path):
    store = ResultsStore(tmp_path)
    first = _add(store, sweep_id="sw", run_key="k1")
    again = _add(store, sweep_id="sw", run_key="k1", status="error", error="late writer")
    assert first is not None and again is None  # the second writer is skipped, not duplicated
    (run,) = store.runs("sweep_id = 'sw'")
    assert run["status"] == "ok" and store.finished_keys("sw") == {"k1"}
    assert store.sweep_run("sw", "k1")["id"] == first and store.sweep_run("sw", "k2") is None
    # the constraint itself, for writers that bypass add_run
    with pytest.raises(sqlite3.IntegrityError):
        store.conn.execute(
            "INSERT INTO runs (run_key, sweep_id, created_at, status, config_json, env_json, "
            "metrics_json) VALUES ('k1', 'sw', 'now', 'ok', '{}', '{}', '{}')"
        )
    # the same run key in another sweep, or outside sweeps, is a new row
    assert _add(store, sweep_id="other", run_key="k1") is not None
    assert _add(store, run_key="k1") is not None and _add(store, run_key="k1") is not None
    assert len(store.runs()) == 4


def test_version_1_database_is_migrated_in_place(tmp_path):
    conn = sqlite3.connect(tmp_path / "results.db")
    conn.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema_version', '1');
        CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, run_key TEXT NOT NULL, group_id TEXT,
            created_at TEXT NOT NULL, status TEXT NOT NULL, error TEXT, workload TEXT NOT NULL DEFAULT 'pretrain',
            backend TEXT NOT NULL DEFAULT 'lpbench', num_gpus INTEGER NOT NULL DEFAULT 1, gpu TEXT, model TEXT,
            precision TEXT, seq_len REAL, mbs REAL, gbs REAL, path TEXT, step_time_s REAL, last_step_time_s REAL,
            tokens_per_sec_per_gpu REAL, tflops_per_gpu REAL, mfu_bf16 REAL, mfu_precision REAL,
            peak_mem_allocated_gb REAL, peak_mem_reserved_gb REAL, device_mem_used_gb REAL, final_loss REAL,
            config_json TEXT NOT NULL, env_json TEXT NOT NULL, metrics_json TEXT NOT NULL);
        INSERT INTO runs (run_key, created_at, status, model, precision, config_json, env_json, metrics_json)
            VALUES ('old', 'then', 'ok', 'tiny', 'bf16', '{}', '{}', '{}');
    """)
    conn.close()
    store = ResultsStore(tmp_path, create=False)
    (old,) = store.runs()
    assert old["run_key"] == run_key({}) and old["sweep_id"] is None  # rekeyed from its (empty) config
    assert _add(store, sweep_id="s") is not None and _add(store, sweep_id="s") is None


@pytest.fixture
def quick_retries(monkeypatch):
    import lpbench.bench.store as store_module

    monkeypatch.setattr(store_module, "BUSY_TIMEOUT_S", 0.05)
    monkeypatch.setattr(store_module, "RETRY_DELAYS_S", (0.01, 0.02))


def test_a_run_the_locked_database_cannot_take_is_kept_and_imported_later(tmp_path, quick_retries, capsys):
    store = ResultsStore(tmp_path)
    other = sqlite3.connect(tmp_path / "results.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock throughout
    assert _add(store, run_key="kept") is None
    err = capsys.readouterr().err
    assert "database is locked" in err and "the run is kept in" in err and len(err.strip().splitlines()) == 1
    [kept] = (tmp_path / "pending-runs").glob("*.json")
    assert store.kept[0]["run_key"] == "kept" and store.runs() == []
    other.execute("ROLLBACK")

    again = ResultsStore(tmp_path, create=False)  # the next command (e.g. lpbench report) imports it
    assert "imported 1 run(s) kept in" in capsys.readouterr().err
    [run] = again.runs()
    assert run["run_key"] == "kept" and run["metrics"]["tokens_per_sec_per_gpu"] == 123.0
    assert [s["loss"] for s in again.steps(run["id"])] == [2.0, 1.5]
    assert not kept.exists() and len(ResultsStore(tmp_path).runs()) == 1  # imported once


def test_a_full_disk_keeps_the_run_aside(tmp_path, quick_retries, monkeypatch, capsys):
    store = ResultsStore(tmp_path)
    tries = []

    def full(*args, **kw):
        tries.append(1)
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(store, "_insert", full)
    assert _add(store) is None
    assert len(tries) == 3  # retried with backoff before giving up
    assert "database or disk is full" in capsys.readouterr().err
    assert len(list((tmp_path / "pending-runs").glob("*.json"))) == 1
    assert not list((tmp_path / "pending-runs").glob(".*"))  # no temporary file left


def test_report_reads_a_read_only_database(tmp_path, monkeypatch, capsys):
    import lpbench.bench.store as store_module
    from lpbench.cli import main

    _add(ResultsStore(tmp_path))
    for path in [*tmp_path.iterdir(), tmp_path]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    if os.geteuid() == 0:  # root writes through permissions: open every read-write connection read-only instead
        real = sqlite3.connect

        def read_only(target, *args, **kw):
            if kw.get("uri"):
                return real(target, *args, **kw)
            return real(f"file:{target}?mode=ro", *args, uri=True, **kw)

        monkeypatch.setattr(store_module.sqlite3, "connect", read_only)
    try:
        assert main(["report", "--results", str(tmp_path), "--format", "json"]) == 0
    finally:
        for path in [tmp_path, *tmp_path.iterdir()]:
            path.chmod(0o755 if path.is_dir() else 0o644)
    out = capsys.readouterr()
    assert json.loads(out.out)[0]["model"] == "tiny" and "Traceback" not in out.err


def test_a_diverged_run_stores_standard_json(tmp_path):
    store = ResultsStore(tmp_path)
    _add(
        store,
        status="diverged",
        metrics={"final_loss": float("nan"), "losses": [1.0, float("inf")]},
        config={"model": "tiny", "lr": float("nan")},
        env={"x": float("-inf")},
    )
    row = store.conn.execute("SELECT config_json, env_json, metrics_json FROM runs").fetchone()

    def refuse(token):
        raise ValueError(f"bare {token} in stored JSON")

    parsed = [json.loads(text, parse_constant=refuse) for text in row]
    assert parsed[2] == {"final_loss": None, "losses": [1.0, None]} and parsed[0]["lr"] is None


def test_a_sweep_parent_finds_the_run_its_child_kept_aside(tmp_path, quick_retries, capsys):
    store = ResultsStore(tmp_path)
    other = sqlite3.connect(tmp_path / "results.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    assert _add(store, sweep_id="sw", run_key="k1") is None  # the child's write, kept aside
    assert store.sweep_run("sw", "k1") is None and store.kept_run("sw", "k1")["status"] == "ok"
    assert store.kept_run("sw", "k2") is None
    other.execute("ROLLBACK")
    assert ResultsStore(tmp_path).sweep_run("sw", "k1")["status"] == "ok"  # imported: the parent's failure row loses
    capsys.readouterr()


def _key_before_schema_3(config: dict) -> str:
    """lpbench's run key up to schema 2 (a hash of every setting but the checkpoint and profiling ones)."""
    import hashlib

    kept = {
        k: v for k, v in config.items() if k not in ("save_every", "save_dir", "load", "profile_steps", "tensorboard")
    }
    if kept["num_layers"] is None:
        del kept["num_layers"]
    if not kept["fused_loss"]:
        del kept["fused_loss"]
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def test_schema_2_run_keys_are_recomputed_so_sweeps_resume_and_runs_group(tmp_path):
    """A database written with the old keys: opened by this lpbench, its rows carry the keys today's configs
    have, so a sweep over the same grid finds them done; two runs of a sweep that the new key no longer tells
    apart (they differ in the FLOP formula only) both stay."""
    from lpbench.bench.sweep_spec import expand

    spec = {"name": "old", "precision": ["bf16", "fp8-tensorwise"], "seq_len": 64, "mbs": 2, "steps": 4}
    configs = [run.config for run in expand(spec).runs]
    store = ResultsStore(tmp_path)
    for cfg in configs:
        _add(store, config=cfg.to_dict(), run_key=_key_before_schema_3(cfg.to_dict()), sweep_id="old")
    legacy = configs[0].with_(flops_formula="nemo-legacy").to_dict()
    _add(store, config=legacy, run_key=_key_before_schema_3(legacy), sweep_id="old")
    store.conn.execute("UPDATE meta SET value='2' WHERE key='schema_version'")
    old_keys = [r["run_key"] for r in store.runs()]
    store.close()
    assert {cfg.key() for cfg in configs}.isdisjoint(old_keys)  # the keys did change

    store = ResultsStore(tmp_path, create=False)
    assert store.finished_keys("old") >= {run.key for run in expand(spec).runs}  # a resumed sweep skips them
    rows = store.runs()
    assert [r["run_key"] for r in rows[:2]] == [cfg.key() for cfg in configs]
    assert rows[2]["run_key"] == old_keys[2] and len(rows) == 3  # kept, under its old key
    assert _add(store, config=configs[0].to_dict(), run_key=configs[0].key(), sweep_id="old") is None  # recorded once
    assert store.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == "4"
    store.close()
    from lpbench.cli import main

    assert main(["report", "--results", str(tmp_path), "--format", "json"]) == 0  # the upgraded database reports


def test_a_pipeline_run_from_before_pp_split_keeps_its_even_split(tmp_path):
    """A pipeline run stored before --pp-split (no pp_split in its config) split its blocks evenly: once its
    schema-3 database is opened, its key is the even split's, not today's balanced default's (so a resumed sweep
    runs the balanced run), and its config reads as even; a run without a pipeline keeps its key."""
    new = RunConfig(seq_len=64, pp=2, mbs=2, gbs=4)
    old = {k: v for k, v in new.to_dict().items() if k != "pp_split"}
    assert run_key(old) == new.with_(pp_split="even").key() != new.key()
    plain = RunConfig(seq_len=64)
    assert run_key({k: v for k, v in plain.to_dict().items() if k != "pp_split"}) == plain.key()
    store = ResultsStore(tmp_path)
    _add(store, config=old, run_key=new.key(), sweep_id="s")  # the key schema 3 gave it
    store.conn.execute("UPDATE meta SET value='3' WHERE key='schema_version'")
    store.close()
    store = ResultsStore(tmp_path, create=False)
    assert new.key() not in store.finished_keys("s")
    (row,) = store.runs()
    assert row["run_key"] == new.with_(pp_split="even").key() and row["config"]["pp_split"] == "even"
    store.close()


def test_run_key_ignores_settings_at_their_defaults():
    """A setting added with a default leaves every existing run's key as it was; one that is set changes it."""
    base = RunConfig(seq_len=64).to_dict()
    assert run_key({**base, "a_setting_from_later": None}) == run_key(base)  # unknown names are not hashed
    assert run_key({k: v for k, v in base.items() if k != "fused_loss"}) == run_key(base)  # default: absent
    assert RunConfig(seq_len=64, fused_loss=True).key() != RunConfig(seq_len=64).key()
    assert RunConfig(seq_len=64, save_dir="x", save_every=2).key() == RunConfig(seq_len=64).key()  # key=False
