"""benchmarks/step_table.py's trace readers: idle gaps between kernels and where the host was when it
launched the kernel after each gap, on a Chrome trace written here."""

import json

import pytest


@pytest.fixture(scope="module")
def step_table(benchmark_script):
    return benchmark_script("step_table")


def _x(cat, name, ts, dur, tid=1, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


@pytest.fixture
def trace(tmp_path, step_table):
    step_table._trace_events.cache_clear()
    events = [
        _x("python_function", "/site/lpbench/train/loop.py(170): train", 0, 2000),
        _x("python_function", "/site/lpbench/precision/weight_cache.py(90): refresh", 100, 700),
        _x("python_function", "/site/torch/cuda/graphs.py(5): zeros", 300, 50),
        _x("cuda_runtime", "cudaLaunchKernel", 10, 5, corr=1),
        _x("cuda_driver", "cuLaunchKernelEx", 320, 5, corr=2),  # Triton launches through the driver API
        _x("cuda_runtime", "cudaLaunchKernel", 330, 5, corr=3),
        _x("cuda_runtime", "cudaStreamSynchronize", 1500, 400),
        _x("kernel", "first", 20, 30, tid=7, corr=1),  # busy 20-50
        _x("kernel", "late", 400, 100, tid=7, corr=2),  # idle 50-400: launched at 320, after the GPU ran dry
        _x("kernel", "queued", 520, 10, tid=7, corr=3),  # idle 500-520: launched at 330, before the gap
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def test_idle_gaps_sum_the_time_between_kernels(step_table, trace):
    idle, gaps, waited = step_table.idle_gaps(trace, 1, 5)
    assert idle == pytest.approx(0.37)
    assert gaps[0] == (pytest.approx(0.35), "first", "late")
    assert waited[0] == ("late", pytest.approx(0.35))


def test_host_waits_name_the_frame_that_launched_late_and_the_blocking_calls(step_table, trace):
    late, blocking = step_table.host_waits(trace, 2, 5)
    assert dict(late) == {
        "lpbench/precision/weight_cache.py(90): refresh | torch/cuda/graphs.py(5): zeros": pytest.approx(0.175),
        "(launched before the gap: the GPU waited on a dependency)": pytest.approx(0.01),
    }
    assert blocking == [("cudaStreamSynchronize", pytest.approx(0.2))]


def test_idle_after_blocking_splits_late_idle_by_time_since_the_host_was_blocked(step_table, tmp_path):
    step_table._trace_events.cache_clear()
    events = [
        _x("cuda_runtime", "cudaStreamSynchronize", 0, 1000),  # the host returns at 1000 us
        _x("cuda_runtime", "cudaLaunchKernel", 1002, 3, corr=1),  # 2 us after it: refilling the drained GPU
        _x("cuda_runtime", "cudaLaunchKernel", 80_000, 3, corr=2),  # 79 ms after it: behind on its own
        _x("kernel", "busy", 500, 400, tid=7),
        _x("kernel", "refill", 1010, 10, tid=7, corr=1),  # idle 900-1010
        _x("kernel", "behind", 80_010, 10, tid=7, corr=2),  # idle 1020-80010
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    split = dict(step_table.idle_after_blocking(str(path), 1))
    assert split["< 5 ms"] == pytest.approx(0.11)
    assert split["50-500 ms"] == pytest.approx(78.99)
    assert split["5-50 ms"] == 0.0 and split[">= 500 ms or none before"] == 0.0


def test_row_suffixes_set_the_rows_settings_in_a_spec_the_sweep_accepts(step_table):
    import argparse

    from lpbench.bench.sweep_spec import expand

    args = argparse.Namespace(
        timeout=60.0, model="tiny", seq_len=32, mbs=2, gbs=4, steps=5, warmup_steps=1, profile=True, num_layers=None
    )
    spec = step_table.spec_for(
        args, ["bf16", "fp8-tensorwise/model-scope", "torchao:fp8-rowwise/fused-loss/model-scope"]
    )
    runs = [r.config for r in expand(spec).runs]
    assert [(c.precision, c.backend, c.compile_scope, c.fused_loss) for c in runs] == [
        ("bf16", "lpbench", "block", False),
        ("fp8-tensorwise", "lpbench", "model", False),
        ("fp8-rowwise", "torchao", "model", True),
    ]
    assert runs[0].profile_steps == "4:5"
    with pytest.raises(SystemExit, match="unknown row suffix /fused; valid: /fused-loss, /model-scope"):
        step_table.spec_for(args, ["bf16/fused"])
