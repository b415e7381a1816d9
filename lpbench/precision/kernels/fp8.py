"""The delayed-scaling amax history update as a torch custom op (one Triton kernel on CUDA).

Hand-written because the update mutates a module buffer from both the forward and the
backward pass: as an opaque custom op with declared mutation, torch.compile keeps it in the
graph (no graph break, no functionalisation of a 1024-entry roll per operand). On CUDA one
tiny Triton kernel replaces the roll + index-write of the reference
(``quantize.update_amax_history``), with which it is bit-exact (tested on CUDA); elsewhere,
and where Triton is not installed (CPU-only torch), the op runs the reference.
"""

from __future__ import annotations

import torch

from lpbench.precision.capability import tl, triton  # None without Triton
from lpbench.precision.quantize import update_amax_history as reference_update


@torch.library.custom_op("lpbench::update_amax_history", mutates_args=("history",))
def update_amax_history(history: torch.Tensor, amax: torch.Tensor) -> None:
    """In place: shift ``history`` by one, record ``amax`` at index 0 (as the reference does)."""
    reference_update(history, amax)


@update_amax_history.register_fake
def _(history, amax):
    return None


if triton is not None:

    @triton.jit
    def _update_history_kernel(hist_ptr, amax_ptr, HIST_LEN, BLOCK: tl.constexpr):
        """Shift the history by one and record amax at index 0 (non-finite amax recorded as 0)."""
        idx = tl.arange(0, BLOCK)
        h = tl.load(hist_ptr + idx, mask=idx < HIST_LEN - 1, other=0.0)
        tl.debug_barrier()
        tl.store(hist_ptr + idx + 1, h, mask=idx < HIST_LEN - 1)
        a = tl.load(amax_ptr)
        finite = (a == a) & (a < float("inf"))
        tl.store(hist_ptr, tl.where(finite, a, 0.0))

    @update_amax_history.register_kernel("cuda")
    def _(history, amax):
        n = history.numel()
        _update_history_kernel[(1,)](history, amax, n, BLOCK=triton.next_power_of_2(max(n, 2)), num_warps=4)
