"""Precision recipes as data.

A recipe is a frozen dataclass instance; adding a recipe means adding an instance to
``RECIPES``, never editing branches across the tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lpbench.errors import UsageError


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    compute_dtype: torch.dtype = torch.bfloat16  # autocast dtype of everything not quantized


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("bf16", "BF16 GEMMs, FP32 master weights and optimizer state (baseline)"),
        Recipe("fp32", "FP32 everywhere (reference)", compute_dtype=torch.float32),
    )
}


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise UsageError(f"unknown precision {name!r}; valid: {', '.join(RECIPES)}") from None


def apply_recipe(model: torch.nn.Module, recipe: Recipe, *, device: torch.device, emulate: bool) -> dict:
    """BF16/FP32 recipes quantize nothing; low-precision recipes arrive with the precision package."""
    return {"path": "native", "quantized": [], "skipped": []}
