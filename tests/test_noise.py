"""Stochastic rounding's keyed draws (lpbench.precision.noise): a function of the key, not of the process's RNG."""

import contextlib
import dataclasses

import pytest
import torch

from lpbench.convert.quantize import apply_recipe
from lpbench.models import build_model
from lpbench.models.registry import MODELS
from lpbench.precision import noise

TINY3 = dataclasses.replace(MODELS["tiny"], n_layers=3)
CPU = torch.device("cpu")


def test_uniforms_are_uniform_and_a_function_of_the_key():
    key = torch.tensor(12345)
    u = noise.uniform(key, (1000, 1000), CPU)
    assert u.min() >= 0 and u.max() < 1
    assert abs(float(u.mean()) - 0.5) < 1e-3 and abs(float(u.var()) - 1 / 12) < 1e-3
    assert torch.equal(u, noise.uniform(key, (1000, 1000), CPU))
    other = noise.uniform(torch.tensor(12346), (1000, 1000), CPU)
    assert float((u == other).float().mean()) < 1e-3
    assert abs(float(torch.corrcoef(torch.stack([u.flatten(), other.flatten()]))[0, 1])) < 5e-3


def _grads(micro_batch: int | None, rng_seed: int, device: torch.device = CPU) -> list[torch.Tensor]:
    """Gradients of one backward of a model with every block in nvfp4 (stochastic rounding of the gradients),
    under the draw key of ``micro_batch`` (None: outside a step), with torch's generator seeded ``rng_seed``. On
    CUDA in BF16 autocast: the fused quantizer's Philox draws (kernels/nvfp4.py), seeded by the key."""
    model = build_model(TINY3, device=device, seed=0)
    apply_recipe(model, "nvfp4-no-bf16-tail", device=device, emulate=True)
    ids = torch.randint(0, TINY3.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)).to(device)
    torch.manual_seed(rng_seed)
    draws = contextlib.nullcontext() if micro_batch is None else noise.drawing(0, 0, micro_batch, device)
    with draws, torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        model(ids, labels=ids).backward()
    return [p.grad for p in model.parameters()]


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_keyed_draws_ignore_the_process_generator_and_follow_the_micro_batch(device):
    device = torch.device(device)
    assert _equal(_grads(0, 1, device), _grads(0, 2, device))  # another process's RNG state: the same draws
    assert not _equal(_grads(0, 1, device), _grads(1, 1, device))  # another micro-batch: other draws
    assert not _equal(_grads(None, 1, device), _grads(None, 2, device))  # outside a step: torch's generator


def test_every_quantized_module_keeps_its_index_through_materialization():
    from lpbench.parallel.plan import materialize

    model = build_model(TINY3, device="meta")
    apply_recipe(model, "nvfp4-no-bf16-tail", device="cpu", emulate=True)
    materialize(model, CPU, 0)  # to_empty leaves buffers undefined; materialize zeroes them, then restores these
    indices = [int(b) for name, b in model.named_buffers() if name.endswith("noise_index")]
    assert indices == list(range(4 * TINY3.n_layers))  # qkv, out, gate+up, down of each block, in order
