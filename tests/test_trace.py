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


def test_exposed_comm_is_nccl_time_no_compute_kernel_overlapped():
    events = [
        _x("kernel", "gemm", 0, 100),
        _x("kernel", "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 50, 130),  # 50-180
        _x("kernel", "gemm", 150, 100),  # 150-250: hides 150-180
        _x("kernel", "cast", 160, 40),  # a second compute stream inside the first: counted once
        _x("cpu_op", "nccl:all_gather", 0, 1000),  # host time is not device time
        _x("kernel", "ncclKernel_ReduceScatter_RING_LL_Sum_float", 300, 50),  # 300-350, nothing beside it
        _x("kernel", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 320, 100),  # 320-420, overlapping the one before
        _x("gpu_memcpy", "Memcpy DtoD", 400, 10),  # hides 400-410
    ]
    comm_ms, exposed_ms = trace.exposed_comm(events)
    assert comm_ms == pytest.approx((130 + 120) / 1e3)  # the union 50-180, 300-420
    assert exposed_ms == pytest.approx((50 + 100 + 10) / 1e3)  # 100-150, 300-400, 410-420
    assert trace.exposed_comm(EVENTS) == (0.0, 0.0)  # no communication kernel


def test_comm_fully_under_compute_is_not_exposed():
    events = [_x("kernel", "gemm", 0, 500), _x("kernel", "ncclDevKernel_AllGather", 100, 200)]
    assert trace.exposed_comm(events) == (pytest.approx(0.2), 0.0)


def test_host_sync_time_and_eager_backward_nodes_read_the_host_side():
    events = [
        _x("cuda_runtime", "cudaStreamSynchronize", 0, 1500),
        _x("cuda_runtime", "cudaDeviceSynchronize", 2000, 500),
        _x("cuda_runtime", "cudaLaunchKernel", 3000, 900),  # a launch is not a wait
        _x("cpu_op", "cudaStreamSynchronize", 4000, 700),  # only the runtime's own event counts
        _x("cpu_op", "_Fp8GroupedFnBackward", 0, 10),
        _x("cpu_op", "_Fp8GroupedFnBackward", 20, 10),
        _x("cpu_op", "MmBackward0", 40, 10),
        _x("cpu_op", "CompiledFunctionBackward", 60, 10),  # a compiled region's backward
        _x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 40, 12),  # the engine's wrapper
        _x("kernel", "SomethingBackward", 0, 5),  # a device event
    ]
    assert trace.host_sync_ms(events) == pytest.approx(2.0)
    assert trace.eager_backward_nodes(events) == {"_Fp8GroupedFnBackward": 2, "MmBackward0": 1}
