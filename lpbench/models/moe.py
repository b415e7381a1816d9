"""Mixture-of-experts layer: router, dropless dispatch, grouped expert GEMMs, combine.

Routing (``ModelConfig.router``), in FP32 and never quantized:

* ``mixtral``: softmax over the k largest router logits;
* ``qwen3``: softmax over all experts, the k largest probabilities, divided by their sum when
  ``router_norm_topk`` (Qwen3-MoE's ``norm_topk_prob``; the same weights as ``mixtral`` then).

Auxiliary losses, per layer, summed over layers (Megatron's definitions; T tokens, E experts):

* load balancing: ``E · Σ_e f_e · P_e`` with f_e the share of the T·k routed slots that went to
  expert e and P_e the mean router probability of e (1 when perfectly balanced). Across
  data-parallel and context-parallel ranks (``MoE.count_group``) f_e counts the tokens of every rank, as Megatron's
  global auxiliary loss does, and P_e stays each rank's own mean: the mean over ranks of their
  losses (and of their gradients, as data parallelism averages them) is the loss of the whole
  global batch;
* router z-loss: ``mean_t logsumexp(logits_t)²``.

Their coefficients (``MoE.aux_coeff`` / ``z_coeff``, ``--moe-aux-loss-coeff`` / ``--moe-z-loss-coeff``)
scale gradients attached to the layer's output, as Megatron's ``MoEAuxLossAutoScaler`` does: the
loss the model returns stays the language-model cross-entropy. ``grad_scale`` is the factor the
training loop divides its loss by (gradient accumulation). Each layer accumulates its per-expert
token counts and loss values in ``stats`` for the log.

Dispatch: every (token, expert) pair sorted by expert (stable, so tokens keep their order) into
the padded buffer of :class:`Groups`; no token is dropped. Expert
parallelism (``ep``, :mod:`lpbench.parallel.ep`) exchanges the sorted pairs all-to-all between the
sort and the GEMMs, and back before the combine; the received rows, each rank's sorted by expert, are
placed in the buffer by expert (:meth:`Groups.of_blocks`) without a second sort. Tensor parallelism
(:func:`lpbench.parallel.tp.apply_tp`) gives every rank all experts' slices of the FFN width and tells the
experts' kernel (``GroupedMM.tp``): the same tokens in, partial outputs summed over the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from lpbench.models.registry import ModelConfig
from lpbench.gemm import linear
from lpbench.passes import rerunning

ROUTERS = ("mixtral", "qwen3")


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a fused gate+up projection ``h`` [..., 2 x ffn] (gate first): ``silu(gate) * up``."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def sqrelu(h: torch.Tensor) -> torch.Tensor:
    return F.relu(h).square()


ACTIVATIONS = {"swiglu": silu_mul, "sqrelu": sqrelu, "gelu": F.gelu}  # ModelConfig.activation -> the function


ALIGN = 16
ROWS_ALIGN = 128  # the buffer's rows: FP8 codes [C, rows] then start every row on a 128-byte boundary


@dataclass
class Groups:
    """Where each expert's rows are in a sorted, padded buffer: the rows of ``x`` [M, K] sorted by expert, expert e's
    ``counts[e]`` rows from ``starts[e]``, a multiple of ``ALIGN`` (the FP8 grouped GEMM's requirement), zeros
    between groups; ``offs``: the groups' padded ends (int32), as torch's grouped-mm ops take them."""

    counts: torch.Tensor  # [E] int64: tokens per expert
    starts: torch.Tensor  # [E] int64: first row of each expert, multiples of ALIGN
    offs: torch.Tensor  # [E] int32: padded end of each expert's rows
    rows: int  # buffer rows (static: an upper bound of the padded total, a multiple of ROWS_ALIGN)
    row_group: torch.Tensor  # [rows] int64: the expert each row belongs to (padding to the expert before it)

    @classmethod
    def of(cls, group: torch.Tensor, n_groups: int) -> tuple["Groups", torch.Tensor]:
        """The layout of items whose group ids ``group`` [P] are sorted ascending, and each item's row."""
        counts = torch.zeros(n_groups, dtype=torch.long, device=group.device).scatter_add_(
            0, group, torch.ones_like(group)
        )
        before = torch.arange(group.numel(), device=group.device) - (counts.cumsum(0) - counts)[group]
        return cls._placing(counts, group, before)

    @classmethod
    def of_blocks(cls, blocks: torch.Tensor, n_items: int) -> tuple["Groups", torch.Tensor]:
        """The layout of ``n_items`` items that arrive in blocks, as an all-to-all delivers them: ``blocks`` [S, G]
        counts, block (s, g) holding ``blocks[s, g]`` items of group g, the blocks in row-major order; and each
        item's row, the groups' items kept in arrival order (as a stable sort by group would)."""
        S, G = blocks.shape
        flat = blocks.flatten()
        block = torch.arange(S * G, device=blocks.device).repeat_interleave(flat, output_size=n_items)
        earlier = (blocks.cumsum(0) - blocks).flatten()  # items of the block's group in the blocks of earlier s
        before = earlier[block] + torch.arange(n_items, device=blocks.device) - (flat.cumsum(0) - flat)[block]
        return cls._placing(blocks.sum(0), block % G, before)

    @classmethod
    def _placing(cls, counts: torch.Tensor, group: torch.Tensor, before: torch.Tensor) -> tuple["Groups", torch.Tensor]:
        """The layout of groups of ``counts`` items, and the row of each item of group ``group`` with ``before``
        items of its group ahead of it."""
        n_groups = counts.numel()
        padded = (counts + ALIGN - 1) // ALIGN * ALIGN
        ends = padded.cumsum(0)
        starts = ends - padded
        rows = (group.numel() + n_groups * ALIGN + ROWS_ALIGN - 1) // ROWS_ALIGN * ROWS_ALIGN
        # a plain field, not a cached_property: that takes a lock on Python 3.11, where Dynamo breaks the graph at it
        row_group = torch.searchsorted(ends, torch.arange(rows, device=group.device), right=True)
        dest = starts[group] + before
        return cls(counts, starts, ends.to(torch.int32), rows, row_group.clamp(max=n_groups - 1)), dest

    @cached_property
    def host(self) -> list[tuple[int, int]]:
        """(start, count) of every expert on the host (synchronises a GPU)."""
        return list(zip(self.starts.tolist(), self.counts.tolist()))

    def clear_tail(self, y: torch.Tensor) -> torch.Tensor:
        """``y`` with the rows after the last expert's zeroed (a grouped GEMM leaves them unwritten)."""
        keep = torch.arange(self.rows, device=y.device) < self.offs[-1]
        return torch.where(keep[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))

    def pieces(self, parts: list[torch.Tensor], width: int, like: torch.Tensor) -> torch.Tensor:
        """The buffer [rows, width] holding ``parts[e]`` at expert e's rows, zeros elsewhere."""
        out, at = [], 0
        for (start, count), part in zip(self.host, parts):
            if start > at:
                out.append(like.new_zeros(start - at, width))
            out.append(part)
            at = start + count
        out.append(like.new_zeros(self.rows - at, width))
        return torch.cat(out)


def grouped_gemm(x: torch.Tensor) -> bool:
    """Whether torch's grouped GEMMs (``torch._grouped_mm``) run ``x``'s experts: CUDA, SM 9.0 on."""
    return x.is_cuda and torch.cuda.get_device_capability(x.device) >= (9, 0)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
    """``x_e · w_eᵀ`` for every expert in ``x``'s dtype (``w`` already in it): ``torch._grouped_mm`` on CUDA (BF16,
    SM90+), else one matmul per expert (the same products, the same accumulation: ``lpbench.gemm.linear``)."""
    if grouped_gemm(x) and x.dtype == torch.bfloat16:
        return groups.clear_tail(torch._grouped_mm(x, w.transpose(1, 2), offs=groups.offs))
    return _per_expert_linear(x, w, groups)


@torch.compiler.disable  # per-expert shapes: run eagerly, never specialised and recompiled on the counts
def _per_expert_linear(x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
    parts = [linear(x[s : s + c], w[e]) for e, (s, c) in enumerate(groups.host)]
    return groups.pieces(parts, w.shape[1], x)


class GroupedMM:
    """The experts' default kernel: both projections by :func:`grouped_matmul` in the compute dtype. A kernel
    (``Experts.gemm``) has a ``name``, its ``recipe`` (None here), ``tp`` (how tensor parallelism split the
    weights, given by ``set_tp``; None without) and ``__call__(experts, name, x, w, groups)``."""

    name, recipe, tp = "GroupedMM", None, None

    def __call__(self, experts, name: str, x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
        return grouped_matmul(x, w.to(x.dtype), groups)

    def set_tp(self, tp, experts) -> None:
        """Hold ``tp`` (an ``lpbench.parallel.tp.ExpertsTP``; ``experts``' weights already split)."""
        self.tp = tp

    def split(self, name: str, w: torch.Tensor):
        """How TP split stacked weight ``name`` (a :class:`lpbench.parallel.tp.TPShard`), or None."""
        return None if self.tp is None else self.tp.shard(name, w.shape)


def route(logits: torch.Tensor, top_k: int, router: str, norm_topk: bool = True):
    """(weights [T, k] FP32, chosen experts [T, k], probabilities [T, E]) from FP32 router logits."""
    probs = logits.softmax(dim=-1)
    if router == "mixtral":
        top, chosen = logits.topk(top_k, dim=-1)
        return top.softmax(dim=-1), chosen, probs
    weights, chosen = probs.topk(top_k, dim=-1)
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen, probs


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``E · Σ_e f_e · P_e``: f_e = counts[e] / Σ counts (the routed slots: T·k for this rank's T tokens,
    more when ``counts`` sums several ranks'), P_e = mean of probs[:, e]."""
    counts = counts.float()
    return probs.shape[1] * (counts / counts.sum() * probs.mean(0)).sum()


def _summed(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts`` summed over the ranks of ``group`` (token counts: no gradient); a functional collective, which
    torch.compile keeps in the block's graph."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(counts, "sum", group)


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """``mean_t logsumexp(logits_t)²`` (ST-MoE's router z-loss)."""
    return logits.logsumexp(dim=-1).square().mean()


class _AttachLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, ``loss`` gets gradient ``scale`` (so it is minimised)."""

    @staticmethod
    def forward(ctx, out, loss, scale: float):
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, device=grad.device), None


def expert_shape(cfg: ModelConfig, name: str) -> tuple[int, int, int]:
    """The whole stacked weight ``name`` (``gate_up``, ``up`` or ``down``) of an MoE layer of ``cfg``."""
    if name == "down":
        return cfg.n_experts, cfg.dim, cfg.ffn_dim
    return cfg.n_experts, (2 if cfg.gated else 1) * cfg.ffn_dim, cfg.dim


class Experts(nn.Module):
    """E expert MLPs as stacked weights: ``gate_up`` [E, 2F, D] (or ``up`` [E, F, D]) and ``down`` [E, D, F].

    ``forward(x, groups)`` takes the expert-sorted buffer. Both projections run through one kernel, ``gemm``
    (``lpbench.convert`` gives the recipe's, LoRA's or a cache's; by default the GEMMs run in the autocast dtype).
    Under expert parallelism a rank holds experts ``[first, first + len)`` of the model's E.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, D, Fd = cfg.n_experts, cfg.dim, cfg.ffn_dim
        self.act, self.n_experts, self.first = ACTIVATIONS[cfg.activation], E, 0
        self.in_name = "gate_up" if cfg.gated else "up"
        setattr(self, self.in_name, nn.Parameter(torch.empty(E, (2 if cfg.gated else 1) * Fd, D)))
        self.down = nn.Parameter(torch.empty(E, D, Fd))
        self.gemm = GroupedMM()  # the kernel of both projections: gemm(self, name, x, weight, groups)

    def forward(self, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        h = self.act(self.gemm(self, self.in_name, x, getattr(self, self.in_name), groups))
        return self.gemm(self, "down", h, self.down, groups)


class MoE(nn.Module):
    """Top-k routed experts (see the module doc)."""

    aux_coeff = 0.0  # load-balancing loss coefficient (set per run)
    z_coeff = 0.0  # router z-loss coefficient
    grad_scale = 1.0  # 1 / gradient accumulation steps

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.n_experts = cfg.top_k, cfg.n_experts
        self.router_kind, self.norm_topk = cfg.router, cfg.router_norm_topk
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg)
        self.ep = None  # lpbench.parallel.ep.ExpertParallel when experts are spread over ranks
        self.count_group = None  # data- and context-parallel ranks whose token counts the load-balancing loss sums
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.n_experts), persistent=False)
        self.register_buffer("loss_sums", torch.zeros(3), persistent=False)  # aux, z, forwards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())
            weights, chosen, probs = route(logits, self.top_k, self.router_kind, self.norm_topk)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)
        token, expert = order // self.top_k, flat[order]
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )
        aux = load_balancing_loss(probs, counts if self.count_group is None else _summed(counts, self.count_group))
        zl = z_loss(logits)
        if not rerunning():  # activation recomputation's rerun: the first pass counted these
            with torch.no_grad():
                self.tokens_per_expert.add_(counts.float())
                self.loss_sums.add_(torch.stack([aux.detach(), zl.detach(), torch.ones_like(zl)]))
        if self.ep is None:
            ys = self._experts(x[token], *Groups.of(expert, self.n_experts))
        elif self.ep.chunked():  # the experts run between their groups' exchanges, each group's compiled apart
            ys = self.ep.exchange_chunked(x[token], counts, self._experts_received)
        else:  # the experts between the two exchanges, in the calling code: compiled with the block
            rows, blocks, back = self.ep.dispatch(x[token], counts)
            ys = self.ep.combine(self._experts_received(rows, blocks), back)
        out = torch.zeros_like(x).index_add_(0, token, ys * weights.flatten()[order, None].to(x.dtype))
        if self.training and (self.aux_coeff or self.z_coeff):
            out = _AttachLoss.apply(out, self.aux_coeff * aux + self.z_coeff * zl, self.grad_scale)
        return out.reshape(shape)

    def _experts(self, xs: torch.Tensor, groups: Groups, dest: torch.Tensor) -> torch.Tensor:
        """Rows ``xs`` through their experts (row i at ``dest[i]`` of the buffer ``groups`` lays out), in their order."""
        buf = xs.new_zeros(groups.rows, xs.shape[1]).index_put((dest,), xs)
        return self.experts(buf, groups)[dest]

    def _experts_received(self, rows: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Rows as the expert-parallel exchange delivered them (``blocks`` [ranks, local experts]: each rank's rows
        for each local expert, in that order) through their experts, in the same order."""
        return self._experts(rows, *Groups.of_blocks(blocks, rows.shape[0]))


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def configure_moe(model: nn.Module, aux_coeff: float = 0.0, z_coeff: float = 0.0, grad_scale: float = 1.0) -> None:
    """Set the auxiliary-loss coefficients and the loss scale of every MoE layer of ``model``."""
    for m in moe_layers(model):
        m.aux_coeff, m.z_coeff, m.grad_scale = aux_coeff, z_coeff, grad_scale


@torch.no_grad()
def take_moe_stats(model: nn.Module) -> dict | None:
    """Per-layer token counts per expert and mean aux / z-loss since the last call (then reset); None without MoE."""
    layers = moe_layers(model)
    if not layers:
        return None
    counts = torch.stack([m.tokens_per_expert for m in layers]).cpu()
    sums = torch.stack([m.loss_sums for m in layers]).cpu()
    for m in layers:
        m.tokens_per_expert.zero_()
        m.loss_sums.zero_()
    n = sums[:, 2].clamp(min=1)
    return {
        "tokens_per_expert": counts.long().tolist(),
        "aux_loss": (sums[:, 0] / n).sum().item(),
        "z_loss": (sums[:, 1] / n).sum().item(),
    }
