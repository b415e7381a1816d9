"""--profile-steps: the time classifier on synthetic names, and a CPU run's trace, table and metrics."""

import json
import re

import pytest

from lpbench.bench.store import ResultsStore
from lpbench.cli import main
from lpbench.metrics.profile import CATEGORIES, breakdown, classify, label, labelled_times
from lpbench.models.registry import MODELS, ModelConfig


@pytest.mark.parametrize(
    "name,category",
    [
        ("aten::mm", "gemm"),
        ("aten::addmm", "gemm"),
        ("aten::_scaled_mm", "gemm"),
        ("aten::bmm", "gemm"),
        ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128", "gemm"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "gemm"),
        ("cutlass::Kernel2<cutlass_80_tensorop_s16816gemm>", "gemm"),
        ("_absmax_kernel", "quantize"),
        ("_cast_kernel", "quantize"),
        ("_amax_scale_kernel", "quantize"),
        ("_transpose_kernel", "quantize"),
        ("_record_kernel", "quantize"),
        ("_group_cast_kernel", "quantize"),
        ("_group_amax_kernel", "quantize"),
        ("_uniform_kernel", "quantize"),
        ("_grouped_kernel", "gemm"),
        ("triton_poi_fused__scaled_mm__to_copy_clamp_clone_mul_t_0", "quantize"),
        ("lpbench/precision/quantize.py(229): quantize", "quantize"),
        ("nn.Module: QuantizedLinear_0", "quantize"),
        ("nn.Module: Float8Linear_3", "quantize"),
        ("triton_red_fused_abs_amax_0", "quantize"),
        ("autograd::engine::evaluate_function: _QuantizedLinearFnBackward", "quantize"),
        ("flash_fwd_kernel", "attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
        ("ScaledDotProductFlashAttentionForCpuBackward0", "attention"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "comm"),
        ("gloo:all_reduce", "comm"),
        ("c10d::allgather_", "comm"),
        ("nccl:_reduce_scatter_base", "comm"),
        ("FSDP::all_gather_copy_in", "comm"),
        ("triton_per_fused__log_softmax_amax_0", "other"),
    ],
)
def test_classify_names(name, category):
    assert classify(name) == category


@pytest.mark.parametrize(
    "name",
    [
        "aten::add",
        "aten::broadcast_tensors",
        "nn.Module: Attention_0",
        "nn.Module: Linear_0",
        "Memcpy HtoD (Pageable -> Device)",
        "lpbench/train/loop.py(120): train",
        "autograd::engine::evaluate_function: AddmmBackward0",
    ],
)
def test_unclassified_names(name):
    assert classify(name) is None


def test_label_is_the_innermost_classifiable_name():
    quantize = "lpbench/precision/quantize.py(229): quantize"
    assert label(["aten::abs", quantize, "nn.Module: QuantizedLinear_0"]) == quantize
    assert label(["aten::mm", "lpbench/precision/linear.py(80): qgemm", "nn.Module: QuantizedLinear_0"]) == "aten::mm"
    assert (
        label(["aten::view", "lpbench/precision/linear.py(95): forward", "nn.Module: QuantizedLinear_0"])
        == "nn.Module: QuantizedLinear_0"
    )
    assert label(["elementwise_kernel", "aten::add", "nn.Module: Attention_0"]) == "elementwise_kernel"


def test_breakdown_sums_times_per_category():
    parts = breakdown(
        [
            ("aten::mm", 6.0),
            ("triton_red_fused_abs_amax_0", 2.0),
            ("flash_fwd_kernel", 1.0),
            ("ncclDevKernel_AllGather", 0.5),
            ("aten::add", 0.25),
            ("aten::mm", 0.25),
        ]
    )
    assert list(parts) == list(CATEGORIES)
    assert {c: p["time"] for c, p in parts.items()} == {
        "gemm": 6.25,
        "quantize": 2.0,
        "attention": 1.0,
        "comm": 0.5,
        "other": 0.25,
    }
    assert parts["gemm"]["share"] == 0.625 and sum(p["share"] for p in parts.values()) == pytest.approx(1.0)
    assert all(p == {"time": 0.0, "share": 0.0} for p in breakdown([]).values())


def _event(name, device="cpu", parent=None, kernels=(), us=0.0, annotation=False):
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    return SimpleNamespace(
        name=name,
        device_type=DeviceType.CPU if device == "cpu" else DeviceType.CUDA,
        is_async=False,
        cpu_parent=parent,
        is_user_annotation=annotation,
        kernels=[SimpleNamespace(name=k, duration=t) for k, t in kernels],
        time_range=SimpleNamespace(elapsed_us=lambda: us),
        self_cpu_time_total=us,
    )


def test_cuda_kernel_time_goes_to_the_launching_operators_category():
    quantize = _event("lpbench/precision/quantize.py(229): quantize")
    events = [
        quantize,
        _event("aten::mm", kernels=[("nvjet_tst_64x8", 5.0)]),
        _event("aten::abs", parent=quantize, kernels=[("vectorized_elementwise_kernel", 2.0)]),
        _event("nvjet_tst_64x8", "cuda", us=5.0),
        _event("vectorized_elementwise_kernel", "cuda", us=2.0),
        _event("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "cuda", us=3.0),  # launched by no recorded op
        _event("ProfilerStep#2", "cuda", us=100.0, annotation=True),  # a range, not a kernel
        _event("Stream Wait Event", "cuda", us=400.0),
        _event("Context Sync", "cuda", us=900.0),
    ]  # waits
    parts = breakdown(labelled_times(events, "cuda"))
    assert {c: p["time"] for c, p in parts.items()} == {
        "gemm": 5.0,
        "quantize": 2.0,
        "attention": 0.0,
        "comm": 3.0,
        "other": 0.0,
    }


def test_each_kernel_counts_once_and_annotations_not_at_all():
    """torch links a range's GPU-side annotation to it like a kernel: it must not count; nor may a kernel
    linked twice count more than the device ran it."""
    step = _event("ProfilerStep#2", kernels=[("ProfilerStep#2", 100.0)])
    graph = _event("## Call CompiledFxGraph fabc ##", parent=step, kernels=[("## Call CompiledFxGraph fabc ##", 50.0)])
    events = [
        step,
        graph,
        _event("aten::mm", parent=graph, kernels=[("nvjet_tst_64x8", 5.0)]),
        _event("aten::mm", parent=graph, kernels=[("nvjet_tst_64x8", 5.0)]),
        _event("triton_poi_fused_add_0", parent=graph, kernels=[("triton_poi_fused_add_0", 3.0)]),
        _event("ProfilerStep#2", "cuda", us=100.0, annotation=True),
        _event("## Call CompiledFxGraph fabc ##", "cuda", us=50.0, annotation=True),
        _event("nvjet_tst_64x8", "cuda", us=5.0),
        _event("triton_poi_fused_add_0", "cuda", us=3.0),
    ]
    parts = breakdown(labelled_times(events, "cuda"))
    assert {c: p["time"] for c, p in parts.items()} == {
        "gemm": 5.0,
        "quantize": 0.0,
        "attention": 0.0,
        "comm": 0.0,
        "other": 3.0,
    }


def test_cpu_self_time_goes_to_the_innermost_classified_name():
    quantize = _event("lpbench/precision/quantize.py(229): quantize", us=1.0)
    loop = _event("lpbench/train/loop.py(120): train", us=0.5)
    events = [
        quantize,
        loop,
        _event("aten::abs", parent=quantize, us=4.0),
        _event("aten::mm", parent=loop, us=3.0),
        _event("aten::add", parent=loop, us=2.0),
    ]
    parts = breakdown(labelled_times(events, "cpu"))
    assert {c: p["time"] for c, p in parts.items()} == {
        "gemm": 3.0,
        "quantize": 5.0,
        "attention": 0.0,
        "comm": 0.0,
        "other": 2.5,
    }


def test_profile_steps_writes_a_trace_and_a_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(MODELS, "test-prof", ModelConfig("test-prof", 2, 64, 128, 4, 2, 512, max_seq_len=256))
    assert (
        main(
            [
                "run",
                "--model",
                "test-prof",
                "--precision",
                "fp8-delayed",
                "--device",
                "cpu",
                "--seq-len",
                "32",
                "--mbs",
                "2",
                "--gbs",
                "4",
                "--steps",
                "4",
                "--warmup-steps",
                "1",
                "--profile-steps",
                "2:3",
                "--results",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    run = ResultsStore(tmp_path).runs()[0]
    trace = tmp_path / "profiles" / run["run_key"] / "trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    assert f"lpbench: profile of steps 2-3 (CPU self time), trace {trace}" in out
    rows = dict(re.findall(r"^  (\w+) +[\d.]+ +([\d.]+)%$", out, re.MULTILINE))
    assert set(rows) == {*CATEGORIES, "total"}
    assert sum(float(rows[c]) for c in CATEGORIES) == pytest.approx(100, abs=0.3)
    found = run["metrics"]["profile"]
    assert all(found[f"{c}_ms"] > 0 for c in ("gemm", "quantize", "attention"))  # each found in the trace

    profile, metrics = run["metrics"]["profile"], run["metrics"]
    assert profile["steps"] == "2:3" and profile["trace"] == str(trace) and profile["basis"] == "CPU self time"
    assert profile["total_ms"] == pytest.approx(sum(profile[f"{c}_ms"] for c in CATEGORIES))
    assert metrics["timed_steps"] == 1  # warm-up step 1 and profiled steps 2-3 are not timed
    assert main(["report", "--results", str(tmp_path), "--format", "json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["profile_gemm_pct"] == pytest.approx(profile["gemm_pct"]) and row["profile_steps"] == "2:3"


@pytest.mark.parametrize(
    "steps,message",
    [
        ("3:2", "need 1 <= A <= B <= --steps (4)"),
        ("2:5", "need 1 <= A <= B <= --steps (4)"),
        ("0:1", "need 1 <= A <= B"),
        ("two", "takes A:B"),
    ],
)
def test_bad_profile_steps_exit_2(steps, message, tmp_path, capsys):
    assert (
        main(
            [
                "run",
                "--precision",
                "bf16",
                "--steps",
                "4",
                "--warmup-steps",
                "1",
                "--profile-steps",
                steps,
                "--results",
                str(tmp_path),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_sweep_run_profiles_into_the_sweeps_results_folder(tmp_path):
    import yaml

    from lpbench.bench.sweep import run_sweep

    spec = tmp_path / "p.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "p",
                "model": "tiny",
                "device": "cpu",
                "seq_len": 32,
                "mbs": 2,
                "gbs": 2,
                "steps": 3,
                "warmup_steps": 1,
                "profile_steps": "2:2",
            }
        )
    )
    assert run_sweep(str(spec), results=str(tmp_path / "results")) == 0
    run = ResultsStore(tmp_path / "results").runs()[0]
    assert run["metrics"]["profile"]["steps"] == "2:2"
    assert (tmp_path / "results" / "profiles" / run["run_key"] / "trace.json").is_file()


def test_a_run_that_fails_inside_the_profiled_steps_still_writes_its_trace(tmp_path, monkeypatch):
    import torch

    import lpbench.train.loop as loop
    from lpbench.config import RunConfig

    monkeypatch.setitem(MODELS, "test-prof", ModelConfig("test-prof", 2, 64, 128, 4, 2, 512, max_seq_len=256))
    real_build = loop.build_model

    def out_of_memory_at_step_2(*args, **kwargs):
        model, calls = real_build(*args, **kwargs), []
        forward = model.forward

        def forward_or_oom(*a, **k):
            calls.append(1)
            if len(calls) == 2:
                raise torch.OutOfMemoryError("CUDA out of memory (test)")
            return forward(*a, **k)

        model.forward = forward_or_oom
        return model

    monkeypatch.setattr(loop, "build_model", out_of_memory_at_step_2)
    cfg = RunConfig(
        model="test-prof",
        seq_len=32,
        mbs=2,
        gbs=2,
        steps=4,
        warmup_steps=1,
        precision="bf16",
        device="cpu",
        profile_steps="2:3",
    )
    result = loop.train(cfg, log=lambda line: None, results_dir=str(tmp_path))
    assert result.status == "oom" and result.metrics["profile"]["steps"] == "2:2"
    assert json.loads((tmp_path / "profiles" / cfg.key() / "trace.json").read_text())["traceEvents"]


@pytest.mark.parametrize("stacks", [True, False])
def test_profile_stacks_choose_whether_the_trace_holds_python_frames(tmp_path, stacks):
    """``--no-profile-stacks`` leaves Python frames out of the trace (less host overhead in the profiled step); the
    operators stay."""
    from lpbench.config import RunConfig
    from lpbench.train.loop import train

    cfg = RunConfig(model="tiny", device="cpu", seq_len=32, mbs=2, gbs=2, steps=2, warmup_steps=1)
    r = train(cfg.with_(profile_steps="2:2", profile_stacks=stacks), log=lambda line: None, results_dir=str(tmp_path))
    events = json.loads((tmp_path / "profiles" / cfg.key() / "trace.json").read_text())["traceEvents"]
    assert r.status == "ok" and any(e.get("name") == "aten::mm" for e in events)
    assert any(e.get("cat") == "python_function" for e in events) == stacks
