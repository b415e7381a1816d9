"""Delayed scaling's state, written once: per operand an amax history and a persistent encode scale.

The semantics are Transformer Engine's ``DelayedScaling`` (``quantize.delayed_update`` states the rule):
each quantized operand (role ``input``, ``weight``, ``grad``) has a scale buffer, 1.0 at first; a cast
multiplies by the scale as it stands, then its amax is recorded in the history and the scale recomputed
from the history (``FP8_MAX / max(history) / 2**margin``, or from the most recent amax with the recipe's
``amax_compute_algo="most_recent"``), keeping the previous scale where that amax is 0 or not finite.
So every scale a step uses is known before the step runs: a cast reads no amax first, and on the
compiled path the operand's producer (RMSNorm, SwiGLU, ...) writes the FP8 codes itself
(``kernels/fp8_linear.py``). Each operand is updated right after its cast: with each module casting
each operand once per pass, as TE's linears do, that is TE's update at the end of each forward and
backward pass.

The first step casts with scale 1.0 (TE's choice: the first steps' codes saturate or underflow where
the operand is far from 1); a zero amax neither enters the history nor changes the scale; NaN and Inf
amaxes enter the history (Inf holds the previous scale until it leaves the history; NaN is ignored by
the max, as TE's ``fmaxf``).

Every module that quantizes with delayed scaling (QuantizedLinear, an MoE expert's ExpertGemms, the
frozen linear of LoRA) inherits :class:`DelayedScaling`, and every path (emulated GEMMs, the fused
FP8 linear, the weight cache, FSDP's FP8 all-gather) reads and updates through it. The buffers are
``amax_history_{role}`` and ``delayed_scale_{role}``, so they follow the module to devices,
checkpoints and FSDP. The update is one custom op (``kernels/fp8.py``: one Triton kernel on CUDA); the
fused FP8 linear launches the same kernel itself, which also gives the cast's decode scale.

Activation recomputation (``lpbench/parallel/recompute.py``) reruns a block's forward in its backward. A
forward cast must then happen once per pass, as without recomputation: in a recomputed block's first pass
(``lpbench/passes.py``) every forward result of the state (:meth:`DelayedScaling.once`: the scale a cast
uses, the update's returned scale) is kept in the pass's record, and in its rerun they are taken back in
order instead of reading the scales (which the first pass updated) or updating them again. So the
histories advance once per step and the rerun casts with the first pass's scales (same codes, same
gradients).
"""

from __future__ import annotations

from collections import deque
import torch

from lpbench import passes
from lpbench.precision.kernels.fp8 import delayed_update, scale_copy
from lpbench.precision.quantize import Scaling, delayed_scaled_max


HISTORY, SCALE = "amax_history_", "delayed_scale_"  # buffer names: the prefix, then the role


def is_delayed_state(name: str, kinds: tuple[str, ...] = (HISTORY, SCALE)) -> bool:
    """Whether buffer ``name`` (a module's own or a dotted state-dict key) is delayed scaling's state of one of
    ``kinds``: an amax history (:data:`HISTORY`) or a scale (:data:`SCALE`)."""
    return name.rpartition(".")[2].startswith(kinds)


class DelayedScaling:
    """Mixin of an ``nn.Module`` with a ``recipe`` and ``reduce_amax`` (the whole operand's amax from this
    module's part; :class:`lpbench.precision.linear.QuantizedGemms`): its delayed-scaling histories and scales."""

    def _init_histories(self, device, roles=("input", "weight", "grad")) -> None:
        if self.recipe.scaling is Scaling.DELAYED:
            for role in roles:
                self.register_buffer(HISTORY + role, torch.zeros(self.recipe.amax_history_len, device=device))
                self.register_buffer(SCALE + role, torch.ones((), device=device))

    def _apply(self, fn, recurse=True):
        """As ``nn.Module._apply``, but the histories and scales stay FP32 under a dtype cast (``.to(bf16)``
        would round the scales and change the codes); they still move between devices."""
        state = {n: b for n, b in self._buffers.items() if is_delayed_state(n)}
        out = super()._apply(fn, recurse)
        for name, old in state.items():
            new = self._buffers[name]
            if new is not None and new.dtype != torch.float32:
                self._buffers[name] = old.to(new.device)
        return out

    @torch.no_grad()
    def reset_delayed_state(self) -> None:
        """Histories empty, scales 1.0: the state of a new module (after ``to_empty``, which leaves it undefined)."""
        for name, buf in self._buffers.items():
            if is_delayed_state(name, HISTORY):
                buf.zero_()
            elif is_delayed_state(name, SCALE):
                buf.fill_(1.0)

    def amax_history(self, role: str) -> torch.Tensor:
        return getattr(self, HISTORY + role)

    def scale_buffer(self, role: str) -> torch.Tensor:
        """Operand ``role``'s persistent encode scale (the buffer itself: the update changes it in place)."""
        return getattr(self, SCALE + role)

    def once(self, make):
        """``make()`` (a tensor this module's state gives a forward cast), kept for a rerun; in the rerun of a
        checkpointed forward, the first pass's result in its place (``make`` not called: see the module doc)."""
        record, again = passes.current()
        if record is None:  # (a compiled checkpoint keeps no record: its graph's partitioner saves the result)
            return make()
        kept = record.setdefault(self, deque())
        if again:
            return kept.popleft()
        out = make()
        kept.append(out)
        return out

    def cast_scale(self, role: str) -> torch.Tensor:
        """The encode scale a cast of ``role`` uses now: the buffer; in a checkpointed forward a copy of it, which
        the rerun takes back (the buffer holds the updated scale by then); compiled, a copy made by an opaque op
        (``kernels/fp8.py: scale_copy``), whose output a backward that recomputes the cast reads."""
        if torch.compiler.is_compiling():
            return scale_copy(self.scale_buffer(role))
        if passes.current()[0] is None:
            return self.scale_buffer(role)
        return self.once(lambda: self.scale_buffer(role).clone())

    def scaled_max(self, role: str) -> float:
        return delayed_scaled_max(self.recipe.element_format(role), self.recipe.margin)

    def record_amax(self, role: str, amax: torch.Tensor) -> torch.Tensor:
        """Record the amax of a cast of ``role`` and update its scale for the next cast (TE's rule); returns the
        scale before the update (a new tensor: the encode scale of that cast). Once per pass (:meth:`once`)."""
        return self.once(lambda: self._update(role, amax))

    def _update(self, role: str, amax: torch.Tensor) -> torch.Tensor:
        return delayed_update(
            self.amax_history(role),
            self.scale_buffer(role),
            amax.float().reshape(()),
            self.scaled_max(role),
            self.recipe.amax_compute_algo == "most_recent",
        )

    def _delayed_scale(self, role: str, t: torch.Tensor) -> torch.Tensor | None:
        """Delayed scaling: the encode scale to cast ``t`` as operand ``role`` with (the scale as it stands),
        ``t``'s amax recorded and the scale updated; None otherwise."""
        if self.recipe.scaling is not Scaling.DELAYED:
            return None
        return self.once(lambda: self._update(role, self.reduce_amax(role, t.detach().abs().amax().float())))
