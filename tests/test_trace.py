"""``lpbench/metrics/trace.py``: device events of a Chrome trace, their totals, and the gaps between them."""

import gzip
import json

import pytest

from lpbench.metrics import trace


def _x(cat, name, ts, dur, **extra):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 7, **extra}


EVENTS = [
    _x("kernel", "gemm", 100, 50),  # busy 100-150
    _x("kernel", "cast", 120, 60),  # another stream, overlapping: busy to 180
    _x("cpu_op", "aten::mm", 90, 500),  # host time is not device time
    _x("gpu_memcpy", "Memcpy HtoD", 200, 10),  # idle 180-200
    _x("kernel", "gemm", 260, 40),  # idle 210-260
    _x("kernel", "attention", 300, 100),  # busy 300-400 ...
    _x("kernel", "short", 310, 10),  # ... though this one, started later, ends at 320
    _x("gpu_memset", "Memset", 350, 5),
    {"ph": "i", "cat": "kernel", "name": "marker", "ts": 230},  # an instant event: no duration, not read
]


@pytest.mark.parametrize("gzipped", [False, True])
def test_read_keeps_complete_events_of_plain_and_gzipped_traces(tmp_path, gzipped):
    path = tmp_path / ("t.json.gz" if gzipped else "t.json")
    with (gzip.open if gzipped else open)(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    assert trace.read(path) == EVENTS[:-1]


def test_totals_gaps_and_busy_time_count_the_device_only():
    ms, calls = trace.kernel_totals(EVENTS)
    assert ms == {
        "gemm": pytest.approx(0.09),
        "cast": pytest.approx(0.06),
        "Memcpy HtoD": pytest.approx(0.01),
        "attention": pytest.approx(0.1),
        "short": pytest.approx(0.01),
        "Memset": pytest.approx(0.005),
    }
    assert calls == {"gemm": 2, "cast": 1, "Memcpy HtoD": 1, "attention": 1, "short": 1, "Memset": 1}
    gaps = trace.gaps(EVENTS)
    assert [(start, before["name"], after["name"], after["ts"]) for start, before, after in gaps] == [
        (180, "cast", "Memcpy HtoD", 200),
        (210, "Memcpy HtoD", "gemm", 260),
    ]
    assert trace.busy_ms(EVENTS) == pytest.approx((400 - 100 - 20 - 50) / 1e3)
    assert trace.gaps([]) == [] and trace.busy_ms([]) == 0.0
