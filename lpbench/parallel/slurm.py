"""``lpbench slurm``: write an sbatch script that runs ``lpbench run`` on N nodes x G GPUs.

Two launchers: ``torchrun`` (default; one srun task per node starts G workers, c10d rendezvous
at the first node) or ``srun`` (one task per GPU; lpbench reads ``SLURM_PROCID`` /
``SLURM_STEP_NUM_TASKS`` / ``SLURM_LOCALID``). Both rendezvous at ``MASTER_ADDR:MASTER_PORT``,
taken from the job's first node and its id. ``--container`` runs the step in a Pyxis/enroot
image with the submit directory mounted and used as the working directory.
"""

from __future__ import annotations

import re
import shlex
import sys

from lpbench.errors import UsageError
from lpbench.parallel.env import NO_MULTICAST_ENV

LAUNCHERS = ("torchrun", "srun")
_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}|\d+-\d+|UNLIMITED|INFINITE")  # Slurm's --time formats
_PLAIN = re.compile(r"[A-Za-z0-9._:%@+,=/-]+")  # needs no quoting in an #SBATCH line


def _directive_value(flag: str, value) -> str:
    """``value`` for an ``#SBATCH --flag=value`` line: as is when plain, else in double quotes, which
    sbatch strips; a newline, a double quote or a backslash (which sbatch's line parser cannot carry) is
    refused."""
    text = str(value)
    if not text or any(c in text for c in '"\\') or any(ord(c) < 32 for c in text):
        raise UsageError(f"--{flag} {text!r}: empty, or holds a newline, a control character, '\"' or '\\'")
    return text if _PLAIN.fullmatch(text) else f'"{text}"'


def sbatch_script(
    run_args: list[str],
    *,
    nodes: int,
    gpus_per_node: int,
    launcher: str = "torchrun",
    container: str | None = None,
    container_mounts: str | None = None,
    job_name: str = "lpbench",
    time: str | None = None,
    partition: str | None = None,
    account: str | None = None,
) -> str:
    """The sbatch script's text (``run_args``: the ``lpbench run`` flags, passed through verbatim)."""
    if launcher not in LAUNCHERS:
        raise UsageError(f"unknown launcher {launcher!r}; valid: {', '.join(LAUNCHERS)}")
    if time is not None and not _TIME.fullmatch(time):
        raise UsageError(f"--time {time!r}: not a Slurm time (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS)")
    for what, value in (
        ("--container", container),
        ("--container-mounts", container_mounts),
        *(("the run flag", a) for a in run_args),
    ):
        if value is not None and any(ord(c) < 32 for c in value):
            raise UsageError(f"{what} {value!r} holds a newline or a control character")
    tasks = 1 if launcher == "torchrun" else gpus_per_node
    sbatch = {
        "job-name": job_name,
        "nodes": nodes,
        "ntasks-per-node": tasks,
        "gpus-per-node": gpus_per_node,
        "exclusive": None,
        "output": f"{job_name}-%j.log",
        "time": time,
        "partition": partition,
        "account": account,
    }
    lines = ["#!/bin/bash"]
    lines += [
        f"#SBATCH --{k}" if k == "exclusive" else f"#SBATCH --{k}={_directive_value(k, v)}"
        for k, v in sbatch.items()
        if v is not None or k == "exclusive"
    ]
    lines += [
        "",
        "set -euo pipefail",
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
    ]
    lines += [f"export {k}=${{{k}:-{v}}}" for k, v in NO_MULTICAST_ENV.items()]
    srun = ["srun", f"--ntasks-per-node={tasks}"]
    if container:
        mounts = shlex.quote(container_mounts) if container_mounts else '"$SLURM_SUBMIT_DIR:$SLURM_SUBMIT_DIR"'
        srun += [
            f"--container-image={shlex.quote(container)}",
            f"--container-mounts={mounts}",
            '--container-workdir="$SLURM_SUBMIT_DIR"',
        ]
    python = "python" if container else shlex.quote(sys.executable)
    if launcher == "torchrun":
        cmd = [
            python,
            "-m",
            "torch.distributed.run",
            '--nnodes="$SLURM_NNODES"',
            f"--nproc-per-node={gpus_per_node}",
            "--rdzv-backend=c10d",
            '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"',
            '--rdzv-id="$SLURM_JOB_ID"',
        ]
    else:
        cmd = [python]
    cmd += ["-m", "lpbench", "run", *map(shlex.quote, run_args)]
    lines += ["", " \\\n    ".join([" ".join(srun), " ".join(cmd)]), ""]
    return "\n".join(lines)
