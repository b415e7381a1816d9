import importlib.util
import json
import socket
from pathlib import Path

import lpbench  # noqa: F401  (first: sets OpenMP's wait policy before torch loads OpenMP)
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow",
        action="store_true",
        help="also run the tests marked slow (minutes each on a 2-core CPU; left out by default)",
    )


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_slow = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)


@pytest.fixture
def one_thread(monkeypatch):
    """The test's own (single-process) runs on one thread, as spawned ranks run: a CPU GEMM's sums depend on the
    thread count, so bit-for-bit comparisons need the same count on both sides. ``OMP_NUM_THREADS`` too: a run
    sets its threads from it (:func:`lpbench.threads.configure`), else from the CPUs."""
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def precise_casts():
    """Compiled code rounds where eager code rounds, as ``lpbench run`` configures inductor."""
    import torch._inductor.config

    with torch._inductor.config.patch(emulate_precision_casts=True):
        yield


@pytest.fixture(scope="session")
def benchmark_script():
    """Loads ``benchmarks/<name>.py`` as a module (the scripts are not a package): ``benchmark_script(name)``."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def spawn_ranks():
    """Runs ``worker(rank, *args)`` (a module-level function) in ``nprocs`` processes of one gloo world on a free
    local port, one thread each (``_dist.run_rank``); returns what each rank's call returned, in rank order, as
    JSON makes it: ``spawn_ranks(worker, nprocs, out, *args)``, ``out`` the folder the ranks write it to."""
    import torch.multiprocessing as mp

    from _dist import run_rank

    def spawn(worker, nprocs: int, out: Path, *args) -> list:
        for attempt in range(3):  # the free port may be taken before rank 0 listens on it (tests running beside)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            try:
                mp.spawn(run_rank, args=(worker, nprocs, port, str(out), args), nprocs=nprocs, join=True)
                break
            except mp.ProcessRaisedException as exc:
                if "EADDRINUSE" not in str(exc) or attempt == 2:
                    raise
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(nprocs)]

    return spawn
