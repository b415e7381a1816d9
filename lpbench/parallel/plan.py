"""``parallelize``: one model, one config -> the module to train on a ``(dp, tp)`` device mesh.

Order (torchtitan's): tensor parallel on the ``tp`` mesh, ``torch.compile``, then FSDP2 or DDP
on the ``dp`` mesh. Every rank builds the same full model from the same seed
before sharding, so all layouts start from identical weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lpbench.config import RunConfig
from lpbench.parallel.dp import apply_ddp, apply_fsdp
from lpbench.parallel.tp import apply_tp


@dataclass
class Parallelized:
    module: nn.Module  # the model, DDP- or FSDP-wrapped: its parameters, train(), gradient sync
    forward: nn.Module  # what to call: ``module``, or ``module`` compiled
    mesh: DeviceMesh | None  # ("dp", "tp"); None for one process
    dp_rank: int  # which data shard this rank reads (TP ranks of one DP group read the same)


@lru_cache(maxsize=None)
def device_mesh(device_type: str, dp: int, tp: int) -> DeviceMesh:
    """The 2-D ``("dp", "tp")`` mesh (TP ranks adjacent, so a TP group stays inside a node)."""
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))


def parallelize(model: nn.Module, cfg: RunConfig, device: torch.device, compute_dtype: torch.dtype,
                use_compile: bool) -> Parallelized:
    """Apply ``cfg``'s TP / FSDP / DDP to ``model`` in place, and ``torch.compile``.

    One process or DDP: the whole model is compiled (DDP through Dynamo's DDPOptimizer), so
    scaling is measured on the same compiled program. FSDP2 or TP: each block is compiled
    before wrapping, as torchtitan does; the embedding, head and loss run eagerly.
    """
    if cfg.world_size == 1:
        return Parallelized(model, torch.compile(model) if use_compile else model, None, 0)
    mesh = device_mesh(device.type, cfg.dp, cfg.tp)
    whole = cfg.tp == 1 and not cfg.fsdp
    if cfg.tp > 1:
        apply_tp(model, mesh["tp"], cfg.sequence_parallel)
    if use_compile and not whole:
        for block in model.layers:
            block.compile(fullgraph=True)
        if cfg.tp > 1:  # torch 2.13: a compiled block fed a DTensor's own local tensor fails in backward
            model.tok_embeddings.register_forward_hook(lambda module, args, out: out.clone())
    module = model
    if cfg.dp > 1 and cfg.fsdp:
        module = apply_fsdp(model, mesh["dp"], compute_dtype if device.type == "cuda" else None)
    elif cfg.dp > 1:
        module = apply_ddp(model, mesh["dp"], device)
    forward = torch.compile(module) if use_compile and whole else module
    return Parallelized(module, forward, mesh, mesh["dp"].get_local_rank())
