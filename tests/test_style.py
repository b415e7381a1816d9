"""The tree is formatted and linted as ``pyproject.toml``'s ``[tool.ruff]`` says (ruff is in the test extra)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["lpbench", "tests", "benchmarks"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff")
    cmd = [exe] if exe else [sys.executable, "-m", "ruff"]
    return subprocess.run([*cmd, *args, *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module", autouse=True)
def ruff_installed():
    if (
        shutil.which("ruff") is None
        and subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode != 0
    ):
        pytest.skip("ruff is not installed (pip install -e '.[test]')")


def test_the_tree_is_formatted():
    done = _ruff("format", "--check")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_tree_passes_the_lint():
    done = _ruff("check")
    assert done.returncode == 0, done.stdout + done.stderr
