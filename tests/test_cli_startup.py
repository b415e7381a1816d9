"""`lpbench`, `lpbench --help` and `--version` start without torch; each command's parser is whole."""

import argparse
import os
import subprocess
import sys

import pytest

from lpbench.cli import COMMANDS, build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = """
import sys
from lpbench.cli import main
try:
    code = main({argv!r})
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in ("torch", "numpy", "lpbench.config", "lpbench.models") if m in sys.modules)
print("HEAVY=" + ",".join(heavy), file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.parametrize("argv", [[], ["--help"], ["--version"], ["nonsense"]])
def test_help_and_version_import_no_torch(argv):
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True, env=env)
    assert out.returncode == (2 if argv == ["nonsense"] else 0), out.stderr
    assert "HEAVY=\n" in out.stderr, out.stderr
    text = out.stdout + out.stderr
    if argv in ([], ["--help"]):
        assert all(name in text for name in COMMANDS)  # every command listed with its help
        assert "quant-error" in text and "slurm" in text
    if argv == ["nonsense"]:
        assert "invalid choice" in text and "Traceback" not in text


def _subparsers(parser):
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_lazy_listing_matches_the_full_parsers():
    """The top-level help (from COMMANDS) says what each command's own parser says."""
    full, lazy = _subparsers(build_parser()), _subparsers(build_parser(""))
    assert list(full.choices) == list(lazy.choices) == list(COMMANDS)
    assert [a.help for a in full._choices_actions] == [a.help for a in lazy._choices_actions]
    for name in COMMANDS:  # building one command gives the same flags as building all
        one = _subparsers(build_parser(name)).choices[name]
        assert [a.option_strings for a in one._actions] == [a.option_strings for a in full.choices[name]._actions]
