"""Dense peak TFLOP/s and memory per GPU and precision class, and GPU detection by device name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPUPeaks:
    name: str
    bf16: float
    fp8: float | None = None
    fp4: float | None = None
    memory_gb: float | None = None  # what torch reports as the device's total memory, GiB (the peaks' unit)


# Dense (no sparsity) peaks in TFLOP/s, from the vendors' datasheets.
PEAKS: dict[str, GPUPeaks] = {
    p.name: p
    for p in (
        GPUPeaks("H100 SXM", 989, 1979, memory_gb=79.2),
        GPUPeaks("H100 PCIe", 756, 1513, memory_gb=79.2),
        GPUPeaks("H200", 989, 1979, memory_gb=139.8),
        GPUPeaks("B200", 2250, 4500, 9000, memory_gb=178.4),
        GPUPeaks("GB200", 2500, 5000, 10000, memory_gb=184.0),
        GPUPeaks("GB300", 2500, 5000, 15000, memory_gb=268.0),
        GPUPeaks("A100", 312, memory_gb=79.2),
    )
}

# Most specific patterns first: "GB200" contains "B200", "H100 PCIe" contains "H100".
_PATTERNS = [
    ("GB300", "GB300"),
    ("GB200", "GB200"),
    ("B200", "B200"),
    ("H200", "H200"),
    ("H100 PCIE", "H100 PCIe"),
    ("H100", "H100 SXM"),
    ("A100", "A100"),
]


def detect_gpu(device_name: str | None) -> GPUPeaks | None:
    """Peak table entry for a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3'); None if unknown."""
    if not device_name:
        return None
    upper = device_name.upper()
    for pattern, key in _PATTERNS:
        if pattern in upper:
            return PEAKS[key]
    return None


def peak_tflops(gpu: GPUPeaks | None, gemm_class: str | None) -> float | None:
    """Peak for a GEMM class ('bf16', 'fp8', 'fp4'); None where the GPU has no such unit."""
    if gpu is None or gemm_class is None:
        return None
    return getattr(gpu, gemm_class, None)


def mfu(tflops: float, peak: float | None) -> float | None:
    return None if not peak else tflops / peak
