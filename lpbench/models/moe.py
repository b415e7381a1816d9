"""Mixture-of-experts layer: router, dropless dispatch, grouped expert GEMMs, combine.

Routing (``ModelConfig.router``), in FP32 and never quantized:

* ``mixtral``: softmax over the k largest router logits;
* ``qwen3``: softmax over all experts, the k largest probabilities, divided by their sum when
  ``router_norm_topk`` (Qwen3-MoE's ``norm_topk_prob``; the same weights as ``mixtral`` then).

Auxiliary losses, per layer, summed over layers (Megatron's definitions; T tokens, E experts):

* load balancing: ``E · Σ_e f_e · P_e`` with f_e the share of the T·k routed slots that went to
  expert e and P_e the mean router probability of e (1 when perfectly balanced). Across
  data-parallel ranks (``MoE.count_group``) f_e counts the tokens of every rank, as Megatron's
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
the padded buffer of :class:`lpbench.precision.grouped.Groups`; no token is dropped. Expert
parallelism (``ep``, :mod:`lpbench.parallel.ep`) exchanges the sorted pairs all-to-all between the
sort and the GEMMs, and back before the combine. Tensor parallelism (``Experts.tp``, set by
:func:`lpbench.parallel.tp.apply_tp`) gives every rank all experts' slices of the FFN width: the
same tokens in, partial outputs summed over the group; quantized experts quantize their slices as the
whole weights (:meth:`Experts.split`, the TP-split dense linear's rule).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lpbench.models.registry import ModelConfig
from lpbench.models.swiglu import swiglu
from lpbench.precision.delayed import rerunning
from lpbench.precision.grouped import GROUPED_FP8_SCALINGS, Groups, fp8_grouped, grouped_linear, looped
from lpbench.precision.weight_cache import cast_once

ROUTERS = ("mixtral", "qwen3")


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


@torch.compiler.disable
def _summed(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts`` summed over the ranks of ``group`` (token counts: no gradient)."""
    import torch.distributed as dist

    counts = counts.clone()
    dist.all_reduce(counts, group=group)
    return counts


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

    ``forward(x, groups)`` takes the expert-sorted buffer. The precision recipe comes from
    :meth:`set_recipe` (``lpbench.precision.policy``); without one the GEMMs run in the autocast dtype.
    Under expert parallelism a rank holds experts ``[first, first + len)`` of the model's E.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, D, Fd = cfg.n_experts, cfg.dim, cfg.ffn_dim
        self.activation, self.n_experts, self.first = cfg.activation, E, 0
        self.in_name = "gate_up" if cfg.gated else "up"
        setattr(self, self.in_name, nn.Parameter(torch.empty(E, (2 if cfg.gated else 1) * Fd, D)))
        self.down = nn.Parameter(torch.empty(E, D, Fd))
        self.recipe = None
        self.gemms = None  # ModuleDict of per-expert ExpertGemms (looped recipes)
        self.tp = None  # lpbench.parallel.tp.ExpertsTP: this rank's slice of every expert's FFN width
        self.adapters = nn.ModuleDict()  # LoRA: weight name -> lpbench.models.lora.ExpertLoRA
        self.weight_codes: dict = {}  # this step's FP8 codes (FP8 grouped) or BF16 copy of each weight (weight_cache)
        self.main_grads: dict = {}  # FP32 buffers the weight gradients are added into (precision.main_grads)

    def set_recipe(self, recipe, native: bool) -> None:
        from lpbench.precision.linear import ExpertGemms

        self.recipe, self.native = recipe, native
        # torch's grouped FP8 GEMM takes E4M3 operands only: E5M2 gradients run natively per expert
        if recipe.scaling not in GROUPED_FP8_SCALINGS or (native and recipe.grad_format != "e4m3"):
            device = self.down.device
            self.gemms = nn.ModuleDict({name: nn.ModuleList(ExpertGemms(recipe, native, device)
                                                            for _ in range(self.n_experts))
                                        for name in (self.in_name, "down")})
        self.set_tp(self.tp)

    def set_tp(self, tp) -> None:
        """Hold ``tp``'s slices (an ExpertsTP; the weights already split): every expert's quantized GEMMs
        quantize their slice as the whole weight, as a split dense linear's do (``tp_shard``)."""
        self.tp = tp
        for name, gemms in (self.gemms or {}).items():
            for g in gemms:
                g.tp_shard = self.split(name)

    def split(self, name: str):
        """How TP split stacked weight ``name`` (a :class:`lpbench.parallel.tp.TPShard`), or None."""
        return None if self.tp is None else self.tp.shard(name, getattr(self, name).shape)

    def set_torchao(self) -> None:
        """Run the GEMMs through torchao's FP8 row-wise grouped GEMMs (``--backend torchao``, Hopper)."""
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

        self.torchao = _to_fp8_rowwise_then_scaled_grouped_mm

    torchao = None

    def _project(self, name: str, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        y = self._base(name, x, groups)
        if name in self.adapters:
            y = y + self.adapters[name].delta(x, groups).to(y.dtype)
        return y

    def _base(self, name: str, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        w = getattr(self, name)
        if self.torchao is not None:  # groups padded to 16 rows, as torchao requires
            return groups.clear_tail(self.torchao(x, w.transpose(1, 2), groups.offs, x.dtype,
                                                  pad_token_groups_for_grouped_mm=False))
        main_grad, codes = self.main_grads.get(name), self.weight_codes.get(name)
        if self.recipe is None:
            return grouped_linear(x, w, groups, codes if main_grad is not None else cast_once(w, codes, x), main_grad)
        if self.gemms is None:
            return fp8_grouped(x, w, groups, self.recipe, self.native, codes, self.split(name), main_grad)
        return looped(x, w, groups, self.gemms[name])

    def forward(self, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if self.tp is not None:
            x = self.tp.enter(x)
        h = self._project(self.in_name, x, groups)
        if self.activation == "swiglu":
            h = swiglu(h)
        elif self.activation == "sqrelu":
            h = F.relu(h).square()
        else:
            h = F.gelu(h)
        y = self._project("down", h, groups)
        return y if self.tp is None else self.tp.leave(y)


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
        self.count_group = None  # data-parallel ranks whose token counts the load-balancing loss sums
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
            0, flat, torch.ones_like(flat))
        aux = load_balancing_loss(probs, counts if self.count_group is None else _summed(counts, self.count_group))
        zl = z_loss(logits)
        if not rerunning():  # activation recomputation's rerun: the first pass counted these
            with torch.no_grad():
                self.tokens_per_expert.add_(counts.float())
                self.loss_sums.add_(torch.stack([aux.detach(), zl.detach(), torch.ones_like(zl)]))
        if self.ep is None:
            ys = self._experts(x[token], expert, self.n_experts)
        else:
            ys = self.ep.exchange(x[token], expert, counts, self._experts)
        out = torch.zeros_like(x).index_add_(0, token, ys * weights.flatten()[order, None].to(x.dtype))
        if self.training and (self.aux_coeff or self.z_coeff):
            out = _AttachLoss.apply(out, self.aux_coeff * aux + self.z_coeff * zl, self.grad_scale)
        return out.reshape(shape)

    def _experts(self, xs: torch.Tensor, expert: torch.Tensor, n_experts: int) -> torch.Tensor:
        """Rows ``xs`` (sorted by ``expert``) through their experts, in the same order."""
        groups, dest = Groups.of(expert, n_experts)
        buf = xs.new_zeros(groups.rows, xs.shape[1]).index_put((dest,), xs)
        return self.experts(buf, groups)[dest]


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
    return {"tokens_per_expert": counts.long().tolist(), "aux_loss": (sums[:, 0] / n).sum().item(),
            "z_loss": (sums[:, 1] / n).sum().item()}
