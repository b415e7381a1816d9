"""``lpbench slurm``: write an sbatch script that runs ``lpbench run`` on N nodes x G GPUs.

Two launchers: ``torchrun`` (default; one srun task per node starts G workers, c10d rendezvous
at the first node) or ``srun`` (one task per GPU; lpbench reads ``SLURM_PROCID`` /
``SLURM_STEP_NUM_TASKS`` / ``SLURM_LOCALID``). Both rendezvous at ``MASTER_ADDR:MASTER_PORT``,
taken from the job's first node and its id. ``--container`` runs the step in a Pyxis/enroot
image with the submit directory mounted and used as the working directory.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from lpbench.errors import UsageError
from lpbench.parallel.env import NO_MULTICAST_ENV

LAUNCHERS = ("torchrun", "srun")


def sbatch_script(run_args: list[str], *, nodes: int, gpus_per_node: int, launcher: str = "torchrun",
                  container: str | None = None, container_mounts: str | None = None, job_name: str = "lpbench",
                  time: str | None = None, partition: str | None = None, account: str | None = None) -> str:
    """The sbatch script's text (``run_args``: the ``lpbench run`` flags, passed through verbatim)."""
    if launcher not in LAUNCHERS:
        raise UsageError(f"unknown launcher {launcher!r}; valid: {', '.join(LAUNCHERS)}")
    tasks = 1 if launcher == "torchrun" else gpus_per_node
    sbatch = {"job-name": job_name, "nodes": nodes, "ntasks-per-node": tasks, "gpus-per-node": gpus_per_node,
              "exclusive": None, "output": f"{job_name}-%j.log", "time": time, "partition": partition,
              "account": account}
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH --{k}" if k == "exclusive" else f"#SBATCH --{k}={v}" for k, v in sbatch.items()
              if v is not None or k == "exclusive"]
    lines += ["", "set -euo pipefail",
              'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))"]
    lines += [f"export {k}=${{{k}:-{v}}}" for k, v in NO_MULTICAST_ENV.items()]
    srun = ["srun", f"--ntasks-per-node={tasks}"]
    if container:
        mounts = shlex.quote(container_mounts) if container_mounts else '"$SLURM_SUBMIT_DIR:$SLURM_SUBMIT_DIR"'
        srun += [f"--container-image={shlex.quote(container)}", f"--container-mounts={mounts}",
                 '--container-workdir="$SLURM_SUBMIT_DIR"']
    python = "python" if container else shlex.quote(sys.executable)
    if launcher == "torchrun":
        cmd = [python, "-m", "torch.distributed.run", '--nnodes="$SLURM_NNODES"',
               f"--nproc-per-node={gpus_per_node}", "--rdzv-backend=c10d",
               '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"', '--rdzv-id="$SLURM_JOB_ID"']
    else:
        cmd = [python]
    cmd += ["-m", "lpbench", "run", *map(shlex.quote, run_args)]
    lines += ["", " \\\n    ".join([" ".join(srun), " ".join(cmd)]), ""]
    return "\n".join(lines)


def cmd_slurm(args) -> int:
    from lpbench.cli import Parser, add_run_args, configs_from_args

    if args.nodes <= 0 or args.gpus_per_node <= 0:
        raise UsageError("--nodes and --gpus-per-node must be positive")
    run_args = [a for i, a in enumerate(args.run_args) if not (i == 0 and a == "--")]
    if any(a.startswith("--nproc-per-node") for a in run_args):
        raise UsageError("leave --nproc-per-node out of the run flags: the script launches the processes")
    run_parser = Parser(prog="lpbench slurm ... -- <lpbench run flags>")
    add_run_args(run_parser)
    configs_from_args(run_parser.parse_args(run_args), world_size=args.nodes * args.gpus_per_node)
    script = sbatch_script(run_args, nodes=args.nodes, gpus_per_node=args.gpus_per_node, launcher=args.launcher,
                           container=args.container, container_mounts=args.container_mounts,
                           job_name=args.job_name, time=args.time, partition=args.partition, account=args.account)
    Path(args.output).write_text(script)
    print(f"wrote {args.output}: {args.nodes} node(s) x {args.gpus_per_node} GPU(s), {args.launcher} launch\n"
          f"submit it with: sbatch {shlex.quote(args.output)}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("slurm", help="write an sbatch script for a multi-node `lpbench run`",
                       description="Write an sbatch script; the flags after -- are passed to `lpbench run`.")
    p.add_argument("--nodes", type=int, required=True, help="number of nodes")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (processes) per node")
    p.add_argument("--launcher", choices=LAUNCHERS, default="torchrun",
                   help="torchrun: one task per node running torchrun (default); srun: one task per GPU")
    p.add_argument("--container", metavar="IMAGE", help="run in this container image (Pyxis --container-image)")
    p.add_argument("--container-mounts", help="Pyxis --container-mounts (default: the submit directory)")
    p.add_argument("--job-name", default="lpbench", help="job name, also the log file's prefix (default lpbench)")
    p.add_argument("--time", help="time limit, e.g. 01:00:00")
    p.add_argument("--partition", help="Slurm partition")
    p.add_argument("--account", help="Slurm account")
    p.add_argument("--output", default="lpbench.sbatch", help="script file to write (default lpbench.sbatch)")
    p.add_argument("run_args", nargs=argparse.REMAINDER, help="-- then the `lpbench run` flags")
    p.set_defaults(func=cmd_slurm)
