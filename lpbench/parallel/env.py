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

from lpbench.errors import UsageError

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
    """The launch this process belongs to, read from the environment (nothing is initialised); a launch
    variable that is not a whole number, or a rank outside the world, is a UsageError naming it."""
    env = os.environ if env is None else env
    for launcher, (rank, local, size) in _LAUNCH_VARS.items():
        if rank in env and size in env:
            world = World(_count(env, rank), _count(env, local, 0), _count(env, size), launcher)
            if world.size < 1 or world.rank >= world.size:
                raise UsageError(
                    f"{rank}={env[rank]} with {size}={env[size]}: not a rank of the launch "
                    f"(set by {launcher}; unset them to run one process)"
                )
            return world
    return World()


_LAUNCH_VARS = {
    "torchrun": ("RANK", "LOCAL_RANK", "WORLD_SIZE"),
    "slurm": ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS"),
}


def _count(env, name: str, default: int | None = None) -> int:
    """``env[name]`` as a whole number >= 0 (``default`` when unset)."""
    text = env.get(name)
    if text is None and default is not None:
        return default
    if not (text or "").strip().isdigit() or len(text.strip()) > 9:
        raise UsageError(
            f"{name}={text!r} in the environment: not a rank or process count (set by torchrun or "
            "srun; unset it to run one process)"
        )
    return int(text)


def is_main_process() -> bool:
    """Whether this process speaks for the launch (rank 0, or not launched); True when the launch
    variables are unusable, so that the error naming them is shown."""
    try:
        return detect_world().is_main
    except UsageError:
        return True


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
