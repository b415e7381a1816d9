import lpbench  # noqa: F401  (first: sets OpenMP's wait policy before torch loads OpenMP)
import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true",
                     help="also run the tests marked slow (minutes each on a 2-core CPU; left out by default)")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_slow = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)


@pytest.fixture
def precise_casts():
    """Compiled code rounds where eager code rounds, as ``lpbench run`` configures inductor."""
    import torch._inductor.config

    with torch._inductor.config.patch(emulate_precision_casts=True):
        yield
