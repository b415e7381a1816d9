"""What every command shares for talking to the user: the rich console and argparse with one-line errors."""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console

# A terminal's width, or $COLUMNS; 200 columns into a file or pipe (no terminal to fit)
console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit() else 200)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2) instead of usage dumps."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def csv_list(value: str) -> list[str]:
    """An argparse type: a comma-separated list, empty items dropped, at least one kept."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


class Ticker:
    """Progress of a long loop as a plain line on stderr at most every ``every`` seconds (a log file reads it
    as well as a terminal): ``tick = Ticker("lpbench data prepare"); tick(documents=n, tokens=t)``."""

    def __init__(self, label: str, every: float = 5.0, stream=None):
        import time

        self.label, self.every, self.stream = label, every, stream or sys.stderr
        self.clock = time.monotonic
        self.t0 = self.last = self.clock()

    def __call__(self, **counts) -> bool:
        """Print the counts if ``every`` seconds passed since the last line; whether it printed."""
        now = self.clock()
        if now - self.last < self.every:
            return False
        self.last = now
        s = int(now - self.t0)
        done = ", ".join(f"{v:,} {k.replace('_', ' ')}" for k, v in counts.items())
        print(f"{self.label}: {done} ({s // 60}:{s % 60:02d} elapsed)", file=self.stream, flush=True)
        return True
