"""What lpbench promises under hostile input and faults (README, "Faults"): paths, signals, launches, text.

Checkpoint faults are in test_checkpoint.py, store faults in test_store.py, spec faults in
test_sweep.py.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lpbench.cli import main

TINY = ["--model", "tiny", "--precision", "bf16", "--device", "cpu", "--seq-len", "32", "--mbs", "2", "--gbs", "2",
        "--steps", "2", "--warmup-steps", "1"]


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _one_line_exit_2(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv,message", [
    (["run", *TINY, "--results", "{file}"], "--results {file}: a file is there, not a folder"),
    (["run", *TINY, "--results", "{file}/results"], "--results {file}/results: cannot create it ({file} is a file"),
    (["run", *TINY, "--results", "{out}", "--save-every", "1", "--save-dir", "{file}/ckpt"], "--save-dir {file}/ckpt"),
    (["sweep", "{spec}", "--results", "{file}"], "--results {file}: a file is there"),
    (["converge", "--model", "tiny", "--results", "{file}"], "--results {file}: a file is there"),
    (["converge", "--model", "tiny", "--results", "{out}", "--plot", "{dir}"], "--plot {dir}: a folder, not a file"),
    (["report", "--results", "{db}", "--html", "{dir}"], "--html {dir}: a folder, not a file"),
    (["report", "--results", "{db}", "--plots", "{file}"], "--plots {file}: a file is there, not a folder"),
    (["report", "--results", "{db}", "--html", "{file}/page.html"], "--html {file}/page.html: cannot create it ({file} is a file"),
    (["data", "prepare", "--input", "{text}", "--output-prefix", "{file}/data"], "--output-prefix {file}/data.bin: cannot create it"),
    (["data", "prepare", "--input", "{text}", "--output-prefix", "{dir}/x"], "--output-prefix {dir}/x.bin: a folder"),
    (["data", "tokenizer", "--input", "{text}", "--vocab-size", "300", "--output", "{dir}"], "--output {dir}: a folder, not a file"),
    (["slurm", "--nodes", "1", "--gpus-per-node", "1", "--output", "{dir}", "--", "--model", "tiny"],
     "--output {dir}: a folder, not a file"),
])
def test_every_output_path_is_checked_before_work_and_nothing_is_created(argv, message, tmp_path, capsys):
    from lpbench.bench.store import ResultsStore

    (tmp_path / "file").write_text("a file")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x.bin").mkdir()
    (tmp_path / "text.txt").write_text("some words to tokenize\n\nand more words\n" * 20)
    (tmp_path / "spec.yaml").write_text("name: s\nmodel: tiny\nprecision: bf16\nsteps: 2\nwarmup_steps: 1\n")
    ResultsStore(tmp_path / "db").close()
    names = dict(file=tmp_path / "file", dir=tmp_path / "dir", text=tmp_path / "text.txt", db=tmp_path / "db",
                 spec=tmp_path / "spec.yaml", out=tmp_path / "out")
    before = _tree(tmp_path)
    err = _one_line_exit_2([a.format(**names) for a in argv], capsys)
    assert message.format(**names) in err
    assert _tree(tmp_path) == before  # no database, no folder, no temporary file


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_run_rejected_on_the_way_creates_no_database(tmp_path, capsys):
    err = _one_line_exit_2(["run", *TINY[:-8], "--device", "cuda", "--results", str(tmp_path / "results")], capsys)
    assert "no CUDA device" in err and not (tmp_path / "results").exists()


def test_sigterm_of_run_says_what_happened(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "lpbench", "run", *TINY[:-4], "--steps", "100000",
                             "--warmup-steps", "1", "--results", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # wait until training runs
        if line.startswith("iteration"):
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and err.strip().splitlines()[-1] == "lpbench: terminated (SIGTERM)", err
    assert "Traceback" not in err


def test_a_launched_run_fails_with_lpbench_s_line_not_torchrun_s_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lpbench", "run", *TINY, "--gbs", "4", "--nproc-per-node", "2",
                          "--data", str(tmp_path / "missing.jsonl"), "--results", str(tmp_path / "results")],
                         capture_output=True, text=True, timeout=300)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and not ln.startswith(("*****", "Setting OMP"))]
    assert out.returncode == 2 and len(lines) == 1 and "--data" in lines[0], out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "results").exists()
