"""Expert parallelism: each MoE layer's experts spread over ``ep`` data-parallel ranks.

Ranks ``[g·ep, (g+1)·ep)`` of the data-parallel ranks form expert-parallel group g (the ``ep`` and
``ep_replicate`` meshes of :class:`lpbench.parallel.dims.ParallelDims`); rank r of a group holds experts
``[r·E/ep, (r+1)·E/ep)`` of every MoE layer as plain tensors (the other weights stay with DDP or
FSDP2, which leave the experts alone). A layer sorts its (token, expert) pairs by expert, sends each
rank the rows of its experts (``all_to_all_single``: counts, then rows), runs its local experts on
what it received (sorted by local expert, :mod:`lpbench.precision.grouped`) and sends the results
back the same way before the combine.

Gradients: an expert's weight gradient sums the losses of every rank of its group (their tokens
reached it through the exchange), each loss already the mean over that rank's batch; so it is
summed over the replicas of the expert (the same expert in the other groups) and divided by the
data-parallel size, which gives the single-process gradient of the mean loss
(:func:`sync_expert_grads`). The gradient norm sums the experts' squares over the group
(:func:`expert_params`). Experts split by tensor parallelism (:mod:`lpbench.parallel.tp`) are handled
alike: the TP group holds the parts, the data-parallel ranks the replicas. Built on torch.distributed (NCCL or gloo) only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lpbench.models.moe import MoE
from lpbench.precision.grouped import Looped


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``send`` to the ranks of ``group``; ``recv`` rows arrive from each
    (and back in backward)."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


class ExpertParallel:
    """One MoE layer's place in its expert-parallel group (see the module doc)."""

    def __init__(self, group, size: int, rank: int, n_local: int):
        self.group, self.size, self.rank, self.n_local = group, size, rank, n_local

    @torch.compiler.disable  # split sizes are host values: never specialised and recompiled on them
    def exchange(self, xs: torch.Tensor, expert: torch.Tensor, counts: torch.Tensor, run) -> torch.Tensor:
        """``run(rows, local expert ids, n_local)`` on the rows this rank's experts own, for ``xs`` [P, D]
        sorted by global ``expert`` (``counts`` per expert); the results in ``xs``'s order."""
        send_counts = counts.view(self.size, self.n_local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        send = send_counts.sum(1).tolist()
        recv = recv_counts.sum(1).tolist()
        xr = _AllToAll.apply(xs, send, recv, self.group)
        local = torch.arange(self.n_local, device=xs.device).repeat(self.size).repeat_interleave(recv_counts.flatten())
        order = local.argsort(stable=True)
        yr = run(xr[order], local[order], self.n_local)[order.argsort()]
        return _AllToAll.apply(yr, recv, send, self.group)


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> None:
    """Keep this rank's experts of every MoE layer of a meta-device ``model`` (before it is materialised);
    ``mesh``: the expert-parallel group."""
    ep, rank = mesh.size(), mesh.get_local_rank()
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        experts = moe.experts
        n_local = experts.n_experts // ep
        for name, p in list(experts.named_parameters(recurse=False)):
            if not p.is_meta:
                raise ValueError("apply_ep needs a model on the meta device")
            setattr(experts, name, nn.Parameter(torch.empty(n_local, *p.shape[1:], device="meta")))
        if isinstance(experts.gemm, Looped):
            experts.gemm.narrow(n_local * rank, n_local)
        experts.n_experts, experts.first = n_local, n_local * rank
        moe.ep = ExpertParallel(mesh.get_group(), ep, rank, n_local)


def _split_layers(model: nn.Module) -> list[tuple[MoE, object]]:
    """MoE layers whose experts differ across ranks, with the group holding the parts (expert or tensor parallel)."""
    return [
        (m, m.ep.group if m.ep is not None else m.experts.tp.group)
        for m in model.modules()
        if isinstance(m, MoE) and (m.ep is not None or m.experts.tp is not None)
    ]


def expert_params(model: nn.Module) -> tuple[list[nn.Parameter], object]:
    """The expert weights this rank holds under expert or tensor parallelism, and the group holding the
    other parts (([], None) without); data-parallel wrappers leave them to :func:`sync_expert_grads`."""
    layers = _split_layers(model)
    return [p for m, _ in layers for p in m.experts.parameters()], (layers[0][1] if layers else None)


@torch.no_grad()
def sync_expert_grads(model: nn.Module, dp: int, replicas) -> None:
    """Split experts' gradients summed over their replicas (``replicas``: the group of ranks holding the same
    part, ``ep_replicate`` or for TP-split experts ``dp``; None: no other) and divided by the data-parallel size."""
    for moe, _ in _split_layers(model):
        for p in moe.experts.parameters():
            if p.grad is None:
                continue
            if replicas is not None:
                dist.all_reduce(p.grad, group=replicas)
            p.grad.div_(dp)
