"""Delayed scaling's state, written once: the amax histories of a module's operands and the scales they give.

Every module that quantizes with delayed scaling (QuantizedLinear, an MoE expert's ExpertGemms, the
frozen linear of LoRA) inherits :class:`DelayedScaling`, and every path (emulated GEMMs, the fused
FP8 linear, FSDP's FP8 all-gather) reads and records through it. The histories are buffers
``amax_history_{role}``, so they follow the module to devices, checkpoints and FSDP; an operand's
encode scale is ``FP8_MAX / max(history) / 2**margin``, the current amax standing in while the
history is empty (:func:`lpbench.precision.quantize.delayed_encode_scale`); recording shifts the
history by one (``kernels/fp8.py``: one Triton kernel on CUDA, the reference elsewhere).
"""

from __future__ import annotations

import torch

from lpbench.precision.kernels.fp8 import update_amax_history
from lpbench.precision.quantize import Scaling, delayed_encode_scale


class DelayedScaling:
    """Mixin of an ``nn.Module`` with a ``recipe`` and ``reduce_amax`` (the whole operand's amax from this
    module's part; :class:`lpbench.precision.linear.QuantizedGemms`): its delayed-scaling histories and scales."""

    def _init_histories(self, device, roles=("input", "weight", "grad")) -> None:
        if self.recipe.scaling is Scaling.DELAYED:
            for role in roles:
                self.register_buffer(f"amax_history_{role}", torch.zeros(self.recipe.amax_history_len, device=device))

    def amax_history(self, role: str) -> torch.Tensor:
        return getattr(self, f"amax_history_{role}")

    def history_scale(self, role: str, amax: torch.Tensor) -> torch.Tensor:
        """The encode scale of operand ``role`` from its history (``amax`` while the history is empty)."""
        return delayed_encode_scale(self.amax_history(role), amax, self.recipe.element_format(role), self.recipe.margin)

    def record_amax(self, role: str, amax: torch.Tensor) -> None:
        update_amax_history(self.amax_history(role), amax)

    def _delayed_scale(self, role: str, t: torch.Tensor) -> torch.Tensor | None:
        """Delayed scaling: the encode scale of ``t`` as operand ``role``, then its amax recorded; None otherwise."""
        if self.recipe.scaling is not Scaling.DELAYED:
            return None
        amax = self.reduce_amax(role, t.detach().abs().amax().float())
        scale = self.history_scale(role, amax)
        self.record_amax(role, amax)
        return scale
