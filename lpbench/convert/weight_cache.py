"""Weights quantized (or cast to BF16) once per optimizer step, not once per micro-batch.

With gradient accumulation each micro-batch's forward would quantize every FP32 master weight again, though it
only changes at the optimizer step. :class:`WeightCache` alone knows when codes are stale: after every
``optimizer.step()`` (a step post-hook: the fused AdamW does not bump version counters) and when a weight's
version changed (``copy_``, a checkpoint load). A forward pre-hook on the model refills the stale ones outside
the compiled graphs; the converter's ``after_optimizer_step`` hook calls the same refill while the GPU still
runs the optimizer. What it holds:

* fused FP8 tensorwise / delayed linears (:func:`eligible`): buffers ``fp8_weight`` [N, K], ``fp8_weight_t``
  [K, N], ``fp8_weight_scale``, filled by the linear's own cast (``kernels/fp8_linear.py: cache_weight``);
* FP8 grouped experts (:func:`grouped_eligible`): each weight's forward and data-gradient codes
  (``precision/grouped.py: weight_codes``) in their kernel's ``codes``, dropped at the step;
* the 16-bit linears and experts autocast would cast every micro-batch (:func:`bf16_eligible`: the decoder's
  ``Linear`` and BF16 experts with FP32 CUDA weights, which get the ``GroupedBf16`` kernel): a BF16 copy,
  ``bf16_weight`` or the experts' kernel's ``codes[name]``, taken through ``lpbench.gemm.cast_once``, as Megatron's
  BF16 parameters are cast once per step.

The codes are those the uncached forward computes, so tensor-wise and row-wise scaling and BF16 train
bit-identically. fp8-delayed casts a weight once per step with its scale as it stands, then records its amax
once: the step's later micro-batches reuse the first one's codes (as Transformer Engine does). A run installs
it with gradient accumulation and ``--compile-scope block`` only (``lpbench.convert.converters_for``).
Tensor-parallel and emulated linears and FSDP-sharded weights are left alone; TP-split experts are cached as
their slices quantized as the whole weights.
"""

from __future__ import annotations

import torch
from torch import nn

from lpbench.convert.lora import base_kernel
from lpbench.models.moe import Experts, GroupedMM
from lpbench.precision.grouped import GroupedBf16, GroupedFp8, weight_codes
from lpbench.precision.kernels.fp8_linear import cache_weight
from lpbench.precision.linear import QuantizedLinear
from lpbench.precision.quantize import Scaling


def eligible(mod: nn.Module) -> bool:
    """Whether ``mod`` is a linear whose weight the fused FP8 tensorwise/delayed forward casts."""
    if not isinstance(mod, QuantizedLinear) or not mod.native or mod.tp_shard is not None:
        return False
    w = mod.weight
    return (
        mod.recipe.scaling in (Scaling.TENSOR, Scaling.DELAYED)
        and type(w) is nn.Parameter
        and w.is_cuda
        and w.dim() == 2
        and w.shape[0] % 16 == 0
        and w.shape[1] % 16 == 0
    )


def bf16_eligible(mod: nn.Module) -> bool:
    """Whether ``mod`` is a linear (a class that sets ``caches_bf16_weight``, the decoder's ``Linear``) or BF16
    grouped experts whose plain FP32 CUDA weights autocast casts in every forward."""
    if getattr(type(mod), "caches_bf16_weight", False):
        names = ["weight"]
    elif isinstance(mod, Experts) and type(mod.gemm) in (GroupedMM, GroupedBf16):
        names = [mod.in_name, "down"]
    else:
        return False
    return all(_plain_fp32_on_cuda(getattr(mod, name)) for name in names)


def _plain_fp32_on_cuda(w: torch.Tensor) -> bool:
    return type(w) is nn.Parameter and w.is_cuda and w.dtype == torch.float32


def grouped_eligible(mod: nn.Module) -> bool:
    """Whether ``mod`` is an MoE layer's experts whose plain weights the FP8 grouped GEMMs quantize."""
    return (
        isinstance(mod, Experts)
        and isinstance(base_kernel(mod), GroupedFp8)
        and all(type(getattr(mod, name)) is nn.Parameter for name in (mod.in_name, "down"))
    )


class WeightCache:
    """The quantized weights of a model's eligible linears and experts, and when they are stale (see the module doc)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, bf16: bool = True):
        self.linears = [m for m in model.modules() if eligible(m)]
        halves = [m for m in model.modules() if bf16_eligible(m)] if bf16 else []
        self.bf16_linears = [m for m in halves if not isinstance(m, Experts)]
        self.experts = [m for m in model.modules() if grouped_eligible(m)] + [
            m for m in halves if isinstance(m, Experts)
        ]
        for m in self.experts:
            if type(m.gemm) is GroupedMM:  # the kernel that takes the BF16 copy
                m.gemm = GroupedBf16(m.gemm.tp)
        for m in self.bf16_linears:
            m.register_buffer("bf16_weight", m.weight.detach().to(torch.bfloat16), persistent=False)
        for m in self.linears:
            w = m.weight
            fmt = m.recipe.element_format("weight").dtype
            m.register_buffer("fp8_weight", torch.empty(w.shape, dtype=fmt, device=w.device), persistent=False)
            m.register_buffer("fp8_weight_t", torch.empty(w.shape[::-1], dtype=fmt, device=w.device), persistent=False)
            m.register_buffer("fp8_weight_scale", torch.ones((), device=w.device), persistent=False)
        self.weights = [(m, "weight") for m in self.linears + self.bf16_linears] + [
            (m, name) for m in self.experts for name in (m.in_name, "down")
        ]
        self.versions: list[int | None] = [None] * len(self.weights)
        roots = getattr(model, "forward_roots", [model])  # a pipeline rank: its stages, each called on its own
        self.handles = [root.register_forward_pre_hook(self.refresh) for root in roots] + [
            optimizer.register_step_post_hook(self.invalidate)
        ]

    def invalidate(self, *_) -> None:
        """Mark every weight stale (the optimizer's step post-hook)."""
        self.versions = [None] * len(self.weights)
        for m in self.experts:  # not held past the step
            base_kernel(m).codes.clear()

    def refresh(self, *_) -> None:
        """Cast the stale weights (the model's forward pre-hook; the training loop calls it after the optimizer
        step as well, :func:`lpbench.train.loop.prefetch_weights`)."""
        for i, (m, name) in enumerate(self.weights):
            w = getattr(m, name)
            if self.versions[i] != w._version:
                if name == "weight" and hasattr(m, "bf16_weight"):
                    with torch.no_grad():
                        m.bf16_weight.copy_(w)
                elif name == "weight":
                    cache_weight(m)
                elif (kernel := base_kernel(m)).recipe is None:  # BF16 grouped experts
                    kernel.codes[name] = w.detach().to(torch.bfloat16)
                else:
                    kernel.codes[name] = weight_codes(w.detach(), kernel.recipe, kernel.split(name, w))
                self.versions[i] = w._version

    def remove(self) -> None:
        """Detach: hooks removed, buffers and codes dropped (every forward quantizes the weights again)."""
        for h in self.handles:
            h.remove()
        for m in self.linears:
            for name in ("fp8_weight", "fp8_weight_t", "fp8_weight_scale"):
                delattr(m, name)
        for m in self.bf16_linears:
            delattr(m, "bf16_weight")
        for m in self.experts:
            base_kernel(m).codes.clear()


def install(model: nn.Module, optimizer: torch.optim.Optimizer, bf16: bool = True) -> WeightCache | None:
    """Quantize ``model``'s eligible linears' and experts' weights once per optimizer step, and cast its 16-bit ones
    to BF16 once per step if ``bf16`` (the run's compute dtype is BF16); None: it has none."""
    cache = WeightCache(model, optimizer, bf16)
    if not cache.weights:
        cache.remove()
        return None
    return cache
