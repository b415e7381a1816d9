"""FP8 weights cast once per optimizer step, not once per micro-batch.

With gradient accumulation every micro-batch's forward used to cast each FP32 master weight to
FP8 again (an amax pass and a cast-transpose pass: 10 bytes per weight), though the weight only
changes at the optimizer step; on llama3-8b@16L that was ~35 GB of traffic per micro-batch.
:func:`install` gives each eligible linear (native fp8-tensorwise / fp8-delayed through
``kernels/fp8_linear.py``, a plain single-device or DDP weight) non-persistent buffers
``fp8_weight`` [N, K], ``fp8_weight_t`` [K, N] and ``fp8_weight_scale``, and fills them with the
linear's own cast (:func:`lpbench.precision.kernels.fp8_linear.cache_weight`) in a forward
pre-hook on the model whenever they are stale: after every ``optimizer.step()`` (a step
post-hook: the fused AdamW does not bump a parameter's version counter) and whenever a weight's
version changed (``copy_``, a checkpoint load). The codes and scales are those the uncached
forward computes from the same weight, so fp8-tensorwise trains bit-identically. fp8-delayed
casts a weight once per optimizer step with the scale its history gives then and records its
amax once: with gradient accumulation the step's later micro-batches reuse the first one's codes
(as Transformer Engine's first-micro-batch weight cache does), where the uncached forward cast
the same weight again with a scale whose history already held its amax (they differ when the new
weight's amax exceeds the history's maximum). Without accumulation the two are identical.

The training loop installs it only with gradient accumulation: with one micro-batch a step the
weight is cast once a step anyway, inside the compiled block, and the eager refill (a few launches
per linear from Python) cost more: llama3.2-1b at GBS = MBS on an H200 ran 138.0 ms a step with
it against 126.9 without. Cost: the row-major FP8 copy stays allocated for the whole step (1 byte per weight; the
transposed copy was already held from forward to backward). The pre-hook must run eagerly, so
the model itself must not be compiled as one graph (``--compile-scope block``, the default,
compiles its blocks). Tensor-parallel, FSDP (FP8 all-gather or not) and emulated linears are
left alone.
"""

from __future__ import annotations

import torch
from torch import nn

from lpbench.precision.quantize import Scaling


def eligible(mod: nn.Module) -> bool:
    """Whether ``mod`` is a linear whose weight the fused FP8 tensorwise/delayed forward casts."""
    from lpbench.precision.linear import QuantizedLinear

    if not isinstance(mod, QuantizedLinear) or not mod.native or mod.tp_shard is not None:
        return False
    w = mod.weight
    return (mod.recipe.scaling in (Scaling.TENSOR, Scaling.DELAYED) and type(w) is nn.Parameter and w.is_cuda
            and w.dim() == 2 and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0)


class WeightCache:
    """The FP8 weight copies of a model's eligible linears and when they are stale (see the module doc)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.mods = [m for m in model.modules() if eligible(m)]
        for m in self.mods:
            w = m.weight
            fmt = m.recipe.element_format("weight").dtype
            m.register_buffer("fp8_weight", torch.empty(w.shape, dtype=fmt, device=w.device), persistent=False)
            m.register_buffer("fp8_weight_t", torch.empty(w.shape[::-1], dtype=fmt, device=w.device),
                              persistent=False)
            m.register_buffer("fp8_weight_scale", torch.ones((), device=w.device), persistent=False)
        self.versions: list[int | None] = [None] * len(self.mods)
        self.handles = [model.register_forward_pre_hook(self._refresh),
                        optimizer.register_step_post_hook(self._stale)]

    def _stale(self, *_) -> None:
        self.versions = [None] * len(self.mods)

    def _refresh(self, *_) -> None:
        from lpbench.precision.kernels.fp8_linear import cache_weight

        for i, m in enumerate(self.mods):
            if self.versions[i] != m.weight._version:
                cache_weight(m)
                self.versions[i] = m.weight._version

    def remove(self) -> None:
        """Detach: hooks removed, buffers dropped (the linears cast in every forward again)."""
        for h in self.handles:
            h.remove()
        for m in self.mods:
            for name in ("fp8_weight", "fp8_weight_t", "fp8_weight_scale"):
                delattr(m, name)


def install(model: nn.Module, optimizer: torch.optim.Optimizer) -> WeightCache | None:
    """Cache the FP8 weights of ``model``'s eligible linears (None if it has none)."""
    cache = WeightCache(model, optimizer)
    if not cache.mods:
        cache.remove()
        return None
    return cache
