"""Progress of a command that trains several runs in one process (``lpbench run``, ``converge``).

A rich progress display (as ``lpbench sweep``'s) with elapsed time and ETA for the current run
and for the whole command, counted in optimizer steps; the step log lines print above it. Each
finished run also prints one plain line with the same times, which stays readable in a log file
where no live display is drawn.
"""

from __future__ import annotations

import shlex
import time

from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)


def next_command(results: str, group: str) -> str:
    """The line that ends ``run`` and ``converge``: how to see these runs in the report."""
    return f"next: lpbench report --results {shlex.quote(str(results))} --group {group} --html report.html"


def clock(seconds: float) -> str:
    """``h:mm:ss``."""
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class RunsProgress:
    """``with RunsProgress(console, [(label, steps), ...]) as p: p.start(i); p.step(rec); p.finish(i, status)``."""

    def __init__(self, console: Console, runs: list[tuple[str, int]], enabled: bool = True):
        self.console, self.runs, self.enabled = console, runs, enabled
        self.total_steps = sum(steps for _, steps in runs)
        self.done_steps = 0  # of finished runs, counted as planned (a diverged run's rest is skipped)
        self.t0 = time.monotonic()
        self.run_t0 = self.t0
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("steps  elapsed"), TimeElapsedColumn(),
                                 TextColumn("ETA"), TimeRemainingColumn(), console=console,
                                 refresh_per_second=2)  # redraws share the CPU with the timed steps
        self.overall = self.current = None

    def __enter__(self) -> "RunsProgress":
        if self.enabled:
            self.progress.start()
            self.overall = self.progress.add_task(f"all {len(self.runs)} runs", total=self.total_steps)
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.progress.stop()

    def start(self, index: int) -> None:
        """Run ``index`` (0-based) begins."""
        self.run_t0 = time.monotonic()
        label, steps = self.runs[index]
        if self.enabled:
            if self.current is not None:
                self.progress.remove_task(self.current)
            self.current = self.progress.add_task(f"run {index + 1}/{len(self.runs)}: {escape(label)}", total=steps)

    def step(self, rec: dict) -> None:
        """Step ``rec["step"]`` of the current run is done (a resumed run starts past 1)."""
        if self.enabled:
            self.progress.update(self.current, completed=rec["step"])
            self.progress.update(self.overall, completed=self.done_steps + rec["step"])

    def finish(self, index: int, status: str) -> str:
        """Run ``index`` ended with ``status``: print and return its line (its time, the command's, the ETA)."""
        label, steps = self.runs[index]
        self.done_steps += steps
        if self.enabled:
            self.progress.update(self.overall, completed=self.done_steps)
        now = time.monotonic()
        elapsed, left = now - self.t0, self.total_steps - self.done_steps
        eta = elapsed / self.done_steps * left if self.done_steps else 0.0
        line = (f"lpbench: run {index + 1}/{len(self.runs)} {label}: {status} in {clock(now - self.run_t0)} | "
                f"elapsed {clock(elapsed)} | " + (f"ETA {clock(eta)} for {len(self.runs) - index - 1} more run(s)"
                                                  if left else "all runs done"))
        self.console.print(escape(line), highlight=False, soft_wrap=True)
        return line
