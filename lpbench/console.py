"""What every command shares for talking to the user: the rich console and argparse with one-line errors."""

from __future__ import annotations

import argparse
import errno
import os
import sys

from rich.console import Console

# A terminal's width, or $COLUMNS; 200 columns into a file or pipe (no terminal to fit)
console = Console(
    width=None if (sys.stdout is not None and sys.stdout.isatty()) or os.environ.get("COLUMNS", "").isdigit() else 200
)


def usable_streams() -> None:
    """Make printing safe whatever the shell gave: a closed stdout (``>&-``) becomes /dev/null, one line on
    stderr says so; characters the streams' encoding lacks (``PYTHONIOENCODING=ascii`` and a path
    with an accent) are escaped, not an error."""
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the process's stdout until it exits)
        print("lpbench: stdout is closed; what lpbench prints there is discarded", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


def stdout_failed(exc: OSError) -> int | None:
    """For an error writing stdout (a broken pipe, ``/dev/full``, a closed descriptor): one line on stderr,
    stdout pointed at /dev/null (so nothing fails again at exit), and the exit status (141 for a broken
    pipe, as a process SIGPIPE ends); None for any other OSError."""
    if exc.errno not in (errno.EPIPE, errno.ENOSPC, errno.EBADF, errno.EIO) or exc.filename is not None:
        return None
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    why = "the reader went away (broken pipe)" if exc.errno == errno.EPIPE else exc.strerror
    print(f"lpbench: cannot write to stdout: {why}; output cut short", file=sys.stderr)
    return 141 if exc.errno == errno.EPIPE else 1


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2) instead of usage dumps, and no empty values: ``--results ''``
    would otherwise mean the current folder, ``--sources ''`` every source, ``--plot ''`` no plot."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def _get_value(self, action, arg_string):
        if (
            isinstance(arg_string, str)
            and not arg_string.strip()
            and action.nargs not in (argparse.PARSER, argparse.REMAINDER)
        ):
            name = "/".join(action.option_strings) or action.dest
            raise argparse.ArgumentError(None, f"argument {name}: an empty value")
        return super()._get_value(action, arg_string)


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
