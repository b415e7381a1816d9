"""Activation recomputation (``--recompute``): blocks whose forward runs again in the backward.

``none``       every block keeps what its backward needs (the default).
``full``       a block keeps only its input; its whole forward reruns in the backward.
``selective``  torchtitan's per-op policy: a block keeps the outputs of attention, of every other GEMM
               (QKV and gate+up) and of the collectives (and compiled, the amax reductions), and reruns
               the rest: the output and down projections and the elementwise ops (norms, RoPE, SwiGLU,
               casts) that hold most bytes per FLOP.

``--recompute-every K`` checkpoints every K-th block (blocks 0, K, 2K, ...), as torchtitan does.

Built on ``torch.utils.checkpoint`` (non-reentrant; selective through
``create_selective_checkpoint_contexts``) applied to each block's ``forward`` in place (parameter
names, state dicts and FSDP/TP plans unchanged), by ``parallel/plan.py: parallelize`` after tensor and
expert parallelism and before ``torch.compile`` and FSDP/DDP, torchtitan's order. Eager, the rerun is
exact for every recipe: the global RNG state is restored for it (NVFP4's stochastic rounding draws
the same noise; its Hadamard signs are fixed), and delayed scaling's casts take back the first pass's
scales instead of updating the histories again (``lpbench/passes.py``), as MoE's
statistics skip the rerun (``rerunning``). Compiled, the checkpoint becomes a graph region that
AOTAutograd's partitioner recomputes; delayed scaling's updates are marked to be saved, never rerun, and so
are the copies of the scale its casts read (``kernels/fp8.py: scale_copy``: a recomputed cast must not read the
buffer, which the update has changed by then).
A block whose graph breaks (MoE routing) cannot be one compiled region: its checkpointed forward runs
eagerly, exact as above, and uncompiled.
"""

from __future__ import annotations

import contextlib
import functools
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lpbench import passes
from lpbench.config import RECOMPUTES
from lpbench.models.moe import MoE


@functools.cache
def _ops(*names: str) -> frozenset:
    """The ``torch.ops`` overloads ``names`` ("namespace.op.overload") that this torch has. Resolved at the
    first checkpointed forward, once the converted model's kernel modules have registered their ops."""
    found = set()
    for name in names:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None) if hasattr(torch.ops, namespace) else None
        if packet is not None and hasattr(packet, overload):
            found.add(getattr(packet, overload))
    return frozenset(found)


# never rerun: the updates of delayed scaling's state (a rerun would advance its history twice): the
# reference update and the fused FP8 linear's record-and-update kernel; and the compiled casts' copies of the
# scale (a rerun would copy the updated buffer)
MUST_SAVE = ("lpbench.delayed_update.default", "lpbench.fp8_record_amax.default", "lpbench.scale_copy.default")
# kept by selective recomputation: GEMMs, attention, collectives, the amax reductions of quantized casts
SELECTIVE_SAVE = (
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten._scaled_mm.default",
    "aten._grouped_mm.default",
    "aten._scaled_grouped_mm.default",
    "lpbench.blockwise_mm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_to_all_single.default",
    "_c10d_functional.all_gather_into_tensor.default",
)
# compiled only: eager, a rerun skips delayed scaling's amaxes (``DelayedScaling.once``), and the eager policy
# hands back saved outputs per op in call order, so no op that a rerun may skip can be kept
COMPILED_SAVE = ("aten.amax.default", "aten.max.default")
MM = ("aten.mm.default", "aten._scaled_mm.default")


def _policy(saved: frozenset, mm: frozenset, counts: dict, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Save ``saved`` ops' outputs, but only every other GEMM's (torchtitan's: the 1st, 3rd, ... of the call:
    a block's QKV and gate+up projections; its output and down projections are recomputed from them)."""
    if op in mm:
        key = "rerun" if ctx.is_recompute else "first"
        counts[key] += 1
        if counts[key] % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts(mode: str, compiled: bool):
    """The (first pass, rerun) context managers of one checkpointed call."""
    names = MUST_SAVE + ((SELECTIVE_SAVE + (COMPILED_SAVE if compiled else ())) if mode == "selective" else ())
    saved = _ops(*names)
    if compiled or mode == "selective":
        op_level = create_selective_checkpoint_contexts(partial(_policy, saved, _ops(*MM), {"first": 0, "rerun": 0}))
    else:  # eager full: no per-op policy to apply
        op_level = contextlib.nullcontext(), contextlib.nullcontext()
    if compiled:  # traced once: the graph, not Python state, carries what the rerun needs
        return op_level
    record: dict = {}  # delayed scaling's results of this call's first pass, for its rerun
    return _Both(passes.first(record), op_level[0]), _Both(passes.rerun(record), op_level[1])


class _Both:
    """Two context managers entered and left as one (the second inside the first)."""

    def __init__(self, outer, inner):
        self.stack, self.outer, self.inner = contextlib.ExitStack(), outer, inner

    def __enter__(self):
        self.stack.enter_context(self.outer)
        self.stack.enter_context(self.inner)
        return self

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)


def checkpointed(forward, mode: str, eager: bool = False):
    """``forward`` whose activations are recomputed as ``mode`` (selective or full) says, when it builds a graph;
    ``eager``: never compiled (a forward whose graph breaks, which a compiled checkpoint cannot hold)."""

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing to recompute
            return forward(*args, **kwargs)
        context_fn = partial(_contexts, mode, torch.compiler.is_compiling())
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return torch._dynamo.disable(run) if eager else run


def apply_recompute(model: nn.Module, mode: str, every: int = 1) -> int:
    """Recompute the activations of every ``every``-th block of ``model.layers`` as ``mode`` says (none:
    nothing changes). Returns how many blocks recompute."""
    if mode not in RECOMPUTES:
        raise ValueError(f"unknown recompute mode {mode!r}; valid: {', '.join(RECOMPUTES)}")
    if mode == "none":
        return 0
    blocks = [block for i, block in model.layers.named_children() if int(i) % every == 0]  # global index
    for block in blocks:
        # MoE routing breaks a compiled block's graph (data-dependent shapes): such a checkpoint runs eagerly
        block.forward = checkpointed(block.forward, mode, eager=any(isinstance(m, MoE) for m in block.modules()))
    return len(blocks)
