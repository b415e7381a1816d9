"""Thread policy for shared machines, and the run's first log line naming it and the GEMM route."""

import os
import subprocess
import sys

import torch

import lpbench.train.loop as loop
from lpbench import threads
from lpbench.config import RunConfig
from lpbench import gemm


def test_importing_lpbench_first_makes_idle_openmp_threads_sleep():
    code = "import os, lpbench, torch; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "PASSIVE"
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # the user's choice wins
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ACTIVE"


def test_threads_follow_the_usable_cpus(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 1)
    try:
        note = threads.configure()
        assert torch.get_num_threads() == 1 and note.startswith("1 threads (of 1 usable CPUs), OpenMP wait ")
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(before)
        assert threads.configure().startswith(f"{before} threads (OMP_NUM_THREADS)")  # left alone
    finally:
        torch.set_num_threads(before)
    assert 1 <= threads.usable_cpus() <= os.cpu_count()


def test_first_log_line_names_threads_and_gemm_route():
    lines = []
    cfg = RunConfig(model="tiny", seq_len=32, mbs=2, gbs=2, steps=1, warmup_steps=0, precision="bf16", device="cpu")
    result = loop.train(cfg, log=lines.append)
    assert result.status == "ok"
    assert "OpenMP wait" in lines[0] and gemm.describe() in lines[0]
    assert result.env["cpu_gemm_route"] == gemm.route() and result.env["cpu_threads"] >= 1
