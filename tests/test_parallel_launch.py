"""Launch: world detection, torchrun re-launch from `lpbench run`, size errors, `lpbench slurm` scripts."""

import json
import os
import socket
import sqlite3
import subprocess
import sys

import pytest

from lpbench.cli import main
from lpbench.parallel.env import World, detect_world
from lpbench.parallel.launch import launch_env

TINY = [
    "--precision",
    "bf16",
    "--model",
    "tiny",
    "--seq-len",
    "32",
    "--mbs",
    "2",
    "--gbs",
    "8",
    "--steps",
    "3",
    "--warmup-steps",
    "1",
    "--device",
    "cpu",
]


def test_world_comes_from_torchrun_then_srun_then_defaults():
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}
    assert detect_world(torchrun) == World(3, 1, 8, "torchrun")
    assert detect_world({"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "16", "SLURM_LOCALID": "5"}) == World(
        5, 5, 16, "slurm"
    )
    assert detect_world({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) == World()  # a batch shell, not an srun step


def test_launched_processes_get_multicast_off_unless_set():
    env = launch_env({"NCCL_NVLS_ENABLE": "1"})
    assert env["NCCL_NVLS_ENABLE"] == "1"
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NVSHMEM_DISABLE_NVLS"] == "1"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tp", "3"], "world size 1 is not divisible by --tp 3"),
        (["--nproc-per-node", "4", "--tp", "4"], "--tp 4 does not divide tiny's 2 kv heads"),
        (["--nproc-per-node", "4", "--tp", "8"], "world size 4 is not divisible by --tp 8"),
        (
            ["--model", "small", "--nproc-per-node", "2", "--tp", "2", "--seq-len", "33"],
            "--seq-len (33) divisible by --tp 2",
        ),
        (
            ["--nproc-per-node", "2", "--gbs", "6", "--mbs", "2"],
            "global batch 6 is not divisible by micro batch 2 x data-parallel size 2",
        ),
        (["--nproc-per-node", "4", "--tp", "2", "--dp", "4"], "--dp 4 x --tp 2 = 8 ranks, but the world size is 4"),
        (["-tp", "0"], "--tp must be positive"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be positive"),
    ],
)
def test_invalid_parallel_sizes_exit_2_before_launching(argv, message, capsys, tmp_path):
    assert main(["run", "--model", "tiny", *argv, "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "results.db").exists()


def _gbs(n: int) -> list[str]:
    """TINY with global batch ``n``: one micro-batch per rank and step (no accumulation to wait for)."""
    at = TINY.index("--gbs") + 1
    return [*TINY[:at], str(n), *TINY[at + 1 :]]


def test_nproc_per_node_relaunches_through_torchrun_and_rank0_reports(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lpbench",
            "run",
            *_gbs(4),
            "--nproc-per-node",
            "2",
            "--fsdp",
            "--results",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("train_step_timing in s:") == 3  # per-step lines from rank 0 only
    assert out.stdout.count("lpbench run ") == 1 and "2 ranks (torchrun) | dp 2 (fsdp) x tp 1" in out.stdout
    with sqlite3.connect(tmp_path / "results.db") as db:
        rows = db.execute("SELECT num_gpus, config_json, metrics_json FROM runs").fetchall()
    assert len(rows) == 1 and rows[0][0] == 2
    config, metrics = json.loads(rows[0][1]), json.loads(rows[0][2])
    assert (config["dp"], config["tp"], config["fsdp"]) == (2, 1, True)
    assert (metrics["world_size"], metrics["dp"], metrics["fsdp"]) == (2, 2, 2)


def test_the_same_command_runs_as_one_srun_task_per_gpu(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "lpbench", "run", *_gbs(2), "--tp", "2", "--results", str(tmp_path)],
            env={
                **os.environ,
                "OMP_NUM_THREADS": "1",  # two ranks on the CI's two cores
                "SLURM_PROCID": str(r),
                "SLURM_LOCALID": str(r),
                "SLURM_JOB_ID": "7",
                "SLURM_STEP_NUM_TASKS": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    (out0, err0), (out1, _) = (p.communicate(timeout=300) for p in procs)
    assert [p.returncode for p in procs] == [0, 0], err0[-2000:]
    assert out0.count("train_step_timing in s:") == 3 and "2 ranks (slurm) | dp 1 (ddp) x tp 2" in out0
    assert out1 == ""  # rank 1 neither logs nor prints the table
    with sqlite3.connect(tmp_path / "results.db") as db:
        assert db.execute("SELECT num_gpus FROM runs").fetchall() == [(2,)]


def _slurm(tmp_path, *argv) -> str:
    script = tmp_path / "job.sbatch"
    assert main(["slurm", "--output", str(script), *argv]) == 0
    return script.read_text()


def test_slurm_torchrun_script(tmp_path, capsys):
    text = _slurm(
        tmp_path,
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--container",
        "nvcr.io/nvidia/pytorch:25.09-py3",
        "--time",
        "00:30:00",
        "--",
        "--model",
        "llama3-8b",
        "--seq-len",
        "8192",
        "--mbs",
        "1",
        "--gbs",
        "128",
        "--tp",
        "2",
        "--fsdp",
        "--precision",
        "bf16,fp8-tensorwise",
    )
    assert f"sbatch {tmp_path / 'job.sbatch'}" in capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    sbatch = [line for line in lines if line.startswith("#SBATCH")]
    for want in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--time=00:30:00"):
        assert f"#SBATCH {want}" in sbatch
    assert lines.index(sbatch[-1]) < next(i for i, line in enumerate(lines) if line.startswith("srun"))
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    assert "export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}" in text
    assert "--container-image=nvcr.io/nvidia/pytorch:25.09-py3" in text
    assert (
        'python -m torch.distributed.run --nnodes="$SLURM_NNODES" --nproc-per-node=8 --rdzv-backend=c10d '
        '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"'
    ) in text
    assert text.rstrip().endswith(
        "-m lpbench run --model llama3-8b --seq-len 8192 --mbs 1 --gbs 128 --tp 2 --fsdp "
        "--precision bf16,fp8-tensorwise"
    )
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0


def test_slurm_srun_per_task_script_quotes_run_args(tmp_path):
    text = _slurm(
        tmp_path,
        "--nodes",
        "1",
        "--gpus-per-node",
        "4",
        "--launcher",
        "srun",
        "--",
        "--model",
        "tiny",
        "--mbs",
        "2",
        "--gbs",
        "8",
        "--data",
        "my corpus.jsonl",
    )
    assert "#SBATCH --ntasks-per-node=4" in text and "torch.distributed.run" not in text
    assert text.rstrip().endswith("-m lpbench run --model tiny --mbs 2 --gbs 8 --data 'my corpus.jsonl'")
    assert "srun --ntasks-per-node=4" in text


def test_slurm_validates_run_args_for_the_whole_job(tmp_path, capsys):
    script = tmp_path / "job.sbatch"
    assert (
        main(
            [
                "slurm",
                "--nodes",
                "2",
                "--gpus-per-node",
                "8",
                "--output",
                str(script),
                "--",
                "--model",
                "llama3-8b",
                "--tp",
                "3",
            ]
        )
        == 2
    )
    assert "world size 16 is not divisible by --tp 3" in capsys.readouterr().err
    assert not script.exists()
