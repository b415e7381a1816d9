"""``lpbench sweep SPEC.yaml``: a grid of runs, each in its own subprocess, resumable.

Spec (YAML mapping; README "Sweeps" has the full story):

* ``name`` (default: the file's stem) is the sweep id: a re-run with the same name resumes.
* ``timeout``: seconds per run (default 3600); ``--timeout`` overrides.
* every other key is a run setting: a RunConfig field (``model``, ``precision``, ``seq_len``,
  ``mbs``, ``gbs``, ``steps``, ``tp``, ``dp``, ``fsdp`` ...; dashes or underscores), or
  ``num_gpus`` (processes to launch, torchrun when > 1; DP = GPUs / TP), ``gpu`` (take
  unset seq_len/mbs/gbs/tp from the recommended configs of that GPU type). ``workload``
  (pretrain, sft, lora), the ``lora_*`` settings and ``hf_checkpoint`` (the run's model is then
  labelled ``hf:<folder>`` unless ``model`` is set) are RunConfig fields too. A scalar applies to
  every run; a list is an axis of the grid; a list of mappings is an axis whose points set
  several settings together (e.g. MBS/GBS pairs, or ``{workload: lora, lora_rank: 8}``).

Each run is ``python -m lpbench.bench.sweep --config JSON ...`` (this module's child entry
point) with a per-run timeout; the child trains and writes its row, and when it cannot (a
crash, a kill, a hang) the parent writes the row from the exit status, the last line of
stderr and the step records the child wrote as JSON lines (``NNN-<key>.steps.jsonl`` beside its
log; the human log lines are never parsed). Rows are keyed by (sweep id, ``RunConfig.key()``)
with a UNIQUE constraint, so resuming never duplicates a run and skips every run that has a
row, whatever its status.

Test-only hook: ``LPBENCH_FAULT`` (read by the child) injects a failure, see ``_install_fault``.
"""

from __future__ import annotations

import argparse
import itertools
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
from dataclasses import dataclass, field, fields
from pathlib import Path

from lpbench.errors import UsageError

DEFAULT_TIMEOUT_S = 3600.0
RESERVED = ("name", "timeout", "description")
RUN_ONLY = ("save_every", "save_dir", "load")  # RunConfig fields a sweep refuses: every run would share them
EXTRA_KEYS = ("num_gpus", "gpu")  # sweep settings that are not RunConfig fields
ALIASES = {"task": "workload", "models": "model", "precisions": "precision", "gpus": "num_gpus",
           "seq": "seq_len", "seq_length": "seq_len", "sequence_length": "seq_len"}
FAULT_ENV = "LPBENCH_FAULT"  # test-only: makes a child fail on purpose
PARENT_ENV = "LPBENCH_SWEEP_PARENT"  # the sweep's pid: a child whose sweep died kills itself
# Launcher variables the child must not inherit: each run's world is the one the sweep launches.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID")


# ----------------------------------------------------------------------------- the spec
@dataclass
class SweepRun:
    index: int  # 1-based position in the grid
    config: object  # RunConfig
    settings: dict  # the spec's settings for this run (after recommended defaults)
    workload: str = "pretrain"
    backend: str = "lpbench"
    num_gpus: int = 1
    recommended: str | None = None  # the recommended row used, described

    @property
    def key(self) -> str:
        return self.config.key()


@dataclass
class Sweep:
    name: str
    timeout: float
    runs: list[SweepRun]
    fixed: dict = field(default_factory=dict)
    varying: list[str] = field(default_factory=list)  # settings that differ between runs (labels)
    skipped: list[tuple[dict, str]] = field(default_factory=list)  # invalid combinations and why
    duplicates: int = 0  # grid points that are the same run as an earlier one

    def label(self, run: SweepRun) -> str:
        keys = self.varying or ["model", "precision"]
        return " ".join(f"{k}={run.settings.get(k, getattr(run.config, k, None))}" for k in keys)


def _norm_key(key, run_fields: dict | None = None) -> str:
    k = str(key).strip().replace("-", "_").lower()
    return k if run_fields and k in run_fields else ALIASES.get(k, k)


def _run_fields() -> dict:
    from lpbench.config import RunConfig

    return {f.name: f for f in fields(RunConfig)}


def _coerce(key: str, value, run_fields: dict):
    """A YAML value as the type of RunConfig's field (or of the sweep setting)."""
    if value is None:
        return None
    from lpbench.config import field_type

    kind = {"num_gpus": int, "gpu": str}.get(key) or field_type(run_fields[key])
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "yes", "on", "1"):
            return True
        if str(value).lower() in ("false", "no", "off", "0"):
            return False
    elif kind is int and not isinstance(value, bool):
        try:
            if float(value) == int(float(value)):
                return int(float(value))
        except (TypeError, ValueError):
            pass
    elif kind is float and not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    elif kind is str and not isinstance(value, (dict, list)):
        return str(value)
    raise UsageError(f"spec key {key}: expected {kind.__name__}, got {value!r}")


def load_spec(path: str | Path) -> dict:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no sweep spec at {path}")
    try:
        spec = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UsageError(f"{path} is not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(spec, dict) or not spec:
        raise UsageError(f"{path}: a sweep spec is a YAML mapping of settings (see README, Sweeps)")
    spec.setdefault("name", path.stem)
    return spec


def expand(spec: dict) -> Sweep:
    """The spec's grid as validated runs (invalid combinations are listed in ``skipped``)."""
    from lpbench.config import WORKLOADS, RunConfig
    from lpbench.models import get_model_config
    from lpbench.precision.recipes import get_recipe

    run_fields = _run_fields()
    valid = sorted(set(run_fields) - set(RUN_ONLY) | set(EXTRA_KEYS))
    spec = {_norm_key(k, run_fields): v for k, v in spec.items()}
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", str(spec.pop("name", "sweep"))).strip("-") or "sweep"
    timeout = spec_timeout = spec.pop("timeout", DEFAULT_TIMEOUT_S)
    spec.pop("description", None)
    try:
        timeout = float(timeout)
    except (TypeError, ValueError):
        timeout = -1.0
    if not timeout > 0:
        raise UsageError(f"spec key timeout: expected seconds > 0, got {spec_timeout!r}")

    fixed: dict = {}
    axes: list[list[dict]] = []
    owner: dict[str, str] = {}  # setting -> the spec key that sets it

    def claim(setting: str, by: str) -> None:
        if setting in RUN_ONLY:
            raise UsageError(f"spec key {setting}: checkpoints belong to one run (lpbench run --save-dir/--load), "
                             "not to a sweep")
        if setting not in valid:
            raise UsageError(f"unknown spec key {setting!r}; valid: {', '.join(RESERVED + tuple(valid))}")
        if setting in owner:
            raise UsageError(f"spec sets {setting} twice (in {owner[setting]!r} and {by!r})")
        owner[setting] = by

    for key, value in spec.items():
        if isinstance(value, str) and key in ("model", "precision") and "," in value:
            value = [v.strip() for v in value.split(",") if v.strip()]  # like --precision a,b
        if isinstance(value, list):
            if not value:
                raise UsageError(f"spec key {key}: an empty list gives no runs")
            if all(isinstance(v, dict) for v in value):  # settings swept together
                points = [{_norm_key(k, run_fields): v for k, v in point.items()} for point in value]
                for setting in dict.fromkeys(k for p in points for k in p):
                    claim(setting, key)
                axes.append([{k: _coerce(k, v, run_fields) for k, v in p.items()} for p in points])
            elif any(isinstance(v, (dict, list)) for v in value):
                raise UsageError(f"spec key {key}: a list of values or a list of mappings, not a mix")
            else:
                claim(key, key)
                axes.append([{key: _coerce(key, v, run_fields)} for v in value])
        elif isinstance(value, dict):
            raise UsageError(f"spec key {key}: a mapping must be inside a list (a list of mappings is "
                             "an axis whose points set several settings together)")
        else:
            claim(key, key)
            fixed[key] = _coerce(key, value, run_fields)

    # Names are checked across the whole spec: a typo is an error, not a skipped run.
    def values(k: str) -> set:
        return {p[k] for axis in axes for p in axis if k in p} | ({fixed[k]} if k in fixed else set())

    for m in values("model"):
        get_model_config(m)
    for p in values("precision"):
        get_recipe(p)
    for w in values("workload"):
        if w not in WORKLOADS:
            raise UsageError(f"unknown workload {w!r}; valid: {', '.join(WORKLOADS)}")

    sweep = Sweep(name=name, timeout=timeout, runs=[], fixed=fixed)
    seen: set[str] = set()
    for combo in itertools.product(*axes) if axes else [()]:
        settings = dict(fixed)
        for point in combo:
            settings.update(point)
        try:
            run = _make_run(settings, run_fields, RunConfig)
        except UsageError as exc:
            sweep.skipped.append((settings, str(exc)))
            continue
        if run.key in seen:
            sweep.duplicates += 1
            continue
        seen.add(run.key)
        run.index = len(sweep.runs) + 1
        sweep.runs.append(run)
    if not sweep.runs:
        reasons = "; ".join(sorted({why for _, why in sweep.skipped}))
        raise UsageError(f"the sweep has no valid run ({reasons})")
    keys = list(dict.fromkeys(k for r in sweep.runs for k in r.settings))
    sweep.varying = [k for k in keys if len({json.dumps(r.settings.get(k)) for r in sweep.runs}) > 1]
    sweep.fixed = {k: sweep.runs[0].settings.get(k) for k in keys if k not in sweep.varying}
    return sweep


def _make_run(settings: dict, run_fields: dict, RunConfig) -> SweepRun:
    from lpbench.train.checkpoint import validated

    settings = dict(settings)
    kwargs = {k: v for k, v in settings.items() if k in run_fields}
    if kwargs.get("hf_checkpoint") and "model" not in kwargs:
        from lpbench.models.hf import hf_label

        kwargs["model"] = hf_label(kwargs["hf_checkpoint"])
    rec_text = None
    if settings.get("gpu"):
        from lpbench.bench.recommended import lookup, run_defaults

        rec = lookup(settings.get("model", RunConfig().model), settings["gpu"], settings.get("num_gpus"),
                     task=settings.get("workload", "pretrain"))
        for k, v in run_defaults(rec).items():
            if k not in kwargs:
                kwargs[k] = settings[k] = v
        settings.setdefault("num_gpus", rec.num_gpus)
        rec_text = rec.describe()
    cfg = RunConfig(**kwargs)
    num_gpus = settings.get("num_gpus")
    if num_gpus is not None:
        if num_gpus <= 0:
            raise UsageError(f"num_gpus must be positive, got {num_gpus}")
        cfg = cfg.with_world(num_gpus, dp=kwargs.get("dp"))
    validated(cfg)
    return SweepRun(index=0, config=cfg, settings=settings, workload=cfg.workload, backend=cfg.backend,
                    num_gpus=cfg.world_size, recommended=rec_text)


# ----------------------------------------------------------------------------- the parent
def child_command(run: SweepRun, results: Path, sweep_id: str, steps_file: Path | None = None) -> list[str]:
    args = ["-m", "lpbench.bench.sweep", "--results", str(results), "--sweep-id", sweep_id,
            "--run-key", run.key, "--workload", run.workload, "--backend", run.backend,
            "--config", json.dumps(run.config.to_dict(), sort_keys=True)]
    if steps_file is not None:
        args += ["--steps-file", str(steps_file)]
    if run.num_gpus > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={run.num_gpus}", *args]
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
        except json.JSONDecodeError:
            continue
        steps[rec["step"]] = rec
    return [steps[k] for k in sorted(steps)]


def classify(returncode: int | None, timed_out: bool, timeout: float, stderr: str,
             steps: list[dict]) -> tuple[str, str]:
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


def _gpu_name(device: str) -> str | None:
    """This machine's GPU name without initialising CUDA in the sweep process."""
    if device == "cpu":
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _parent_env(run: SweepRun) -> dict:
    import lpbench

    return {"lpbench": lpbench.__version__, "python": platform.python_version(), "host": platform.node(),
            "gpu": _gpu_name(run.config.device), "recorded_by": "sweep parent (the run left no row)"}


def _record_failure(store, run: SweepRun, sweep_id: str, rc, timed_out: bool, timeout: float,
                    out_path: Path, err_path: Path, steps_path: Path) -> None:
    from lpbench.bench.runner import record
    from lpbench.train.loop import RunResult

    err = err_path.read_text(errors="replace") if err_path.exists() else ""
    steps = read_steps(steps_path)
    status, message = classify(rc, timed_out, timeout, err, steps)
    metrics = {"recorded_by": "sweep", "logged_steps": len(steps), "num_gpus": run.num_gpus,
               "exit_code": rc, "log": str(out_path)}
    if steps:
        metrics["final_loss"] = steps[-1].get("loss")
        if status == "diverged":
            metrics["diverged_step"] = next(s["step"] for s in steps if s.get("loss") is None
                                            or not math.isfinite(s["loss"]))
    record(store, RunResult(config=run.config, status=status, error=message, metrics=metrics, steps=steps,
                            env=_parent_env(run)), group_id=sweep_id, sweep_id=sweep_id, workload=run.workload)


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
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(child_command(run, results, sweep_id, steps_path), stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.returncode
        except BaseException:  # Ctrl-C / SIGTERM of the sweep: leave no run behind
            _kill_group(proc)
            raise
    row = store.sweep_run(sweep_id, run.key)
    if row is None:
        _record_failure(store, run, sweep_id, rc, timed_out, timeout, out_path, err_path, steps_path)
        row = store.sweep_run(sweep_id, run.key)
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


def run_sweep(spec_path: str, results: str = "lpbench-results", dry_run: bool = False,
              timeout: float | None = None, resume: bool = True, name: str | None = None,
              console=None) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    from rich.table import Table

    from lpbench.bench.store import ResultsStore
    from lpbench.report.tables import summary_rows, to_rich

    console = console or Console()
    spec = load_spec(spec_path)
    if name:
        spec["name"] = name
    sweep = expand(spec)
    if timeout is not None:
        if timeout <= 0:
            raise UsageError(f"--timeout must be positive, got {timeout:g}")
        sweep.timeout = timeout
    sweep_id = sweep.name if resume else f"{sweep.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    results_dir = Path(results)

    done: set[str] = set()
    store = None
    if (results_dir / "results.db").exists() or not dry_run:
        store = ResultsStore(results_dir)
        done = store.finished_keys(sweep_id) if resume else set()
    pending = [r for r in sweep.runs if r.key not in done]

    fixed = ", ".join(f"{k}={v}" for k, v in sweep.fixed.items())
    console.print(f"sweep [bold]{sweep_id}[/]: {len(sweep.runs)} runs ({len(sweep.runs) - len(pending)} done, "
                  f"{len(pending)} to run), timeout {sweep.timeout:g} s per run"
                  + (f"; fixed: {escape(fixed)}" if fixed else ""))
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
            state = "done" if r.key in done else "to run"
            table.add_row(str(r.index), *(str(r.settings.get(c, getattr(r.config, c, ""))) for c in cols),
                          str(r.num_gpus), r.key, state)
        console.print(table)
        recs = sorted({r.recommended for r in sweep.runs if r.recommended})
        for text in recs:
            console.print(f"recommended config: {escape(text)}")
        return 0

    if done:
        here = _gpu_name("auto") if any(r.config.device != "cpu" for r in sweep.runs) else None
        there = {r.get("gpu") for r in store.runs("sweep_id = ?", (sweep_id,))}
        if there != {here}:
            console.print(f"[yellow]resuming sweep {sweep_id}: its finished runs were measured on "
                          f"{', '.join(sorted(str(g or 'cpu') for g in there))}, this machine has {here or 'cpu'}; "
                          "use --no-resume (or --name) to measure them here too[/]")

    log_dir = results_dir / "sweeps" / sweep_id
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if main_thread else None  # e.g. scancel
    try:
        with Progress(SpinnerColumn(), TextColumn("[bold]{task.fields[sweep]}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("elapsed"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                      TextColumn("{task.description}"), console=console) as progress:
            task = progress.add_task("", total=len(pending), sweep=sweep_id)
            for i, run in enumerate(pending, start=1):
                label = sweep.label(run)
                progress.update(task, description=f"run {run.index}/{len(sweep.runs)}: {escape(label)}")
                t0 = time.time()
                row = execute(run, store, results_dir, sweep_id, sweep.timeout, log_dir)
                progress.console.print(f"\\[{run.index}/{len(sweep.runs)}] {escape(label)}: {_status_text(row)} "
                                       f"({time.time() - t0:.1f} s)")
                progress.advance(task)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

    keys = {r.key for r in sweep.runs}
    rows = [r for r in store.runs("sweep_id = ?", (sweep_id,)) if r["run_key"] in keys]
    console.print(to_rich(summary_rows(rows), title=f"lpbench sweep {sweep_id} -> {store.path}"))
    console.print(f"logs: {log_dir}   report: lpbench report --results {results_dir} --group {sweep_id}")
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        console.print(f"[red]{len(failed)} of {len(rows)} runs did not finish ok[/]")
    return 0 if not failed and len(rows) == len(keys) else 1


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def add_parser(sub) -> None:
    """``lpbench sweep`` on the CLI's subparsers."""
    p = sub.add_parser("sweep", help="run a grid of configs from a YAML spec, one subprocess per run, resumable",
                       description="Run the grid a YAML spec describes (models x precisions x seq lens x batch "
                                   "sizes x parallel sizes x GPU counts): each run in its own subprocess with a "
                                   "timeout, each recorded with its status (ok, oom, diverged, timeout, error). "
                                   "A re-run of the same spec resumes: finished runs are skipped. Exit code 0 "
                                   "when every run is ok, 1 otherwise.")
    p.add_argument("spec", help="sweep spec (YAML); see README, Sweeps, and examples/sweep-cpu.yaml")
    p.add_argument("--results", default="lpbench-results", help="results folder (default ./lpbench-results)")
    p.add_argument("--dry-run", action="store_true", help="list the runs (and which are done) without running")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"seconds per run before it is killed and recorded as timeout "
                        f"(default: the spec's timeout, else {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="skip runs this sweep already recorded (default); --no-resume starts a new sweep id "
                        "(name-YYYYmmdd-HHMMSS) that measures everything again")
    p.add_argument("--name", default=None, help="sweep id (default: the spec's name, else its file name)")
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(args) -> int:
    from lpbench.console import console

    return run_sweep(args.spec, results=args.results, dry_run=args.dry_run, timeout=args.timeout,
                     resume=args.resume, name=args.name, console=console)


# ----------------------------------------------------------------------------- the child
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie is dead
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def _watch_parent() -> None:
    """Die with the sweep: a killed sweep must not leave runs training behind it."""
    pid = os.environ.get(PARENT_ENV)
    if not pid:
        return

    def watch():
        while _alive(int(pid)):
            time.sleep(0.5)
        if os.getpgrp() == os.getsid(0):  # the session the sweep made for this run: take it all down
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(137)

    threading.Thread(target=watch, name="lpbench-sweep-watchdog", daemon=True).start()


def _install_fault(cfg) -> str | None:
    """TEST-ONLY failure injection, from ``LPBENCH_FAULT`` (never set it for real runs).

    ``LPBENCH_FAULT="[FIELD=VALUE[,FIELD=VALUE]:]KIND[@STEP][;...]"``: the first entry whose
    conditions match this run's RunConfig applies. KIND at optimizer step STEP (default 1):
    ``diverge`` (the loss becomes NaN), ``error`` (an exception), ``oom`` (a CUDA
    OutOfMemoryError the loop catches), ``oom-exit`` (an OOM message, then the process exits
    without a row), ``crash`` (SIGKILL itself), ``hang`` (sleep forever). Implemented with
    global module hooks, so the training loop has no test code in it.
    """
    text = os.environ.get(FAULT_ENV, "").strip()
    if not text:
        return None
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        cond, _, action = entry.rpartition(":")
        pairs = [c.split("=", 1) for c in cond.split(",") if c.strip()]
        if any(len(p) != 2 for p in pairs):
            raise RuntimeError(f"{FAULT_ENV}: bad condition in {entry!r}")
        if all(str(getattr(cfg, k.strip(), None)) == v.strip() for k, v in pairs):
            kind, _, at = action.partition("@")
            _hook_fault(kind.strip(), int(at or 1), cfg.grad_accum)
            return entry
    return None


def _hook_fault(kind: str, at_step: int, grad_accum: int) -> None:
    import torch
    from torch.nn.modules import module as nn_module

    if kind not in ("diverge", "error", "oom", "oom-exit", "crash", "hang"):
        raise RuntimeError(f"{FAULT_ENV}: unknown fault {kind!r}")
    state = {"depth": 0, "calls": 0}

    def pre(mod, args):
        state["depth"] += 1

    def post(mod, args, out):
        state["depth"] -= 1
        if state["depth"]:
            return None  # an inner module: only the model's own forward (one per micro-batch) counts
        state["calls"] += 1
        step = (state["calls"] - 1) // grad_accum + 1
        if step < at_step:
            return None
        if kind == "diverge":
            return out * float("nan")
        if kind == "error":
            raise RuntimeError(f"{FAULT_ENV}: injected error at step {step}")
        if kind == "oom":
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 1.00 GiB ({FAULT_ENV} at step {step})")
        if kind == "oom-exit":
            print(f"torch.OutOfMemoryError: CUDA out of memory ({FAULT_ENV} at step {step})", file=sys.stderr,
                  flush=True)
            os._exit(1)
        if kind == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang
            time.sleep(3600)

    nn_module.register_module_forward_pre_hook(pre)
    nn_module.register_module_forward_hook(post)


def child_main(argv: list[str] | None = None) -> int:
    """One run of a sweep: train the config, write its row (rank 0). Internal entry point."""
    ap = argparse.ArgumentParser(prog="python -m lpbench.bench.sweep",
                                 description="internal: one run of `lpbench sweep` (use `lpbench sweep`)")
    ap.add_argument("--config", required=True, help="RunConfig as JSON")
    ap.add_argument("--results", required=True)
    ap.add_argument("--sweep-id", required=True)
    ap.add_argument("--run-key", required=True)
    ap.add_argument("--workload", default="pretrain")
    ap.add_argument("--backend", default="lpbench")
    ap.add_argument("--steps-file", default=None, help="append each step's record here (JSON lines)")
    args = ap.parse_args(argv)
    _watch_parent()

    from lpbench.bench import runner
    from lpbench.bench.store import ResultsStore
    from lpbench.config import RunConfig

    cfg = RunConfig(**json.loads(args.config))
    if cfg.key() != args.run_key:
        print(f"lpbench sweep: run key mismatch ({cfg.key()} != {args.run_key}): different lpbench versions?",
              file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    steps_file = open(args.steps_file, "a") if args.steps_file and rank == 0 else None

    def on_step(rec: dict) -> None:  # the parent reads them if this process dies before its row
        steps_file.write(json.dumps(rec) + "\n")
        steps_file.flush()

    _install_fault(cfg)
    result = runner.execute(cfg, results_dir=args.results, on_step=on_step if steps_file else None,
                            record_usage_errors=True)
    if result.status == "diverged" and result.steps:
        result.metrics["diverged_step"] = result.steps[-1]["step"]
    if rank == 0:
        store = ResultsStore(args.results)
        env = result.env or {"lpbench": __import__("lpbench").__version__, "host": platform.node(),
                             "gpu": _gpu_name(cfg.device)}  # a failed run is reported with the machine's GPU
        runner.record(store, result, group_id=args.sweep_id, sweep_id=args.sweep_id, env=env)
        store.close()
    return 0 if result.status == "ok" else 1


if __name__ == "__main__":
    sys.exit(child_main())
