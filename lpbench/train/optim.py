"""AdamW with decoupled weight decay on matrices only, and linear warm-up + cosine decay.

torch's fused and foreach AdamW update a parameter group with one multi-tensor kernel, which takes
tensors of one kind only: plain tensors, or DTensors of one mesh. A model under FSDP2 with expert
parallelism holds both (FSDP-sharded DTensors, each rank's own experts as plain tensors), as does
TP with tensor-parallel experts; so each decay group is split by kind (:func:`by_kind`).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from lpbench.config import RunConfig


def by_kind(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """``params`` split into lists of one kind each (plain; DTensor per mesh), in order of first appearance;
    ``[params]`` when they are all of one kind."""
    kinds: dict = {}
    for p in params:
        kinds.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(kinds.values()) or [params]


def build_optimizer(model: torch.nn.Module, cfg: RunConfig, fused: bool) -> torch.optim.Optimizer:
    """AdamW (fused with ``fused``, else torch's default: foreach on CUDA), one parameter group per decay and
    kind of tensor (see the module doc)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": same, "weight_decay": decay}
        for decay, chosen in (
            (cfg.weight_decay, [p for p in params if p.ndim >= 2]),
            (0.0, [p for p in params if p.ndim < 2]),
        )
        for same in by_kind(chosen)
    ]
    return torch.optim.AdamW(groups, lr=cfg.peak_lr, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)


def lr_factor(step: int, cfg: RunConfig) -> float:
    """Multiplier of the peak LR at ``step`` (0-based): linear warm-up, then cosine to min_lr_ratio."""
    warm = cfg.lr_warmup
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, cfg.steps - warm))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: RunConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
