"""``lpbench run --nproc-per-node N``: re-launch the same command line through torchrun.

Inside a launch (our own torchrun, an external torchrun, or srun) the flag is ignored and the
world comes from the environment (:mod:`lpbench.parallel.env`). Launched processes get NVLink
multicast switched off (NCCL NVLS, symmetric-memory and NVSHMEM multicast) unless the user set
those variables.
"""

from __future__ import annotations

import os
import signal
import sys

from lpbench.errors import Terminated, UsageError
from lpbench.parallel.env import NO_MULTICAST_ENV, detect_world


def launch_env(base: dict | None = None) -> dict:
    """``base`` (default: this process's environment) plus the multicast switches it lacks."""
    env = dict(os.environ if base is None else base)
    for key, value in NO_MULTICAST_ENV.items():
        env.setdefault(key, value)
    return env


def planned_world(nproc_per_node: int | None) -> int:
    """World size of this run: the launch's, else ``nproc_per_node`` (to be launched), else 1."""
    if nproc_per_node is not None and nproc_per_node <= 0:
        raise UsageError(f"--nproc-per-node must be positive, got {nproc_per_node}")
    world = detect_world()
    return world.size if world.launcher != "none" else nproc_per_node or 1


def needs_relaunch(nproc_per_node: int | None) -> bool:
    return (nproc_per_node or 1) > 1 and detect_world().launcher == "none"


def relaunch(nproc_per_node: int, argv: list[str] | None = None) -> int:
    """Run ``lpbench <argv>`` (default: this command line) as ``nproc_per_node`` torchrun workers.

    torchrun's launcher runs in this process (``elastic_launch``, as ``torchrun --standalone``)
    with its logging silenced: a worker's failure is reported by the worker (one line for bad
    input), not by torchrun's traceback, and its exit code is the command's.
    """
    import logging
    import uuid

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    argv = sys.argv[1:] if argv is None else argv
    if not any(a.startswith("--nproc-per-node") for a in argv):
        raise UsageError("--nproc-per-node re-launches the lpbench command line; from Python, start torchrun yourself")
    os.environ.update(launch_env())
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several workers
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)  # each has its own level: silence them one by one
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        run_id=str(uuid.uuid4()),
        rdzv_endpoint="localhost:0",
        rdzv_backend="c10d",
        max_restarts=0,
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "lpbench", *argv)
    except ChildFailedError as exc:
        code = exc.get_first_failure()[1].exitcode
        return 128 - code if code < 0 else code  # killed by a signal: the shell's 128 + N
    except SignalException as exc:  # the launcher stopped the workers on Ctrl-C or SIGTERM: say which
        raise (Terminated if exc.sigval == signal.SIGTERM else KeyboardInterrupt)() from None
    return 0
