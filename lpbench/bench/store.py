"""The results store: one SQLite database, a row per run and a row per step.

A run and its steps are written in one transaction, so a run killed half-way leaves no
half row. Summary metrics are columns (for queries and reports); the full config,
environment and metrics are kept as JSON beside them.

Sweep runs carry a ``sweep_id``; ``UNIQUE(sweep_id, run_key)`` makes "record this run of
this sweep" idempotent: a second insert (a resumed sweep, or the sweep parent writing the
row of a child that died) is skipped, never duplicated. Rows without a sweep id (plain
``lpbench run``) are not constrained.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from lpbench.errors import UsageError
from lpbench.models.registry import model_label

SCHEMA_VERSION = 2  # 2: runs.sweep_id + UNIQUE(sweep_id, run_key)
DB_NAME = "results.db"

# Summary columns copied from a run's metrics (or config) for querying.
METRIC_COLUMNS = ("path", "step_time_s", "last_step_time_s", "tokens_per_sec_per_gpu", "tflops_per_gpu",
                  "mfu_bf16", "mfu_precision", "peak_mem_allocated_gb", "peak_mem_reserved_gb",
                  "device_mem_used_gb", "final_loss")
CONFIG_COLUMNS = ("model", "precision", "seq_len", "mbs", "gbs")

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_key TEXT NOT NULL,
    group_id TEXT,
    sweep_id TEXT,
    created_at TEXT NOT NULL,
    status TEXT NOT NULL,
    error TEXT,
    workload TEXT NOT NULL DEFAULT 'pretrain',
    backend TEXT NOT NULL DEFAULT 'lpbench',
    num_gpus INTEGER NOT NULL DEFAULT 1,
    gpu TEXT,
    {", ".join(f"{c} TEXT" if c in ("model", "precision", "path") else f"{c} REAL" for c in CONFIG_COLUMNS + METRIC_COLUMNS)},
    config_json TEXT NOT NULL,
    env_json TEXT NOT NULL,
    metrics_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS steps (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    step INTEGER NOT NULL,
    loss REAL,
    step_time_s REAL,
    lr REAL,
    grad_norm REAL,
    tokens_per_sec_per_gpu REAL,
    peak_mem_gb REAL,
    PRIMARY KEY (run_id, step)
);
"""

# Indexes come after the migration: a version-1 table has no sweep_id column yet.
_INDEXES = """
CREATE INDEX IF NOT EXISTS runs_key ON runs(run_key);
CREATE UNIQUE INDEX IF NOT EXISTS runs_sweep_key ON runs(sweep_id, run_key);
"""

STEP_COLUMNS = ("step", "loss", "step_time_s", "lr", "grad_norm", "tokens_per_sec_per_gpu", "peak_mem_gb")


def _finite_or_none(v):
    return v if not isinstance(v, float) or v == v and abs(v) != float("inf") else None


class ResultsStore:
    """``ResultsStore(dir)`` opens (or creates) ``dir/results.db``."""

    def __init__(self, directory: str | Path, create: bool = True):
        self.path = Path(directory) / DB_NAME
        if not create and not self.path.exists():
            raise UsageError(f"no results database at {self.path} (run `lpbench run` first, or pass --results DIR)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            self.conn.row_factory = sqlite3.Row
            self.conn.execute("PRAGMA foreign_keys = ON")
            self.conn.execute("PRAGMA journal_mode = WAL")
            with self.transaction():
                for stmt in _SCHEMA.split(";"):
                    if stmt.strip():
                        self.conn.execute(stmt)
                self.conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                version = int(self.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0])
                if version == 1:  # written by lpbench before sweeps: add the column, keep every row
                    self.conn.execute("ALTER TABLE runs ADD COLUMN sweep_id TEXT")
                    self.conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
                    version = SCHEMA_VERSION
                if version == SCHEMA_VERSION:
                    for stmt in _INDEXES.split(";"):
                        if stmt.strip():
                            self.conn.execute(stmt)
        except sqlite3.DatabaseError as exc:
            raise UsageError(f"{self.path} is not a readable lpbench results database ({exc})") from None
        if version != SCHEMA_VERSION:
            raise UsageError(f"{self.path} has schema version {version}; this lpbench reads {SCHEMA_VERSION}")

    def transaction(self):
        return _Transaction(self.conn)

    def add_run(self, *, config: dict, status: str, error: str | None, metrics: dict, steps: list[dict],
                env: dict, run_key: str, group_id: str | None = None, workload: str = "pretrain",
                backend: str = "lpbench", num_gpus: int = 1, sweep_id: str | None = None) -> int | None:
        """Insert a finished run and its steps atomically; returns the run id.

        With a ``sweep_id``, a run already recorded for (sweep_id, run_key) is left as it is
        and None is returned: recording a sweep's run twice is a no-op, not a duplicate.
        """
        cols = {c: config.get(c) for c in CONFIG_COLUMNS}
        cols["model"] = model_label(config.get("model"), config.get("num_layers"))  # llama3-8b@16L
        cols.update({c: _finite_or_none(metrics.get(c)) for c in METRIC_COLUMNS})
        row = dict(run_key=run_key, group_id=group_id, sweep_id=sweep_id,
                   created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), status=status, error=error, workload=workload,
                   backend=backend, num_gpus=num_gpus, gpu=env.get("gpu"), **cols,
                   config_json=json.dumps(config, sort_keys=True),
                   env_json=json.dumps(env, sort_keys=True), metrics_json=json.dumps(metrics, sort_keys=True))
        with self.transaction():
            if sweep_id is not None and self.conn.execute(
                    "SELECT 1 FROM runs WHERE sweep_id=? AND run_key=?", (sweep_id, run_key)).fetchone():
                return None  # BEGIN IMMEDIATE holds the write lock: nobody can insert between check and insert
            cur = self.conn.execute(
                f"INSERT INTO runs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", tuple(row.values()))
            run_id = cur.lastrowid
            self.conn.executemany(
                f"INSERT INTO steps (run_id, {', '.join(STEP_COLUMNS)}) VALUES (?{', ?' * len(STEP_COLUMNS)})",
                [(run_id, *(_finite_or_none(s.get(c)) for c in STEP_COLUMNS)) for s in steps])
        return run_id

    def runs(self, where: str = "1", params: tuple = ()) -> list[dict]:
        rows = self.conn.execute(f"SELECT * FROM runs WHERE {where} ORDER BY id", params).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            for key in ("config", "env", "metrics"):
                d[key] = json.loads(d.pop(f"{key}_json"))
            out.append(d)
        return out

    def sweep_run(self, sweep_id: str, run_key: str) -> dict | None:
        """The recorded run of ``run_key`` in sweep ``sweep_id``, or None."""
        found = self.runs("sweep_id = ? AND run_key = ?", (sweep_id, run_key))
        return found[0] if found else None

    def finished_keys(self, sweep_id: str) -> set[str]:
        """Run keys of ``sweep_id`` that have a row (any terminal status)."""
        rows = self.conn.execute("SELECT run_key FROM runs WHERE sweep_id = ?", (sweep_id,)).fetchall()
        return {r[0] for r in rows}

    def steps(self, run_id: int) -> list[dict]:
        rows = self.conn.execute(f"SELECT {', '.join(STEP_COLUMNS)} FROM steps WHERE run_id=? ORDER BY step",
                                 (run_id,)).fetchall()
        return [dict(r) for r in rows]

    def close(self) -> None:
        self.conn.close()


class _Transaction:
    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    def __enter__(self):
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, exc_type, exc, tb):
        self.conn.execute("ROLLBACK" if exc_type else "COMMIT")
        return False
