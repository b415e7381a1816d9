"""AdamW with decoupled weight decay on matrices only, and linear warm-up + cosine decay."""

from __future__ import annotations

import math

import torch

from lpbench.config import RunConfig


def build_optimizer(model: torch.nn.Module, cfg: RunConfig, fused: bool) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
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
