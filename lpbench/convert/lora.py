"""LoRA: frozen base linears plus trainable low-rank adapters, and merging them back.

``apply_lora`` wraps the chosen linears of ``model.layers`` in :class:`LoRALinear`::

    y = base(x) + (alpha / r) · (x · Aᵀ) · Bᵀ      A [r, in] Kaiming-uniform, B [out, r] zeros

so the adapted model starts equal to the base model, and freezes every other parameter
(embeddings, norms, lm_head, the base weights). As NeMo does for Megatron's fused linears, the
fused ``attn.qkv`` and ``mlp.gate_up`` get one adapter each (A shared by q, k and v). Adapter
parameters live in ``adapter_dtype`` (FP32 master weights by default, like every trained
parameter in lpbench); their GEMMs run in the autocast dtype (BF16), never quantized.

**Quantized bases.** ``LoRALinear`` only calls ``base(x)``; it never touches ``base.weight`` in the
forward pass. So the base may be an ``nn.Linear`` or any subclass, e.g. the recipe's
``QuantizedLinear``: apply the recipe before or after ``apply_lora`` (``apply_recipe`` swaps the
``nn.Linear`` it finds at ``*.base``; adapters are plain parameters, not linears, so they stay
BF16). With the base frozen, autograd asks the quantized linear for the data gradient only (no
weight-gradient GEMM). A base that stores its frozen weight already quantized (codes + scales,
quantized once) fits the same slot; for merging it implements ``merge_lora_delta(delta)``
(dequantize, add, requantize or become a plain linear), which ``merge_lora`` calls instead of
``base.weight.add_(delta)``.

**Targets** (``--lora-targets``): ``qkv``, ``o``, ``mlp`` (= ``gate_up``/``up`` and ``down``),
or ``gate_up``, ``up``, ``down`` alone. MoE layers: routers are frozen, never adapted; the stacked expert
weights of a target get one adapter per expert (:class:`ExpertLoRA`, stacked the same way: A [E, r, in],
B [E, out, r], run as grouped GEMMs over the expert-sorted tokens), as each expert's linear had.

**Tensor parallelism** (:meth:`LoRALinear.split_tp`, called by ``parallel/tp.py: apply_tp``): the wrapper
owns its split and its communication, for every kind of base alike (``nn.Linear``, ``QuantizedLinear``,
a base stored quantized). The base keeps this rank's rows (column-wise: ``qkv``, ``gate_up``/``up``) or
columns (row-wise: ``o``, ``down``) of its weight as plain tensors; the adapters follow the base's split::

    column-wise  A [r, in] replicated, B [out/tp, r] Shard(0)   y_r = base_r(x) + (x Aᵀ) B_rᵀ
    row-wise     A [r, in/tp] Shard(1), B [out, r] replicated    y = Σ_r base_r(x_r) + (Σ_r x_r A_rᵀ) Bᵀ

Column-wise, x's gradient is a partial sum (reduced once, for base and adapter together) and so is A's
(all-reduced: [r, in]); row-wise, the base's partial outputs are all-reduced (reduce-scattered along the
sequence with sequence parallelism) and so are the adapter's [tokens, r] partial products, and with
sequence parallelism B's gradient (each rank sees its part of the sequence) is all-reduced. Adapters are
DTensors on the TP mesh (checkpoints and gradient norms see the whole adapter); the frozen base is plain
per-rank tensors, so a checkpoint of a LoRA run holds the adapters, not the base (``train/checkpoint.py``).
Megatron's and NeMo's LoRA layers split the same way.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lpbench.errors import UsageError
from lpbench.models.decoder import assign, expand_targets
from lpbench.models.moe import Experts
from lpbench import gemm
from lpbench.gemm import AllReduce, GradAllReduce
from lpbench.precision.grouped import grouped_linear


class _ReduceScatterSeq(torch.autograd.Function):
    """Partial sums [B, S, ...] summed over ``group``, this rank keeping its S / size positions (dim 1); the
    gradient all-gathered. All-reduce based, so gloo runs it too (the tensors are [tokens, rank] small)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank, ctx.size = group, dist.get_rank(group), dist.get_world_size(group)
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x.chunk(ctx.size, 1)[ctx.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.zeros_like(grad) for _ in range(ctx.size)]
        parts[ctx.rank] = grad
        full = torch.cat(parts, 1)
        dist.all_reduce(full, group=ctx.group)
        return full, None


@torch.compiler.disable
def _comm(fn, x: torch.Tensor, group) -> torch.Tensor:
    """``fn.apply(x, group)`` outside compiled graphs (a compiled block breaks its graph here)."""
    return fn.apply(x, group)


class LoRALinear(nn.Module):
    """``base(x) + scaling · (x Aᵀ) Bᵀ`` with a frozen ``base`` (any module with in/out_features)."""

    tp = None  # (group, split dim, sequence parallel) once split_tp split it

    def __init__(
        self,
        base: nn.Module,
        rank: int,
        alpha: float,
        adapter_dtype: torch.dtype = torch.float32,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        if rank < 1:
            raise UsageError(f"LoRA rank must be >= 1, got {rank}")
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha, self.scaling = int(rank), float(alpha), float(alpha) / rank
        device = next(base.parameters()).device
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, device=device, dtype=adapter_dtype))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, device=device, dtype=adapter_dtype))
        if device.type != "meta":
            self.reset_parameters(generator)

    @torch.no_grad()
    def draw_a(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """A whole, as nn.Linear's default init (as PEFT), drawn from ``generator``."""
        a = torch.empty(self.lora_a.shape, dtype=self.lora_a.dtype, device=self.lora_a.device)
        return nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """A drawn whole from ``generator`` (:meth:`draw_a`; a sharded A keeps its part); B zeros."""
        assign(self.lora_a, self.draw_a(generator))
        self.lora_b.zero_()

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution ``scaling · (x Aᵀ) Bᵀ``."""
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.lora_a.dtype)
        return gemm.linear(gemm.linear(x, self.lora_a), self.lora_b) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            return self._forward_tp(x)
        y = self.base(x)
        return y + self.delta(x).to(y.dtype)

    @property
    def tp_multiple(self) -> int:
        return getattr(self.base, "tp_multiple", 1)

    @torch.no_grad()
    def split_tp(self, mesh, shard, sequence_parallel: bool) -> None:
        """Keep this rank's part of the base and the adapters (``shard``: ``parallel/tp.py: TPShard``; see the
        module doc). The base's rows (columns) ``shard.index`` are taken in the fused layout's local order."""
        index = shard.index(torch.device("cpu") if self.lora_a.is_meta else self.lora_a.device)
        base = self.base
        if shard.dim == 1 and getattr(base, "bias", None) is not None:
            raise UsageError("--tp with LoRA needs row-parallel linears (attn.o, mlp.down) without a bias: use --tp 1")
        if hasattr(base, "tp_local"):  # stored quantized: its codes and scales
            base.tp_local(shard.dim, index)
        else:
            index = index.to(base.weight.device)
            base.weight = nn.Parameter(base.weight.index_select(shard.dim, index), requires_grad=False)
            if shard.dim == 0 and base.bias is not None:
                base.bias = nn.Parameter(base.bias.index_select(0, index), requires_grad=False)
            base.in_features, base.out_features = base.weight.shape[1], base.weight.shape[0]
        base.tp_shard = shard  # quantized GEMMs quantize the shards as the whole tensors
        a, b = self.lora_a.detach(), self.lora_b.detach()
        index = index.to(a.device)
        if shard.dim == 0:
            a, b, placements = a, b.index_select(0, index), ([Replicate()], [Shard(0)])
        else:
            a, b, placements = a.index_select(1, index), b, ([Shard(1)], [Replicate()])
        self.lora_a = nn.Parameter(DTensor.from_local(a.contiguous(), mesh, placements[0], run_check=False))
        self.lora_b = nn.Parameter(DTensor.from_local(b.contiguous(), mesh, placements[1], run_check=False))
        self.tp = (shard.group, shard.dim, sequence_parallel)

    def _forward_tp(self, x: torch.Tensor) -> torch.Tensor:
        group, dim, sp = self.tp
        a, b = self.lora_a.to_local(), self.lora_b.to_local()
        if dim == 0:  # x replicated: its gradient and A's are partial sums over the ranks
            x = x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) else _comm(GradAllReduce, x, group)
            y = self.base(x)
            a = _comm(GradAllReduce, a, group)
            return y + self._adapt(x, a, b).to(y.dtype)
        if isinstance(x, DTensor):
            x = x.to_local()
        reduce = _ReduceScatterSeq if sp else AllReduce
        y = _comm(reduce, self.base(x), group)
        h = _comm(reduce, self._adapt(x, a), group)
        if sp:  # each rank's B gradient covers its part of the sequence
            b = _comm(GradAllReduce, b, group)
        return y + (gemm.linear(h, b) * self.scaling).to(y.dtype)

    def _adapt(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """``x Aᵀ`` (and ``· scaling Bᵀ`` when ``b`` is given), in the autocast dtype or the adapters'."""
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(a.dtype)
        h = gemm.linear(x, a)
        return h if b is None else gemm.linear(h, b) * self.scaling

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``scaling · B A`` [out, in] in FP32."""
        return (self.lora_b.float() @ self.lora_a.float()) * self.scaling

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha:g}, adapters={self.lora_a.dtype}"


class ExpertLoRA(nn.Module):
    """One adapter per expert of a stacked expert weight [E, out, in]: expert e adds ``scaling · (x Aₑᵀ) Bₑᵀ``
    to its tokens' projection (in :class:`LoRAExperts`' ``adapters`` under the weight's name)."""

    def __init__(
        self,
        weight: torch.Tensor,
        rank: int,
        alpha: float,
        adapter_dtype: torch.dtype = torch.float32,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        n_experts, self.out_features, self.in_features = weight.shape
        self.rank, self.alpha, self.scaling = int(rank), float(alpha), float(alpha) / rank
        self.lora_a = nn.Parameter(
            torch.empty(n_experts, rank, self.in_features, device=weight.device, dtype=adapter_dtype)
        )
        self.lora_b = nn.Parameter(
            torch.zeros(n_experts, self.out_features, rank, device=weight.device, dtype=adapter_dtype)
        )
        if weight.device.type != "meta":
            self.reset_parameters(generator)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """A drawn whole from ``generator`` (:meth:`draw_a`; a sharded A keeps its part); B zeros."""
        assign(self.lora_a, self.draw_a(generator))
        self.lora_b.zero_()

    @torch.no_grad()
    def draw_a(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """Each expert's A as :class:`LoRALinear` draws it, in turn from ``generator``."""
        full = torch.empty(self.lora_a.shape, dtype=self.lora_a.dtype, device=self.lora_a.device)
        for a in full:
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        return full

    def delta(self, x: torch.Tensor, groups) -> torch.Tensor:
        """``scaling · (x_e A_eᵀ) B_eᵀ`` for every expert's rows of the sorted buffer ``x`` (``groups``)."""
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.lora_a.dtype)
        return grouped_linear(grouped_linear(x, self.lora_a, groups), self.lora_b, groups) * self.scaling

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``scaling · B_e A_e`` [E, out, in] in FP32."""
        return (self.lora_b.float() @ self.lora_a.float()) * self.scaling

    def extra_repr(self) -> str:
        return f"experts={self.lora_a.shape[0]}, rank={self.rank}, alpha={self.alpha:g}, adapters={self.lora_a.dtype}"


class LoRAExperts(nn.Module):
    """The experts' kernel with LoRA (``Experts.gemm``): the projection of the kernel under it (``base``: the model's,
    the recipe's or torchao's) plus, for each adapted weight, its :class:`ExpertLoRA` (``adapters``)."""

    tp = None  # tensor parallelism does not split expert adapters (lpbench.parallel.tp refuses)

    def __init__(self, base):
        super().__init__()
        self.base, self.adapters = base, nn.ModuleDict()

    @property
    def name(self) -> str:
        return self.base.name

    @property
    def recipe(self):
        return self.base.recipe

    def forward(self, experts, name: str, x: torch.Tensor, w: torch.Tensor, groups) -> torch.Tensor:
        y = self.base(experts, name, x, w, groups)
        if name in self.adapters:
            y = y + self.adapters[name].delta(x, groups).to(y.dtype)
        return y


def base_kernel(experts: Experts):
    """The kernel that runs ``experts``' own weights (under LoRA's)."""
    return experts.gemm.base if isinstance(experts.gemm, LoRAExperts) else experts.gemm


def set_kernel(experts: Experts, kernel) -> None:
    """Make ``kernel`` the one that runs ``experts``' own weights (under LoRA's, if it has adapters)."""
    if isinstance(experts.gemm, LoRAExperts):
        experts.gemm.base = kernel
    else:
        experts.gemm = kernel


def _is_linear(mod: nn.Module) -> bool:
    w = getattr(mod, "weight", None)
    return isinstance(mod, nn.Linear) or (hasattr(mod, "in_features") and isinstance(w, torch.Tensor) and w.ndim == 2)


def apply_lora(
    model: nn.Module,
    rank: int,
    alpha: float | None = None,
    targets=("qkv", "o", "mlp"),
    *,
    adapter_dtype: torch.dtype = torch.float32,
    base_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> dict:
    """Wrap ``targets`` of every block in ``model.layers`` with LoRA adapters; freeze the rest.

    ``alpha`` defaults to ``rank`` (scaling 1). ``base_dtype`` (e.g. ``torch.bfloat16``) casts the
    frozen linear weights inside ``model.layers`` once (they need no FP32 master copy; compute
    must then run under autocast). Returns ``{"adapted": [names], "trainable": n, "frozen": n}``.
    """
    names = set(expand_targets(targets))
    if rank < 1:
        raise UsageError(f"--lora-rank must be >= 1, got {rank}")
    alpha = float(rank if alpha is None else alpha)
    if alpha <= 0:
        raise UsageError(f"--lora-alpha must be > 0, got {alpha}")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError("apply_lora needs the transformer blocks in model.layers (an nn.ModuleList)")
    if lora_modules(model):
        raise UsageError("the model already has LoRA adapters")
    for p in model.parameters():
        p.requires_grad_(False)
    if base_dtype is not None:
        for layer in layers:
            for mod in layer.modules():
                if _is_linear(mod):
                    mod.to(base_dtype)
                elif isinstance(mod, Experts):
                    for p in mod.parameters(recurse=False):
                        p.data = p.data.to(base_dtype)
    first = next(model.parameters())
    gen = torch.Generator(device=first.device) if first.device.type != "meta" else None
    if gen is not None:
        gen.manual_seed(seed)
    adapted = []
    for i, layer in enumerate(layers):
        for name, mod in list(layer.named_modules()):
            if isinstance(mod, Experts):  # stacked experts: an adapter per expert for each targeted weight
                for wname, w in mod.named_parameters(recurse=False):
                    if wname in names:
                        if not isinstance(mod.gemm, LoRAExperts):
                            mod.gemm = LoRAExperts(mod.gemm)
                        mod.gemm.adapters[wname] = ExpertLoRA(w, rank, alpha, adapter_dtype, gen)
                        adapted.append(f"layers.{i}.{name}.{wname}")
                continue
            leaf = name.rpartition(".")[2]
            if leaf not in names or "router" in name or not _is_linear(mod):
                continue
            wrapper = LoRALinear(mod, rank, alpha, adapter_dtype, gen)
            parent, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent) if parent else layer, child, wrapper)
            adapted.append(f"layers.{i}.{name}")
    if not adapted:
        raise UsageError(f"no linear named {', '.join(sorted(names))} in model.layers to adapt")
    trainable = lora_parameters(model)
    for p in trainable:
        p.requires_grad_(True)
    n_train = sum(p.numel() for p in trainable)
    return {
        "adapted": adapted,
        "trainable": n_train,
        "frozen": sum(p.numel() for p in model.parameters()) - n_train,
        "rank": rank,
        "alpha": alpha,
        "targets": sorted(names),
    }


def init_adapters(module: nn.Module, generator: torch.Generator, skip: int = 0) -> None:
    """Draw the adapters of ``module`` (e.g. one block of a model LoRA was applied to on the meta device, once
    allocated) from ``generator`` in module order: drawn block after block from one generator seeded as
    ``apply_lora``'s, they equal the adapters it draws on a materialized model. ``skip``: first draw (and drop)
    the adapters of that many blocks like ``module`` (another pipeline stage's blocks)."""
    for _ in range(skip):
        for _, m in lora_modules(module):
            m.draw_a(generator)
    for _, m in lora_modules(module):
        m.reset_parameters(generator)


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear | ExpertLoRA]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (LoRALinear, ExpertLoRA))]


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter parameters (A then B of each adapted linear, in module order)."""
    return [p for _, m in lora_modules(model) for p in (m.lora_a, m.lora_b)]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapters, by their full names (``layers.0.attn.qkv.lora_a`` ...)."""
    return {f"{n}.{k}": getattr(m, k).detach() for n, m in lora_modules(model) for k in ("lora_a", "lora_b")}


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (``W += scaling · B A``) and unwrap the base.

    The model is changed in place and returned; its outputs are unchanged up to rounding in the
    base weight's dtype. ``requires_grad`` flags are left as they are (the base stays frozen).
    """
    for name, mod in lora_modules(model):
        if isinstance(mod, ExpertLoRA):  # name: <experts>.gemm.adapters.<weight>
            experts_name, _, wname = name.rpartition(".gemm.adapters.")
            experts = model.get_submodule(experts_name)
            w = getattr(experts, wname)
            if hasattr(w, "full_tensor") or w.is_meta:
                raise UsageError(f"{name}: cannot merge into a sharded or meta weight; gather it first")
            w.copy_((w.float() + mod.delta_weight().to(w.device)).to(w.dtype))
            del experts.gemm.adapters[wname]
            if not len(experts.gemm.adapters):
                base = experts.gemm.base
                del experts.gemm  # a module's slot: a plain kernel cannot be assigned over it
                experts.gemm = base
            continue
        base, delta = mod.base, mod.delta_weight()
        if hasattr(base, "merge_lora_delta"):  # a base that stores its weight quantized
            base = base.merge_lora_delta(delta) or base
        else:
            w = base.weight
            if hasattr(w, "full_tensor") or w.is_meta:
                raise UsageError(f"{name}: cannot merge into a sharded or meta weight; gather it first")
            w.copy_((w.float() + delta.to(w.device)).to(w.dtype))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, base)
    return model
