"""Peak memory is each run's own peak: on CPU the RSS high-water mark since the run began."""

import sys

import pytest
import torch

from lpbench.metrics import memory

CPU = torch.device("cpu")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_cpu_peak_is_the_high_water_mark_since_reset():
    memory.reset_peak(CPU)
    before = memory.peak_gb(CPU)
    big = torch.ones(64 * 2**20)  # 256 MiB, touched
    del big  # freed: the current RSS drops, the peak does not
    peak = memory.peak_gb(CPU)
    assert peak >= before + 0.24
    assert memory.summary(CPU)["peak_mem_allocated_gb"] == pytest.approx(peak, abs=0.01)
    memory.reset_peak(CPU)  # the next run starts from the current RSS, not the last run's peak
    assert memory.peak_gb(CPU) < peak - 0.2


def test_cpu_peak_is_unknown_where_it_cannot_be_reset(monkeypatch):
    monkeypatch.setattr(memory, "_host_peak_reset", False)
    assert memory.peak_gb(CPU) is None and memory.summary(CPU)["peak_mem_allocated_gb"] is None


@pytest.mark.parametrize("where", ["build", "step"])
def test_out_of_memory_is_an_oom_result_with_the_estimate_while_building_and_in_a_step(where, monkeypatch, tmp_path):
    from lpbench.bench import runner
    from lpbench.config import RunConfig
    from lpbench.train import loop

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(loop, "build_model" if where == "build" else "clip_grad_norm_", oom)
    cfg = RunConfig(model="tiny", seq_len=32, mbs=1, gbs=1, steps=2, warmup_steps=1, device="cpu", eval_every=0)
    result = runner.execute(cfg, results_dir=str(tmp_path))
    assert result.status == "oom"
    assert result.error.startswith("CUDA out of memory. Tried to allocate 2.00 GiB (predicted peak ")
    assert "GB per GPU" in result.error
