"""The results store: one SQLite database, a row per run and a row per step.

A run and its steps are written in one transaction, so a run killed half-way leaves no
half row. Summary metrics are columns (for queries and reports); the full config,
environment and metrics are kept as JSON beside them.

Sweep runs carry a ``sweep_id``; ``UNIQUE(sweep_id, run_key)`` makes "record this run of
this sweep" idempotent: a second insert (a resumed sweep, or the sweep parent writing the
row of a child that died) is skipped, never duplicated. Rows without a sweep id (plain
``lpbench run``) are not constrained. A database written by an older lpbench is upgraded when
opened for writing: a version-1 table gains the sweep id, and the run keys of versions 1 to 3 (a hash
over every setting; a pipeline run from before ``--pp-split`` keyed as the balanced split) are
recomputed from each row's config as :func:`lpbench.config.run_key` does, so old runs still group
with new ones, a sweep resumes across the upgrade, and an old evenly split pipeline run is not
taken for a balanced one. Rows are read with their configs completed (:func:`lpbench.config.completed`).

A finished run is never lost: a write that fails (the database locked by another process
beyond SQLite's busy timeout, a full disk) is retried with backoff, and if it still fails the run
is kept as JSON in ``pending-runs/`` beside the database (one line on stderr says so). The next
command that opens the database for writing (``run``, ``sweep``, ``converge``, ``report``)
imports those files and says so in one line; a file there that is not a kept run (malformed JSON,
a row or steps of the wrong shape) is moved to ``pending-runs/rejected/`` with a one-line warning
and blocks nothing. A database that cannot be written at all (a read-only file or folder, a path
SQLite cannot open, locked by another process past ``LOCK_WAIT_S``: each said in one line) is
still read by ``report``, and ``open_store`` gives the runs of ``run``, ``converge`` and a sweep
child to ``pending-runs/`` instead (:class:`AsideStore`). A database found locked when opened is
waited for, at most ``LOCK_WAIT_S``, and one line says so.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from lpbench.errors import UsageError
from lpbench.models.registry import model_label
from lpbench.parsing import parse_json

SCHEMA_VERSION = 4  # 2: runs.sweep_id + UNIQUE(sweep_id, run_key); 3: run keys over non-default settings;
# 4: keys of pipeline runs from before --pp-split name their even split (config.completed)
DB_NAME = "results.db"
PENDING_DIR = "pending-runs"  # runs that could not be written, imported by the next writer
BUSY_TIMEOUT_S = 30.0  # SQLite waits this long for another writer's lock ...
RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0)  # ... then lpbench retries after each of these pauses
LOCK_WAIT_S = 60.0  # a database locked by another process when opened is waited for this long
SQLITE_MAX_PATH = 512  # SQLite opens no database whose absolute path is longer (SQLITE_MAX_PATHNAME)

# Summary columns copied from a run's metrics (or config) for querying.
METRIC_COLUMNS = (
    *("path", "step_time_s", "last_step_time_s", "tokens_per_sec_per_gpu", "tflops_per_gpu", "mfu_bf16"),
    *("mfu_precision", "peak_mem_allocated_gb", "peak_mem_reserved_gb", "device_mem_used_gb", "final_loss"),
)
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


def _say(message: str) -> None:
    """One line on stderr."""
    print(f"lpbench: {message}", file=sys.stderr, flush=True)


def _finite_or_none(v):
    return v if not isinstance(v, float) or math.isfinite(v) else None


def _json_safe(value):
    """``value`` with every NaN/inf float replaced by None, so its JSON is standard JSON."""
    if isinstance(value, float):
        return _finite_or_none(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def strict_json(value, **kw) -> str:
    """Standard JSON (no bare NaN or Infinity: non-finite numbers become null)."""
    return json.dumps(_json_safe(value), allow_nan=False, **kw)


@dataclass
class RunRecord:
    """A finished run as the store takes it: its config (a dict), outcome, metrics, steps and identity."""

    config: dict
    status: str
    error: str | None
    metrics: dict
    steps: list[dict]
    env: dict
    run_key: str
    group_id: str | None = None
    workload: str = "pretrain"
    backend: str = "lpbench"
    num_gpus: int = 1
    sweep_id: str | None = None


def run_row(run: RunRecord) -> dict:
    """A finished run as ``ResultsStore.runs`` returns it (without an id): columns plus config/env/metrics."""
    cols = {c: run.config.get(c) for c in CONFIG_COLUMNS}
    cols["model"] = model_label(run.config.get("model"), run.config.get("num_layers"))  # llama3-8b@16L
    cols.update({c: _finite_or_none(run.metrics.get(c)) for c in METRIC_COLUMNS})
    return dict(
        id=None,
        run_key=run.run_key,
        group_id=run.group_id,
        sweep_id=run.sweep_id,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        status=run.status,
        error=run.error,
        workload=run.workload,
        backend=run.backend,
        num_gpus=run.num_gpus,
        gpu=run.env.get("gpu"),
        **cols,
        config=_json_safe(run.config),
        env=_json_safe(run.env),
        metrics=_json_safe(run.metrics),
    )


_TRANSIENT = ("locked", "busy", "disk is full", "disk i/o error")
_UNWRITABLE = ("readonly", "read-only", "unable to open", "disk i/o error", "disk is full")


class StoreUnwritable(UsageError):
    """The results database cannot be written now (locked past the wait, read-only, a path SQLite cannot open)."""


def _locked(exc: Exception) -> bool:
    return any(t in str(exc).lower() for t in ("locked", "busy"))


def kept_run_of(data) -> tuple[dict, list[dict]]:
    """(row, steps) of a ``pending-runs/`` file's parsed JSON; TypeError or ValueError saying what is wrong with it."""
    if not isinstance(data, dict) or not isinstance(data.get("row"), dict) or not isinstance(data.get("steps"), list):
        raise TypeError("not an object with a row object and a steps list")
    row, steps = data["row"], data["steps"]
    known = {
        "id",
        "run_key",
        "group_id",
        "sweep_id",
        "created_at",
        "status",
        "error",
        "workload",
        "backend",
        "num_gpus",
    }
    known |= {"gpu", *CONFIG_COLUMNS, *METRIC_COLUMNS, "config", "env", "metrics"}
    if set(row) - known:
        raise ValueError(f"unknown row field(s) {sorted(set(row) - known)[:3]}")
    for key in ("run_key", "created_at", "status"):
        if not isinstance(row.get(key), str):
            raise TypeError(f"row field {key} is not a string")
    for key in ("config", "env", "metrics"):
        if not isinstance(row.get(key), dict):
            raise TypeError(f"row field {key} is not an object")
    for key in ("group_id", "sweep_id", "error", "gpu", "model", "precision", "path", "workload", "backend"):
        if not isinstance(row.get(key), (str, type(None))):
            raise TypeError(f"row field {key} is not a string")
    for key in ("num_gpus", "seq_len", "mbs", "gbs", *METRIC_COLUMNS):
        if key != "path" and not isinstance(row.get(key), (int, float, type(None))):
            raise TypeError(f"row field {key} is not a number")
    for s in steps:
        if (
            not isinstance(s, dict)
            or not isinstance(s.get("step"), int)
            or isinstance(s.get("step"), bool)
            or any(not isinstance(s.get(c), (int, float, type(None))) for c in STEP_COLUMNS)
        ):
            raise TypeError("a step is not an object of numbers with an integer step")
    return _rekeyed(data), steps


def _retrying(write):
    """``write()``, retried with backoff while SQLite reports a lock, a full disk or an I/O error."""
    for delay in (*RETRY_DELAYS_S, None):
        try:
            return write()
        except sqlite3.OperationalError as exc:
            if delay is None or not any(t in str(exc).lower() for t in _TRANSIENT):
                raise
            time.sleep(delay)


class ResultsStore:
    """``ResultsStore(dir)`` opens (or creates) ``dir/results.db``."""

    def __init__(self, directory: str | Path, create: bool = True):
        """``create=False`` (reports): the database must exist; one that cannot be written is read as is."""
        self.path = Path(directory) / DB_NAME
        if not create and not self.path.exists():
            raise UsageError(f"no results database at {self.path} (run `lpbench run` first, or pass --results DIR)")
        self.kept: list[dict] = []  # rows this process could not write (kept in PENDING_DIR)
        self.read_only = False
        try:
            if len(os.fsencode(self.path.absolute())) > SQLITE_MAX_PATH:
                raise sqlite3.OperationalError(
                    f"unable to open database file: its path is longer than SQLite's {SQLITE_MAX_PATH} bytes"
                )
            if create:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            self.conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            self.conn.row_factory = sqlite3.Row
            self.conn.execute("PRAGMA foreign_keys = ON")
            version = self._waiting_for_lock(self._set_up)
        except (sqlite3.OperationalError, OSError, StoreUnwritable) as exc:
            unwritable = isinstance(exc, (StoreUnwritable, OSError)) or any(t in str(exc).lower() for t in _UNWRITABLE)
            if not unwritable:
                raise UsageError(f"{self.path} is not a readable lpbench results database ({exc})") from None
            if create or not self.path.exists():
                why = exc if isinstance(exc, StoreUnwritable) else f"{self.path} cannot be written ({exc})"
                raise StoreUnwritable(str(why)) from None
            version = self._open_read_only()
        except sqlite3.DatabaseError as exc:
            raise UsageError(f"{self.path} is not a readable lpbench results database ({exc})") from None
        if version != SCHEMA_VERSION:
            raise UsageError(f"{self.path} has schema version {version}; this lpbench reads {SCHEMA_VERSION}")
        if not self.read_only:
            self.import_kept()

    def _open_read_only(self) -> int:
        """Read a database this process may not write (read-only file or folder); returns its schema version."""
        from urllib.parse import quote

        self.read_only = True
        uri = f"file:{quote(str(self.path.resolve()))}"
        for mode in ("?mode=ro", "?immutable=1"):  # immutable: a WAL database whose folder is read-only
            try:
                self.conn = sqlite3.connect(uri + mode, uri=True, isolation_level=None)
                self.conn.row_factory = sqlite3.Row
                return _schema_version(self.conn)
            except sqlite3.OperationalError as exc:
                error = exc
            except sqlite3.DatabaseError as exc:
                raise UsageError(f"{self.path} is not a readable lpbench results database ({exc})") from None
        raise UsageError(f"{self.path} is not a readable lpbench results database ({error})") from None

    def _waiting_for_lock(self, action):
        """``action()``; if another process holds the database locked, say so and wait for it at most
        ``LOCK_WAIT_S`` (StoreUnwritable after that)."""
        self.conn.execute("PRAGMA busy_timeout = 100")
        try:
            return action()
        except sqlite3.OperationalError as exc:
            if not _locked(exc):
                raise
        _say(f"{self.path} is locked by another process; waiting for it (at most {LOCK_WAIT_S:g} s)")
        self.conn.execute(f"PRAGMA busy_timeout = {int(LOCK_WAIT_S * 1000)}")
        try:
            return action()
        except sqlite3.OperationalError as exc:
            if _locked(exc):
                raise StoreUnwritable(f"{self.path} is locked by another process (waited {LOCK_WAIT_S:g} s)") from None
            raise
        finally:
            self.conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")

    def _set_up(self) -> int:
        """Create or migrate the schema; returns the schema version."""
        self.conn.execute("PRAGMA journal_mode = WAL")
        with self.transaction():
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    self.conn.execute(stmt)
            self.conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            version = _schema_version(self.conn)
            if version == 1:  # written by lpbench before sweeps: add the column, keep every row
                self.conn.execute("ALTER TABLE runs ADD COLUMN sweep_id TEXT")
            if version in (1, 2, 3):  # keys hashed every setting, or an old pipeline's split as balanced: recomputed
                self._rekey()
                self.conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
                version = SCHEMA_VERSION
            if version == SCHEMA_VERSION:
                for stmt in _INDEXES.split(";"):
                    if stmt.strip():
                        self.conn.execute(stmt)
        return version

    def _rekey(self) -> None:
        """Each row's run key recomputed from its stored config (schema 1-3 -> 4), inside ``_set_up``'s transaction."""
        from lpbench.config import run_key

        self.conn.execute("DROP INDEX IF EXISTS runs_sweep_key")  # rebuilt after: keys change one row at a time
        rows = self.conn.execute("SELECT id, sweep_id, run_key, config_json FROM runs ORDER BY id").fetchall()
        taken, updates = set(), []
        for r in rows:
            try:
                key = run_key(json.loads(r["config_json"]))
            except (ValueError, TypeError, AttributeError, RecursionError):  # a row of the wrong shape keeps its key
                key = r["run_key"]
            if r["sweep_id"] is not None and (r["sweep_id"], key) in taken:
                key = r["run_key"]  # differs from an earlier run of its sweep only in what the new key leaves out
            taken.add((r["sweep_id"], key))
            updates.append((key, r["id"]))
        self.conn.executemany("UPDATE runs SET run_key=? WHERE id=?", updates)

    def transaction(self):
        return _Transaction(self.conn)

    def add_run(self, run: RunRecord) -> int | None:
        """Insert a finished run and its steps atomically; returns the run id.

        With a ``sweep_id``, a run already recorded for (sweep_id, run_key) is left as it is
        and None is returned: recording a sweep's run twice is a no-op, not a duplicate. A run
        the database cannot take after the retries is kept in ``PENDING_DIR`` (None returned,
        the row appended to ``kept``).
        """
        row = run_row(run)
        try:
            return _retrying(lambda: self._insert(row, run.steps))
        except sqlite3.OperationalError as exc:
            self.kept.append(row)
            path = keep_run(self.path.parent, row, run.steps)
            _say(
                f"could not write {self.path} ({exc}); the run is kept in {path} and imported by "
                "the next lpbench command on this results folder"
            )
            return None

    def _insert(self, row: dict, steps: list[dict], kept: bool = False) -> int | None:
        """Insert ``row`` (as ``run_row`` makes it) and its steps in one transaction."""
        values = {k: v for k, v in row.items() if k not in ("id", "config", "env", "metrics")}
        values.update({f"{k}_json": strict_json(row[k], sort_keys=True) for k in ("config", "env", "metrics")})
        with self.transaction():  # BEGIN IMMEDIATE holds the write lock: nobody inserts between check and insert
            if row["sweep_id"] is not None and self._has("sweep_id=? AND run_key=?", (row["sweep_id"], row["run_key"])):
                return None
            imported = (row["run_key"], row["group_id"], row["created_at"], values["metrics_json"])
            if kept and self._has("run_key=? AND group_id IS ? AND created_at=? AND metrics_json=?", imported):
                return None  # imported before (its file outlived the import)
            cur = self.conn.execute(
                f"INSERT INTO runs ({', '.join(values)}) VALUES ({', '.join('?' * len(values))})",
                tuple(values.values()),
            )
            run_id = cur.lastrowid
            self.conn.executemany(
                f"INSERT INTO steps (run_id, {', '.join(STEP_COLUMNS)}) VALUES (?{', ?' * len(STEP_COLUMNS)})",
                [(run_id, *(_finite_or_none(s.get(c)) for c in STEP_COLUMNS)) for s in steps],
            )
        return run_id

    def _has(self, where: str, params: tuple) -> bool:
        return self.conn.execute(f"SELECT 1 FROM runs WHERE {where}", params).fetchone() is not None

    def import_kept(self) -> int:
        """Insert the runs kept in ``PENDING_DIR`` and delete their files; returns how many were imported.
        A file that is not a kept run is set aside (:func:`_set_aside`), one line each."""
        folder = self.path.parent / PENDING_DIR
        imported = 0
        for path, kept in _kept_files(folder):
            try:
                row, steps = kept_run_of(kept)
                _retrying(lambda row=row, steps=steps: self._insert(row, steps, kept=True))
                path.unlink()
            except (ValueError, TypeError, sqlite3.IntegrityError, sqlite3.InterfaceError) as exc:
                _set_aside(path, str(exc))
                continue
            except (sqlite3.OperationalError, OSError):
                break  # still not writable: the files stay for the next command
            imported += 1
        if imported:
            _say(f"imported {imported} run(s) kept in {folder} when {self.path} could not be written")
        return imported

    def kept_run(self, sweep_id: str, run_key: str) -> dict | None:
        """The run of ``run_key`` in sweep ``sweep_id`` kept in ``PENDING_DIR`` (not yet imported), or None."""
        for _, kept in _kept_files(self.path.parent / PENDING_DIR, quiet=True):
            try:
                row, _ = kept_run_of(kept)
            except (TypeError, ValueError):
                continue
            if row.get("sweep_id") == sweep_id and row.get("run_key") == run_key:
                return row
        return None

    def runs(self, where: str = "1", params: tuple = ()) -> list[dict]:
        """The rows ``where`` selects; a row whose JSON or numbers are not what lpbench writes is skipped with
        a one-line warning (a report still shows the others)."""
        from lpbench.config import completed

        rows = self.conn.execute(f"SELECT * FROM runs WHERE {where} ORDER BY id", params).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            try:
                for key in ("config", "env", "metrics"):
                    d[key] = parse_json(d.pop(f"{key}_json"), f"its {key}_json")
                    if not isinstance(d[key], dict):
                        raise UsageError(f"its {key}_json is not an object")
                d["config"] = completed(d["config"])
                bad = [
                    c
                    for c in ("num_gpus", *CONFIG_COLUMNS, *METRIC_COLUMNS)
                    if c not in ("model", "precision", "path") and not isinstance(d.get(c), (int, float, type(None)))
                ]
                bad += [c for c in ("run_key", "status", "created_at") if not isinstance(d.get(c), str)]
                if bad:
                    raise UsageError(f"its {', '.join(bad)} {'is' if len(bad) == 1 else 'are'} of the wrong type")
            except UsageError as exc:
                print(f"lpbench: {self.path}: run {d.get('id')} skipped: {exc}", file=sys.stderr)
                continue
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
        rows = self.conn.execute(
            f"SELECT {', '.join(STEP_COLUMNS)} FROM steps WHERE run_id=? ORDER BY step", (run_id,)
        ).fetchall()
        return [dict(r) for r in rows]

    def close(self) -> None:
        self.conn.close()


def _rekeyed(kept: dict) -> dict:
    """The row of a kept run (``keep_run``'s file), its run key recomputed if an older lpbench kept it."""
    row = kept["row"]
    if kept.get("schema", 2) >= 3:
        return row
    from lpbench.config import run_key

    return {**row, "run_key": run_key(row["config"])}


def _schema_version(conn: sqlite3.Connection) -> int:
    row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    try:
        return int(row[0])
    except (TypeError, ValueError):
        raise sqlite3.DatabaseError(f"schema version {row[0] if row else None!r} is not a number") from None


def _kept_files(folder: Path, quiet: bool = False):
    """(path, parsed JSON) of each file in ``folder``; one that is not JSON is set aside (left as is if ``quiet``)."""
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            yield path, parse_json(path.read_bytes().decode("utf-8"), "")
        except (OSError, UnicodeDecodeError, UsageError) as exc:
            if not quiet and path.exists():
                _set_aside(path, str(exc).strip(": ") or "not JSON")


def _set_aside(path: Path, why: str) -> None:
    """Move a ``pending-runs/`` file that is not a kept run to ``pending-runs/rejected/``, saying so in one line."""
    dest = path.parent / "rejected" / path.name
    try:
        dest.parent.mkdir(exist_ok=True)
        os.replace(path, dest)
        where = f"moved to {dest}"
    except OSError:
        where = "left as is"
    _say(f"{path}: not a kept run ({why.splitlines()[0][:160]}); {where}")


def open_store(directory: str | Path, create: bool = True) -> ResultsStore | AsideStore | None:
    """The results database of ``directory`` for writing runs, or, where it cannot be written (locked past
    the wait, read-only, a path SQLite cannot open), an :class:`AsideStore` keeping them in ``PENDING_DIR``
    (one line says so). A file that is not a results database is a UsageError. ``create=False``: None
    where there is no database yet (and one could be made)."""
    path = Path(directory) / DB_NAME
    if not create and not path.exists() and len(os.fsencode(path.absolute())) <= SQLITE_MAX_PATH:
        return None
    try:
        return ResultsStore(directory)
    except StoreUnwritable as exc:
        _say(f"{exc}; runs will be kept in {Path(directory) / PENDING_DIR}")
        return AsideStore(directory, str(exc))


def keep_run(directory: Path, row: dict, steps: list[dict]) -> Path:
    """Write a run the database could not take to ``directory/PENDING_DIR`` (else the temp folder)."""
    text = strict_json({"schema": SCHEMA_VERSION, "row": row, "steps": _json_safe(steps)})
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}.json"
    error = None
    for folder in (Path(directory) / PENDING_DIR, Path(tempfile.gettempdir()) / f"lpbench-{PENDING_DIR}"):
        tmp = folder / f".{name}.tmp"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, folder / name)
            return folder / name
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            error = exc
    raise error


class AsideStore:
    """Stands in for a database that cannot even be opened: ``add_run`` keeps the run in ``PENDING_DIR``."""

    def __init__(self, directory: str | Path, reason: str):
        self.directory, self.reason = Path(directory), reason
        self.path = self.directory / DB_NAME
        self.kept: list[dict] = []

    def add_run(self, run: RunRecord) -> None:
        row = run_row(run)
        path = keep_run(self.directory, row, run.steps)
        self.kept.append(row)
        _say(
            f"{self.reason}; the run is kept in {path} and imported by the next lpbench command on this results folder"
        )

    def runs(self, where: str = "1", params: tuple = ()) -> list[dict]:
        return []

    def close(self) -> None:
        pass


class _Transaction:
    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    def __enter__(self):
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, exc_type, exc, tb):
        self.conn.execute("ROLLBACK" if exc_type else "COMMIT")
        return False
