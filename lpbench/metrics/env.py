"""The environment a run measured on: GPU, driver, library versions, git revision."""

from __future__ import annotations

import os
import platform
import subprocess
from functools import lru_cache
from pathlib import Path

import torch

import lpbench


def _first_line(cmd: list[str], **kw) -> str | None:
    """The first line ``cmd`` prints; None where it cannot run, fails or prints nothing."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0] if out.returncode == 0 and lines else None


@lru_cache(maxsize=1)
def _git_sha() -> str | None:
    return _first_line(["git", "rev-parse", "--short", "HEAD"], timeout=5, cwd=Path(lpbench.__file__).parents[1])


def _driver() -> str | None:
    return _first_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], timeout=10)


def environment(device: torch.device) -> dict:
    env = {
        "lpbench": lpbench.__version__,
        "git_sha": _git_sha(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "gpu": None,
        "capability": None,
        "cuda": torch.version.cuda,
        "driver": None,
    }
    if device.type == "cpu":
        env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            driver=_driver(),
            gpu_memory_gb=round(props.total_memory / 1024**3, 1),
        )
    return env
