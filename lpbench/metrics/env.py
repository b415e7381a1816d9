"""The environment a run measured on: GPU, driver, library versions, git revision."""

from __future__ import annotations

import os
import platform
import subprocess
from functools import lru_cache

import torch

import lpbench


@lru_cache(maxsize=1)
def _git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=os.path.dirname(os.path.dirname(lpbench.__file__)),
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


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
