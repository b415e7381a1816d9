"""Chrome traces of profiled steps (``--profile-steps``, :class:`lpbench.metrics.profile.StepProfiler`) read back:
the device's kernels, their time by name, and the gaps between them where the GPU ran nothing. The benchmark
scripts that explain a step (``benchmarks/step_table.py``, ``benchmarks/moe.py``) build on these."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # what occupies the GPU


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
