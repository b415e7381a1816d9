"""Expert parallelism: each MoE layer's experts spread over ``ep`` data-parallel ranks.

Ranks ``[g·ep, (g+1)·ep)`` of the data-parallel ranks form expert-parallel group g (the ``ep`` and
``ep_replicate`` meshes of :class:`lpbench.parallel.dims.ParallelDims`); rank r of a group holds experts
``[r·E/ep, (r+1)·E/ep)`` of every MoE layer as plain tensors (the other weights stay with DDP or
FSDP2, which leave the experts alone). A layer sorts its (token, expert) pairs by expert, sends each
rank the rows of its experts (``all_to_all_single``: counts, then rows), places what it received in its experts'
buffer by local expert (each rank's rows arrive sorted by local expert: :meth:`lpbench.models.moe.Groups.of_blocks`,
no second sort), runs its local experts (:mod:`lpbench.precision.grouped`) and sends the results back in the order
the rows came, before the combine. The two exchanges (:meth:`ExpertParallel.dispatch`, ``combine``) run
outside torch.compile, as their split sizes are host values (one host synchronisation a layer); the experts
between them run in the caller's code, compiled with the block (the received rows' count a dynamic size).

Overlap (``--ep-chunks C``): a rank's experts are split into C contiguous groups; every group's rows are sent
at once, asynchronously, and each group's experts run as soon as its rows arrived, while the later groups' rows
and the earlier groups' results are still in flight (in backward the same, the engine running the nodes in
reverse). torch.compile skips the loop over the groups but compiles the experts it calls, each group's as a
graph of its own. Each expert still receives all its rows in the same
order, and the other groups' experts get none in that call (a zero gradient, added exactly), so the result is
bit-identical to C = 1 where the experts' kernel computes each expert apart (:data:`CHUNKABLE`: the
compute-dtype grouped GEMMs, and the FP8 row-/tensor-wise ones, whose scales are per token, per expert row, per
expert, per expert and column); the per-expert dense GEMMs (``Looped``: delayed scaling's histories, the block
formats) run unchunked. Not bit-identical, only within rounding: FP8 weight gradients added into FP32 buffers on
Hopper (:mod:`lpbench.precision.kernels.grouped_mm` sums an expert's rows in slices aligned in the grouped
buffer, and a group's buffer places them elsewhere).

Gradients: an expert's weight gradient sums the losses of every rank of its group (their tokens
reached it through the exchange), each loss already the mean over that rank's batch; so it is
summed over the replicas of the expert (the same expert in the other groups and CP ranks) and divided by
the data-parallel size (times CP's), which gives the single-process gradient of the mean loss
(:func:`sync_expert_grads`). The gradient norm sums the experts' squares over the group
(:func:`expert_params`). Experts split by tensor parallelism (:mod:`lpbench.parallel.tp`) are handled
alike: the TP group holds the parts, the data-parallel ranks the replicas. Built on torch.distributed (NCCL or gloo) only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lpbench.models.moe import GroupedMM, MoE
from lpbench.precision.grouped import EmulatedGroupedFp8, GroupedBf16, GroupedFp8, Looped

# experts' kernels that compute each expert apart (FP8: scales per token, per expert, per expert and column):
# --ep-chunks applies
CHUNKABLE = (GroupedMM, GroupedBf16, GroupedFp8, EmulatedGroupedFp8)


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


class _Start(torch.autograd.Function):
    """``_AllToAll`` started asynchronously: returns the (unfilled) output; :class:`_Wait` completes it.
    In backward the reverse exchange is waited for here, after :class:`_Wait`'s backward started it."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group, pending: list):
        ctx.group, ctx.pending = group, pending
        out = x.new_empty(sum(recv), *x.shape[1:])
        pending.append(dist.all_to_all_single(out, x.contiguous(), recv, send, group=group, async_op=True))
        return out

    @staticmethod
    def backward(ctx, grad):
        work, back = ctx.pending.pop()
        work.wait()
        return back, None, None, None, None


class _Wait(torch.autograd.Function):
    """Wait for the exchange :class:`_Start` began (forward); start the reverse exchange (backward), whose result
    :class:`_Start`'s backward returns as the gradient of its input once it waited for it."""

    @staticmethod
    def forward(ctx, out, send: list[int], recv: list[int], group, pending: list):
        ctx.send, ctx.recv, ctx.group, ctx.pending = send, recv, group, pending
        pending.pop().wait()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):  # the gradient of x, filled by the exchange, is handed over in ``pending``
        back = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        work = dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group, async_op=True)
        ctx.pending.append((work, back))
        return grad, None, None, None, None


def _exchange_async(x: torch.Tensor, send: list[int], recv: list[int], group):
    """Start ``_AllToAll.apply(x, send, recv, group)``; the returned ``finish()`` waits for it and gives its value
    (in backward the reverse exchange runs between the two nodes)."""
    pending: list = []
    out = _Start.apply(x, send, recv, group, pending)
    return lambda: _Wait.apply(out, send, recv, group, pending)


@dataclass
class _Route:
    """What :meth:`ExpertParallel.combine` needs of its dispatch: the rows sent to and received from each rank."""

    send: list[int]
    recv: list[int]


@dataclass
class _Chunks:
    """:meth:`ExpertParallel.exchange_chunked`'s plan: each group's local experts ``[a, b)`` (``spans``), where
    rank r's rows for local expert e start in the sent rows (``starts[r][e]``), each group's rows sent to and
    received from each rank, and the received counts [size, n_local]."""

    spans: list[tuple[int, int]]
    starts: list[list[int]]
    send: list[list[int]]
    recv: list[list[int]]
    recv_counts: torch.Tensor


class ExpertParallel:
    """One MoE layer's place in its expert-parallel group (see the module doc)."""

    def __init__(self, group, size: int, rank: int, n_local: int, chunks: int = 1, experts: nn.Module | None = None):
        self.group, self.size, self.rank, self.n_local = group, size, rank, n_local
        self.chunks = min(chunks, n_local)  # groups of local experts exchanged apart (--ep-chunks)
        self.experts = experts  # the layer's Experts: whether its kernel computes each expert apart

    def chunkable(self) -> bool:
        """Whether the experts' kernel (chosen by the converters, possibly after apply_ep) computes each expert apart."""
        e = self.experts
        return e is not None and e.gemm.tp is None and type(e.gemm) in CHUNKABLE  # LoRA's kernel is not

    def chunked(self) -> bool:
        """Whether the layer exchanges its experts' rows in groups (``--ep-chunks``, a kernel that allows it)."""
        return self.chunks > 1 and self.chunkable()

    def _counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows this rank sends to each (rank, local expert) of the group, and those it receives: [size, n_local]."""
        send_counts = counts.view(self.size, self.n_local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        return send_counts, recv_counts

    @torch.compiler.disable  # split sizes are host values: never specialised and recompiled on them
    def dispatch(self, xs: torch.Tensor, counts: torch.Tensor):
        """Send the rows ``xs`` [P, D], sorted by global expert (``counts`` per expert), to the ranks owning their
        experts; returns the rows this rank received (each rank's in turn, sorted by local expert), their counts
        [size, n_local] (for :meth:`lpbench.models.moe.Groups.of_blocks`), and the route for :meth:`combine`.
        One host synchronisation: the split sizes."""
        send_counts, recv_counts = self._counts(counts)
        sizes = torch.cat([send_counts.sum(1), recv_counts.sum(1)]).tolist()
        route = _Route(sizes[: self.size], sizes[self.size :])
        return _AllToAll.apply(xs, route.send, route.recv, self.group), recv_counts, route

    @torch.compiler.disable
    def combine(self, ys: torch.Tensor, route: _Route) -> torch.Tensor:
        """The experts' results ``ys`` (in the order :meth:`dispatch` received the rows) sent back: the rows of its
        ``xs``, in its order."""
        return _AllToAll.apply(ys, route.recv, route.send, self.group)

    @torch.compiler.disable(recursive=False)  # this frame skipped; the experts it calls compile as the caller's code
    def exchange_chunked(self, xs: torch.Tensor, counts: torch.Tensor, run) -> torch.Tensor:
        """:meth:`dispatch`, ``run(rows, their counts [size, n_local])`` and :meth:`combine` with the local experts in
        ``self.chunks`` groups, each group's exchange overlapping the others' experts (module doc). Only this loop
        is skipped by torch.compile: every exchange below is a skipped call, and ``run`` compiles as its own graph."""
        plan = self._plan(counts)
        arrivals = self._send(xs, plan)
        returns = []
        for c in range(self.chunks):
            rows, blocks = self._arrived(arrivals[c], plan, c)
            returns.append(self._send_back(run(rows, blocks), plan, c))
        return self._returned(returns, plan)

    @torch.compiler.disable
    def _plan(self, counts: torch.Tensor) -> _Chunks:
        """The groups' spans and split sizes (one host synchronisation: the counts exchanged)."""
        send_counts, recv_counts = self._counts(counts)
        sends, recvs = torch.stack([send_counts, recv_counts]).tolist()  # [rank][local expert], one host copy
        bounds = [self.n_local * c // self.chunks for c in range(self.chunks + 1)]
        spans = list(zip(bounds, bounds[1:]))
        starts, at = [], 0  # starts[r][e]: first row of (rank r, local expert e) in xs
        for row in sends:
            starts.append([at + sum(row[:e]) for e in range(self.n_local + 1)])
            at += sum(row)
        return _Chunks(
            spans,
            starts,
            send=[[starts[r][b] - starts[r][a] for r in range(self.size)] for a, b in spans],
            recv=[[sum(recvs[r][a:b]) for r in range(self.size)] for a, b in spans],
            recv_counts=recv_counts,
        )

    @torch.compiler.disable
    def _send(self, xs: torch.Tensor, plan: _Chunks) -> list:
        """Every group's rows sent at once, asynchronously: one ``finish()`` a group."""
        pieces = [
            torch.cat([xs[plan.starts[r][a] : plan.starts[r][b]] for r in range(self.size)]) for a, b in plan.spans
        ]
        return [_exchange_async(p, s, r, self.group) for p, s, r in zip(pieces, plan.send, plan.recv)]

    @torch.compiler.disable
    def _arrived(self, finish, plan: _Chunks, c: int):
        """Group ``c``'s rows, once arrived, and their counts [size, n_local] (the other groups' experts none)."""
        a, b = plan.spans[c]
        mine = torch.zeros_like(plan.recv_counts)
        mine[:, a:b] = plan.recv_counts[:, a:b]
        return finish(), mine

    @torch.compiler.disable
    def _send_back(self, ys: torch.Tensor, plan: _Chunks, c: int):
        """Group ``c``'s results sent back, asynchronously (in the order its rows arrived)."""
        return _exchange_async(ys, plan.recv[c], plan.send[c], self.group)

    @torch.compiler.disable
    def _returned(self, returns: list, plan: _Chunks) -> torch.Tensor:
        """Every group's results, once back, as the rows of ``xs`` in its order (by rank, then local expert)."""
        ys = [finish().split(s) for finish, s in zip(returns, plan.send)]  # [chunk][rank]
        return torch.cat([ys[c][r] for r in range(self.size) for c in range(self.chunks)])


def apply_ep(model: nn.Module, mesh: DeviceMesh, chunks: int = 1) -> None:
    """Keep this rank's experts of every MoE layer of a meta-device ``model`` (before it is materialised);
    ``mesh``: the expert-parallel group; ``chunks``: ``--ep-chunks`` (applies to :data:`CHUNKABLE` kernels only,
    judged when the layer runs)."""
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
        moe.ep = ExpertParallel(mesh.get_group(), ep, rank, n_local, chunks, experts)


def _split_layers(model: nn.Module) -> list[tuple[MoE, object]]:
    """MoE layers whose experts differ across ranks, with the group holding the parts (expert or tensor parallel)."""
    return [
        (m, m.ep.group if m.ep is not None else m.experts.gemm.tp.group)
        for m in model.modules()
        if isinstance(m, MoE) and (m.ep is not None or m.experts.gemm.tp is not None)
    ]


def expert_params(model: nn.Module) -> tuple[list[nn.Parameter], object]:
    """The expert weights this rank holds under expert or tensor parallelism, and the group holding the
    other parts (([], None) without); data-parallel wrappers leave them to :func:`sync_expert_grads`."""
    layers = _split_layers(model)
    return [p for m, _ in layers for p in m.experts.parameters()], (layers[0][1] if layers else None)


@torch.no_grad()
def sync_expert_grads(model: nn.Module, dp: int, replicas) -> None:
    """Split experts' gradients summed over their replicas (``replicas``: the group of ranks holding the same
    part, ``ep_replicate`` or for TP-split experts ``loss``; None: no other) and divided by ``dp``, the ranks whose
    losses are averaged (data-parallel × CP: a CP rank's loss is its share of the sequences' mean × CP size)."""
    for moe, _ in _split_layers(model):
        for p in moe.experts.parameters():
            if p.grad is None:
                continue
            if replicas is not None:
                dist.all_reduce(p.grad, group=replicas)
            p.grad.div_(dp)
