"""Memory probes: allocator peaks (allocated, reserved) and device-level used memory (NVML).

The two differ: the allocator sees only PyTorch's tensors, NVML sees the whole device
(CUDA context, NCCL buffers, fragmentation). On CPU the host resident set size is reported.
"""

from __future__ import annotations

import os
import resource

import torch

GB = 1024**3


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _host_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_gb(device: torch.device) -> float | None:
    """Peak allocated GB on a GPU; current host RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GB
    return _host_rss_bytes() / GB


def device_used_gb(device: torch.device) -> float | None:
    """Device-level used memory from NVML, or None where NVML is unavailable."""
    if device.type != "cuda":
        return None
    try:
        return torch.cuda.device_memory_used(device) / GB
    except Exception:  # no NVML binding / not an NVIDIA device
        return None


def summary(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"peak_mem_allocated_gb": torch.cuda.max_memory_allocated(device) / GB,
                "peak_mem_reserved_gb": torch.cuda.max_memory_reserved(device) / GB,
                "device_mem_used_gb": device_used_gb(device), "memory_kind": "cuda"}
    return {"peak_mem_allocated_gb": _host_rss_bytes() / GB, "peak_mem_reserved_gb": None,
            "device_mem_used_gb": None, "memory_kind": "host-rss"}
