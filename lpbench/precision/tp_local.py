"""GEMMs on tensor-parallel shards: what a Linear subclass with its own GEMMs needs under TP.

Here, below :mod:`lpbench.parallel`, because the linears that call it (the quantized linear, the
decoder's CPU-route linear) must not import the layer that shards them (ARCHITECTURE.md, Layers).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard


def local_linear(module: nn.Linear, x: torch.Tensor, fn) -> torch.Tensor:
    """Run ``fn(x, weight, bias)`` on the plain local shards of a tensor-parallel linear.

    For a Linear subclass with its own GEMMs (a quantized linear): call this from ``forward``
    and declare ``tp_aware = True`` (:func:`lpbench.parallel.tp.apply_tp` refuses Linear subclasses without it).
    Column-wise (weight ``Shard(0)``): the output is ``Shard(-1)``. Row-wise (``Shard(1)``):
    a partial sum, reduced by the parallel style, with the replicated bias added after the
    reduction. Not tensor parallel: ``fn`` on the module's own tensors. Differentiable.
    """
    w, b = module.weight, module.bias
    if not isinstance(w, DTensor):
        return fn(x, w, b)
    mesh, (placement,) = w.device_mesh, w.placements
    if placement == Shard(0):  # column-wise: x replicated, its gradient a partial sum over ranks
        y = fn(x.to_local(grad_placements=[Partial()]), w.to_local(), None if b is None else b.to_local())
        return DTensor.from_local(y, mesh, [Shard(y.dim() - 1)], run_check=False)
    if placement == Shard(1):  # row-wise: x sharded on its last dim, the output a partial sum
        y = DTensor.from_local(fn(x.to_local(), w.to_local(), None), mesh, [Partial()], run_check=False)
        return y if b is None else y + b
    raise ValueError(f"local_linear: unsupported weight placement {placement}")
