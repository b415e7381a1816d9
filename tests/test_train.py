import math

import pytest
import torch

import lpbench.train.loop as loop
from lpbench.config import RunConfig
from lpbench.train.optim import lr_factor

TINY = RunConfig(model="tiny", seq_len=64, mbs=4, gbs=4, steps=10, warmup_steps=2, precision="fp32")


def test_tiny_run_lowers_its_loss():
    result = loop.train(TINY.with_(seq_len=256, mbs=8, gbs=8, steps=40, precision="bf16"), log=lambda line: None)
    losses = [s["loss"] for s in result.steps]
    assert result.status == "ok" and len(losses) == 40
    assert losses[-1] < losses[0] - 0.8  # ln(2048) = 7.6 at the start; 6.5 after 40 steps
    m = result.metrics
    assert m["timed_steps"] == 38 and m["tokens_per_sec_per_gpu"] > 0
    assert m["tokens_per_sec_per_gpu"] == pytest.approx(8 * 256 / m["step_time_s"])
    assert m["mfu_bf16"] is None  # no peak on a CPU
    assert (
        m["step_time_min_s"] <= m["step_time_p25_s"] <= m["step_time_s"] <= m["step_time_p75_s"] <= m["step_time_max_s"]
    )


def test_step_time_spread_is_quartiles_min_and_max():
    assert loop.step_time_dist([4.0, 1.0, 100.0, 2.0, 3.0]) == {
        "step_time_p25_s": 2.0,
        "step_time_p75_s": 4.0,
        "step_time_min_s": 1.0,
        "step_time_max_s": 100.0,
    }
    assert loop.step_time_dist([0.5]) == {
        "step_time_p25_s": 0.5,
        "step_time_p75_s": 0.5,
        "step_time_min_s": 0.5,
        "step_time_max_s": 0.5,
    }


def test_gradient_accumulation_matches_one_big_micro_batch():
    one = loop.train(TINY.with_(steps=4, warmup_steps=1), log=lambda line: None)
    two = loop.train(TINY.with_(steps=4, warmup_steps=1, mbs=2), log=lambda line: None)
    for a, b in zip(one.steps, two.steps):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)


def test_nan_loss_stops_the_run_as_diverged(monkeypatch):
    real_build = loop.build_model

    def poisoned(*args, **kwargs):
        model = real_build(*args, **kwargs)
        calls = {"n": 0}
        forward = model.forward

        def forward_with_nan(*a, **k):
            calls["n"] += 1
            out = forward(*a, **k)
            return out * float("nan") if calls["n"] >= 3 else out

        model.forward = forward_with_nan
        return model

    monkeypatch.setattr(loop, "build_model", poisoned)
    result = loop.train(TINY.with_(steps=10), log=lambda line: None)
    assert result.status == "diverged" and "at step 3" in result.error
    assert len(result.steps) == 3 and math.isnan(result.steps[-1]["loss"])


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = RunConfig(steps=100, lr_warmup_steps=10, min_lr_ratio=0.1)
    factors = [lr_factor(s, cfg) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))
    assert lr_factor(100, cfg) == pytest.approx(0.1)


def test_unknown_device_and_missing_cuda_are_usage_errors():
    from lpbench.errors import UsageError

    with pytest.raises(UsageError, match="unknown --device"):
        loop.resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="no CUDA device"):
            loop.resolve_device("cuda")


def test_a_config_for_more_ranks_than_the_job_is_a_usage_error():
    from lpbench.errors import UsageError

    with pytest.raises(UsageError, match=r"config is for 2 ranks \(dp 1 x tp 2\) but this job has 1"):
        loop.train(TINY.with_(tp=2), log=lambda line: None)


def test_grad_accumulation_follows_nemo_semantics():
    cfg = RunConfig(mbs=2, gbs=32, tp=2).with_world(8)
    assert (cfg.dp, cfg.grad_accum, cfg.world_size) == (4, 4, 8)
