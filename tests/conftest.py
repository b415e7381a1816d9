import lpbench  # noqa: F401  (first: sets OpenMP's wait policy before torch loads OpenMP)
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def precise_casts():
    """Compiled code rounds where eager code rounds, as ``lpbench run`` configures inductor."""
    import torch._inductor.config

    with torch._inductor.config.patch(emulate_precision_casts=True):
        yield
