"""The MoE experts' weight gradients accumulated in FP32 by their weight-gradient GEMMs (gradient-accumulation
fusion, as Megatron's ``main_grad``).

Autograd would add each micro-batch's BF16 grouped-GEMM product into ``.grad`` (a cast and an add per expert
weight per micro-batch). Here each expert weight has an FP32 buffer (its kernel's ``main_grads``) that the grouped
GEMMs' autograd functions add their weight gradient into (``precision/grouped.py: add_wgrad``, on Hopper in the
GEMM's epilogue), handing autograd none; the converter's ``after_backward`` hook makes each buffer its weight's
``.grad`` (:meth:`MainGrads.expose`) and the optimizer's step post-hook zeroes them. BF16 experts get the
``GroupedBf16`` kernel, which adds into the buffers. The buffer holds the sum of the FP32 products, where
autograd added each product rounded to BF16: the same sum up to that rounding.

Only for weights no data-parallel wrapper reduces (DDP and FSDP reduce ``.grad`` in autograd hooks): one
process, or experts split over ranks, which ``parallel/ep.py: sync_expert_grads`` reduces after ``expose``.
Installed with gradient accumulation and ``--compile-scope block`` only, as the weight cache.
"""

from __future__ import annotations

import torch
from torch import nn

from lpbench.models.moe import Experts, GroupedMM
from lpbench.precision.grouped import EmulatedGroupedFp8, GroupedBf16, GroupedFp8


def eligible(mod: nn.Module, owned: set[int]) -> bool:
    """Whether ``mod`` is an MoE layer's experts on the grouped GEMMs (BF16 or FP8 grouped) whose trained weights
    are plain parameters in ``owned`` (ids)."""
    if not isinstance(mod, Experts) or type(mod.gemm) not in (GroupedMM, GroupedBf16, GroupedFp8, EmulatedGroupedFp8):
        return False
    weights = [getattr(mod, name) for name in (mod.in_name, "down")]
    return all(type(w) is nn.Parameter and w.requires_grad and id(w) in owned for w in weights)


class MainGrads:
    """The FP32 gradient buffers of a model's eligible experts (see the module doc)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, owned: list[nn.Parameter]):
        ids = {id(p) for p in owned}
        self.experts = [m for m in model.modules() if eligible(m, ids)]
        self.weights = [(m, name) for m in self.experts for name in (m.in_name, "down")]
        for m in self.experts:
            if type(m.gemm) is GroupedMM:  # the kernel that adds into the buffers
                m.gemm = GroupedBf16(m.gemm.tp)
        for m, name in self.weights:
            m.gemm.main_grads[name] = torch.zeros_like(getattr(m, name), dtype=torch.float32)
        self.handle = optimizer.register_step_post_hook(self.zero)

    def expose(self) -> None:
        """Make each buffer its weight's ``.grad`` (after the step's last backward, before anything reads them)."""
        for m, name in self.weights:
            getattr(m, name).grad = m.gemm.main_grads[name]

    def zero(self, *_) -> None:
        """Zero the buffers (the optimizer's step post-hook: the step has read them)."""
        for m, name in self.weights:
            m.gemm.main_grads[name].zero_()

    def remove(self) -> None:
        """Detach: the hook removed, the buffers dropped (autograd accumulates ``.grad`` again)."""
        self.handle.remove()
        for m in self.experts:
            m.gemm.main_grads.clear()


def install(model: nn.Module, optimizer: torch.optim.Optimizer, owned: list[nn.Parameter]) -> MainGrads | None:
    """Accumulate the weight gradients of ``model``'s eligible experts (weights among ``owned``) in FP32 buffers;
    None: it has none."""
    grads = MainGrads(model, optimizer, owned)
    if not grads.weights:
        grads.remove()
        return None
    return grads
