"""Chrome traces of profiled steps (``--profile-steps``, :class:`lpbench.metrics.profile.StepProfiler`) read back:
the device's kernels, their time by name, the gaps between them where the GPU ran nothing, and the communication
kernels' time that no compute kernel overlapped (:func:`exposed_comm`). The benchmark scripts that explain a step
(``benchmarks/step_table.py``, ``benchmarks/moe.py``, ``benchmarks/scale.py``) build on these."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from pathlib import Path

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # what occupies the GPU
COMM = re.compile(r"nccl", re.IGNORECASE)  # NCCL's kernels (ncclDevKernel_*, ncclKernel_*): collectives on the GPU


def read(path: str | Path) -> list[dict]:
    """The complete events (``ph == "X"``, with a duration) of a Chrome trace, gzipped or not."""
    path = str(path)
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def device_events(events: list[dict]) -> list[dict]:
    """Kernels, copies and memsets with a duration, in start order."""
    return sorted((e for e in events if e.get("cat") in DEVICE_CATS and "dur" in e), key=lambda e: e["ts"])


def kernel_totals(events: list[dict]) -> tuple[Counter, Counter]:
    """(ms, launches) of each device event name."""
    ms, calls = Counter(), Counter()
    for e in device_events(events):
        ms[e["name"]] += e["dur"] / 1e3
        calls[e["name"]] += 1
    return ms, calls


def gaps(events: list[dict]) -> list[tuple[float, dict, dict]]:
    """Each span in which no device event ran, between the first and the last: (µs idle start, the event that
    ended last before it, the event that starts it). Events on several streams overlap: a gap is idle on all."""
    out, end, last = [], None, None
    for e in device_events(events):
        if end is not None and e["ts"] > end:
            out.append((end, last, e))
        if end is None or e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    return out


def busy_ms(events: list[dict]) -> float:
    """Time (ms) in which at least one device event ran."""
    dev = device_events(events)
    if not dev:
        return 0.0
    span = max(e["ts"] + e["dur"] for e in dev) - dev[0]["ts"]
    return (span - sum(e["ts"] - start for start, _, e in gaps(events))) / 1e3


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint (start, end) intervals covering the same time as ``spans``."""
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def exposed_comm(events: list[dict]) -> tuple[float, float]:
    """(ms in which a communication kernel ran, ms of that in which no other device event ran).

    Communication: device events named like NCCL's kernels (:data:`COMM`); every other kernel, copy and memset
    is compute. The second figure is what the step waited on communication with the GPU otherwise idle (the
    union of the communication spans less its intersection with the union of the compute spans). An NCCL
    kernel runs from its launch until the slowest rank joins, so waiting for another rank counts as
    communication too.
    """
    comm, compute = [], []
    for e in device_events(events):
        (comm if COMM.search(e["name"]) else compute).append((e["ts"], e["ts"] + e["dur"]))
    comm, compute = _union(comm), _union(compute)
    busy = sum(b - a for a, b in comm)
    return busy / 1e3, (busy - _overlap(comm, compute)) / 1e3


SYNC = re.compile(r"^cuda(Stream|Device|Event)Synchronize$")  # the runtime calls in which the host waits for the GPU
EAGER_NODE = re.compile(r"^(?!CompiledFunction)\w*Backward\d*$")  # an autograd node outside a compiled region's own


def host_sync_ms(events: list[dict]) -> float:
    """Time (ms) the host spent blocked in CUDA synchronisations. Small while the GPU idles much of the step: the
    host, not the GPU, sets the pace (it launches too slowly, or a synchronisation keeps it from running ahead)."""
    return sum(e["dur"] for e in events if e.get("cat") == "cuda_runtime" and SYNC.match(e["name"])) / 1e3


def eager_backward_nodes(events: list[dict]) -> Counter:
    """Calls of each autograd node that ran outside a compiled graph (``MmBackward0``, a custom Function's
    ``<Name>Backward``; a compiled region's backward is one ``CompiledFunctionBackward``). In a compiled model, a
    Function named here ran eagerly, op by op."""
    return Counter(e["name"] for e in events if e.get("cat") == "cpu_op" and EAGER_NODE.match(e["name"]))
