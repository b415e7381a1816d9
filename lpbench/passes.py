"""Which forward pass runs now: an ordinary one, or the first pass or rerun of a recomputed block.

Activation recomputation (``lpbench/parallel/recompute.py``) reruns a block's forward in its backward.
A forward with side effects — delayed scaling's amax histories, MoE's token statistics — must have them
once, as without recomputation. The recompute wraps a block's first pass in :func:`first` and its rerun in
:func:`rerun` of the same record (a dict the side effects may keep their first-pass results in, keyed by
their owner). This sits below models and precision so that both can ask, neither importing the other.

A backward can run twice too: the zero-bubble pipeline schedules compute a micro-batch's input gradients
with the graph retained and its weight gradients later, rerunning each autograd Function's backward.
:func:`backward_pass` treats those two runs as a first pass and its rerun, so a gradient's amax is recorded
once per micro-batch, as in one process.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch

_record: dict | None = None  # the record of the recomputed forward running now
_again = False  # whether that forward is the rerun (takes results back) or the first pass (keeps them)


class _Pass:
    """A pass over ``record``: the first (its results kept) or a rerun (taken back). Re-enterable: a rerun leaves
    the record as it found it, so the rerun of a graph kept for a second backward takes the same results again."""

    def __init__(self, record: dict, again: bool):
        self.record, self.again = record, again

    def __enter__(self):
        global _record, _again
        self.outer = _record, _again
        self.kept = {owner: copy.copy(results) for owner, results in self.record.items()} if self.again else None
        _record, _again = self.record, self.again

    def __exit__(self, *exc):
        global _record, _again
        _record, _again = self.outer
        if self.kept is not None:
            self.record.update(self.kept)


def first(record: dict) -> _Pass:
    """A recomputed forward's first pass: side effects happen and may keep their results in ``record``."""
    return _Pass(record, False)


def rerun(record: dict) -> _Pass:
    """The recomputation of the forward that filled ``record``: its results taken back, no side effect again."""
    return _Pass(record, True)


def current() -> tuple[dict | None, bool]:
    """(the record of the recomputed forward running now or None, whether it is the rerun)."""
    return _record, _again


def rerunning() -> bool:
    """Whether a forward runs now as activation recomputation's rerun (its side effects happened already)."""
    return _record is not None and _again


def backward_pass(ctx):
    """The pass an autograd Function's backward (``ctx`` its context) runs in: the first of two where the graph is
    kept for another backward (a zero-bubble schedule's input-gradient pass), whose record ``ctx`` keeps; the rerun
    of that record in the next backward (the weight-gradient pass); an ordinary pass otherwise (compiled too: a
    compiled graph keeps no record)."""
    record = getattr(ctx, "backward_record", None)
    if record is not None:
        ctx.backward_record = None
        return rerun(record)
    if torch.compiler.is_compiling() or not torch._C._autograd._get_current_graph_task_keep_graph():
        return nullcontext()
    ctx.backward_record = record = {}
    return first(record)
