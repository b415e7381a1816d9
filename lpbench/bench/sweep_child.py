"""One run of a sweep, in its own process: ``python -m lpbench.bench.sweep_child --config JSON ...``.

Internal entry point of :mod:`lpbench.bench.sweep`: trains the config through the runner, writes
its row (rank 0) and each step's record as a JSON line (``--steps-file``) for the parent, and
dies with the sweep (a watchdog on the parent's pid).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time

PARENT_ENV = "LPBENCH_SWEEP_PARENT"  # the sweep's pid: a child whose sweep died kills itself


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


def _gpu_name(device: str) -> str | None:
    """This machine's GPU name without initialising CUDA in the sweep process."""
    if device == "cpu":
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def child_main(argv: list[str] | None = None) -> int:
    """One run of a sweep: train the config, write its row (rank 0). Internal entry point."""
    ap = argparse.ArgumentParser(
        prog="python -m lpbench.bench.sweep_child",
        description="internal: one run of `lpbench sweep` (use `lpbench sweep`)",
    )
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
    from lpbench.bench.store import AsideStore, open_store
    from lpbench.errors import UsageError
    from lpbench.config import RunConfig
    from lpbench.parallel.env import detect_world

    cfg = RunConfig(**json.loads(args.config))
    if cfg.key() != args.run_key:
        print(
            f"lpbench sweep: run key mismatch ({cfg.key()} != {args.run_key}): different lpbench versions?",
            file=sys.stderr,
        )
        return 2
    rank = detect_world().rank
    steps_file = open(args.steps_file, "a") if args.steps_file and rank == 0 else None

    def on_step(rec: dict) -> None:  # the parent reads them if this process dies before its row
        steps_file.write(json.dumps(rec) + "\n")
        steps_file.flush()

    result = runner.execute(
        cfg, results_dir=args.results, on_step=on_step if steps_file else None, record_usage_errors=True
    )
    if result.status == "diverged" and result.steps:
        result.metrics["diverged_step"] = result.steps[-1]["step"]
    if rank == 0:
        try:
            store = open_store(args.results)  # retries, and keeps the run aside if a write still fails
        except UsageError as exc:  # not even a results database: the run is kept aside
            store = AsideStore(args.results, str(exc))
        env = result.env or {
            "lpbench": __import__("lpbench").__version__,
            "host": platform.node(),
            "gpu": _gpu_name(cfg.device),
        }  # a failed run is reported with the machine's GPU
        runner.record(store, result, group_id=args.sweep_id, sweep_id=args.sweep_id, env=env)
        store.close()
    return 0 if result.status == "ok" else 1


if __name__ == "__main__":
    sys.exit(child_main())
