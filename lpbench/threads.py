"""CPU threads for a shared machine: idle OpenMP threads sleep, one intra-op thread per usable CPU.

PyTorch's OpenMP threads spin between parallel regions by default. When other processes share the
cores, a spinning thread holds a core that another thread of the same run is waiting for, and a
step slows far more than the load (benchmarks/RESULTS.md). With ``OMP_WAIT_POLICY=PASSIVE`` idle
threads sleep, so a run on a loaded machine slows in proportion to the load. OpenMP reads the
policy when torch loads it, so ``lpbench/__init__.py`` calls :func:`set_wait_policy` before
anything imports torch (an ``OMP_WAIT_POLICY`` the user set wins; torch imported before lpbench
keeps whatever was set then). The intra-op thread count is the CPUs this process may run on
(affinity and cgroup quota), capped by torch's default (physical cores); ``OMP_NUM_THREADS`` wins.
"""

from __future__ import annotations

import math
import os
import sys

WAIT_ENV = "OMP_WAIT_POLICY"
_wait_policy: str | None = None  # what OpenMP was loaded with, as far as lpbench can tell


def set_wait_policy() -> None:
    """Make idle OpenMP threads sleep (unless the user chose); call before importing torch."""
    global _wait_policy
    if "torch" not in sys.modules:
        os.environ.setdefault(WAIT_ENV, "PASSIVE")
        _wait_policy = os.environ[WAIT_ENV].lower()
    else:
        _wait_policy = os.environ.get(WAIT_ENV, "active (default; torch was imported before lpbench)").lower()


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return n


def configure() -> str:
    """Set torch's intra-op threads for a CPU run; returns what was chosen, for the first log line."""
    import torch

    if "OMP_NUM_THREADS" in os.environ:
        how = "OMP_NUM_THREADS"
    else:
        usable = usable_cpus()
        torch.set_num_threads(max(1, min(usable, _default_threads(torch))))
        how = f"of {usable} usable CPUs"
    return f"{torch.get_num_threads()} threads ({how}), OpenMP wait {_wait_policy or 'unknown'}"


_torch_default: int | None = None


def _default_threads(torch) -> int:
    """torch's own choice (physical cores), read before lpbench first changes it."""
    global _torch_default
    if _torch_default is None:
        _torch_default = torch.get_num_threads()
    return _torch_default
