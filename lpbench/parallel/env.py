"""Who am I in the job: rank and world from torchrun or srun, process-group set-up, small reductions.

Launchers, in order of precedence: torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), then one
srun task per GPU (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``; rendezvous at
``MASTER_ADDR:MASTER_PORT``, which default to the first node of the step and a port derived from
the job id). Anything else is a single process. Backend: NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import gc
import os
import subprocess
from dataclasses import dataclass

import torch
import torch.distributed as dist

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class World:
    rank: int = 0
    local_rank: int = 0
    size: int = 1
    launcher: str = "none"  # none | torchrun | slurm

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def cuda_index(self) -> int:
        """This rank's GPU (the local rank; modulo the visible GPUs where each task sees only its own)."""
        return self.local_rank % max(1, torch.cuda.device_count())


def detect_world(env: dict | None = None) -> World:
    """The launch this process belongs to, read from the environment (nothing is initialised)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return World(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"]), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        return World(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)),
                     int(env["SLURM_STEP_NUM_TASKS"]), "slurm")
    return World()


def _slurm_rendezvous() -> None:
    """Export MASTER_ADDR/PORT for srun-per-task launches where the script did not."""
    if "MASTER_ADDR" not in os.environ:
        nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "localhost")
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, timeout=30)
            os.environ["MASTER_ADDR"] = out.stdout.split()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            os.environ["MASTER_ADDR"] = nodes.split(",")[0]
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", 0)) % 20000))


def init_distributed(device_type: str) -> World:
    """Join the job's process group (once) and pin this rank's GPU; a no-op for one process."""
    world = detect_world()
    if world.size == 1 or dist.is_initialized():
        return world
    if world.launcher == "slurm":
        _slurm_rendezvous()
        os.environ.setdefault("LOCAL_RANK", str(world.local_rank))  # read by DeviceMesh
    if device_type == "cuda":
        torch.cuda.set_device(world.cuda_index)
        for key, value in NO_MULTICAST_ENV.items():  # NVLink multicast off unless the user says otherwise
            os.environ.setdefault(key, value)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=world.rank, world_size=world.size)
    return world


def shutdown() -> None:
    """Leave the process group (end of ``lpbench run``): garbage collected first, so that no finished run's
    reference cycles (sharded models, DTensors, optimizer state) still hold the groups, then a barrier, so
    that no rank tears its connections down while a peer is in its last collective; then destroyed.
    benchmarks/RESULTS.md ("Notes behind the code") says why each step is there."""
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def all_reduce(values: list[float], op: str, device: torch.device, group=None) -> list[float]:
    """Sum or max of a few floats over the ranks of ``group`` (default: all; the values themselves when not
    distributed)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return t.tolist()
