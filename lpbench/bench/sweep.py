"""``lpbench sweep SPEC.yaml``: a grid of runs, each in its own subprocess, resumable.

The spec and its grid: :mod:`lpbench.bench.sweep_spec`. Each run is ``python -m
lpbench.bench.sweep_child --config JSON ...`` (:mod:`lpbench.bench.sweep_child`) with a per-run
timeout; the child trains and writes its row, and when it cannot (a crash, a kill, a hang) this
supervisor writes the row from the exit status, the last line of stderr and the step records the
child wrote as JSON lines (``NNN-<key>.steps.jsonl`` beside its log; the human log lines are never
parsed). Rows are keyed by (sweep id, ``RunConfig.key()``) with a UNIQUE constraint, so resuming
never duplicates a run and skips every run that has a row, whatever its status.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from lpbench.bench.sweep_child import PARENT_ENV, _gpu_name
from lpbench.bench.sweep_spec import DEFAULT_TIMEOUT_S, SweepRun, expand, load_spec
from lpbench.errors import UsageError, raise_terminated
from lpbench.paths import check_dir

# Launcher variables the child must not inherit: each run's world is the one the sweep launches.
_LAUNCH_VARS = (
    *("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"),
    *("TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"),
)


def child_command(run: SweepRun, results: Path, sweep_id: str, steps_file: Path | None = None) -> list[str]:
    args = ["-m", "lpbench.bench.sweep_child", "--results", str(results), "--sweep-id", sweep_id, "--run-key", run.key]
    args += ["--workload", run.workload, "--backend", run.backend]
    args += ["--config", json.dumps(run.config.to_dict(), sort_keys=True)]
    if steps_file is not None:
        args += ["--steps-file", str(steps_file)]
    if run.num_gpus > 1:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={run.num_gpus}",
            *args,
        ]
    return [sys.executable, *args]


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the run's process group, SIGKILL what is left after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # stragglers of the group (torchrun workers) once the leader is gone
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)\b(:|$)")
_OOM = re.compile(r"out ?of ?memory|OutOfMemoryError", re.IGNORECASE)


def error_line(stderr: str) -> str | None:
    """The message a failed child left: its last exception line, else its last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if _EXC_LINE.match(ln) and "ChildFailedError" not in ln:
            return ln
    return lines[-1] if lines else None


def read_steps(path: Path) -> list[dict]:
    """The step records a child wrote (JSON lines; a line a killed child left half-written is skipped)."""
    steps: dict[int, dict] = {}
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            steps[rec["step"]] = rec
    return [steps[k] for k in sorted(steps)]


def classify(
    returncode: int | None, timed_out: bool, timeout: float, stderr: str, steps: list[dict]
) -> tuple[str, str]:
    """Status and message of a child that left no row."""
    last = f"; last logged step {steps[-1]['step']}" if steps else "; no step logged"
    if timed_out:
        return "timeout", f"no result within {timeout:g} s, killed{last}"
    bad = next((s for s in steps if s.get("loss") is not None and not math.isfinite(s["loss"])), None)
    if bad:
        return "diverged", f"loss became {bad['loss']} at step {bad['step']}"
    message = error_line(stderr)
    if _OOM.search(stderr):
        oom = next((ln.strip() for ln in reversed(stderr.splitlines()) if _OOM.search(ln)), message)
        return "oom", oom
    if returncode is not None and returncode < 0:
        try:
            sig = signal.Signals(-returncode).name
        except ValueError:
            sig = f"signal {-returncode}"
        return "error", f"killed by {sig}" + (f": {message}" if message else "") + last
    return "error", message or f"exited with code {returncode} without a result"


def _parent_env(run: SweepRun) -> dict:
    import lpbench

    return {
        "lpbench": lpbench.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "gpu": _gpu_name(run.config.device),
        "recorded_by": "sweep parent (the run left no row)",
    }


def _record_failure(store, run: SweepRun, sweep_id: str, rc, timed_out: bool, timeout: float, paths) -> None:
    """Record the run from its exit status, its stderr and its step records (``paths``: log, stderr, steps)."""
    from lpbench.bench.runner import record
    from lpbench.train.loop import RunResult

    out_path, err_path, steps_path = paths
    err = err_path.read_text(errors="replace") if err_path.exists() else ""
    steps = read_steps(steps_path)
    status, message = classify(rc, timed_out, timeout, err, steps)
    metrics = dict(recorded_by="sweep", logged_steps=len(steps), num_gpus=run.num_gpus, exit_code=rc, log=str(out_path))
    if steps:
        metrics["final_loss"] = steps[-1].get("loss")
        if status == "diverged":
            metrics["diverged_step"] = next(
                s["step"] for s in steps if s.get("loss") is None or not math.isfinite(s["loss"])
            )
    result = RunResult(
        config=run.config, status=status, error=message, metrics=metrics, steps=steps, env=_parent_env(run)
    )
    record(store, result, group_id=sweep_id, sweep_id=sweep_id, workload=run.workload)


def execute(run: SweepRun, store, results: Path, sweep_id: str, timeout: float, log_dir: Path) -> dict:
    """Run one config in a subprocess; returns its row (written by the child, or here)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path = log_dir / f"{run.index:03d}-{run.key}.log"
    err_path = log_dir / f"{run.index:03d}-{run.key}.err"
    steps_path = log_dir / f"{run.index:03d}-{run.key}.steps.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update({PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"})
    if run.num_gpus > 1:  # the same launch environment as `lpbench run --nproc-per-node` (NVLink multicast off)
        from lpbench.parallel.launch import launch_env

        env = launch_env(env)
    rc, timed_out = None, False
    steps_path.write_bytes(b"")  # this attempt's steps only: a killed earlier attempt's are not this run's
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        cmd = child_command(run, results, sweep_id, steps_path)
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.returncode
        except BaseException:  # Ctrl-C / SIGTERM of the sweep: leave no run behind
            _kill_group(proc)
            raise
    row = store.sweep_run(sweep_id, run.key) or store.kept_run(sweep_id, run.key)  # the child's, if it wrote one
    if row is None:
        _record_failure(store, run, sweep_id, rc, timed_out, timeout, (out_path, err_path, steps_path))
        row = store.sweep_run(sweep_id, run.key) or store.kept_run(sweep_id, run.key)
    return row


def _status_text(row: dict) -> str:
    """A run's outcome as rich markup (the error text escaped)."""
    from rich.markup import escape

    colour = {"ok": "green", "oom": "magenta", "diverged": "yellow", "timeout": "red", "error": "red"}
    s = row["status"]
    text = f"[{colour.get(s, 'red')}]{s}[/]"
    if s == "ok" and row.get("tokens_per_sec_per_gpu"):
        text += f" {row['tokens_per_sec_per_gpu']:,.0f} tokens/s/GPU"
    elif row.get("error"):
        text += f": {escape(row['error'])}"
    return text


def run_sweep(
    spec_path: str,
    results: str = "lpbench-results",
    dry_run: bool = False,
    timeout: float | None = None,
    resume: bool = True,
    name: str | None = None,
    console=None,
) -> int:
    from rich.markup import escape
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.table import Table
    from rich.text import Text

    from lpbench.bench.store import ResultsStore
    from lpbench.report.tables import summary_rows, to_rich

    from lpbench.console import console as shared

    console = console or shared  # the table is fitted to the console it is printed on
    spec = load_spec(spec_path)
    if name:
        spec["name"] = name
    sweep = expand(spec)
    if timeout is not None:
        if not (math.isfinite(timeout) and timeout > 0):
            raise UsageError(f"--timeout must be a positive number of seconds, got {timeout:g}")
        sweep.timeout = timeout
    sweep_id = sweep.name if resume else f"{sweep.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    results_dir = check_dir(results, "--results")

    done: set[str] = set()
    store = None
    if (results_dir / "results.db").exists() or not dry_run:
        store = ResultsStore(results_dir)
        done = store.finished_keys(sweep_id) if resume else set()
    pending = [r for r in sweep.runs if r.key not in done]

    fixed = ", ".join(f"{k}={v}" for k, v in sweep.fixed.items())
    console.print(
        f"sweep [bold]{sweep_id}[/]: {len(sweep.runs)} runs ({len(sweep.runs) - len(pending)} done, "
        f"{len(pending)} to run), timeout {sweep.timeout:g} s per run" + (f"; fixed: {escape(fixed)}" if fixed else "")
    )
    for settings, why in sweep.skipped:
        shown = " ".join(f"{k}={settings[k]}" for k in sweep.varying if k in settings) or escape(str(settings))
        console.print(f"[yellow]skipped (invalid combination): {escape(shown)}: {escape(why)}[/]")
    if sweep.duplicates:
        console.print(f"[yellow]{sweep.duplicates} grid points repeat an earlier run and are run once[/]")

    if dry_run:
        table = Table(title=f"lpbench sweep {sweep_id} (dry run)")
        cols = [c for c in sweep.varying if c != "num_gpus"] or ["model", "precision"]
        for c in ["#", *cols, "GPUs", "run key", "state"]:
            table.add_column(c)
        for r in sweep.runs:
            values = (Text(str(r.settings.get(c, getattr(r.config, c, "")))) for c in cols)
            table.add_row(str(r.index), *values, str(r.num_gpus), r.key, "done" if r.key in done else "to run")
        console.print(table)
        recs = sorted({r.recommended for r in sweep.runs if r.recommended})
        for text in recs:
            console.print(f"recommended config: {escape(text)}")
        return 0

    if done:
        here = _gpu_name("auto") if any(r.config.device != "cpu" for r in sweep.runs) else None
        there = {r.get("gpu") for r in store.runs("sweep_id = ?", (sweep_id,))}
        if there != {here}:
            console.print(
                f"[yellow]resuming sweep {sweep_id}: its finished runs were measured on "
                f"{escape(', '.join(sorted(str(g or 'cpu') for g in there)))}, this machine has "
                f"{escape(here or 'cpu')}; "
                "use --no-resume (or --name) to measure them here too[/]"
            )

    log_dir = results_dir / "sweeps" / sweep_id
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, raise_terminated) if main_thread else None  # e.g. scancel
    if not pending:
        console.print(
            f"nothing to run: all {len(sweep.runs)} runs of {sweep_id} are recorded (--no-resume measures them again)"
        )
    try:
        with Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.fields[sweep]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("elapsed"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
            console=console,
            disable=not pending,
        ) as progress:
            task = progress.add_task("", total=len(pending), sweep=sweep_id)
            for i, run in enumerate(pending, start=1):
                label = sweep.label(run)
                progress.update(task, description=f"run {run.index}/{len(sweep.runs)}: {escape(label)}")
                t0 = time.time()
                row = execute(run, store, results_dir, sweep_id, sweep.timeout, log_dir)
                progress.console.print(
                    f"\\[{run.index}/{len(sweep.runs)}] {escape(label)}: {_status_text(row)} ({time.time() - t0:.1f} s)"
                )
                progress.advance(task)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

    keys = {r.key for r in sweep.runs}
    rows = [r for r in store.runs("sweep_id = ?", (sweep_id,)) if r["run_key"] in keys]
    console.print(to_rich(summary_rows(rows), title=f"lpbench sweep {sweep_id} -> {store.path}", width=console.width))
    console.print(escape(f"logs: {log_dir}   report: lpbench report --results {results_dir} --group {sweep_id}"))
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        console.print(f"[red]{len(failed)} of {len(rows)} runs did not finish ok[/]")
    return 0 if not failed and len(rows) == len(keys) else 1


def add_parser(sub) -> None:
    """``lpbench sweep`` on the CLI's subparsers."""
    p = sub.add_parser(
        "sweep",
        help="run a grid of configs from a YAML spec, one subprocess per run, resumable",
        description="Run the grid a YAML spec describes (models x precisions x seq lens x batch "
        "sizes x parallel sizes x GPU counts): each run in its own subprocess with a "
        "timeout, each recorded with its status (ok, oom, diverged, timeout, error). "
        "A re-run of the same spec resumes: finished runs are skipped. Exit code 0 "
        "when every run is ok, 1 otherwise.",
    )
    p.add_argument("spec", help="sweep spec (YAML); see README, Sweeps, and examples/sweep-cpu.yaml")
    p.add_argument("--results", default="lpbench-results", help="results folder (default ./lpbench-results)")
    p.add_argument("--dry-run", action="store_true", help="list the runs (and which are done) without running")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"seconds per run before it is killed and recorded as timeout "
        f"(default: the spec's timeout, else {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="skip runs this sweep already recorded (default); --no-resume starts a new sweep id "
        "(name-YYYYmmdd-HHMMSS) that measures everything again",
    )
    p.add_argument("--name", default=None, help="sweep id (default: the spec's name, else its file name)")
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(args) -> int:
    from lpbench.console import console

    return run_sweep(args.spec, args.results, args.dry_run, args.timeout, args.resume, args.name, console)
