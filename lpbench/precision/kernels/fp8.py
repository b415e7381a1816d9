"""Delayed scaling's amax-and-scale update as a torch custom op (one Triton kernel on CUDA).

Hand-written because the update mutates two module buffers (the amax history and the scale) from
both the forward and the backward pass: as an opaque custom op with declared mutation,
torch.compile keeps it in the graph (no graph break, no functionalisation of a 1024-entry roll per
operand). On CUDA the single-program Triton kernel of ``kernels/fp8_cast.py`` (``_record_kernel``)
replaces the reference (``quantize.delayed_update``), with which it is bit-exact (tested); elsewhere,
and where Triton is not installed (CPU-only torch), the op runs the reference.
"""

from __future__ import annotations

import torch

from lpbench.precision.capability import triton  # None without Triton
from lpbench.precision.quantize import delayed_update as reference_update


@torch.library.custom_op("lpbench::delayed_update", mutates_args=("history", "scale"))
def delayed_update(
    history: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, scaled_max: float, most_recent: bool
) -> torch.Tensor:
    """In place: ``amax`` recorded in ``history`` and ``scale`` recomputed (``quantize.delayed_update``).
    Returns a copy of the scale before the update: what a cast that follows the update must use (a read of
    the buffer itself could be scheduled after the update by a compiler)."""
    old = scale.clone()
    reference_update(history, scale, amax, scaled_max, "most_recent" if most_recent else "max")
    return old


@delayed_update.register_fake
def _(history, scale, amax, scaled_max, most_recent):
    return torch.empty_like(scale)


@torch.library.custom_op("lpbench::scale_copy", mutates_args=())
def scale_copy(scale: torch.Tensor) -> torch.Tensor:
    """A copy of a scale buffer, as an op the compiler cannot see into: a compiled cast reads the scale through it
    (``DelayedScaling.cast_scale``). AOTAutograd keeps a buffer mutated in the forward (the update) as a graph
    input saved for the backward by reference; a cast recomputed in the backward (activation recomputation, or
    the partitioner's own rematerialization of cheap elementwise ops) that read the buffer would read the updated
    scale. It recomputes from this copy's saved output instead (``parallel/recompute.py`` saves it)."""
    return scale.clone()


@scale_copy.register_fake
def _(scale):
    return torch.empty_like(scale)


if triton is not None:
    from lpbench.precision.kernels.fp8_cast import _record_amax

    @delayed_update.register_kernel("cuda")
    def _(history, scale, amax, scaled_max, most_recent):
        return _record_amax(history, scale, amax.float().reshape(()), scale, scaled_max, most_recent, True)[1]
