"""The per-step log lines are read by the grep commands and formulas of the field's benchmark docs.

The patterns below are copied from those docs (not read from them at test time):
- Megatron-Bridge's NVFP4 playbook: ``grep -E "elapsed time per iteration|MODEL_TFLOP" nvfp4.log``,
  lines ``Step Time : 5.39s GPU utilization: 2347.0MODEL_TFLOP/s/GPU`` and
  ``iteration 10/50 | ... elapsed time per iteration (ms): 5390 | ... lm loss: ...``;
- NeMo's Nemotron4 recipe: ``grep -r --include '*.out' train_step_timing experiments``, throughput
  = seq len x global batch / train_step_timing;
- the NeMo NVFP4 benchmark notes: TPS/GPU = GBS x L / train_step_timing / GPUs, read from
  ``global_step``, ``reduced_train_loss``, ``train_step_timing in s``, ``TFLOPS_per_GPU``,
  ``consumed_samples``.
"""

import re
import shutil
import subprocess

import pytest

from lpbench.config import RunConfig
from lpbench.train.loop import format_log_lines, plain, train

BRIDGE_GREP = "elapsed time per iteration|MODEL_TFLOP"
NUMBER = r"([0-9.]+)"  # what the docs' users write: plain decimals only


def field(line: str, name: str) -> float:
    m = re.search(re.escape(name) + r":? *" + NUMBER, line)
    assert m, f"{name} not in {line!r}"
    return float(m.group(1))


@pytest.fixture(scope="module")
def run_log(tmp_path_factory):
    cfg = RunConfig(model="tiny", seq_len=32, mbs=2, gbs=4, steps=3, warmup_steps=1, precision="fp32")
    lines: list[str] = []
    result = train(cfg, log=lines.append)
    folder = tmp_path_factory.mktemp("experiments") / "pretrain_tiny_fp32_1"
    folder.mkdir()
    (folder / "log-0.out").write_text("\n".join(lines) + "\n")
    return cfg, result, folder.parent


def grep(*args: str) -> list[str]:
    if shutil.which("grep") is None:
        pytest.skip("no grep on this machine")
    out = subprocess.run(["grep", *args], capture_output=True, text=True)
    return out.stdout.splitlines()


def test_megatron_bridge_playbook_grep_reads_latency_and_tflops(run_log):
    cfg, result, experiments = run_log
    found = grep("-r", "-E", BRIDGE_GREP, str(experiments))
    bridge = [ln for ln in found if "MODEL_TFLOP" in ln]
    megatron = [ln for ln in found if "elapsed time per iteration" in ln]
    assert len(bridge) == len(megatron) == cfg.steps
    for rec, b, m in zip(result.steps, bridge, megatron):
        step_time = float(re.search(r"Step Time : " + NUMBER + "s", b).group(1))
        tflops = float(re.search(r"GPU utilization: " + NUMBER + "MODEL_TFLOP/s/GPU", b).group(1))
        assert step_time == pytest.approx(rec["step_time_s"], abs=0.006)
        assert tflops == pytest.approx(rec["tflops_per_gpu"], rel=1e-3)
        assert field(m, "elapsed time per iteration (ms)") == pytest.approx(rec["step_time_s"] * 1e3, abs=0.06)
        assert field(m, "lm loss") == pytest.approx(rec["loss"], abs=1e-4)


def test_nemo_grep_and_throughput_formula(run_log):
    cfg, result, experiments = run_log
    found = grep("-r", "--include", "*.out", "train_step_timing", str(experiments))
    assert len(found) == cfg.steps
    for rec, line in zip(result.steps, found):
        timing = field(line, "train_step_timing in s")
        gbs = field(line, "global_batch_size")
        assert field(line, "global_step") == rec["step"]
        assert field(line, "consumed_samples") == rec["step"] * cfg.gbs
        assert field(line, "reduced_train_loss") == pytest.approx(rec["loss"], abs=1e-4)
        assert field(line, "TFLOPS_per_GPU") == pytest.approx(rec["tflops_per_gpu"], rel=1e-3)
        tps_per_gpu = gbs * cfg.seq_len / timing / cfg.world_size
        assert tps_per_gpu == pytest.approx(rec["tokens_per_sec_per_gpu"], rel=2e-3)


@pytest.mark.parametrize(
    "value,text", [(1.704e-3, "0.001704"), (1831.2, "1831.2"), (0.5, "0.5000"), (3e-4, "0.0003000"), (12.81, "12.81")]
)
def test_plain_decimals(value, text):
    assert plain(value) == text


def test_no_exponent_in_step_lines():
    rec = {
        "step": 3,
        "loss": 7.25,
        "step_time_s": 0.0123,
        "tflops_per_gpu": 2.5e-5,
        "lr": 3e-5,
        "grad_norm": 0.5,
        "tokens_per_sec_per_gpu": 1234.0,
        "peak_mem_gb": None,
    }
    for line in format_log_lines(rec, 10, 4):
        assert not re.search(r"\d[eE][+-]?\d", line), line
