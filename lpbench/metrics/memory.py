"""Memory probes: allocator peaks (allocated, reserved) and device-level used memory (NVML).

The two differ: the allocator sees only PyTorch's tensors, NVML sees the whole device
(CUDA context, NCCL buffers, fragmentation). On CPU the peak is the process's resident set
size high-water mark (Linux ``VmHWM``) since ``reset_peak``, which resets it through
``/proc/self/clear_refs``; where that cannot be reset (not Linux) the peak is unknown (None),
not the whole process's.
"""

from __future__ import annotations


import torch

GB = 1024**3


_host_peak_reset = False  # whether VmHWM was reset by reset_peak (so it is this run's peak)


def reset_peak(device: torch.device) -> None:
    global _host_peak_reset
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak RSS to the current RSS
        _host_peak_reset = _host_peak_bytes() is not None
    except OSError:
        _host_peak_reset = False


def _host_peak_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_gb(device: torch.device) -> float | None:
    """Peak allocated GB on a GPU; on CPU the peak host RSS since ``reset_peak`` (None if unknown)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GB
    peak = _host_peak_bytes() if _host_peak_reset else None
    return None if peak is None else peak / GB


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
        return {
            "peak_mem_allocated_gb": torch.cuda.max_memory_allocated(device) / GB,
            "peak_mem_reserved_gb": torch.cuda.max_memory_reserved(device) / GB,
            "device_mem_used_gb": device_used_gb(device),
            "memory_kind": "cuda",
        }
    return {
        "peak_mem_allocated_gb": peak_gb(device),
        "peak_mem_reserved_gb": None,
        "device_mem_used_gb": None,
        "memory_kind": "host-rss",
    }
