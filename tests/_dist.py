"""One rank of a spawned CPU world for the tests: conftest's ``spawn_ranks`` starts each rank in :func:`run_rank`.

A module of its own, not part of conftest.py: ``torch.multiprocessing.spawn`` starts fresh interpreters, which
import the function they run by its module's name, and conftest is pytest's to import.
"""

import json
import os
from pathlib import Path

import torch


def run_rank(rank: int, worker, world: int, port: int, out: str, args: tuple) -> None:
    """Joins a gloo world of ``world`` ranks meeting on ``port``, on one thread (as the single-process references
    the tests compare with: a CPU GEMM's sums depend on the thread count); runs ``worker(rank, *args)`` and writes
    what it returns (JSON) to ``out/rank{rank}.json``; leaves the world."""
    from lpbench.parallel.env import init_distributed, shutdown

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",  # a run sets its threads from it (lpbench.threads.configure)
    )
    torch.set_num_threads(1)
    init_distributed("cpu")
    results = worker(rank, *args)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    shutdown()  # all ranks meet first: a rank leaving mid-collective aborts its peer
