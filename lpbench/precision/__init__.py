"""Precision: number formats, reference quantizers, recipes, the quantized Linear, the layer policy.

``quantize_dequantize`` and ``quant_error_table`` are the public tools for studying
quantization error; both run the same reference quantizers the training path uses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lpbench.precision.quantize import quantize
from lpbench.precision.recipes import RECIPES, ROLES, Recipe, get_recipe

DISTRIBUTIONS = ("gaussian", "student-t", "outlier-channel")

__all__ = [
    "DISTRIBUTIONS",
    "RECIPES",
    "ROLES",
    "Recipe",
    "get_recipe",
    "quant_error_table",
    "quantize_dequantize",
    "sample_tensor",
]


def quantize_dequantize(
    x: torch.Tensor, recipe: str | Recipe, role: str, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The FP32 tensor that ``recipe``'s GEMM sees for operand ``role`` (input, weight or grad).

    Blocks run along the last dim (leading dims are flattened into rows): input and weight as
    in the forward GEMM (2-D blocks for weights where the recipe has them), grad as in the
    dgrad GEMM (stochastically rounded where the recipe says so, drawing from ``generator``).
    No Hadamard transform (it only rotates wgrad operands); delayed scaling has no history
    here, so it scales like current scaling; unquantized recipes round to their compute dtype.
    """
    r = get_recipe(recipe) if isinstance(recipe, str) else recipe
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if not r.quantized:
        return x.to(r.compute_dtype).float()
    spec = r.operand(role, "dgrad" if role == "grad" else "fprop")
    q = quantize(x.reshape(-1, x.shape[-1]), spec, generator=generator)
    return q.dequantize().reshape(x.shape)


def sample_tensor(distribution: str, shape: tuple[int, int] = (512, 1024), *, seed: int = 0) -> torch.Tensor:
    """A test tensor: ``gaussian``, ``student-t`` (3 degrees of freedom, heavy tails) or
    ``outlier-channel`` (Gaussian with 1% of the last-dim channels 100× larger)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=g)
    if distribution == "gaussian":
        return z
    if distribution == "student-t":
        chi2 = torch.randn((3, *shape), generator=g).pow(2).sum(0)
        return z / (chi2 / 3).sqrt()
    if distribution == "outlier-channel":
        cols = torch.randperm(shape[-1], generator=g)[: max(1, shape[-1] // 100)]
        z[..., cols] *= 100
        return z
    raise ValueError(f"unknown distribution {distribution!r}; valid: {', '.join(DISTRIBUTIONS)}")


def quant_error_table(
    recipes: Sequence[str] | None = None,
    roles: Sequence[str] = ROLES,
    distributions: Sequence[str] = DISTRIBUTIONS,
    *,
    shape: tuple[int, int] = (512, 1024),
    seed: int = 0,
) -> list[dict]:
    """One row per (distribution, recipe, role): relative L2 error ‖q(x) − x‖ / ‖x‖ and
    SQNR = −20·log10(relative error) in dB (inf when exact)."""
    rows = []
    for dist in distributions:
        x = sample_tensor(dist, shape, seed=seed)
        for name in recipes or RECIPES:
            for role in roles:
                try:
                    q = quantize_dequantize(x, name, role, generator=torch.Generator().manual_seed(seed))
                except ValueError as exc:
                    raise ValueError(f"{name} {role}: {exc}") from None
                rel = ((q.double() - x.double()).norm() / x.double().norm()).item()
                sqnr = -20 * math.log10(rel) if rel > 0 else math.inf
                rows.append({"recipe": name, "role": role, "distribution": dist, "rel_error": rel, "sqnr_db": sqnr})
    return rows
