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
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


def next_command(results: str, group: str) -> str:
    """The line that ends ``run`` and ``converge``: how to see these runs in the report."""
    return f"next: lpbench report --results {shlex.quote(str(results))} --group {group} --html report.html"


def clock(seconds: float) -> str:
    """``h:mm:ss``."""
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


EMULATED_STEP_COST = {"tensor": 3.0, "delayed": 3.0, "row": 3.0, "block": 4.0, "mx": 4.0, "nvfp4": 5.0}
"""How many times BF16's step time an emulated recipe's step is expected to take, by scaling kind, until
the recipe's own steps are measured: the quantizers run as many elementwise passes over every operand."""


def step_cost(precision: str, emulated: bool) -> float:
    """A run's expected step time relative to BF16's on the same work (1 native, EMULATED_STEP_COST emulated)."""
    from lpbench.precision.recipes import get_recipe

    recipe = get_recipe(precision)
    if not recipe.quantized or not emulated:
        return 1.0
    return EMULATED_STEP_COST.get(recipe.scaling.value, 4.0)


def step_costs(configs) -> list[float]:
    """``step_cost`` of each config on the device it will run on (CPU, or the GPU when one is visible)."""
    import torch

    from lpbench.precision.capability import emulation_reason
    from lpbench.precision.recipes import get_recipe

    def emulated(cfg) -> bool:
        device = "cuda" if torch.cuda.is_available() and cfg.device != "cpu" else "cpu"
        return emulation_reason(get_recipe(cfg.precision), device, cfg.emulate) is not None

    return [step_cost(cfg.precision, emulated(cfg)) for cfg in configs]


class RunsProgress:
    """``with RunsProgress(console, [(label, steps), ...], costs) as p: p.start(i); p.step(rec); p.finish(i, status)``.

    The ETA is the command's own estimate, not rich's rate of the whole bar: the current run's remaining
    steps at its own rate, each later run's steps at the time a BF16 step took here times its ``cost``
    (``step_cost``); a run's measured rate replaces the estimate once it has run two steps.
    """

    def __init__(
        self, console: Console, runs: list[tuple[str, int]], costs: list[float] | None = None, enabled: bool = True
    ):
        self.console, self.runs, self.enabled = console, runs, enabled
        self.costs = costs or [1.0] * len(runs)
        self.total_steps = sum(steps for _, steps in runs)
        self.done_steps = 0  # of finished runs, counted as planned (a diverged run's rest is skipped)
        self.t0 = time.monotonic()
        self.run_t0 = self.t0
        self.index = 0
        self.steps_here = 0  # steps the current run has done in this process
        self.first_step_at = None  # the current run's first step (its compile and warm-up before it)
        self.unit: list[float] = []  # seconds per step per unit of cost, of each finished run
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps  elapsed"),
            TimeElapsedColumn(),
            TextColumn("ETA {task.fields[eta]}"),
            console=console,
            refresh_per_second=2,
        )  # redraws share the CPU with the timed steps
        self.overall = self.current = None

    def __enter__(self) -> "RunsProgress":
        if self.enabled:
            self.progress.start()
            self.overall = self.progress.add_task(f"all {len(self.runs)} runs", total=self.total_steps, eta="-")
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.progress.stop()

    def start(self, index: int) -> None:
        """Run ``index`` (0-based) begins."""
        self.run_t0 = time.monotonic()
        self.index, self.steps_here, self.first_step_at = index, 0, None
        label, steps = self.runs[index]
        if self.enabled:
            self.current = self.progress.add_task(
                f"run {index + 1}/{len(self.runs)}: {escape(label)}", total=steps, eta="-"
            )

    def _rate(self) -> float | None:
        """Seconds per step of the current run: measured after its first step, else estimated."""
        if self.steps_here >= 2:
            return (time.monotonic() - self.first_step_at) / (self.steps_here - 1)
        return self._unit() * self.costs[self.index] if self._unit() else None

    def _unit(self) -> float | None:
        return sum(self.unit) / len(self.unit) if self.unit else None

    def eta(self, current_left: int) -> tuple[float | None, float | None]:
        """(seconds left in the current run, seconds left in the command), None while nothing is measured."""
        rate = self._rate()
        if rate is None:
            return None, None
        later = self._later(self.index, self._unit() or rate / self.costs[self.index])
        return current_left * rate, current_left * rate + later

    def _later(self, index: int, unit: float) -> float:
        """Seconds the runs after ``index`` take at ``unit`` seconds per step per unit of cost."""
        return sum(steps * cost * unit for (_, steps), cost in zip(self.runs[index + 1 :], self.costs[index + 1 :]))

    def step(self, rec: dict) -> None:
        """Step ``rec["step"]`` of the current run is done (a resumed run starts past 1)."""
        self.steps_here += 1
        if self.first_step_at is None:
            self.first_step_at = time.monotonic()
        if self.enabled:
            steps = self.runs[self.index][1]
            here, total = self.eta(steps - rec["step"])
            self.progress.update(self.current, completed=rec["step"], eta="-" if here is None else clock(here))
            self.progress.update(
                self.overall, completed=self.done_steps + rec["step"], eta="-" if total is None else clock(total)
            )

    def finish(self, index: int, status: str) -> str:
        """Run ``index`` ended with ``status``: print and return its line (its time, the command's, the ETA)."""
        label, steps = self.runs[index]
        self.done_steps += steps
        now = time.monotonic()
        if status == "ok" and self.steps_here >= 2:
            self.unit.append((now - self.first_step_at) / (self.steps_here - 1) / self.costs[index])
        self.index = index + 1
        left, unit = self.total_steps - self.done_steps, self._unit()
        eta = 0.0 if not left else self._later(index, unit) if unit else None
        if self.enabled:
            self.progress.remove_task(self.current)  # a run that stopped early leaves no bar behind
            self.current = None
            self.progress.update(self.overall, completed=self.done_steps, eta="-" if eta is None else clock(eta))
        more = len(self.runs) - index - 1
        if not left:
            tail = "all runs done"
        elif eta is not None:
            tail = f"ETA {clock(eta)} for {more} more run(s)"
        else:
            tail = f"{more} more run(s), ETA unknown"
        line = f"lpbench: run {index + 1}/{len(self.runs)} {label}: {status} in {clock(now - self.run_t0)} | "
        line += f"elapsed {clock(now - self.t0)} | {tail}"
        self.console.print(escape(line), highlight=False, soft_wrap=True)
        return line
