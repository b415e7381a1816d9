"""What every command shares for talking to the user: the rich console and argparse with one-line errors."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

console = Console(width=None if sys.stdout.isatty() else 200)


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
